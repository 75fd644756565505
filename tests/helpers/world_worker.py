"""Worker pairs for the tests of schedulers sized by the run and of streams without a length.

    python tests/helpers/world_worker.py horizon OUT   # file:// pair: a OneCycleLR sized for one process
    python tests/helpers/world_worker.py stream  OUT   # file:// pair: a finite stream without a length, 2 epochs
    python tests/helpers/world_worker.py two_layouts OUT  # file:// pair: a DDP Trainer and a tp=2 one, one process

Started by ``helpers.dist_procs.pair`` (``TEST_INIT``, ``TEST_RANK``, ``TEST_WORLD`` in the environment).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import torchrig

QUIET = {"log.progress": "lines", "log.tensorboard": False, "log.plot": False, "checkpoint.every_epochs": 0}


def _pair() -> dict:
    return {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
            "world_size": int(os.environ["TEST_WORLD"]), "dist_timeout": 60.0, "threads": 1}


def horizon(out: Path) -> None:
    """96 samples, batch 4 per process, 2 epochs: 48 steps on one process, 24 on two; the scheduler
    given was sized for one process; the factory gets the run's count."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=48)
    t = torchrig.Trainer(model, opt, scheduler=sched, epochs=2, batch_size=4, run_dir=str(out / "given"),
                         **QUIET, **_pair())
    t.fit((x, y))
    seen = []

    def factory(optimizer, total_steps):
        seen.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    model = nn.Linear(8, 3)
    f = torchrig.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=factory, epochs=2,
                         batch_size=4, run_dir=str(out / "factory"), **QUIET, **_pair())
    f.fit((x, y))
    (out / f"horizon-{f.rank}.json").write_text(json.dumps({
        "given_steps": t.global_step, "factory_got": seen, "total_steps": f.total_steps,
        "factory_stepped": f.schedulers["default"].last_epoch}))


class Stream(torch.utils.data.IterableDataset):
    """``(x, y, id)`` samples in order, with no ``__len__``."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i], i


def stream(out: Path) -> None:
    """40 samples without a length, batch 4 per process, 2 epochs, no data.steps_per_epoch: each rank records
    the sample ids it trains on per epoch."""
    from torchrig.trainer.step import default_step

    seen: dict = {}

    def step_fn(step, batch):
        x, y, ids = batch
        seen.setdefault(step.epoch, []).extend(ids.tolist())
        return default_step(step, [x, y])

    torch.manual_seed(0)
    t = torchrig.Trainer(nn.Linear(8, 3), epochs=2, batch_size=4, run_dir=str(out / "run"), step_fn=step_fn,
                         num_workers=0, **QUIET, **_pair())
    t.fit(Stream(40))
    (out / f"stream-{t.rank}.json").write_text(json.dumps({"seen": seen, "steps": t.global_step,
                                                           "history": [h["step"] for h in t.history]}))


def two_layouts(out: Path) -> None:
    """Two Trainers in one process group: ``ddp`` (2 data-parallel ranks, no mesh) made first, then ``tp`` (tp=2: a
    mesh whose data-parallel group is each rank alone). Each must reduce over its own ranks: ``ddp``'s evaluation
    sums both ranks' shards (93 samples), ``tp``'s counts each sample once though both ranks see it."""
    torch.manual_seed(0)
    x, y = torch.randn(93, 8), torch.randint(0, 3, (93,))
    mlp = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # noqa: E731
    ddp = torchrig.Trainer(mlp(), epochs=1, batch_size=4, run_dir=str(out / "ddp"), **QUIET, **_pair())
    tp = torchrig.Trainer(mlp(), epochs=1, batch_size=4, run_dir=str(out / "tp"), tp=2,
                          tp_plan={"0": "colwise", "2": "rowwise"}, **QUIET, **_pair())
    found = {}
    for name, t in (("ddp", ddp), ("tp", tp), ("ddp_again", ddp)):
        if name != "ddp_again":
            t.fit((x, y))
        with torch.no_grad():  # the same evaluation in plain PyTorch, on every sample once
            bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
            bare.load_state_dict({k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                                  for k, v in torchrig.runtime.unwrap(t.model).state_dict().items()})
            want = {"accuracy": (bare(x).argmax(1) == y).float().mean().item(),
                    "loss": nn.functional.cross_entropy(bare(x), y).item()}
        found[name] = {"got": t.evaluate((x, y)), "want": want, "dp": t.dp_size,
                       "tokens": t.global_step}
    (out / f"two_layouts-{ddp.rank}.json").write_text(json.dumps(found))
    tp.close()
    ddp.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"horizon": horizon, "stream": stream, "two_layouts": two_layouts}[sys.argv[1]](target)
