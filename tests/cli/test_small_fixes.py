"""The small things a new user trips on: a key given without its section or by another tool's name gets the
right suggestion, ``~`` in run_dir is expanded, predict's --output format comes from the extension (or is
refused), the Python API's messages speak Python, a list of sample tensors is refused in one line, and
doctor lists the optional packages the extras install."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import torch
from torch import nn

import torchrig
from helpers import QUIET, TinyNet, make_classification, one_line_error
from torchrig.cli import main
from torchrig.data import DataError


@pytest.mark.parametrize("given,meant", [("progress", "'log.progress'"), ("learning_rate", "'optim.lr'"),
                                         ("every_steps", "'checkpoint.every_steps' or 'log.every_steps'"),
                                         ("num_epochs", "'epochs'")])
def test_a_key_without_its_section_or_by_another_name_is_suggested(capsys, given, meant):
    assert one_line_error(capsys, ["train", "--set", f"{given}=1"]) == (
        f"torchrig: error: unknown config key '{given}'; did you mean {meant}?")
    with pytest.raises(torchrig.config.ConfigError, match=f"did you mean {meant}"):
        torchrig.load_config(base={given: 1})


@pytest.mark.parametrize("given,meant", [("learning_rate", "'lr'"), ("every_steps", "'checkpoint_every' or "
                                                                                      "'log_every'"),
                                         ("mlflow_uri", "**{'log.mlflow_uri': ...}")])
def test_a_trainer_keyword_is_suggested_as_python_writes_it(given, meant):
    with pytest.raises(TypeError) as info:
        torchrig.Trainer(nn.Linear(2, 2), **{given: 1})
    assert str(info.value) == f"Trainer got an unexpected keyword argument '{given}'; did you mean {meant}?"


def test_run_dir_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    trainer = torchrig.Trainer(TinyNet(), **dict(QUIET, run_dir="~/runs/x", epochs=1, num_workers=0))
    trainer.fit(make_classification(16))
    assert trainer.run_dir == tmp_path / "runs" / "x" and (tmp_path / "runs" / "x" / "checkpoints").is_dir()
    assert not (tmp_path / "~").exists()  # not a folder named ~ in the current directory
    cfg = torchrig.load_config(overrides=["run_dir=~/y"])
    assert cfg.run_dir == str(tmp_path / "y")


def test_the_python_api_speaks_python(tmp_path):
    x, y = make_classification(16)
    opts = dict(QUIET, run_dir=str(tmp_path / "run"), epochs=1, num_workers=0)
    torchrig.Trainer(TinyNet(), **opts).fit((x, y))
    with pytest.raises(torchrig.TorchrigError) as info:
        torchrig.Trainer(TinyNet(), **opts).fit((x, y))
    assert str(info.value) == (f"run_dir '{tmp_path / 'run'}' holds a run that reached step 1: continue it with "
                               f"resume=\"latest\", choose another run_dir, or overwrite=True")


def test_a_list_of_sample_tensors_is_one_line(tmp_path):
    x, _ = make_classification(16)
    trainer = torchrig.Trainer(TinyNet(), **dict(QUIET, run_dir=str(tmp_path / "run"), epochs=1, num_workers=0))
    with pytest.raises(DataError) as info:
        trainer.fit([x[i] for i in range(16)])
    assert str(info.value) == (
        "the data is a list of 16 tensors of shape (8,): torchrig reads a list or tuple of tensors as columns "
        "(inputs…, target), each holding every sample, and these look like one sample each; stack them "
        "(torch.stack(samples)) and give (inputs, targets), or give a list of (x, y) pairs")
    from torchrig.data.batches import BatchError

    with pytest.raises(BatchError, match=r"^the batch's inputs are 2 tensors \(float32 \(16, 8\), float32 \(16, 8\)\), "
                                         r"each passed to forward as one argument, but TinyNet\.forward\(\) does not "
                                         r"take 2 .*give \(x, y\), or a forward taking each input$"):
        trainer.fit([x, x, torch.zeros(16, dtype=torch.long)])


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("digits") / "run"
    assert main(["train", "--set", "max_steps=2", "--set", "epochs=1", "--set", "log.plot=false", "--set",
                 "log.tensorboard=false", "--set", "log.progress=none", "--set", f"run_dir={run}"]) == 0
    return run


def test_predict_output_format_by_extension_or_refused(digits_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import numpy as np
    from sklearn.datasets import load_digits

    np.save(tmp_path / "x.npy", load_digits().images[:3].astype("float32") / 16)  # the model learnt [0, 1]
    assert one_line_error(capsys, ["predict", "--checkpoint", str(digits_run), "--input", "x.npy", "--output",
                                   "preds.txt"]) == (
        "torchrig: error: predict --output 'preds.txt': the format is chosen by the file's extension, and '.txt' "
        "is not one this task writes; end the name with .csv or .json (e.g. predictions.csv)")
    assert not (tmp_path / "preds.txt").exists()
    assert main(["predict", "--checkpoint", str(digits_run), "--input", "x.npy", "--output", "p.JSON"]) == 0
    assert (tmp_path / "p.JSON").read_text().lstrip().startswith("[")


def test_doctor_lists_what_the_extras_install(capsys):
    from torchrig.cli.doctor import extras

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    listed = extras()
    assert {"datasets", "mlflow", "wandb", "torchdata"} <= set(listed)
    optional = next(line for line in out.splitlines() if line.startswith("optional"))
    for name in ("datasets", "mlflow", "wandb", "torchdata"):
        assert f"{name} {md.version(name)}" in optional
    missing = next((line for line in out.splitlines() if line.startswith("missing")), "")
    for name, extra in listed.items():  # a package is called missing only with the extra that installs it
        assert (name in missing) == (f'{name} (pip install "torchrig[{extra}]")' in missing)


def test_doctors_own_list_is_the_extras_of_pyproject():
    """What doctor says without torchrig's metadata (a source checkout on PYTHONPATH) is pyproject's extras."""
    import re
    import tomllib

    from torchrig.cli.doctor import EXTRAS

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    declared = {}
    for extra, packages in project["optional-dependencies"].items():
        for spec in packages if extra not in ("all", "test") else []:
            declared.setdefault(re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower(), extra)
    assert EXTRAS == declared


@pytest.mark.parametrize("env, shown", [({"RANK": "1"}, 0), ({"RANK": "0"}, 1), ({"SLURM_PROCID": "3"}, 0), ({}, 1)])
def test_torchrig_warnings_come_from_the_first_process_only(monkeypatch, env, shown):
    """Under torchrig launch (torchrun) or srun every process runs the command: torchrig's own warnings are printed by
    rank 0 alone, not once per process; other libraries' warnings are left alone."""
    import warnings

    import torchrig.cli as cli
    from torchrig.parallel.wrap import wrap_model

    for k in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.warn_once_per_job()
        wrap_model(torch.nn.Linear(2, 2), "dp", torch.device("cpu"))  # warns: DataParallel needs two GPUs
        warnings.warn("another library's warning", UserWarning)
    texts = [str(w.message) for w in caught]
    assert sum("strategy 'dp'" in t for t in texts) == shown, texts
    assert "another library's warning" in texts


def test_torchrig_warnings_are_one_line_on_the_command_line(monkeypatch):
    """A torchrig warning on the command line reads `torchrig: warning: …`, without Python's file, line and source
    line; other libraries' warnings keep Python's format; installing it twice keeps one wrapper."""
    import warnings

    import torchrig.cli as cli
    import torchrig.parallel.wrap as wrap

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    cli._one_line_warnings()
    cli._one_line_warnings()
    ours = warnings.formatwarning("strategy 'dp' needs two GPUs", UserWarning, wrap.__file__, 42)
    assert ours == "torchrig: warning: strategy 'dp' needs two GPUs\n"
    theirs = warnings.formatwarning("deprecated", UserWarning, "/site-packages/other/x.py", 7, "x = 1")
    assert theirs.startswith("/site-packages/other/x.py:7: UserWarning: deprecated")


def test_a_numbered_run_is_named_once_it_starts_and_not_by_a_start_that_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("import torch\n\ndef model(cfg):\n    return torch.nn.Linear(4, 2)\n\n"
                                      "def data(cfg):\n    raise ValueError('no data here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    capsys.readouterr()
    assert main(["train", "--model", "mine:model", "--data", "mine:data"]) == 1
    out, err = capsys.readouterr()
    assert "raised ValueError: no data here" in err
    assert "runs/custom/1" not in out + err and not (tmp_path / "runs" / "custom" / "1").exists()
    assert main(["train", "--set", "max_steps=1", "--set", "log.progress=none", "--set", "log.plot=false",
                 "--set", "log.tensorboard=false", "--set", "log.summary=false"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("torchrig: run_dir not set; writing to runs/digits/1 (last -> 1)\n")
    assert "torchrig: 1 process(es) on cpu" in err  # printed before: the line comes when training starts
