"""Two gloo ranks (started by tests/metrics/test_torchmetrics.py) scoring torchmetrics objects beside
torchrig's own metrics on 93 samples: 47 on rank 0, 46 on rank 1. Training batches of 46 per rank leave
one sample for the second step (the other rank's share is a filler of weight 0); evaluation batches of
23 give rank 0 a third batch of 1 that rank 1 matches with a padding batch. ``python tests/helpers/tm_worker.py torchmetrics OUT`` with TEST_INIT / TEST_RANK / TEST_WORLD."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

N, FEATURES, CLASSES = 93, 6, 3


def data():
    rule = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))
    x = torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(1))
    return x, (x @ rule).argmax(dim=1)


def model() -> nn.Module:
    """The labelling rule plus noise: mostly right, with errors in every class."""
    rule = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))
    m = nn.Linear(FEATURES, CLASSES)
    with torch.no_grad():
        m.weight.copy_(rule.T + 1.5 * torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(5)))
        m.bias.zero_()
    return m


def metrics():
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

    return ["f1", MulticlassF1Score(CLASSES, average="macro"),
            MetricCollection({"acc": MulticlassAccuracy(CLASSES, average="micro"),
                              "precision_w": MulticlassPrecision(CLASSES, average="weighted")}, prefix="tm_")]


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="sgd", lr=1e-30, epochs=1, batch_size=46, eval_batch_size=23, seed=0, run_dir=str(run_dir),
              metrics=metrics(), threads=1, progress="none", plot=False, tensorboard=False)
    kw.update(extra)
    return kw


def run(out: Path) -> None:
    from torchrig import Trainer

    x, y = data()
    pair = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
            "world_size": int(os.environ["TEST_WORLD"]), "dist_timeout": 60.0}
    t = Trainer(model(), strategy="ddp", **settings(out / "run"), **pair)
    t.fit((x, y))  # lr 1e-30 moves no float32 weight: the model stays as built, so the epoch's train metrics score all 93 samples once
    report = {"evaluate": t.evaluate((x, y)), "train": {k: v for k, v in t.history[-1].items()
                                                        if k.startswith("train/") and k != "train/loss"}}
    (out / f"report-{t.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"torchmetrics": run}[sys.argv[1]](target)
