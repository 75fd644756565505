"""A slow little training run to send signals to (used by tests/test_signals.py).

    python tests/helpers/signal_child.py RUN_DIR [KEY=VALUE ...]

Each optimizer step sleeps ``STEP_SLEEP`` seconds (env, default 0.02) so that a signal lands mid-run
(``STUCK_SLEEP`` from the second step on, to play a stuck step; on rank ``STUCK_RANK`` only, if set). In optimizer step ``READY_AT_STEP``
+ 1 (env, default 1: the second step) each rank writes its pid to ``RUN_DIR/ready-RANK``; the first
step function call that sees a stop signal received writes the optimizer steps completed by then to
``RUN_DIR/landed-RANK``; a finished fit saves the weights to ``RUN_DIR/final-RANK.pt``.
``SAMPLES`` (default 256) sets the data size and ``DROPOUT`` (default none) adds a dropout layer.
``SLOW_SAVE`` (seconds) makes every checkpoint write first write ``RUN_DIR/saving-RANK`` and sleep;
``HOOK_SLEEP`` names a callback hook (``on_fit_start``, ``on_fit_end``) that writes ``RUN_DIR/HOOK-RANK``
and sleeps 60 s.
Distributed pairs get ``TEST_INIT``, ``TEST_RANK`` and ``TEST_WORLD`` (a ``file://`` rendezvous); under
``torchrig launch`` torchrun's ``RANK`` names the rank. ``KEY=VALUE`` arguments are Trainer keywords.
"""

from __future__ import annotations

import os
import signal
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


def signal_received() -> int:
    """The stop signal torchrig's handler has recorded in this process (0: none yet)."""
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, "__self__", None), "received", 0)


def main() -> None:
    run_dir = Path(sys.argv[1])
    extra = {}
    for item in sys.argv[2:]:
        key, value = item.split("=", 1)
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    pause = float(os.environ.get("STEP_SLEEP", "0.02"))
    ready_at = int(os.environ.get("READY_AT_STEP", "1"))
    rank = int(os.environ.get("TEST_RANK", os.environ.get("RANK", "0")))
    stuck = float(os.environ.get("STUCK_SLEEP", "0"))  # from the second step on: a step that never ends
    if os.environ.get("STUCK_RANK", str(rank)) != str(rank):
        stuck = 0.0  # only that rank is stuck; its peers wait for it in a collective
    landed = run_dir / f"landed-{rank}"

    def slow_step(step, batch):
        if signal_received() and not landed.exists():
            landed.write_text(str(step.global_step))
        out = default_step(step, batch)
        if step.sync_gradients:
            if step.global_step == ready_at:  # one checkpointable step is done
                (run_dir / f"ready-{rank}").write_text(str(os.getpid()))
            time.sleep(stuck if stuck and step.global_step >= 1 else pause)
        return out

    slow_save = float(os.environ.get("SLOW_SAVE", "0"))
    if slow_save:  # a checkpoint that takes long to write (a large model, a slow file system)
        from torchrig.checkpoint.manager import CheckpointManager

        write = CheckpointManager.write

        def slow_write(self, step, *args, **kwargs):
            (run_dir / f"saving-{rank}").write_text(str(step))
            time.sleep(slow_save)
            return write(self, step, *args, **kwargs)

        CheckpointManager.write = slow_write

    torch.manual_seed(0)
    dropout = [nn.Dropout(float(os.environ["DROPOUT"]))] if os.environ.get("DROPOUT") else []
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), *dropout, nn.Linear(16, 2))
    dist = {}
    if "TEST_INIT" in os.environ:
        dist = dict(init_method=os.environ["TEST_INIT"], rank=rank, world_size=int(os.environ["TEST_WORLD"]))
    opts = dict(run_dir=str(run_dir), epochs=50, batch_size=8, optimizer="sgd", lr=0.05, num_workers=0,
                progress="none", tensorboard=False, plot=False, log_every=0, checkpoint_every_epochs=0)
    opts.update(dist)
    opts.update(extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    callbacks = []
    hook = os.environ.get("HOOK_SLEEP")
    if hook:  # a callback that takes its time before or after the loop
        class Dawdle:
            pass

        def dawdle(*args):
            (run_dir / f"{hook}-{rank}").write_text(str(os.getpid()))
            time.sleep(60)

        setattr(Dawdle, hook, staticmethod(dawdle))
        callbacks.append(Dawdle())
    trainer = torchrig.Trainer(model, step_fn=slow_step, callbacks=callbacks, **opts)
    trainer.fit(Samples(int(os.environ.get("SAMPLES", "256"))))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / f"final-{rank}.pt")


if __name__ == "__main__":
    main()
