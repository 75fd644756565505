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

from helpers import UserProject, forget_modules, forkserver, one_line_error, record_checksums

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


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder with the user's own factories and one run trained from them."""
    root = tmp_path_factory.mktemp("project")
    project = UserProject(root, PKG, TASK)
    code = main(["train", "--model", f"{PKG}.task:build_model", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "epochs=1", "--set", f"run_dir={root / 'run'}"])
    project.close()
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
    forget_modules(PKG, "shared_model", "payload", "bare")


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
        record_checksums(ckpt)  # a forger re-records them: a checksum is no signature
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
    spec = "shared_model.checkpoints.payload:build"
    assert main(["evaluate", "--checkpoint", str(run), "--set", f"model.factory={spec}"]) == 0
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
        forget_modules(PKG)


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


# ----------------------------------------------------------------------------- a process group from a checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"

# A real attacker: a process that opens a process group as rank 0 on 127.0.0.1, then runs the very command
# the victim runs (so that every collective before the exchange matches), except that every object it gives
# torchrig's gather / broadcast is a pickle payload that would create a marker file.
ATTACKER = r"""
import datetime, os, sys
from pathlib import Path

import torch
import torch.distributed as dist

marker, joined, port, *command = sys.argv[1:]


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


import torchrig.runtime as R

gather, broadcast = R.gather, R.broadcast
R.gather = lambda obj, *group: gather(Payload(), *group)  # group: the data-parallel ranks
R.broadcast = lambda obj, src=0: broadcast(obj if isinstance(obj, torch.Tensor) else Payload(), src)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
Path(joined).touch()
from torchrig.cli import main
sys.exit(main(command))
"""


def _subprocess_env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))
    return env


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    assert main(["train", *QUICK, "--set", "max_steps=2", "--set", f"run_dir={root / 'run'}"]) == 0
    np.save(root / "x.npy", np.zeros((5, 8, 8), dtype=np.float32))
    return root


def _commands(root: Path, run: Path) -> dict[str, list[str]]:
    return {"evaluate": ["evaluate", "--checkpoint", str(run)],
            "predict": ["predict", "--checkpoint", str(run), "--input", str(root / "x.npy"),
                        "--output", str(root / "p.csv")]}


def _attack(root: Path, tmp_path: Path, port: int, command: list[str], *victim_extra: str):
    """Start the attacker on ``port``, then the victim's ``torchrig COMMAND``; (victim's result, marker, joined)."""
    marker, joined = tmp_path / "pwned", tmp_path / "joined"
    # both forked from the tests' fork server: real processes with their own sockets, no interpreter start
    attacker = forkserver.popen(["-c", ATTACKER, marker, joined, port, *command], cwd=root, env=_subprocess_env())
    try:
        victim = forkserver.run(["-m", "torchrig.cli", *command, *victim_extra], cwd=root, env=_subprocess_env(),
                                timeout=240)
    finally:
        attacker.kill()
        attacker.wait()
    return victim, marker, joined


@pytest.mark.slow
@pytest.mark.parametrize("way", ["evaluate", "predict"])
def test_a_checkpoint_cannot_make_this_process_join_a_process_group(digits_run, tmp_path, way):
    """config.yaml names an attacker's group (dist.init_method, rank, world_size): the victim evaluates alone,
    says that it ignored them, and never connects."""
    from helpers.dist_procs import free_port

    run = tmp_path / "crafted"
    shutil.copytree(digits_run / "run", run, symlinks=True)
    port = free_port()
    for config_file in (run / "checkpoints").glob("step-*/config.yaml"):
        config = yaml.safe_load(config_file.read_text())
        config["dist"].update(init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, backend="gloo")
        config_file.write_text(yaml.safe_dump(config))
        record_checksums(config_file.parent)
    victim, marker, joined = _attack(digits_run, tmp_path, port, _commands(digits_run, run)[way])
    assert not marker.exists() and not joined.exists()
    assert victim.returncode == 0, victim.stderr
    ckpt = (run / "checkpoints" / "latest").resolve()
    assert victim.stderr.strip().splitlines() == [
        f"torchrig: checkpoint '{ckpt}' names dist.init_method=tcp://127.0.0.1:{port}, dist.rank=1, dist.world_size=2, "
        f"dist.backend=gloo; ignored: how this process joins a process group comes from this command line and its "
        f"environment only (torchrun's RANK, WORLD_SIZE, MASTER_ADDR)"]


@pytest.mark.slow
@pytest.mark.parametrize("way", ["evaluate", "predict"])
def test_objects_from_another_rank_are_never_unpickled(digits_run, tmp_path, way):
    """Joined on purpose (the command line names the group), rank 0 sends a pickle payload where torchrig
    exchanges plain data: it is refused, by name, and never runs."""
    from helpers.dist_procs import free_port

    port = free_port()
    victim, marker, joined = _attack(digits_run, tmp_path, port, _commands(digits_run, digits_run / "run")[way],
                                     "--set", f"dist.init_method=tcp://127.0.0.1:{port}", "--set", "dist.rank=1",
                                     "--set", "dist.world_size=2")
    assert joined.exists()  # the attacker's group formed: the victim took part
    assert not marker.exists()
    assert victim.returncode == 1
    assert victim.stderr.strip().splitlines()[-1] == (
        "torchrig: error: rank 1: the object rank 0 sent pickles 'posix.system'; ranks exchange only plain data "
        "(tensors, numbers, strings, lists, tuples, dicts), so that no process can make another run code. Check "
        "that every rank runs your own program (and gather / broadcast plain values)")


# ----------------------------------------------------------------------------- the other fields read back


def test_this_runs_keys_are_never_taken_from_a_checkpoint(tmp_path):
    """Every key of THIS_RUN, crafted in config.yaml, takes this run's value: the default, or --set."""
    from torchrig import config as C
    from torchrig.recipes.run import THIS_RUN, inference_config

    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    crafted = {"dist": {"init_method": "tcp://203.0.113.7:29500", "rank": 1, "world_size": 2, "backend": "gloo",
                        "timeout": 1e9, "strategy": "fsdp"},
               "device": "cuda:7", "threads": 100000, "interop_threads": 100000,
               "data": {"num_workers": 1000, "prefetch_factor": 100000, "pin_memory": True, "batch_size": 16},
               "log": {"trackers": ["mlflow", "wandb"], "mlflow_uri": "http://203.0.113.7:5000",
                       "project": "theirs", "run_name": "theirs", "tensorboard": True, "plot": True},
               "profile": {"steps": [1, 2], "memory_snapshot": True}, "resume": "/home/victim/other_run",
               "resume_weights_only": True, "overwrite": True, "run_dir": "/home/victim/important",
               "model": {"weights": "/home/victim/secret.pt"},
               "parallel": {"tp": 2, "dp_shard": 2, "tp_plan": "auto"}}
    notes: list[str] = []
    cfg = inference_config(crafted, ckpt, say=notes.append)
    default = C.Config()
    for key in THIS_RUN:
        if key != "run_dir":
            assert C.get_key(cfg, key) == C.get_key(default, key), key
    assert cfg.run_dir == str(tmp_path / "run")  # the run directory the checkpoint lies in
    assert cfg.data.batch_size == 16  # not a key of this run: the checkpoint's
    assert notes == [f"torchrig: checkpoint '{ckpt}' names dist.init_method=tcp://203.0.113.7:29500, dist.rank=1, "
                     f"dist.world_size=2, dist.backend=gloo; ignored: how this process joins a process group comes "
                     f"from this command line and its environment only (torchrun's RANK, WORLD_SIZE, MASTER_ADDR)"]
    cfg = inference_config(crafted, tmp_path / "bare", ["threads=2", "data.num_workers=0"], say=notes.append)
    assert (cfg.threads, cfg.data.num_workers, cfg.run_dir) == (2, 0, str(tmp_path / "bare"))


def test_evaluate_ignores_the_machine_keys_of_a_crafted_checkpoint(digits_run, tmp_path, capsys):
    """The same numbers as the untouched checkpoint, with threads, workers, trackers, paths crafted."""
    assert main(["evaluate", "--checkpoint", str(digits_run / "run"), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    run = tmp_path / "crafted"
    shutil.copytree(digits_run / "run", run, symlinks=True)
    for config_file in (run / "checkpoints").glob("step-*/config.yaml"):
        config = yaml.safe_load(config_file.read_text())
        config.update(threads=100000, run_dir=str(tmp_path / "elsewhere"), resume=str(tmp_path / "elsewhere"),
                      overwrite=True)
        config["data"].update(num_workers=1000, prefetch_factor=100000)
        config["log"].update(trackers=["mlflow"], mlflow_uri="http://127.0.0.1:9")
        config["model"]["weights"] = str(tmp_path / "elsewhere" / "w.pt")
        config_file.write_text(yaml.safe_dump(config))
        record_checksums(config_file.parent)
    assert main(["evaluate", "--checkpoint", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    assert not (tmp_path / "elsewhere").exists()


def test_index_json_never_names_a_folder_to_remove(digits_run, tmp_path, capsys):
    """Pruning removes the checkpoints index.json lists: a crafted entry outside the folder is dropped."""
    run = tmp_path / "run"
    shutil.copytree(digits_run / "run", run, symlinks=True)
    precious, beside = tmp_path / "precious", tmp_path / "beside"
    for folder in (precious, beside):
        folder.mkdir()
        (folder / "keep.txt").write_text("mine")
    index = json.loads((run / "checkpoints" / "index.json").read_text())
    index["checkpoints"] = [str(precious), "../../beside", *index["checkpoints"]]
    index["best"] = [{"name": "../../beside", "value": 1.0}]
    (run / "checkpoints" / "index.json").write_text(json.dumps(index))
    assert main(["train", *QUICK, "--set", f"run_dir={run}", "--set", "resume=latest", "--set", "max_steps=4",
                 "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=1"]) == 0
    assert (precious / "keep.txt").read_text() == "mine" and (beside / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000004"]


def test_the_last_link_of_numbered_runs_stays_in_its_folder(digits_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(digits_run / "run", outside, symlinks=True)
    (tmp_path / "runs" / "digits").mkdir(parents=True)
    link = tmp_path / "runs" / "digits" / "last"
    link.symlink_to(outside)
    message = (f"torchrig: error: run link 'runs/digits/last' points outside its folder, to '{outside}'; torchrig "
               f"follows 'last' only to a run in the same folder. Remove the link, or give the run directory itself")
    assert one_line_error(capsys, ["evaluate", "--checkpoint", "runs/digits"]) == message
    before = sorted(p.name for p in (outside / "checkpoints").iterdir())
    assert one_line_error(capsys, ["train", *QUICK, "--set", "resume=latest", "--set", "max_steps=4"]) == message
    assert sorted(p.name for p in (outside / "checkpoints").iterdir()) == before


def test_model_options_read_back_download_nothing(monkeypatch):
    """model.options reach the torchvision / timm builders: weights= is refused, pretrained= dropped."""
    timm = pytest.importorskip("timm")
    from torchrig.models import ModelError
    from torchrig.models.vision import build_image_model

    with pytest.raises(ModelError, match="torchrig never downloads weights: set model.weights to a local file"):
        build_image_model("torchvision:resnet18", 3, 3, {"weights": "IMAGENET1K_V1"})
    seen = {}
    monkeypatch.setattr(timm, "create_model", lambda name, **kw: seen.update(kw))
    build_image_model("timm:resnet18", 3, 3, {"pretrained": True})
    assert seen["pretrained"] is False
