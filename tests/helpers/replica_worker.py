"""The worker of the torchft test: one replica group of ``torchrig launch --replica-groups 2``.

    torchrig launch --replica-groups 2 --max-restarts 1 -- tests/helpers/replica_worker.py OUT KILL_AT

Trains a linear regression (64 samples, 4 per group and step, 8 steps per epoch, 2 epochs, SGD with momentum) with
``dist.fault_tolerance=torchft``. Replica group 1 SIGKILLs itself at the end of step KILL_AT on its first start;
torchrun starts it again and it copies group 0's state. The replacement waits (bounded) until group 0 has trained
steps KILL_AT + 1 and KILL_AT + 2 alone (``alone``); group 0 waits at step KILL_AT + 2 (bounded) until the
replacement process exists, and then paces its steps (2 s each, bounded) until the replacement has joined, so
that the join happens mid-run however slowly the machine starts a process. Files in OUT: ``restarted`` and
``joined`` (group 1's markers), ``final-G.pt`` (each group's last weights), ``records-G.json`` (the steps each
group took part in, as ``parallel.Replicas`` recorded them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

N, FEATURES, BATCH, EPOCHS, LR, MOMENTUM = 64, 4, 4, 2, 0.05, 0.9


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(FEATURES, 1)


def settings(run_dir: Path) -> dict:
    return {"optimizer": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0, "loss": "mse", "batch_size": BATCH, "epochs": EPOCHS, "shuffle": False,
            "run_dir": str(run_dir), "metrics": [], "threads": 1, "scheduler": None, "log.progress": "none",
            "log.summary": False, "log.every_steps": 0, "checkpoint.every_epochs": 0, "checkpoint.save_final": False,
            "dist.fault_tolerance": "torchft", "dist.timeout": 60.0}


def _wait_for(path: Path, limit: float) -> bool:
    end = time.monotonic() + limit
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    return path.exists()


class Faults:
    """Group 1 dies at step ``kill_at`` (first start only); group 0 waits for its replacement (see the module)."""

    def __init__(self, out: Path, kill_at: int, group: int, restart: int):
        self.out, self.kill_at, self.group, self.restart = out, kill_at, group, restart

    def on_fit_start(self, trainer) -> None:
        if self.group == 1 and self.restart > 0:
            (self.out / "joined").write_text(str(trainer.global_step))

    def on_step_end(self, trainer, values) -> None:
        step = trainer.global_step
        if self.group == 1 and self.restart == 0 and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.group == 0 and step == self.kill_at + 2:  # two steps trained alone: the replacement may start
            (self.out / "alone").write_text(str(step))
            _wait_for(self.out / "restarted", 180)
        if self.group == 0 and step > self.kill_at + 2 and not (self.out / "joined").exists():
            time.sleep(2.0)  # bounded: 9 steps leave the replacement 18 s to join, however loaded the machine


def main() -> None:
    from torchrig import Trainer

    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    group = int(os.environ["REPLICA_GROUP_ID"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if group == 1 and restart > 0:  # a replacement started at once would join group 0's next quorum, lost unnoticed
        _wait_for(out / "alone", 180)
    trainer = Trainer(model(), callbacks=[Faults(out, kill_at, group, restart)], **settings(out / "run"))
    if group == 1 and restart > 0:
        (out / "restarted").write_text("1")
    trainer.fit(data())
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / f"final-{group}.pt")
    (out / f"records-{group}.json").write_text(json.dumps(trainer.replicas.records))
    trainer.close()


if __name__ == "__main__":
    main()
