"""The model, data and 2-rank runs of the micro-batching tests (tests/trainer/test_micro_batching.py).

    python tests/helpers/microbatch_worker.py ddp OUT   # a file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD)

The model raises ``torch.cuda.OutOfMemoryError`` (as CUDA's allocator does) when a forward gets more
rows than ``limit``, after drawing its dropout mask, so a failed attempt consumes random numbers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}
FEATURES, CLASSES = 8, 4


class Limited(nn.Module):
    """An MLP with dropout that "runs out of memory" above ``limit`` rows (None: never), from its
    ``after``-th forward on (0: from the first)."""

    def __init__(self, limit: Optional[int], after: int = 0, p: float = 0.2, norm: bool = False):
        super().__init__()
        torch.manual_seed(7)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16) if norm else nn.Tanh(), nn.Dropout(p),
                                 nn.Linear(16, CLASSES))
        self.limit, self.after = limit, after
        self.calls = self.oom = 0

    def forward(self, x):
        h = self.net[2](self.net[1](self.net[0](x)))
        self.calls += 1
        if self.limit is not None and x.shape[0] > self.limit and self.calls > self.after:
            self.oom += 1
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (test: {x.shape[0]} rows > {self.limit})")
        return self.net[3](h)


def classification(n: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return x, y


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="sgd", lr=0.2, momentum=0.9, epochs=2, seed=0, run_dir=str(run_dir), metrics=["accuracy"],
              threads=1, num_workers=0, batch_size=8, **QUIET)
    kw.update(extra)
    return kw


def params(model: nn.Module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def ddp(out: Path) -> None:
    """Rank 1 runs out of memory above 2 rows from its 4th forward on (the second loaded batch of the second
    window, so rank 0 has gone on to the window's end), rank 0 never; then the same data with
    data.micro_batch_size=2 from the start (no dropout: the first window ran whole batches). The same with
    BatchNorm (rank 0's buffers broadcast before each window, as DDP does), failing from the first forward."""
    from torchrig import Trainer

    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": int(os.environ["TEST_WORLD"])}
    report = {}
    first = None
    runs = (("auto", 2 if rank == 1 else None, "auto", 3, False, 45), ("fixed", None, 2, 0, False, 45),
            # BatchNorm (whose statistics see micro-batches): out of memory from the first forward on
            ("auto_bn", 2 if rank == 1 else None, "auto", 0, True, 48), ("fixed_bn", None, 2, 0, True, 48))
    for name, limit, size, after, norm, n in runs:
        model = Limited(limit, after=after, p=0.0, norm=norm)
        t = Trainer(model, strategy="ddp", accumulate=2, **settings(out / name, **{"data.micro_batch_size": size}),
                    **group)
        first = first or t
        t.fit(classification(n))
        report[name] = {"size": t.windows.micro_batch_size, "oom": model.oom, "history": t.history}
        if rank == 0:
            torch.save(params(model), out / f"{name}.pt")
    # SyncBatchNorm (all-gathers in its forward, so an OOM on one rank would leave the other waiting): refused
    from torchrig.config import ConfigError

    sync = nn.Sequential(nn.Linear(FEATURES, 16), nn.SyncBatchNorm(16), nn.Linear(16, CLASSES))
    try:
        Trainer(sync, strategy="ddp", **settings(out / "syncbn", **{"data.micro_batch_size": "auto"}), **group)
        report["syncbn"] = "accepted"
    except ConfigError as e:
        report["syncbn"] = str(e)
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    first.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"ddp": ddp}[sys.argv[1]](target)
