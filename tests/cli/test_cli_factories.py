"""``torchrig train --model MODULE:FN --data MODULE:FN``: your own model and data from the command line,
recorded in the run's config so ``evaluate`` and ``predict`` rebuild them; bad specs give one line."""

from __future__ import annotations

import csv
import json
import shutil
import sys
import textwrap

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from torchrig import Trainer
from torchrig.cli import main

from helpers import UserProject, one_line_error, record_checksums

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none"]
PKG = "rigfactories"  # a package name no other test uses

TASK = '''
import torch
from torch import nn


def build_model(cfg):
    width = cfg.model.options.get("width", 16)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def build_data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (x[:64], y[:64]), (x[64:80], y[64:80]), (x[80:], y[80:])


def digits_model(cfg):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def returns_dict(cfg):
    return {"weights": 1}


def four_splits(cfg):
    part = (torch.zeros(4, 4), torch.zeros(4, dtype=torch.long))
    return part, part, part, part


answer = 42
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding a tiny package, made the current directory (as a user runs from their project)."""
    project = UserProject(tmp_path_factory.mktemp("project"), PKG, TASK)
    yield project.root
    project.close()


@pytest.fixture(scope="module")
def run(workdir):
    run = workdir / "run"
    code = main(["train", "--model", f"{PKG}.task:build_model", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "epochs=2", "--set", f"run_dir={run}", "--set", "model.options.width=8"])
    assert code == 0
    return run




def test_the_specs_are_recorded(run):
    cfg = yaml.safe_load((run / "checkpoints" / "latest" / "config.yaml").read_text())
    assert cfg["recipe"] == "custom"  # --data without a recipe named
    assert cfg["model"]["factory"] == f"{PKG}.task:build_model"
    assert cfg["data"]["factory"] == f"{PKG}.task:build_data"
    assert cfg["model"]["python_class"] is None and cfg["model"]["options"] == {"width": 8}


def test_evaluate_rebuilds_the_model_and_data(run, capsys):
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    # the same numbers by hand: the factory's model with the checkpoint's weights, on its test split
    task = sys.modules[f"{PKG}.task"]
    cfg = type("Cfg", (), {"model": type("M", (), {"options": {"width": 8}})})()
    model = task.build_model(cfg)
    model.load_state_dict(load_file(str(run / "checkpoints" / "latest" / "model.safetensors")))
    x, y = task.build_data(None)[2]
    with torch.no_grad():
        out = model(x)
    assert results["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), abs=1e-6)
    assert results["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item(), abs=1e-6)
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--split", "val", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"loss", "accuracy"}


def test_predict_rebuilds_the_model(run, workdir, capsys):
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.save(workdir / "x.npy", x)
    assert main(["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", "p.csv", "--topk", "2"]) == 0
    rows = list(csv.DictReader(open(workdir / "p.csv")))
    assert [r["input"] for r in rows] == [f"x.npy[{i}]" for i in range(5)]
    assert main(["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", "raw.npy"]) == 0
    probs = np.load(workdir / "raw.npy")
    task = sys.modules[f"{PKG}.task"]
    model = task.build_model(type("Cfg", (), {"model": type("M", (), {"options": {"width": 8}})})())
    model.load_state_dict(load_file(str(run / "checkpoints" / "latest" / "model.safetensors")))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).softmax(1).numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    assert [int(r["prediction"]) for r in rows] == expected.argmax(1).tolist()


def test_model_alone_keeps_the_recipe_data(workdir):
    run = workdir / "digits"
    assert main(["train", "--model", f"{PKG}.task:digits_model", *QUICK, "--set", "max_steps=2",
                 "--set", f"run_dir={run}"]) == 0
    cfg = yaml.safe_load((run / "checkpoints" / "latest" / "config.yaml").read_text())
    assert cfg["recipe"] == "digits" and cfg["model"]["factory"] == f"{PKG}.task:digits_model"
    assert cfg["data"]["factory"] is None
    assert set(load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))) == {"1.weight", "1.bias"}


def test_resume_rebuilds_the_recorded_model_and_data(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    before = load_file(str(copy / "checkpoints" / "latest" / "model.safetensors"))
    capsys.readouterr()
    # no --model / --data / model.options: the run's config.yaml names them
    assert main(["train", *QUICK, "--set", f"run_dir={copy}", "--set", "resume=latest", "--set", "epochs=3"]) == 0
    assert "test: loss" in capsys.readouterr().out
    cfg = yaml.safe_load((copy / "checkpoints" / "latest" / "config.yaml").read_text())
    assert (cfg["recipe"], cfg["epochs"], cfg["model"]["options"]) == ("custom", 3, {"width": 8})
    assert cfg["model"]["factory"] == f"{PKG}.task:build_model" and cfg["data"]["factory"] == f"{PKG}.task:build_data"
    after = load_file(str(copy / "checkpoints" / "latest" / "model.safetensors"))
    assert after.keys() == before.keys() and not torch.equal(after["0.weight"], before["0.weight"])


def test_a_checkpoint_cannot_name_a_standard_library_function(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    config = copy / "checkpoints" / "latest" / "config.yaml"
    config.write_text(config.read_text().replace(f"factory: {PKG}.task:build_model", "factory: os:system"))
    record_checksums(config.parent)  # crafted whole: the checksums match
    one_line_error(capsys, ["evaluate", "--checkpoint", str(copy)],
                    "model.factory 'os:system': 'os' is a standard-library module")


def test_a_checkpoint_runs_code_only_from_the_current_directory(run, tmp_path, capsys):
    """An installed package named by a crafted config.yaml is not imported; naming it on the command
    line is the user's choice and is honoured."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    config = copy / "checkpoints" / "latest" / "config.yaml"
    config.write_text(config.read_text().replace(f"factory: {PKG}.task:build_model", "factory: pytest:main"))
    record_checksums(config.parent)  # crafted whole: the checksums match
    one_line_error(capsys, ["evaluate", "--checkpoint", str(copy)],
                    "names model.factory 'pytest:main', a module outside the current directory",
                    "--set model.factory=pytest:main")
    assert main(["evaluate", "--checkpoint", str(copy), "--set", f"model.factory={PKG}.task:build_model"]) == 0


@pytest.mark.parametrize("flag,spec,fragments", [
    ("--model", "nosuchpkg_xyz.models:build", ["model.factory 'nosuchpkg_xyz.models:build'",
                                               "module 'nosuchpkg_xyz.models' not found", "current directory"]),
    ("--model", f"{PKG}.task:build_modle", [f"'{PKG}.task' has no attribute 'build_modle'",
                                            "did you mean 'build_model'"]),
    ("--model", f"{PKG}.task:answer", [f"model.factory '{PKG}.task:answer'", "'answer' is a int, not a function"]),
    ("--model", f"{PKG}.task:returns_dict", ["returned a dict, not a torch.nn.Module"]),
    ("--model", "shutil:rmtree", ["model.factory 'shutil:rmtree': 'shutil' is a standard-library module"]),
    ("--model", "no colon here", ["config key 'model.factory'", "'module:attribute'", "'no colon here'"]),
    ("--data", f"{PKG}.task:returns_dict", [f"data.factory '{PKG}.task:returns_dict' returned a dict with key "
                                            "'weights'", "(train, val, test)"]),
    ("--data", f"{PKG}.task:four_splits", ["returned a 4-item tuple", "(train, val)"]),
    ("--data", f"{PKG}.task:answer", ["'answer' is a int, not a function"]),
])
def test_bad_specs_give_one_line(workdir, capsys, tmp_path, flag, spec, fragments):
    other = ["--model", f"{PKG}.task:build_model"] if flag == "--data" else []
    one_line_error(capsys, ["train", flag, spec, *other, *QUICK, "--set", "epochs=1",
                             "--set", f"run_dir={tmp_path / 'r'}"], *fragments)


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_python_api_checkpoint_fails_with_the_exact_message(workdir, capsys, tmp_path):
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    with Trainer(TinyNet(), epochs=1, run_dir=str(tmp_path / "py"), progress="none", plot=False,
                 tensorboard=False) as trainer:
        trainer.fit((x, y))
        expected = trainer.predict(x)
    ckpt = (tmp_path / "py" / "checkpoints" / "latest").resolve()
    cls = f"{TinyNet.__module__}.{TinyNet.__qualname__}"
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert saved["model"]["python_class"] == f"{TinyNet.__module__}:TinyNet"
    message = (f"torchrig: error: checkpoint '{ckpt}': this checkpoint was saved from a model and data built in "
               f"Python ({cls}); rebuild them in Python and load its model.safetensors (Trainer.evaluate, "
               f"torch.onnx.export …), or pass --set model.factory=MODULE:FN and --set data.factory=MODULE:FN (or "
               f"--input FILE), functions of yours that build them")
    assert one_line_error(capsys, ["evaluate", "--checkpoint", str(tmp_path / "py")]) == message
    resumed = one_line_error(capsys, ["train", *QUICK, "--set", f"run_dir={tmp_path / 'py'}", "--set", "resume=latest"])
    assert resumed == message.replace("load its model.safetensors (Trainer.evaluate, torch.onnx.export …)",
                                      "pass resume= to its Trainer").replace(" (or --input FILE)", "")
    np.save(tmp_path / "x.npy", x.numpy())
    assert one_line_error(capsys, ["predict", "--checkpoint", str(tmp_path / "py"), "--input",
                                    str(tmp_path / "x.npy"), "--output", str(tmp_path / "p.csv")]) == message
    # naming a factory that builds the same architecture lets the command line load it after all
    (workdir / PKG / "tiny.py").write_text(textwrap.dedent("""
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                return self.fc(x)

        def build(cfg):
            return Net()
        """))
    assert main(["predict", "--checkpoint", str(tmp_path / "py"), "--input", str(tmp_path / "x.npy"),
                 "--output", str(tmp_path / "p.npy"), "--set", f"model.factory={PKG}.tiny:build"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), expected.numpy(), atol=1e-6)
