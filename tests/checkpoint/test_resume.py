"""Capability 8: a run stopped at any step and resumed with ``resume="latest"`` ends bitwise equal to the
uninterrupted run — with shuffling, dropout, random augmentation, accumulation, schedules and bf16.

The first tests interrupt a run in-process right after a chosen checkpoint (cheap, many kill points);
the SIGKILL tests kill real child processes (``tests/resume_child.py``) at chosen and at random moments.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (HELPERS, forkserver, QUIET, AugmentedDataset, gan_models, gan_step, make_classification, read_jsonl,
                     subprocess_env)
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.checkpoint import resolve

# ----------------------------------------------------------------------------- in-process interruptions


class Interrupted(Exception):
    pass


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def _train(run_dir, stop_at=None, model=None, data=None, **kw):
    """Train (resuming from latest); with ``stop_at="7"`` / ``"4e"`` raise right after that checkpoint."""
    x, y = make_classification(n=38)
    model = model if model is not None else _model()
    opts = dict(QUIET, run_dir=str(run_dir), optimizer="adamw", lr=0.01, batch_size=4, epochs=3, accumulate=3,
                checkpoint_every=1, resume="latest", num_workers=0, metrics=["accuracy"], log_every=1)
    opts.update(kw)
    trainer = torchrig.Trainer(model, **opts)
    if stop_at is not None:
        real = trainer._save

        def save(metrics=None, final=False):
            path = real(metrics=metrics, final=final)
            tag = f"{trainer.global_step}{'e' if trainer.state.batch_in_epoch == 0 and not final else ''}"
            if path is not None and tag == stop_at:
                raise Interrupted(tag)
            return path

        trainer._save = save
    try:
        trainer.fit(data if data is not None else AugmentedDataset(x, y), val_data=AugmentedDataset(x[:12], y[:12]))
    except Interrupted:
        return None
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}, trainer


def _assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"differ: {diff}"


def _losses(run_dir) -> dict:
    """Step -> logged training loss (the last record of a step wins, as after a resume)."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "train/loss" in r}


def chain(accumulate: int) -> list[str]:
    """Kill points for 38 samples in micro-batches of 4 (10 per epoch), e.g. accumulate=3 -> windows 3, 3, 3, 1
    -> 4 steps per epoch: "3" mid-epoch; "4" after the last window, before the epoch end (evaluation,
    epoch schedule); "4e" at the epoch boundary; "7" mid-epoch in epoch 2; "11" one step before the end."""
    n = -(-10 // accumulate)
    return ["3", str(n), f"{n}e", str(n + 3), str(3 * n - 1)]


@pytest.mark.parametrize("extra", [
    {},
    {"scheduler": "cosine"},  # per optimizer step
    {"scheduler": "step", "scheduler.step_size": 1, "scheduler.gamma": 0.5},  # per epoch
    {"precision": "bf16", "scheduler": "warmup_cosine", "warmup_steps": 3},
    {"optimizer": "sgd", "momentum": 0.9, "nesterov": True, "accumulate": 2, "clip_grad_norm": 0.5},
], ids=["plain", "cosine-per-step", "step-per-epoch", "bf16-warmup", "sgd-acc2-clip"])
def test_resume_chain_is_bitwise_exact(tmp_path, extra):
    ref, ref_trainer = _train(tmp_path / "ref", **extra)
    run = tmp_path / "chain"
    for stop in chain(extra.get("accumulate", 3)):
        assert _train(run, stop_at=stop, **extra) is None
    out, trainer = _train(run, **extra)
    _assert_bitwise(ref, out)
    assert trainer.global_step == ref_trainer.global_step
    assert _losses(run) == _losses(tmp_path / "ref")  # the whole trajectory, not just the end
    for k, opt in ref_trainer.optimizers.items():
        a, b = opt.state_dict(), trainer.optimizers[k].state_dict()
        assert a["param_groups"] == b["param_groups"]
        for i in a["state"]:
            for key, v in a["state"][i].items():
                assert torch.equal(v, b["state"][i][key]) if isinstance(v, torch.Tensor) else v == b["state"][i][key]


@pytest.mark.slow
def test_resume_with_two_workers_is_bitwise_exact(tmp_path):
    ref, _ = _train(tmp_path / "ref", num_workers=2)
    for stop in ("3", "4e"):
        assert _train(tmp_path / "run", stop_at=stop, num_workers=2) is None
    out, _ = _train(tmp_path / "run", num_workers=2)
    _assert_bitwise(ref, out)


def test_resume_from_an_explicit_older_checkpoint(tmp_path):
    ref, _ = _train(tmp_path / "ref", keep_last=100)
    _train(tmp_path / "run", keep_last=100)
    older = tmp_path / "run" / "checkpoints" / "step-00000005"
    out, trainer = _train(tmp_path / "run", resume=str(older), keep_last=100)
    _assert_bitwise(ref, out)
    assert trainer.resumed_from == older


def test_resume_finished_run_is_a_no_op(tmp_path):
    ref, _ = _train(tmp_path / "run")
    out, trainer = _train(tmp_path / "run")
    _assert_bitwise(ref, out)
    assert trainer.global_step == 12


def test_resume_with_fast_path_tensor_data(tmp_path):
    x, y = make_classification(n=38)
    data = TensorDataset(x, y)
    ref, _ = _train(tmp_path / "ref", data=data, scheduler="onecycle")
    assert _train(tmp_path / "run", stop_at="6", data=data, scheduler="onecycle") is None
    out, _ = _train(tmp_path / "run", data=data, scheduler="onecycle")
    _assert_bitwise(ref, out)


def test_resume_gan_custom_step(tmp_path):
    real = torch.randn(40, 8) * 0.5 + 2

    def no_val(run_dir, stop_at=None):
        models = gan_models()
        trainer = torchrig.Trainer(models, optimizer={"G": "adam", "D": "adam"}, step_fn=gan_step, accumulate=2,
                                   batch_size=8, epochs=2, checkpoint_every=1, resume="latest",
                                   run_dir=str(run_dir), **QUIET)
        if stop_at is not None:
            real_save = trainer._save

            def save(**kw):
                path = real_save(**kw)
                if trainer.global_step == stop_at:
                    raise Interrupted()
                return path

            trainer._save = save
        try:
            trainer.fit((real,))
        except Interrupted:
            return None
        return {k: v.clone() for k, v in models.state_dict().items()}

    ref = no_val(tmp_path / "ref")
    assert no_val(tmp_path / "run", stop_at=2) is None
    _assert_bitwise(ref, no_val(tmp_path / "run"))


def test_resume_restores_best_tracking_and_skipped_steps(tmp_path):
    x, y = make_classification(n=38)
    x[5] = float("nan")
    data = TensorDataset(x, y)
    ref, ref_trainer = _train(tmp_path / "ref", data=data, on_nonfinite="skip")
    assert _train(tmp_path / "run", stop_at="6", data=data, on_nonfinite="skip") is None
    out, trainer = _train(tmp_path / "run", data=data, on_nonfinite="skip")
    _assert_bitwise(ref, out)
    assert trainer.skipped_steps == ref_trainer.skipped_steps == 3
    assert trainer.monitor.best == ref_trainer.monitor.best
    assert all(torch.isfinite(v).all() for v in out.values())  # skipped windows leave no NaN in BatchNorm stats


# ----------------------------------------------------------------------------- real SIGKILLs


CHILD = str(HELPERS / "resume_child.py")


def _start(run_dir: Path, opts: dict, **env) -> forkserver.Forked:
    """resume_child.py, forked from the tests' fork server: a SIGKILL test needs a real process, not a fresh
    interpreter (the child imports torchrig and the helpers itself)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "paused").unlink(missing_ok=True)
    return forkserver.popen([CHILD, run_dir, json.dumps(opts)], env=subprocess_env(**env))


def _wait(proc: forkserver.Forked, until, timeout=120.0):
    deadline = time.time() + timeout
    while not until():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) early:\n{proc.communicate()[1][-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("child took too long")
        time.sleep(0.02)


def _kill(proc: forkserver.Forked) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _finish(proc: forkserver.Forked) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _latest_step(run_dir: Path) -> int:
    link = run_dir / "checkpoints" / "latest"
    if not link.is_symlink():
        return 0
    return int(os.readlink(link).split("-")[1])


def _final_weights(run_dir: Path) -> dict:
    return load_file(resolve("latest", run_dir) / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("opts,kills", [
    # workers 0, accumulation 3, cosine per step: kill mid-epoch (3), at an epoch boundary (4e), mid-epoch (7)
    ({"accumulate": 3, "scheduler": "cosine"}, ["3", "4e", "7"]),
    # workers 2, accumulation 2, step schedule per epoch, bf16: a kill at a random moment, then at step 7
    ({"accumulate": 2, "num_workers": 2, "scheduler": "step", "scheduler.step_size": 1, "precision": "bf16"},
     ["random", "7"]),
], ids=["workers0-acc3-cosine", "workers2-acc2-step-bf16"])
def test_sigkill_and_resume_is_bitwise_exact(tmp_path, opts, kills):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = _start(ref_dir, opts)  # runs beside the first killed child
    for kill in kills:
        if kill == "random":
            child = _start(run_dir, opts, SLOW_STEP="0.1")
            _wait(child, lambda: _latest_step(run_dir) >= 2)
            _kill(child)  # wherever it is: mid-step, mid-save, mid-evaluation
        else:
            before = _latest_step(run_dir)
            if not kill.endswith("e") and int(kill) <= before:  # a random kill that landed late (busy machine)
                kill = str(before + 2)
            child = _start(run_dir, opts, PAUSE_AT=kill)
            _wait(child, lambda: (run_dir / "paused").exists())
            _kill(child)
            assert _latest_step(run_dir) == int(kill.rstrip("e")) > before
            assert not (run_dir / "done").exists()
    child = _start(run_dir, opts)
    _finish(child)
    _finish(ref)
    assert (run_dir / "done").read_text() == (ref_dir / "done").read_text()
    a, b = _final_weights(ref_dir), _final_weights(run_dir)
    assert a.keys() == b.keys() and "1.running_mean" in a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert _losses(run_dir) == _losses(ref_dir)
