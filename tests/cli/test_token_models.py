"""A token model of the user's own (``helpers/char_lm.py``: an Embedding, a ModuleList of blocks, logits
``(batch, positions, classes)``, its own Dataset and loss) on the command line: trained with ``--set
loss=MODULE:FN``, evaluated, predicted and resumed from its checkpoint, which names that loss only under the rules
of a factory; and trained in Python, then used from the command line with both factories named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from helpers import QUIET, UserProject, one_line_error, record_checksums
from helpers.char_lm import CHARS, SEQ, SOURCE, CharLM, Chars, build_data, lm_loss
from safetensors.torch import load_file

from torchrig import Trainer
from torchrig.cli import main

PKG = "rigcharlm"  # a package name no other test uses
QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none"]
FACTORIES = ["--set", f"model.factory={PKG}.task:build_model", "--set", f"data.factory={PKG}.task:build_data"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's project folder, made the current directory; ``ids.npy``: 3 prompts of token ids."""
    project = UserProject(tmp_path_factory.mktemp("lmproject"), PKG, SOURCE)
    np.save(project.root / "ids.npy", np.stack([Chars()[i][0].numpy() for i in range(3)]))
    yield project.root
    project.close()


@pytest.fixture(scope="module")
def cli_run(project):
    run = project / "runs" / "lm"
    assert main(["train", *FACTORIES, "--set", f"loss={PKG}.task:lm_loss", "--set", "epochs=1",
                 "--set", f"run_dir={run}", *QUICK]) == 0
    return run


def _trained(run) -> CharLM:
    model = CharLM()
    model.load_state_dict(load_file(str(run / "checkpoints" / "latest" / "model.safetensors")))
    return model.eval()


def test_the_loss_is_recorded_and_evaluate_rebuilds_it(cli_run, capsys):
    saved = yaml.safe_load((cli_run / "checkpoints" / "latest" / "config.yaml").read_text())
    assert (saved["loss"], saved["metrics"], saved["recipe"]) == (f"{PKG}.task:lm_loss", ["accuracy"], "custom")
    meta = json.loads((cli_run / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["factories"]["loss"]["module"] == f"{PKG}.task"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(cli_run), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    ids, targets = (torch.stack(t) for t in zip(*build_data(None)[2]))
    with torch.no_grad():
        logits = _trained(cli_run)(ids)
    assert results["loss"] == pytest.approx(lm_loss(logits, targets).item(), abs=1e-5)
    # accuracy over each position's 13 classes (the argmax over the positions would not even fit the targets)
    assert results["accuracy"] == pytest.approx((logits.argmax(-1) == targets).float().mean().item(), abs=1e-6)


def test_predict_says_what_it_applies_and_softmax_runs_over_the_classes(cli_run, project, capsys):
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(cli_run), "--input", "ids.npy", "--output", "raw.npy"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"predict: raw outputs (loss={PKG}.task:lm_loss is no classification loss torchrig knows); "
                      f"--activation softmax for probabilities over the classes")
    with torch.no_grad():
        logits = _trained(cli_run)(torch.from_numpy(np.load(project / "ids.npy")))
    np.testing.assert_allclose(np.load(project / "raw.npy"), logits.numpy(), atol=1e-5)
    assert main(["predict", "--checkpoint", str(cli_run), "--input", "ids.npy", "--output", "p.npy",
                 "--activation", "softmax"]) == 0
    assert capsys.readouterr().out.splitlines() == ["predictions written to p.npy"]  # chosen: nothing to say
    probs = np.load(project / "p.npy")
    assert probs.shape == (3, SEQ, len(CHARS))
    np.testing.assert_allclose(probs.sum(-1), np.ones((3, SEQ)), atol=1e-5)  # rows sum to 1 over the classes
    np.testing.assert_allclose(probs, logits.softmax(-1).numpy(), atol=1e-6)


def test_resume_rebuilds_the_loss(cli_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(cli_run, copy, symlinks=True)
    # no --set loss / model.factory / data.factory: the run's config.yaml names them, from the file they came from
    assert main(["train", "--set", f"run_dir={copy}", "--set", "resume=latest", "--set", "epochs=2", *QUICK]) == 0
    saved = yaml.safe_load((copy / "checkpoints" / "latest" / "config.yaml").read_text())
    assert (saved["loss"], saved["epochs"]) == (f"{PKG}.task:lm_loss", 2)


@pytest.mark.parametrize("key,planted,fragments", [
    ("loss", "pytest:main", ["names loss 'pytest:main', a module outside the current directory",
                             "or pass --set loss=pytest:main to use it"]),
    ("metrics", ["accuracy", "pytest:main"], ["names metrics[1] 'pytest:main', a module outside the current "
                                              "directory", "or pass --set metrics=[pytest:main] to use it"]),
])
def test_a_checkpoint_naming_code_the_command_line_does_not_is_refused(cli_run, tmp_path, capsys, key, planted,
                                                                       fragments):
    copy = tmp_path / "copy"
    shutil.copytree(cli_run, copy, symlinks=True)
    config = copy / "checkpoints" / "latest" / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    saved[key] = planted
    config.write_text(yaml.safe_dump(saved))
    record_checksums(config.parent)  # crafted whole: the checksums match
    one_line_error(capsys, ["evaluate", "--checkpoint", str(copy)], *fragments)
    # named on the command line: the user's choice
    mine = f"loss={PKG}.task:lm_loss" if key == "loss" else "metrics=[accuracy]"
    assert main(["evaluate", "--checkpoint", str(copy), "--set", mine]) == 0


@pytest.fixture(scope="module")
def python_run(project, tmp_path_factory):
    run = tmp_path_factory.mktemp("py") / "mylm"
    torch.manual_seed(0)
    with Trainer(CharLM(), loss="cross_entropy", metrics=["accuracy"], epochs=1, batch_size=32, run_dir=str(run),
                 **QUIET) as trainer:
        trainer.fit(build_data(None)[0])
    return run


def test_a_python_run_asks_for_both_factories_and_data(python_run, project, capsys):
    ckpt = (python_run / "checkpoints" / "latest").resolve()
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert (saved["recipe"], saved["model"]["python_class"]) == ("custom", "helpers.char_lm:CharLM")
    assert one_line_error(capsys, ["evaluate", "--checkpoint", str(python_run)]) == (
        f"torchrig: error: checkpoint '{ckpt}': this checkpoint was saved from a model and data built in Python "
        f"(helpers.char_lm.CharLM); rebuild them in Python and load its model.safetensors (Trainer.evaluate, "
        f"torch.onnx.export …), or pass --set model.factory=MODULE:FN and --set data.factory=MODULE:FN (or --input "
        f"FILE), functions of yours that build them")
    model_only = ["--set", f"model.factory={PKG}.task:build_model"]
    assert one_line_error(capsys, ["evaluate", "--checkpoint", str(python_run), *model_only]) == (
        f"torchrig: error: no data: checkpoint '{ckpt}' names no data to evaluate on (recipe 'custom'); pass --set "
        f"data.factory=MODULE:FN, a function of yours that returns (train, val, test)")
    assert one_line_error(capsys, ["export", "--checkpoint", str(python_run), "--format", "safetensors",
                                   *model_only]) == (
        "torchrig: error: no data: recipe 'custom' has no data to take example inputs from; pass --input "
        "FILE_OR_FOLDER or --set data.factory=MODULE:FN")
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(python_run), "--json", *FACTORIES]) == 0
    results = json.loads(capsys.readouterr().out)
    ids, targets = (torch.stack(t) for t in zip(*build_data(None)[2]))
    with torch.no_grad():
        logits = _trained(python_run)(ids)
    assert results["accuracy"] == pytest.approx((logits.argmax(-1) == targets).float().mean().item(), abs=1e-6)
    assert main(["predict", "--checkpoint", str(python_run), "--input", "ids.npy", "--output", "py.npy",
                 *model_only]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("predict: softmax over the classes (from loss=cross_entropy); "
                                                       "--activation none for raw outputs")
    np.testing.assert_allclose(np.load(project / "py.npy").sum(-1), np.ones((3, SEQ)), atol=1e-5)


def test_a_python_run_recorded_as_digits_resumes_in_python(python_run, tmp_path):
    """A checkpoint of a Python run saved before its recipe was recorded as custom (``recipe: digits``) resumes:
    the recipe names none of a Python run's data, so it is not compared."""
    copy = tmp_path / "copy"
    shutil.copytree(python_run, copy, symlinks=True)
    config = copy / "checkpoints" / "latest" / "config.yaml"
    config.write_text(config.read_text().replace("recipe: custom", "recipe: digits"))
    record_checksums(config.parent)
    torch.manual_seed(0)
    with Trainer(CharLM(), loss="cross_entropy", metrics=["accuracy"], epochs=2, batch_size=32, run_dir=str(copy),
                 resume="latest", **QUIET) as trainer:
        trainer.fit(build_data(None)[0])
        assert trainer.global_step == 6


@pytest.mark.parametrize("setting,fragments", [
    (f"loss={PKG}.task:SEQ", [f"loss '{PKG}.task:SEQ' is a int, not a loss; name a function loss(output, target)"]),
    (f"loss={PKG}.task:lm_los", [f"loss '{PKG}.task:lm_los': '{PKG}.task' has no attribute 'lm_los'",
                                 "did you mean 'lm_loss'"]),
    (f"metrics=[accuracy,{PKG}.task:CHARS]", [f"metrics '{PKG}.task:CHARS' is a list, not a metric"]),
    ("loss=os:system", ["loss 'os:system': 'os' is a standard-library module"]),
])
def test_a_bad_loss_or_metric_spec_is_one_line(project, tmp_path, capsys, setting, fragments):
    one_line_error(capsys, ["train", *FACTORIES, "--set", setting, "--set", "max_steps=1",
                            "--set", f"run_dir={tmp_path / 'r'}", *QUICK], *fragments)
