"""Worker processes of the hang and straggler tests (started in pairs by pytest through ``file://``).

    python tests/helpers/hang_worker.py data  OUT   # rank 1 sleeps in its dataset's __getitem__ before step 3
    python tests/helpers/hang_worker.py skip  OUT   # rank 1 skips a collective rank 0 calls in its step, at step 3
    python tests/helpers/hang_worker.py kill  OUT   # rank 1 SIGKILLs itself in its dataset's __getitem__ before step 3
    python tests/helpers/hang_worker.py slow  OUT   # rank 1's forward is slow on purpose: named as a straggler
    python tests/helpers/hang_worker.py health OUT  # rank 1's matmul is slow on purpose: named by the health check

``HANG_TIMEOUT`` sets ``dist.hang_timeout``; ``FAULT_MARK`` is the file a fault writes its wall-clock time to. Each
run saves a checkpoint every 2 steps, so the hang at step 3 has step-2's checkpoint on disk.
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

FAULT_STEP = 3
BATCH = 4


class Rows(Dataset):
    """16 rows of a fixed classification problem; rank 1 misbehaves in ``__getitem__`` at the first row of step 3."""

    def __init__(self, fault: str = ""):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
        self.fault = fault

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.fault and os.environ.get("TEST_RANK") == "1" and _steps() == FAULT_STEP - 1:
            _mark()
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # stuck on a file system that does not answer
        return self.x[i], self.y[i]


class Slow(nn.Module):
    """A small MLP whose forward sleeps on rank 1 (a slow device)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        if os.environ.get("TEST_RANK") == "1" and os.environ.get("SLOW_FORWARD"):
            time.sleep(float(os.environ["SLOW_FORWARD"]))
        return self.net(x)


_TRAINER = []


def _steps() -> int:
    return _TRAINER[0].global_step if _TRAINER else -1


def _mark() -> None:
    if "FAULT_MARK" in os.environ:
        Path(os.environ["FAULT_MARK"]).write_text(f"{time.time()}\n")


def skipping_step(step, batch):
    """The default step, but at step 3 rank 0 sums a number over a group of both ranks and rank 1 does not."""
    from torchrig import runtime
    from torchrig.trainer.step import default_step

    if step.global_step == FAULT_STEP - 1 and os.environ["TEST_RANK"] == "0":
        _mark()
        runtime.all_reduce_sum(torch.ones(1), group=_GROUP[0])
    return default_step(step, batch)


_GROUP = []


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def trainer(out: Path, **extra):
    from torchrig import Trainer

    kw = dict(optimizer="sgd", lr=0.1, epochs=4, batch_size=BATCH, seed=0, threads=1, run_dir=str(out / "run"),
              strategy="ddp", init_method=os.environ["TEST_INIT"], rank=int(os.environ["TEST_RANK"]),
              world_size=int(os.environ["TEST_WORLD"]), dist_timeout=120.0,
              **{"log.progress": "none", "log.tensorboard": False, "log.plot": False, "log.summary": False,
                 "data.num_workers": 0, "checkpoint.every_steps": 2, "checkpoint.every_epochs": 0,
                 "checkpoint.async_save": False, "dist.hang_timeout": float(os.environ.get("HANG_TIMEOUT", 4))})
    kw.update(extra)
    t = Trainer(Slow(), **kw)
    _TRAINER.append(t)
    return t


def run(what: str, out: Path) -> None:
    import torch.distributed as dist

    if what == "skip":
        t = trainer(out, step_fn=skipping_step)
        _GROUP.append(dist.new_group([0, 1], backend="gloo"))
        t.fit(Rows())
    elif what == "slow":
        t = trainer(out, epochs=1, **{"log.every_steps": 1, "dist.straggler_steps": 2})
        t.fit(Rows())
    elif what == "health":
        if os.environ["TEST_RANK"] == "1":  # a device at a tenth of its speed
            from torchrig.runtime import health

            plain = health._matmul
            health._matmul = lambda a, b: (time.sleep(9 * _timed(plain, a, b)), plain(a, b))[1]
        t = trainer(out, epochs=1, max_steps=1, **{"dist.health_check": True})
        t.fit(Rows())
    else:
        trainer(out).fit(Rows(what))
    print(f"rank {os.environ['TEST_RANK']}: finished at step {_steps()}", flush=True)


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    run(sys.argv[1], target)
