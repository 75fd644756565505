"""A small training run for the exact-resume tests, run as a child process that the test SIGKILLs.

    python tests/helpers/resume_child.py RUN_DIR '{"accumulate": 3, ...}'

Trains a dropout + BatchNorm MLP on a data set with random augmentation (torch, python and numpy RNGs),
with shuffling and a checkpoint after every optimizer step, resuming from ``RUN_DIR/checkpoints/latest``
when there is one. Environment:

- ``PAUSE_AT=N`` pauses forever right after the checkpoint of step N is written (``Ne``: the epoch-end
  checkpoint of step N), first writing ``RUN_DIR/paused``, so the parent can kill it at that exact point;
- ``SLOW_STEP=seconds`` sleeps in every step, so a kill at a random moment lands mid-run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

from helpers import AugmentedDataset, make_classification  # noqa: E402

import torchrig  # noqa: E402
from torchrig.trainer.step import default_step  # noqa: E402


def build_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def main() -> None:
    run_dir = Path(sys.argv[1])
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    pause = os.environ.get("PAUSE_AT")
    slow = float(os.environ.get("SLOW_STEP", "0"))
    x, y = make_classification(n=38)  # 10 micro-batches of 4 (the last one of 2)

    def step_fn(step, batch):
        if slow:
            time.sleep(slow)
        return default_step(step, batch)

    kw = dict(optimizer="adamw", lr=0.01, batch_size=4, epochs=3, checkpoint_every=1, keep_last=2, resume="latest",
              threads=1, num_workers=0, metrics=["accuracy"], log_every=1, plot=False, tensorboard=False,
              progress="none", run_dir=str(run_dir))
    kw.update(opts)
    trainer = torchrig.Trainer(build_model(), step_fn=step_fn, **kw)
    if pause:
        real_save = trainer._save

        def save(metrics=None, final=False):
            path = real_save(metrics=metrics, final=final)
            trainer.checkpoints.wait()  # an asynchronous save is written in the background: until it is
            epoch_end = trainer.state.batch_in_epoch == 0 and not final
            if path is not None and f"{trainer.global_step}{'e' if epoch_end else ''}" == pause:
                (run_dir / "paused").write_text(str(path))
                time.sleep(600)
            return path

        trainer._save = save
    trainer.fit(AugmentedDataset(x, y), val_data=AugmentedDataset(x[:12], y[:12]))
    (run_dir / "done").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
