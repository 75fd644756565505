"""A slow little training run to send signals to (used by tests/test_signals.py).

    python tests/helpers/signal_child.py RUN_DIR [KEY=VALUE ...]

Each optimizer step sleeps ``STEP_SLEEP`` seconds (env, default 0.02) so that a signal lands mid-run
(``STUCK_SLEEP`` from the second step on, to play a stuck step);
in the second step each rank touches ``RUN_DIR/ready-RANK``. Distributed pairs get ``TEST_INIT``,
``TEST_RANK`` and ``TEST_WORLD`` (a ``file://`` rendezvous). ``KEY=VALUE`` arguments are Trainer keywords.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import torchrig
from torchrig.trainer import default_step


class Samples(Dataset):
    """A map-style data set (not tensors), so that DataLoader workers are used when asked for."""

    def __init__(self, n: int = 256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main() -> None:
    run_dir = Path(sys.argv[1])
    extra = {}
    for item in sys.argv[2:]:
        key, value = item.split("=", 1)
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    pause = float(os.environ.get("STEP_SLEEP", "0.02"))
    stuck = float(os.environ.get("STUCK_SLEEP", "0"))  # from the second step on: a step that never ends
    rank = int(os.environ.get("TEST_RANK", "0"))

    def slow_step(step, batch):
        out = default_step(step, batch)
        if step.sync_gradients:
            if step.global_step == 1:  # in the second step: one checkpointable step is done
                (run_dir / f"ready-{rank}").touch()
            time.sleep(stuck if stuck and step.global_step >= 1 else pause)
        return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    dist = {}
    if "TEST_INIT" in os.environ:
        dist = dict(init_method=os.environ["TEST_INIT"], rank=rank, world_size=int(os.environ["TEST_WORLD"]))
    opts = dict(run_dir=str(run_dir), epochs=50, batch_size=8, optimizer="sgd", lr=0.05, num_workers=0,
                progress="none", tensorboard=False, plot=False, log_every=0, checkpoint_every_epochs=0)
    opts.update(dist)
    opts.update(extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    torchrig.Trainer(model, step_fn=slow_step, **opts).fit(Samples())


if __name__ == "__main__":
    main()
