"""``torchrig export``: each format is loaded back by its own library and reproduces the checkpoint's
model within 1e-5; a model that cannot be traced gets one line naming the blocker."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys

import pytest
import torch
from helpers import REPO, UserProject, one_line_error

from torchrig.cli import main
from torchrig.export import example_inputs
from torchrig.recipes.run import load_for_inference

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none"]
PKG = "rigexport"  # a package name no other test uses

TASK = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def build_model(cfg):
    return Branchy()


def build_mlp(cfg):
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def build_data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return (x[:24], (x[:24, 0] > 0).long()), (x[24:], (x[24:, 0] > 0).long())
'''


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "digits"
    assert main(["train", *QUICK, "--set", "max_steps=2", "--set", f"run_dir={run}"]) == 0
    return run


def checkpoint_model(run):
    """The checkpoint's model and the example batch, read as the export command reads them."""
    recipe, cfg, model, _ = load_for_inference(str(run))
    args, kwargs = example_inputs(recipe, cfg, model.eval())
    return model, args, kwargs


def test_torch_export_program_reproduces_the_model_at_any_batch_size(digits, capsys):
    out = digits / "model.pt2"
    assert main(["export", "--checkpoint", str(digits), "--format", "torch-export", "--output", str(out)]) == 0
    assert f"exported torch-export to {out}" in capsys.readouterr().out
    model, (x,), _ = checkpoint_model(digits)
    program = torch.export.load(str(out)).module()
    for batch in (x[:1], x, torch.randn(7, *x.shape[1:]), torch.randn(2, 1, 12, 12)):  # batch and image size
        with torch.inference_mode():
            got, want = program(batch), model(batch)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5


def test_example_inputs_from_files_as_predict_reads_them(digits, tmp_path, capsys):
    import numpy as np

    images = np.random.default_rng(0).random((4, 8, 8), dtype=np.float32)
    np.save(tmp_path / "x.npy", images)
    out = tmp_path / "from-input.pt2"
    assert main(["export", "--checkpoint", str(digits), "--format", "torch-export", "--output", str(out),
                 "--input", str(tmp_path / "x.npy")]) == 0
    assert "run on 3 samples" in capsys.readouterr().out
    model, _, _ = checkpoint_model(digits)
    x = torch.from_numpy(images).unsqueeze(1)
    with torch.inference_mode():
        assert (torch.export.load(str(out)).module()(x) - model(x)).abs().max() <= 1e-5


def test_onnx_without_its_packages_is_one_line(digits, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if it were not installed: import raises
    one_line_error(capsys, ["export", "--checkpoint", str(digits), "--format", "onnx"],
                   "--format onnx needs the onnxscript package", "pip install onnx onnxscript onnxruntime")
    assert not (digits / "export" / "step-00000002.onnx").exists()


def test_safetensors_weights_load_into_the_bare_model(digits, capsys):
    from safetensors.torch import load_model, safe_open

    assert main(["export", "--checkpoint", str(digits), "--format", "safetensors"]) == 0
    out = digits / "export" / "step-00000002.safetensors"  # the default: RUN_DIR/export/CHECKPOINT.safetensors
    assert f"exported safetensors to {out}" in capsys.readouterr().out
    model, (x,), _ = checkpoint_model(digits)
    fresh = type(model)()
    load_model(fresh, str(out))
    with torch.inference_mode():
        assert (fresh.eval()(x) - model(x)).abs().max() <= 1e-5
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["torchrig.recipe"] == "digits"


def test_hugging_face_folder_loads_with_auto_classes(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run, data = tmp_path / "text", tmp_path / "texts.csv"
    topics = {"files": "folder path file list open", "mail": "email message header parse send",
              "math": "number sum square root float"}
    data.write_text("text,label\n" + "".join(f"{' '.join(words.split()[i % 5:] + words.split()[:i % 5])},{label}\n"
                                             for i in range(8) for label, words in topics.items()))
    assert main(["train", "--recipe", "text-classification", *QUICK, "--set", "model.name=hf_bert",
                 "--set", f"data.path={data}", "--set", "text.min_frequency=1",
                 "--set", "model.options={hidden: 16, layers: 1, heads: 2}", "--set", "text.max_length=24",
                 "--set", "text.vocab_size=300", "--set", "max_steps=1", "--set", f"run_dir={run}"]) == 0
    assert main(["export", "--checkpoint", str(run), "--format", "hf"]) == 0
    out = run / "export" / "step-00000001-hf"
    assert f"exported hf to {out}" in capsys.readouterr().out
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    texts = ["Open the file in a folder.", "Parse an email message header and send it"]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    from torchrig.recipes.text import read_tokenizer

    ours = read_tokenizer(run / "tokenizer.json").encode_batch(
        texts, None, 24)
    width = enc["input_ids"].shape[1]  # ours pads to max_length, the folder's tokenizer to the longest text
    assert torch.equal(ours[0][:, :width], enc["input_ids"]) and ours[0][:, width:].eq(0).all()
    model, _, _ = checkpoint_model(run)
    with torch.inference_mode():
        got = loaded(**enc).logits
        want = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert got.shape == (2, 3) and (got - want).abs().max() <= 1e-5
    if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnxscript"):
        # ONNX of the same model: inputs named as forward names them, the sequence length dynamic
        import onnxruntime as ort

        assert main(["export", "--checkpoint", str(run), "--format", "onnx"]) == 0
        session = ort.InferenceSession(str(run / "export" / "step-00000001.onnx"), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        assert names == ["input_ids", "attention_mask", "token_type_ids"], names
        assert all(isinstance(d, str) for d in session.get_inputs()[0].shape), "batch and length dynamic"
        assert width != 7  # the example batch (the first 3 samples) is 7 tokens long
        (logits,) = session.run(None, {k: enc[k].numpy() for k in names})
        assert (torch.from_numpy(logits) - want).abs().max() <= 1e-5


def test_onnx_runs_in_onnxruntime(digits, capsys):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = digits / "model.onnx"
    assert main(["export", "--checkpoint", str(digits), "--format", "onnx", "--output", str(out)]) == 0
    line = capsys.readouterr().out
    # torch.export leaves the image size dynamic (the model pools adaptively), but ONNX's adaptive pooling
    # keeps the example's size: the check at a smaller size catches it and only the batch stays dynamic
    assert f"exported onnx to {out}" in line and "only the batch dimension is dynamic" in line, line
    model, (x,), _ = checkpoint_model(digits)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (spec,) = session.get_inputs()
    assert spec.name == "x" and spec.shape[1:] == [1, 8, 8] and isinstance(spec.shape[0], str), spec
    for batch in (x, torch.randn(5, *x.shape[1:])):
        (got,) = session.run(None, {"x": batch.numpy()})
        with torch.inference_mode():
            assert (torch.from_numpy(got) - model(batch)).abs().max() <= 1e-5


@pytest.fixture
def project(tmp_path):
    """The user's package with the models below, the current directory for the test; forgotten after it."""
    project = UserProject(tmp_path, PKG, TASK)
    yield project.root
    project.close()


def test_what_cannot_be_exported_is_named_in_one_line(tmp_path, capsys, project, digits):
    run = tmp_path / "branchy"
    assert main(["train", "--model", f"{PKG}.task:build_model", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "max_steps=1", "--set", f"run_dir={run}"]) == 0
    line = one_line_error(capsys, ["export", "--checkpoint", str(run), "--format", "torch-export"],
                          "cannot trace Branchy", "data-dependent", "task.py:12 in forward: if x.sum() > 0:")
    assert not (run / "export" / "step-00000001.pt2").exists(), line
    # the weights alone need no tracing
    assert main(["export", "--checkpoint", str(run), "--format", "safetensors"]) == 0
    one_line_error(capsys, ["export", "--checkpoint", str(run), "--format", "hf"],
                   "Branchy is not a Hugging Face model", "--format safetensors")
    one_line_error(capsys, ["export", "--checkpoint", str(run), "--format", "safetensors"],
                   "step-00000001.safetensors already exists", "--overwrite")
    assert main(["export", "--checkpoint", str(run), "--format", "safetensors", "--overwrite"]) == 0
    one_line_error(capsys, ["export", "--checkpoint", str(digits), "--format", "torch-export", "--output", "m.pt"],
                   "a torch-export export is a .pt2 file", "m.pt2")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def test_the_docs_examples_run(tmp_path, monkeypatch, capsys):
    """README's Deployment commands and docs/deployment.md's Python example, as written."""
    monkeypatch.chdir(tmp_path)
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Deployment"):readme.index("## Configuration reference")]
    (commands,) = blocks(section, "bash")
    for line in commands.splitlines():
        argv = shlex.split(line.partition("#")[0])
        assert argv[0] == "torchrig"
        if argv[1] == "train":
            argv += [*QUICK]
        assert main(argv[1:]) == 0, line
    assert (tmp_path / "runs/deploy/export/step-00000020.pt2").is_file()
    assert (tmp_path / "model.safetensors").is_file()
    (example,) = blocks((REPO / "docs" / "deployment.md").read_text(), "python")
    (tmp_path / "again").mkdir()
    monkeypatch.chdir(tmp_path / "again")
    exec(compile(example, "docs/deployment.md", "exec"), {"__name__": "docs"})
    assert (tmp_path / "again/runs/deploy/export/step-00000020.safetensors").is_file()


@pytest.mark.parametrize("fmt", ["torch-export", "onnx"])
def test_a_plain_mlp_exports_with_only_its_batch_dynamic(tmp_path, capsys, project, fmt):
    """torch.export keeps an MLP's feature size as a SymInt holding 4: it is no dynamic dimension, so the check
    at smaller sizes cuts the batch only (before, it cut the features to 3 and the model itself failed)."""
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    run = tmp_path / "mlp"
    assert main(["train", "--model", f"{PKG}.task:build_mlp", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "max_steps=1", "--set", f"run_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "only the batch dimension" not in out and "at smaller sizes of its dynamic dimensions" in out, out
