"""What a checkpoint may decide when it is read back (``docs/reliability.md``, "What a checkpoint may decide").

A checkpoint someone hands you is plain data, but some of its fields name things: a module to import, a
process group to join, paths, sizes. Each test here crafts such a field the way an attacker would and
checks that it decides nothing it may not: a planted factory module never runs (a marker file it would
write never appears), and the refusal is one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from torchrig.cli import main

from helpers import one_line_error

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none"]
PKG = "trustproj"  # a package name no other test uses

TASK = '''
import torch
from torch import nn


def build_model(cfg):
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def build_data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (x[:32], y[:32]), None, (x[32:], y[32:])
'''

PAYLOAD = '''
from pathlib import Path

Path({marker!r}).write_text("the planted module ran")


def build(cfg):
    from torch import nn

    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
'''


def _forget(*prefixes: str) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in prefixes]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder with the user's own factories and one run trained from them."""
    root = tmp_path_factory.mktemp("project")
    (root / PKG).mkdir()
    (root / PKG / "__init__.py").write_text("")
    (root / PKG / "task.py").write_text(textwrap.dedent(TASK))
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setattr(sys, "path", list(sys.path))
    code = main(["train", "--model", f"{PKG}.task:build_model", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "epochs=1", "--set", f"run_dir={root / 'run'}"])
    mp.undo()
    _forget(PKG)
    assert code == 0
    return root


@pytest.fixture
def victim(project, tmp_path, monkeypatch):
    """The victim's working folder: a copy of the project, made the current directory."""
    here = tmp_path / "work"
    shutil.copytree(project, here, symlinks=True)
    for meta_file in (here / "run" / "checkpoints").glob("step-*/meta.json"):  # as if trained here
        meta_file.write_text(meta_file.read_text().replace(str(project.resolve()), str(here.resolve())))
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield here
    _forget(PKG, "shared_model", "payload", "bare")


def _latest(run: Path) -> Path:
    return (run / "checkpoints" / "latest").resolve()


def test_the_factories_are_recorded_with_their_file_and_hash(project):
    meta = json.loads((_latest(project / "run") / "meta.json").read_text())
    task = project / PKG / "task.py"
    record = {"spec": f"{PKG}.task:build_model", "module": f"{PKG}.task", "file": str(task.resolve()),
              "sha256": hashlib.sha256(task.read_bytes()).hexdigest()}
    assert meta["factories"]["model.factory"] == record
    assert meta["factories"]["data.factory"] == dict(record, spec=f"{PKG}.task:build_data")


def _plant(victim: Path, run: Path, module_file: Path, module: str, key: str = "model.factory") -> tuple[str, Path]:
    """An attacker's run folder: the payload module at ``module_file``, the config naming it, and a meta.json
    record that matches it exactly (its real path and hash): the strongest forgery."""
    marker = victim / "pwned"
    module_file.parent.mkdir(parents=True, exist_ok=True)
    module_file.write_text(textwrap.dedent(PAYLOAD.format(marker=str(marker))))
    spec = f"{module}:build"
    for ckpt in [p for p in (run / "checkpoints").glob("step-*")] or [run]:
        config = yaml.safe_load((ckpt / "config.yaml").read_text())
        section, _, name = key.partition(".")
        config[section][name] = spec
        (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
        meta = json.loads((ckpt / "meta.json").read_text())
        meta.setdefault("factories", {})[key] = {"spec": spec, "module": module, "file": str(module_file.resolve()),
                                                 "sha256": hashlib.sha256(module_file.read_bytes()).hexdigest()}
        (ckpt / "meta.json").write_text(json.dumps(meta))
    return spec, marker


def _shared_model(victim: Path, key: str = "model.factory") -> tuple[str, Path, Path]:
    """``shared_model/``: a run folder someone handed over, unpacked in the current directory, whose config.yaml
    names ``shared_model.checkpoints.payload:build``."""
    run = victim / "shared_model"
    shutil.copytree(victim / "run", run, symlinks=True)
    spec, marker = _plant(victim, run, run / "checkpoints" / "payload.py", "shared_model.checkpoints.payload", key)
    return spec, marker, run


def _refusal(ckpt: Path, key: str, spec: str, place: Path, run: Path) -> str:
    return (f"torchrig: error: checkpoint '{ckpt}': its config.yaml names {key} '{spec}', which is '{place}', a file "
            f"or folder that holds the checkpoint or lies in its run directory {run}: torchrig never imports code "
            f"that comes with a checkpoint. Name your own factory on the command line: --set {key}=MODULE:FUNCTION")


WAYS = {
    "evaluate": lambda run: ["evaluate", "--checkpoint", str(run)],
    "evaluate-step": lambda run: ["evaluate", "--checkpoint", str(_latest(run))],
    "predict": lambda run: ["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", "p.csv"],
    "resume": lambda run: ["train", *QUICK, "--set", f"run_dir={run}", "--set", "resume=latest", "--set", "epochs=2"],
}


@pytest.mark.parametrize("key", ["model.factory", "data.factory"])
@pytest.mark.parametrize("way", list(WAYS))
def test_a_factory_planted_in_a_run_folder_never_runs(victim, capsys, way, key):
    spec, marker, run = _shared_model(victim, key)
    np.save(victim / "x.npy", np.zeros((2, 4), dtype=np.float32))
    line = one_line_error(capsys, WAYS[way](run))
    assert not marker.exists()
    # the package `shared_model` is the run folder itself, which holds the checkpoint
    assert line == _refusal(_latest(run), key, spec, run, run)


def test_a_module_beside_the_checkpoints_of_the_current_folder_never_runs(victim, capsys, monkeypatch):
    """Run from inside the handed-over run folder: the planted top-level module lies in the run directory."""
    run = victim / "shared_model"
    shutil.copytree(victim / "run", run, symlinks=True)
    spec, marker = _plant(victim, run, run / "payload.py", "payload")
    monkeypatch.chdir(run)
    line = one_line_error(capsys, ["evaluate", "--checkpoint", "."])
    assert not marker.exists()
    assert line == _refusal(_latest(run), "model.factory", spec, run / "payload.py", run)


def test_a_module_inside_a_bare_checkpoint_folder_never_runs(victim, capsys):
    bare = victim / "bare"
    shutil.copytree(_latest(victim / "run"), bare)
    spec, marker = _plant(victim, bare, bare / "payload.py", "bare.payload")
    line = one_line_error(capsys, ["evaluate", "--checkpoint", str(bare)])
    assert not marker.exists()
    assert line == _refusal(bare, "model.factory", spec, bare, bare)


def test_the_payload_is_live(victim):
    """The planted module does write its marker when imported: the tests above can fail."""
    _, marker, _ = _shared_model(victim)
    sys.path.insert(0, str(victim))
    __import__("shared_model.checkpoints.payload")
    assert marker.exists()


def test_a_factory_named_on_the_command_line_is_the_users_choice(victim, capsys):
    _, marker, run = _shared_model(victim)
    assert main(["evaluate", "--checkpoint", str(run), "--set", f"model.factory={PKG}.task:build_model"]) == 0
    assert not marker.exists()
    assert main(["evaluate", "--checkpoint", str(run), "--set", "model.factory=shared_model.checkpoints.payload:build"]) == 0
    assert marker.exists()  # named on the command line: your choice, imported as given


def test_a_moved_project_is_named_again_on_the_command_line(project, tmp_path, monkeypatch, capsys):
    """The same factory in a copy of the project: not the file the run was trained with."""
    moved = tmp_path / "moved"
    shutil.copytree(project, moved, symlinks=True)
    monkeypatch.chdir(moved)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        ckpt = _latest(moved / "run")
        spec = f"{PKG}.task:build_model"
        line = one_line_error(capsys, ["evaluate", "--checkpoint", str(moved / "run")])
        assert line == (f"torchrig: error: checkpoint '{ckpt}': its config.yaml names model.factory '{spec}', which "
                        f"resolves to '{(moved / PKG / 'task.py').resolve()}' here, not to the file the run was "
                        f"trained with ('{(project / PKG / 'task.py').resolve()}'); torchrig imports a factory read "
                        f"back from a checkpoint only when it is the file the run was trained with. Name it on the "
                        f"command line: --set model.factory=MODULE:FUNCTION")
        assert main(["evaluate", "--checkpoint", str(moved / "run"), "--set", f"model.factory={spec}",
                     "--set", f"data.factory={PKG}.task:build_data"]) == 0
    finally:
        _forget(PKG)


def test_an_edited_factory_or_a_checkpoint_without_a_record_is_refused(victim, capsys):
    run = victim / "run"
    spec = f"{PKG}.task:build_model"
    (victim / PKG / "task.py").write_text(textwrap.dedent(TASK) + "\n# edited\n")
    line = one_line_error(capsys, ["evaluate", "--checkpoint", str(run)])
    assert line.endswith(f"names model.factory '{spec}', whose file '{(victim / PKG / 'task.py').resolve()}' changed "
                         f"since the run was trained (its SHA-256 differs); torchrig imports a factory read back from "
                         f"a checkpoint only when it is the file the run was trained with. Name it on the command "
                         f"line: --set model.factory=MODULE:FUNCTION")
    meta_file = _latest(run) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["factories"]
    meta_file.write_text(json.dumps(meta))
    line = one_line_error(capsys, ["evaluate", "--checkpoint", str(run)])
    assert line.endswith(f"names model.factory '{spec}', but its meta.json does not record which file that module "
                         f"was imported from; torchrig imports a factory read back from a checkpoint only when it is "
                         f"the file the run was trained with. Name it on the command line: "
                         f"--set model.factory=MODULE:FUNCTION")
