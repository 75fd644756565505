"""On a CUDA device, a training step synchronises with the host only at log steps.

``torch.cuda.set_sync_debug_mode("warn")`` is on for the whole fit; every synchronising call is
recorded with the Python stack that made it and the phase of the run it fell in (set-up, a quiet step
strictly between log steps, a log step, the epoch's end). Quiet steps must have none. With
``TORCHRIG_SYNC_REPORT=FILE`` set, each configuration's census is added to ``FILE`` as one JSON line (what
``benchmarks/gpu.py`` keeps beside its figures).
"""

from __future__ import annotations

import json
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch

import torchrig
from helpers import step_configs as C

SRC = str(Path(torchrig.__file__).resolve().parent)


class Census:
    """Callbacks that name the phase each synchronisation happens in."""

    def __init__(self):
        self.phase = "setup"
        self.records: list[dict] = []
        self.quiet_steps: list[int] = []

    def on_fit_start(self, trainer):
        self.phase = "first-step"

    def on_step_end(self, trainer, values):
        k = trainer.global_step
        if trainer.metrics_log.should_log(k):
            self.phase = f"log@{k}"
        else:
            self._next(k + 1)

    def on_log(self, trainer, values, kind):
        self.phase = "epoch-end" if kind == "epoch" else self._next(trainer.global_step + 1)

    def _next(self, k: int) -> str:
        quiet = k % C.EVERY != 0 and k < C.STEPS
        self.phase = f"quiet@{k}" if quiet else f"step@{k}"
        if quiet:
            self.quiet_steps.append(k)
        return self.phase

    def record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f"{Path(f.filename).relative_to(SRC)}:{f.lineno} {f.name}" for f in stack
                if f.filename.startswith(SRC)]
        inner = f"{Path(filename).name}:{lineno}"
        self.records.append({"phase": self.phase, "site": inner, "torchrig": ours[-6:]})


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(C.CONFIGS))
def test_sync_census(name, tmp_path):
    census = Census()
    opts, model, data = C.build(name, tmp_path / "run", "cuda", callbacks=[census])
    trainer = torchrig.Trainer(model, **opts)
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = census.record
            torch.cuda.set_sync_debug_mode("warn")
            trainer.fit(data)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
        trainer.close()
    report = {"config": name, "steps": trainer.global_step, "skipped": trainer.skipped_steps,
              "quiet_steps": census.quiet_steps, "syncs": census.records}
    if os.environ.get("TORCHRIG_SYNC_REPORT"):
        with open(os.environ["TORCHRIG_SYNC_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    assert trainer.global_step == C.STEPS  # every window is a step; skipped_steps counts those not applied
    assert trainer.skipped_steps == (1 if opts.get("on_nonfinite") == "skip" else 0)
    assert len(census.quiet_steps) >= 6
    quiet = [r for r in census.records if r["phase"].startswith("quiet")]
    assert quiet == [], json.dumps(quiet, indent=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
