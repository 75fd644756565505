"""No code from any checkpoint file; links that stay in their folder; storage failures that lose nothing.

A real plain checkpoint (``torchrig train``, one process) and a real sharded one (``dist.strategy=fsdp``
in a one-rank gloo group) are built once. Every case copies one, plants a ``__reduce__`` payload (it
would create a marker file) in one of its non-safetensors files, and goes in one way: ``evaluate``,
``predict``, ``export``, ``train --set resume=PATH``, ``train --set resume=latest``, the Python API, and a torchrun
restart (``TORCHELASTIC_RESTART_COUNT=1`` resumes by itself). The payload never runs; a file that the
way reads is refused as unsafe, by name.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import forkserver, record_checksums
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from torchrig import Trainer
from torchrig.checkpoint import CheckpointError, CheckpointManager, read_checkpoint, resolve
from torchrig.config import files as files_mod
from torchrig.cli import main
from torchrig.recipes import get_recipe
from torchrig.recipes.run import build_config

SRC = Path(__file__).resolve().parents[2] / "src"
STEP = "step-00000002"
QUICK = ["epochs=1", "max_steps=2", "log.plot=false", "log.tensorboard=false", "log.progress=none"]

BUILD_SHARDED = r"""
import sys, tempfile
import torch.distributed as dist
from torchrig.cli import main
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
sys.exit(main(sys.argv[1:]))
"""


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    assert main(["train", *_sets(*QUICK, f"run_dir={root / 'plain'}")]) == 0
    forkserver.run(["-c", BUILD_SHARDED, "train", *_sets(*QUICK, f"run_dir={root / 'sharded'}", "dist.strategy=fsdp")],
                   env=_env(), check=True, timeout=120)  # forked: its own process group, no interpreter start
    assert (root / "sharded" / "checkpoints" / STEP / "sharded" / ".metadata").exists()
    return root


@pytest.fixture
def run_copy(built, tmp_path):
    def copy(kind: str) -> Path:
        return Path(shutil.copytree(built / kind, tmp_path / "run", symlinks=True))
    return copy


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------- payloads


def _plant_pickle(ckpt: Path, marker: Path) -> Path:
    path = ckpt / "sharded" / ".metadata"
    path.write_bytes(pickle.dumps(Evil(marker)))
    return path


def _plant_state(ckpt: Path, marker: Path) -> Path:
    path = ckpt / "state.pt"
    state = torch.load(path, weights_only=True)
    state["extra"] = Evil(marker)
    torch.save(state, path)
    return path


def _plant_yaml(ckpt: Path, marker: Path) -> Path:
    path = ckpt / "config.yaml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    return path


def _plant_distcp(ckpt: Path, marker: Path, values: bool) -> Path:
    """Point DCP's index at a pickled payload appended to the shard file: for every non-tensor value
    (DCP itself reads those with ``weights_only=False``) or for every tensor."""
    folder = ckpt / "sharded"
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own, trusted file
    payload = io.BytesIO()
    torch.save(Evil(marker), payload)
    shard = folder / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(payload.getvalue())
    for index, info in meta.storage_data.items():
        if isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata) == values:
            meta.storage_data[index] = dataclasses.replace(info, relative_path=shard.name, offset=offset,
                                                           length=len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return shard


PLANTS = {
    "state.pt": _plant_state,
    "config.yaml": _plant_yaml,
    "sharded/.metadata": _plant_pickle,
    "distcp-values": lambda ckpt, marker: _plant_distcp(ckpt, marker, values=True),
    "distcp-tensors": lambda ckpt, marker: _plant_distcp(ckpt, marker, values=False),
}
WHAT = {"config.yaml": "uses the YAML tag 'tag:yaml.org,2002:python/object/apply:os.system'"}


def _unsafe_read(name: str, path: Path) -> None:
    """How a loader without torchrig's guards reads the planted file."""
    if name == "config.yaml":
        yaml.unsafe_load(path.read_text())
    elif name == "sharded/.metadata":
        pickle.loads(path.read_bytes())
    elif name.startswith("distcp"):
        meta = pickle.loads((path.parent / ".metadata").read_bytes())
        info = max(meta.storage_data.values(), key=lambda i: i.offset)  # the planted one, at the end
        torch.load(io.BytesIO(path.read_bytes()[info.offset:info.offset + info.length]), weights_only=False)
    else:
        torch.load(path, weights_only=False)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_every_planted_payload_is_live(run_copy, tmp_path, plant):
    """The payloads below are real: a plain loader runs them (so the tests that follow can fail)."""
    ckpt = run_copy("sharded") / "checkpoints" / STEP
    marker = tmp_path / "pwned"
    path = PLANTS[plant](ckpt, marker)
    _unsafe_read(plant, path)
    assert marker.exists()


# ----------------------------------------------------------------------------- ways in


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()[-1] if code else ""


def _evaluate(run, ckpt, tmp_path, capsys, monkeypatch):
    return _cli(capsys, ["evaluate", "--checkpoint", str(ckpt)])


def _predict(run, ckpt, tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "x.npy", np.zeros((2, 8, 8), dtype=np.float32))
    return _cli(capsys, ["predict", "--checkpoint", str(ckpt), "--input", str(tmp_path / "x.npy"),
                         "--output", str(tmp_path / "p.csv")])


def _export(run, ckpt, tmp_path, capsys, monkeypatch):
    return _cli(capsys, ["export", "--checkpoint", str(ckpt), "--format", "safetensors",
                         "--output", str(tmp_path / "exported.safetensors")])


def _resume_path(run, ckpt, tmp_path, capsys, monkeypatch):
    return _cli(capsys, ["train", *_sets(*QUICK, "max_steps=3", f"run_dir={tmp_path / 'new'}", f"resume={ckpt}")])


def _resume_latest(run, ckpt, tmp_path, capsys, monkeypatch):
    return _cli(capsys, ["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", "resume=latest")])


def _torchrun_restart(run, ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    return _cli(capsys, ["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}")])


def _python_api(run, ckpt, tmp_path, capsys, monkeypatch):
    cfg = build_config(overrides=[*QUICK, "max_steps=3", f"run_dir={tmp_path / 'api'}"])
    recipe = get_recipe(cfg.recipe)
    data = recipe.build_data(cfg)
    trainer = Trainer(recipe.build_model(cfg), config=cfg, resume=str(ckpt), **recipe.trainer_kwargs(cfg, data))
    try:
        trainer.fit(data["train"])
    except CheckpointError as exc:
        return 1, f"torchrig: error: {exc}"
    finally:
        trainer.close()
    return 0, ""


WAYS = {"evaluate": _evaluate, "predict": _predict, "export": _export, "resume=PATH": _resume_path, "resume=latest": _resume_latest,
        "torchrun-restart": _torchrun_restart, "python-api": _python_api}
INFERENCE = {"evaluate", "predict", "export"}  # they read model.safetensors, state.pt, config.yaml and meta.json only
CASES = [("plain", plant, way) for plant in ("state.pt", "config.yaml") for way in WAYS] + \
        [("sharded", plant, way) for plant in PLANTS for way in WAYS]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind,plant,way", CASES, ids=["-".join(c) for c in CASES])
def test_planted_payload_never_runs(run_copy, tmp_path, capsys, monkeypatch, kind, plant, way):
    run = run_copy(kind)
    ckpt = run / "checkpoints" / STEP
    marker = tmp_path / "pwned"
    path = PLANTS[plant](ckpt, marker)
    record_checksums(ckpt)  # a crafted checkpoint records its own checksums: they stop no one on purpose
    code, line = WAYS[way](run, ckpt, tmp_path, capsys, monkeypatch)
    assert not marker.exists()
    if plant.startswith(("sharded", "distcp")) and way in INFERENCE:
        assert code == 0, line  # the shards are not read: the full weights are in model.safetensors
        return
    assert code == 1
    what = WHAT.get(plant, "pickles 'posix.system'")
    assert line == (f"torchrig: error: checkpoint file '{path}' was refused as unsafe: it {what}, which is not "
                    f"plain data (tensors, numbers, strings, lists, dicts); torchrig never runs code from a "
                    f"checkpoint. Use a checkpoint torchrig wrote, or re-save the file as a plain state_dict or "
                    f"safetensors")


def test_shard_file_named_outside_its_folder_is_refused(run_copy, capsys):
    run = run_copy("sharded")
    folder = run / "checkpoints" / STEP / "sharded"
    meta = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next(iter(meta.storage_data.items()))
    meta.storage_data[index] = dataclasses.replace(info, relative_path="../../../../secret")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    record_checksums(folder.parent)
    code, line = _resume_latest(run, None, run, capsys, None)
    assert code == 1 and line.startswith(f"torchrig: error: checkpoint file '{folder / '.metadata'}' was refused as "
                                         f"unsafe: it names the shard file '../../../../secret' outside its folder")


@pytest.mark.parametrize("name", ["meta.json", "index.json"])
def test_json_files_hold_no_code(run_copy, tmp_path, capsys, name):
    run = run_copy("plain")
    marker = tmp_path / "pwned"
    path = run / "checkpoints" / (STEP + "/meta.json" if name == "meta.json" else "index.json")
    path.write_bytes(pickle.dumps(Evil(marker)))
    code, line = _resume_latest(run, None, tmp_path, capsys, None)
    assert not marker.exists()
    if name == "meta.json":
        assert (code, line) == (1, f"torchrig: error: '{path}' is corrupt (not JSON); use another checkpoint "
                                   f"(RUN_DIR/checkpoints/)")
    else:  # the index is a cache: the checkpoints are found by their names instead
        assert code == 0 and CheckpointManager(run).index["checkpoints"] == [STEP, "step-00000003"]


# ----------------------------------------------------------------------------- latest / best links


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(src, dst))


@pytest.mark.parametrize("link", ["latest", "best"])
@pytest.mark.parametrize("target", ["absolute", "other-run", "text-file"])
def test_links_outside_the_checkpoints_folder_are_refused(run_copy, tmp_path, capsys, link, target):
    run = run_copy("plain")
    folder = run / "checkpoints"
    outside = _copy_checkpoint(folder / STEP, tmp_path / "x")  # a whole checkpoint, but another run's
    _copy_checkpoint(folder / STEP, tmp_path / "other_run" / "checkpoints" / STEP)
    relative = f"../../other_run/checkpoints/{STEP}"
    (folder / link).unlink(missing_ok=True)
    if target == "text-file":
        (folder / link).write_text(relative + "\n")
    else:
        os.symlink(str(outside) if target == "absolute" else relative, folder / link)
    shown = outside if target == "absolute" else tmp_path / "other_run" / "checkpoints" / STEP
    message = (f"checkpoint link '{folder / link}' points outside its folder, to '{shown}'; torchrig follows "
               f"'{link}' only to a checkpoint in the same folder. Remove the link, or give the checkpoint "
               f"directory itself")
    with pytest.raises(CheckpointError) as err:
        resolve(link, run)
    assert str(err.value) == message
    assert _cli(capsys, ["evaluate", "--checkpoint", str(folder / link)]) == (1, f"torchrig: error: {message}")
    assert _cli(capsys, ["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", f"resume={link}")]) == \
        (1, f"torchrig: error: {message}")


def test_links_inside_the_folder_still_work(run_copy):
    run = run_copy("plain")
    folder = run / "checkpoints"
    assert resolve("latest", run) == folder / STEP
    (folder / "latest").unlink()
    (folder / "latest").write_text(STEP + "\n")  # the text-file form
    assert resolve("latest", run) == folder / STEP


# ----------------------------------------------------------------------------- storage failures


class _FullDisk:
    """A file whose writes fail with ``code`` (what a full disk or a broken device does)."""

    def __init__(self, fh, code: int):
        self.fh, self.code = fh, code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, data):
        self.fh.write(bytes(data)[:100])  # part of it lands, then the device refuses
        raise OSError(self.code, os.strerror(self.code))

    def __getattr__(self, name):
        return getattr(self.fh, name)


def _fail_writes(monkeypatch, code: int, file: str, from_step: int) -> None:
    """Every write of ``file`` fails with ``code`` once the checkpoint of ``from_step`` is being saved."""
    real_open, real_save = open, CheckpointManager.save
    saving = {"step": 0}

    def save(self, step, *args, **kwargs):
        saving["step"] = step
        return real_save(self, step, *args, **kwargs)

    def fake_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if saving["step"] >= from_step and Path(path).name.startswith(f".{file}.tmp-"):
            return _FullDisk(fh, code)
        return fh

    monkeypatch.setattr(CheckpointManager, "save", save)
    monkeypatch.setattr(files_mod, "open", fake_open, raising=False)  # the one open() every file written goes through


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) if folder.exists() else []


@pytest.mark.parametrize("code,file,from_step,message", [
    (errno.ENOSPC, "state.pt", 4, "no space left on device while saving checkpoint step 4 to {dir}; the previous "
                                  "checkpoint (step 2) is intact. Free some space"),
    (errno.ENOSPC, "model.safetensors", 2, "no space left on device while saving checkpoint step 2 to {dir}; there "
                                           "is no previous checkpoint. Free some space"),
    (errno.EIO, "meta.json", 4, "OS error EIO (Input/output error) while saving checkpoint step 4 to {dir}; the "
                                "previous checkpoint (step 2) is intact. Fix the storage"),
    (errno.ENOSPC, "index.json", 4, "no space left on device while saving checkpoint step 4 to {dir}; checkpoint step "
                                    "4 itself is complete and 'latest' names it; only index.json or the 'best' link "
                                    "may be out of date. Free some space"),
], ids=["enospc-state", "enospc-first", "eio-meta", "enospc-index"])
def test_write_error_while_saving_is_one_line_and_loses_nothing(tmp_path, capsys, monkeypatch, code, file,
                                                                from_step, message):
    run = tmp_path / "run"
    folder = run / "checkpoints"
    _fail_writes(monkeypatch, code, file, from_step)
    argv = ["train", *_sets(*QUICK, "max_steps=4", "checkpoint.every_steps=2", f"run_dir={run}")]
    assert _cli(capsys, argv) == (1, "torchrig: error: " + message.format(dir=folder)
                                  + " and continue with --set resume=latest")
    assert _temporaries(folder) == []
    kept = 4 if file == "index.json" else from_step - 2
    assert (os.readlink(folder / "latest") if kept else None) == (f"step-{kept:08d}" if kept else None)
    if kept:
        state, meta, _ = read_checkpoint(resolve("latest", run))
        assert meta["step"] == state["counters"]["global_step"] == kept
    monkeypatch.undo()  # space again: the run continues from what was kept
    assert _cli(capsys, ["train", *_sets(*QUICK, "max_steps=6", "checkpoint.every_steps=2", f"run_dir={run}",
                                          "resume=latest")]) == (0, "")
    assert os.readlink(folder / "latest") == "step-00000006"


FILE_SIZE_LIMIT = r"""
import resource, signal, sys
from torchrig.checkpoint import CheckpointManager
from torchrig.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
real_save = CheckpointManager.save
def save(self, step, *args, **kwargs):
    if step > 2:  # from the second checkpoint on, no file may grow past 64 KiB (model.safetensors is bigger)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
    return real_save(self, step, *args, **kwargs)
CheckpointManager.save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_file_size_limit_while_saving_is_one_line_and_loses_nothing(tmp_path):
    """The kernel's own EFBIG (RLIMIT_FSIZE), no root needed, through the real command line in a child."""
    run = tmp_path / "run"
    argv = ["train", *_sets(*QUICK, "max_steps=4", "checkpoint.every_steps=2", f"run_dir={run}")]
    proc = forkserver.run(["-c", FILE_SIZE_LIMIT, *argv], env=_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"torchrig: error: no space left on device (EFBIG: File too large) while saving checkpoint step 4 to "
        f"{run / 'checkpoints'}; the previous checkpoint (step 2) is intact. Free some space and continue with "
        f"--set resume=latest")
    assert _temporaries(run / "checkpoints") == []
    assert os.readlink(run / "checkpoints" / "latest") == STEP


SHARD_WRITE_FAILS = r"""
import errno, os
from torch.distributed.checkpoint.filesystem import FileSystem
from torchrig.checkpoint import CheckpointManager
real_save, real_stream, saving = CheckpointManager.save, FileSystem.create_stream, [0]
def save(self, step, *args, **kwargs):
    saving[0] = step
    return real_save(self, step, *args, **kwargs)
def create_stream(self, path, mode):  # DCP's own writes of the shard files fail from step 4 on
    if "w" in mode and saving[0] >= 4 and str(path).endswith(".distcp"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real_stream(self, path, mode)
CheckpointManager.save, FileSystem.create_stream = save, create_stream
""" + BUILD_SHARDED


@pytest.mark.slow
def test_shard_write_error_while_saving_is_one_line_and_loses_nothing(tmp_path):
    """FSDP: the shards are written by DCP on every rank; its failure is reported like any other."""
    run = tmp_path / "run"
    argv = ["train", *_sets(*QUICK, "max_steps=4", "checkpoint.every_steps=2", f"run_dir={run}", "dist.strategy=fsdp")]
    proc = forkserver.run(["-c", SHARD_WRITE_FAILS, *argv], env=_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"torchrig: error: no space left on device while saving checkpoint step 4 to {run / 'checkpoints'}; the "
        f"previous checkpoint (step 2) is intact. Free some space and continue with --set resume=latest")
    assert _temporaries(run / "checkpoints") == []
    assert os.readlink(run / "checkpoints" / "latest") == STEP


# ----------------------------------------------------------------------------- leftovers of killed saves


def test_leftovers_of_killed_saves_are_removed_at_fit_start(run_copy, capsys):
    run = run_copy("plain")
    folder = run / "checkpoints"
    partial = folder / ".tmp-step-00000003-4242"
    (partial / "sharded").mkdir(parents=True)
    (partial / "sharded" / "__0_0.distcp").write_bytes(b"half a shard")
    (partial / ".state.pt.tmp-4242").write_bytes(b"half a file")
    shutil.copytree(folder / STEP, folder / f".tmp-staged-{STEP}-4242")
    shutil.copytree(folder / STEP, folder / f".tmp-trash-{STEP}-4242")
    (folder / ".index.json.tmp-4242").write_text("{")
    os.symlink(STEP, folder / ".latest.tmp-4242")
    os.symlink(STEP, folder / ".best.tmp-4242")
    assert len(_temporaries(folder)) == 6
    assert _cli(capsys, ["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", "resume=latest")]) == (0, "")
    assert _temporaries(folder) == []
    assert os.readlink(folder / "latest") == "step-00000003"


@pytest.mark.parametrize("final_exists", [True, False], ids=["before-swap", "mid-swap"])
def test_a_resave_cut_short_is_finished_at_the_next_start(run_copy, final_exists):
    """A re-save of a step points ``latest`` at its complete temporary directory while it swaps the old
    directory out; killed there, the next start puts the new directory in place."""
    run = run_copy("plain")
    folder = run / "checkpoints"
    newer = folder / f".tmp-{STEP}-4242"
    shutil.copytree(folder / STEP, newer)
    meta = json.loads((newer / "meta.json").read_text())
    (newer / "meta.json").write_text(json.dumps(dict(meta, newer=True)))
    if not final_exists:
        os.replace(folder / STEP, folder / f".tmp-trash-{STEP}-4242")
    (folder / "latest").unlink()
    os.symlink(newer.name, folder / "latest")
    assert resolve("latest", run) == newer  # readable as it is
    CheckpointManager(run).clean_partial()
    assert os.readlink(folder / "latest") == STEP and _temporaries(folder) == []
    assert read_checkpoint(resolve("latest", run))[1] == dict(meta, newer=True)
