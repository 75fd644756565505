"""Asynchronous checkpoint saves (``checkpoint.async_save``): the same files as a synchronous save, even
when training changes the weights right after ``save`` returns; at most one save in flight; a write
error of the background thread reported with the synchronous message; SIGKILL during the background
write leaves the previous checkpoint whole."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import PYTHON, TinyNet, subprocess_env
from safetensors import safe_open
from safetensors.torch import load_file

from torchrig.checkpoint import CheckpointManager, CheckpointWriteError, read_checkpoint, resolve
from torchrig.optim.ema import EMA


def _states(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ema = EMA(model, 0.9)
    ema.update()
    return {"model": model, "optimizers": {"default": opt}, "ema": ema}


def _train_a_little(states: dict) -> None:
    """What the next optimizer step does to the tensors a save has just copied."""
    with torch.no_grad():
        for p in states["model"].parameters():
            p.add_(1.0)
    states["optimizers"]["default"].state[next(iter(states["model"].parameters()))]["exp_avg"].add_(1.0)
    states["ema"].update()


def _save(mgr: CheckpointManager, step: int, states: dict):
    return mgr.save(step, states, config={"epochs": 1}, meta={"step": step}, metrics={"loss": 1.0 / step})


def _files(folder: Path) -> dict:
    out = {}
    for name in ("model.safetensors", "ema.safetensors"):
        out[name] = load_file(folder / name)
    state, meta, config = read_checkpoint(folder)
    meta.pop("saved_at")
    # torch.save's and safetensors' bytes differ from one save to the next, so the checksums do too; but
    # each is that of the bytes on disk (hashed by the writer thread as it wrote them)
    sums = meta.pop("checksums")
    assert sums == {f.name: "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
                    for f in folder.iterdir() if f.name != "meta.json"}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # (its header's key order varies run to run)
        header = f.metadata()
    return {**out, "state": state, "meta": meta, "config": config, "header": header}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_async_save_writes_what_a_sync_save_writes_even_if_training_goes_on(tmp_path):
    sync, lazy = CheckpointManager(tmp_path / "sync"), CheckpointManager(tmp_path / "async", async_save=True)
    s1, s2 = _states(), _states()
    for step in (1, 2, 3):
        path_sync = _save(sync, step, s1)
        path_async = _save(lazy, step, s2)
        _train_a_little(s2)  # at once, while the background thread may still be writing
        _train_a_little(s1)
        assert path_async.name == path_sync.name == f"step-{step:08d}"
    lazy.close()
    for step in (2, 3):
        a, b = _files(tmp_path / "sync" / "checkpoints" / f"step-{step:08d}"), _files(path_async.parent / f"step-{step:08d}")
        assert _equal(a, b)
    assert os.readlink(tmp_path / "async" / "checkpoints" / "latest") == "step-00000003"
    assert json.loads((tmp_path / "async" / "checkpoints" / "index.json").read_text()) == \
        json.loads((tmp_path / "sync" / "checkpoints" / "index.json").read_text())


class SlowWrites(CheckpointManager):
    """Counts writes running at once; each write takes at least 0.2 s."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.active, self.most, self.lock = 0, 0, threading.Lock()

    def _write(self, *a, **kw):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0.2)
            return super()._write(*a, **kw)
        finally:
            with self.lock:
                self.active -= 1


def test_at_most_one_save_in_flight_and_save_returns_before_the_write(tmp_path):
    mgr = SlowWrites(tmp_path / "run", keep_last=10, async_save=True)
    states = _states()
    t0 = time.perf_counter()
    _save(mgr, 1, states)
    returned = time.perf_counter() - t0
    assert returned < 0.2 and mgr._background.busy  # the write goes on in the background
    for step in (2, 3, 4):
        _save(mgr, step, states)  # waits for the one in flight first
        assert mgr.active <= 1
    mgr.track_best("step-00000004", 0.5, "min")  # after the save of step 4, on the same thread
    mgr.wait()
    assert mgr.most == 1 and mgr.active == 0
    assert mgr.index["checkpoints"] == [f"step-{s:08d}" for s in (1, 2, 3, 4)]
    assert os.readlink(tmp_path / "run" / "checkpoints" / "best") == "step-00000004"
    mgr.close()


class FullDisk(CheckpointManager):
    """The disk fills up while ``state.pt`` of step ``fail_at`` is written."""

    fail_at = 4

    def _write(self, tmp, weights, state, *a, **kw):
        if state.get("counters", {}).get("global_step") == self.fail_at:
            (tmp.mkdir(exist_ok=True), (tmp / ".state.pt.tmp-1").write_bytes(b"half"))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super()._write(tmp, weights, state, *a, **kw)


def test_error_of_the_background_write_is_raised_by_the_next_save_with_the_sync_message(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    messages = []
    for async_save in (False, True):
        mgr = FullDisk(tmp_path / "run", async_save=async_save)
        states = _states()
        for step in (2, 4):
            class Counters:
                def state_dict(self, step=step):
                    return {"global_step": step}

                def load_state_dict(self, state):
                    pass

            states["counters"] = Counters()
            if step == 4 and not async_save:
                with pytest.raises(CheckpointWriteError) as err:
                    _save(mgr, step, states)
                messages.append(str(err.value))
            else:
                _save(mgr, step, states)  # asynchronous: returns, the error comes later
        if async_save:
            with pytest.raises(CheckpointWriteError) as err:
                _save(mgr, 6, states)  # the next save reports it, and writes nothing itself
            messages.append(str(err.value))
            mgr.close()  # the error was reported once
        assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []
        assert os.readlink(folder / "latest") == "step-00000002"
        (folder / "latest").unlink()
        for p in folder.glob("step-*"):
            import shutil

            shutil.rmtree(p)
        (folder / "index.json").unlink()
    assert messages[0] == messages[1] == (
        f"no space left on device while saving checkpoint step 4 to {folder}; the previous checkpoint (step 2) is "
        f"intact. Free some space and continue with resume=\"latest\"")


CHILD = r"""
import os, sys, torch
from torchrig.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1], async_save=True)
weights = lambda step: {"w": torch.full((512, 512), float(step))}
class Obj:
    def __init__(self, step): self.step = step
    def state_dict(self): return {"global_step": self.step}
def states(step):
    model = torch.nn.Linear(512, 512, bias=False)
    with torch.no_grad(): model.weight.fill_(float(step))
    return {"model": model, "optimizers": {}, "counters": Obj(step)}
mgr.save(1, states(1), config={"epochs": 1}, meta={"step": 1})
mgr.wait()
mgr.save(2, states(2), config={"epochs": 1}, meta={"step": 2})  # pauses in the background, at state.pt
print("save returned", flush=True)
mgr.wait()
"""


@pytest.mark.slow
def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, "-c", CHILD, str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(TORCHRIG_TEST_PAUSE_AT="state.pt@2"))
    try:
        assert proc.stdout.readline().strip() == "save returned"  # training would go on meanwhile
        line = proc.stderr.readline()
        assert line.startswith("torchrig: test pause at state.pt "), line
        folder = run / "checkpoints"
        assert list(folder.glob(".tmp-step-00000002-*/.state.pt.tmp-*"))  # killed mid-write
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    path = resolve("latest", run)
    assert path.name == "step-00000001"
    state, meta, _ = read_checkpoint(path)
    assert state["counters"]["global_step"] == meta["step"] == 1
    assert bool((load_file(path / "model.safetensors")["weight"] == 1.0).all())
    CheckpointManager(run).clean_partial()  # the next start
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "latest", "step-00000001"]


def test_fit_with_async_saves_waits_for_the_last_one(tmp_path):
    import torchrig
    from helpers import QUIET, make_classification
    from torch.utils.data import TensorDataset

    x, y = make_classification()
    t = torchrig.Trainer(TinyNet(), **QUIET, run_dir=str(tmp_path / "run"), batch_size=8, epochs=2, lr=0.05,
                         optimizer="sgd", checkpoint_every=1)
    assert t.cfg.checkpoint.async_save is True  # the default
    t.fit(TensorDataset(x, y))
    assert not t.checkpoints._background.busy
    latest = resolve("latest", tmp_path / "run")
    assert latest.name == "step-00000010"
    weights = load_file(latest / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in t.model.state_dict().items())
    assert sys.modules["torchrig"] is torchrig


def test_background_write_hands_the_gil_over_often_and_restores_the_interval():
    """While a write runs, the switch interval is short (the training thread gets the GIL back quickly);
    afterwards it is what it was."""
    from torchrig.checkpoint.background import SWITCH_INTERVAL_S, BackgroundWriter

    before = sys.getswitchinterval()
    seen = []
    writer = BackgroundWriter()
    try:
        writer.submit(lambda: seen.append(sys.getswitchinterval()))
        writer.wait()
        writer.submit(lambda: 1 / 0)  # a failing write restores it too
        with pytest.raises(ZeroDivisionError):
            writer.wait()
    finally:
        writer.close()
    assert seen == [pytest.approx(min(before, SWITCH_INTERVAL_S))]
    assert sys.getswitchinterval() == before


def test_config_yaml_is_rendered_again_only_when_the_config_changes(tmp_path):
    """Saves of one run reuse the config's YAML text; a changed config (also one changed in place) is
    written as it now is."""
    import yaml

    manager = CheckpointManager(tmp_path, keep_last=5)
    config = {"optim": {"lr": 0.1}, "epochs": 3}
    first = manager.save(1, _states(), config=config, meta={})
    second = manager.save(2, _states(), config=config, meta={})
    assert (first / "config.yaml").read_bytes() == (second / "config.yaml").read_bytes()
    config["optim"]["lr"] = 0.5  # the same dict object, changed
    third = manager.save(3, _states(), config=config, meta={})
    assert yaml.safe_load((third / "config.yaml").read_text()) == {"optim": {"lr": 0.5}, "epochs": 3}
    assert yaml.safe_load((second / "config.yaml").read_text())["optim"]["lr"] == 0.1
