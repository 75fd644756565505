"""``data.num_workers=auto`` against the two fixed choices, on a cheap and a costly map-style data set.

An MLP (SGD) trained by ``Trainer.fit`` on a user's ``Dataset`` class (not a ``TensorDataset``, so
no fast path), one thread, about ``--steps`` steps per run:

- ``cheap``: ``__getitem__`` returns a row of in-memory tensors (a few µs per sample), for the tiny
  MLP (a ~0.5 ms step);
- ``costly``: each sample also goes through a CPU transform with noise (~80 µs: an augmented image),
  for a wider MLP (64-1024-10, a step of some milliseconds): a worker can make the next batch while
  the model trains on this one.

Arms: ``none`` (``num_workers=0``), ``workers`` (every core but one: 1 on a 2-core machine, what
``auto`` gave for every map-style data set before it looked at the samples) and ``auto``. Each run is
a fresh process; the arms alternate; medians over the runs. ``auto`` seeds every sample from
``(seed, epoch, index)`` as a worker does, so all arms but ``none`` train bitwise the same weights
(asserted). Reported per data set: ``auto``'s step time over the faster fixed choice's, and over
``workers``'s.

Usage: ``python benchmarks/workers.py [--runs 5] [--steps 300] [--quick]``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "workers"
BATCH = 64
COSTLY_ROUNDS = 15  # tanh(W @ v) rounds per sample in the costly data set: ~80 µs on one core
HIDDEN = {"cheap": 32, "costly": 1024}


def _datasets():
    import torch
    from torch.utils.data import Dataset

    class Rows(Dataset):
        """A user's in-memory data set: one row of each tensor per sample."""

        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    class Transformed(Rows):
        """Each sample through a CPU transform with a little noise (augmentation), ~80 µs."""

        def __init__(self, x, y):
            super().__init__(x, y)
            self.w = torch.randn(x.shape[1], x.shape[1], generator=torch.Generator().manual_seed(1)) / 8

        def __getitem__(self, i):
            v = self.x[i] + 0.01 * torch.randn(self.x.shape[1])
            for _ in range(COSTLY_ROUNDS):
                v = torch.tanh(self.w @ v) + self.x[i]
            return v, self.y[i]

    return {"cheap": Rows, "costly": Transformed}


def _arm(p: dict) -> dict:
    c.pin_threads()
    import torch
    from torch import nn

    import torchrig
    from torchrig.data import workers

    x, y = c.make_data(c.N_SAMPLES)
    data = _datasets()[p["data"]](x, y)
    setting: Any = {"none": 0, "workers": workers.most_workers(), "auto": "auto"}[p["arm"]]
    torch.manual_seed(0)
    hidden = HIDDEN[p["data"]]
    model = nn.Sequential(nn.Linear(c.N_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, c.N_CLASSES))
    with tempfile.TemporaryDirectory() as run_dir:
        devnull = open(os.devnull, "w")
        saved, sys.stderr = sys.stderr, devnull
        try:
            trainer = torchrig.Trainer(model, optimizer="sgd", lr=0.05, num_workers=setting,
                                       **dict(c.trainer_kwargs(run_dir, p["epochs"], fast_path=True), batch_size=BATCH))
            timing = c.time_trainer_fit(trainer, data)
        finally:
            sys.stderr = saved
            devnull.close()
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    return {"step_us": timing["loop_s"] / timing["steps"] * 1e6, "steps": timing["steps"], "params_sha256": digest,
            "num_workers": setting if setting != "auto" else None}


HANDLERS = {arm: (lambda p, arm=arm: _arm(dict(p, arm=arm))) for arm in ("none", "workers", "auto")}


def _measure(data: str, epochs: int, runs: int, quick: bool) -> dict:
    arms_in = {arm: {"data": data, "epochs": epochs} for arm in HANDLERS}
    print(f"{NAME}: {data} data set: {runs} runs per arm, {epochs} epochs, fresh processes, alternating",
          file=sys.stderr)
    runs_ = c.alternate(Path(__file__), arms_in, runs, warmup=not quick)
    seeded = {r["params_sha256"] for arm in ("workers", "auto") for r in runs_[arm]}
    assert len(seeded) == 1, f"auto and worker processes trained different weights on the {data} data set"
    arms = {name: {"runs": len(rs), "median_step_us": c.median([r["step_us"] for r in rs]),
                   "step_us": [r["step_us"] for r in rs], "spread": c.spread([r["step_us"] for r in rs]),
                   "steps": rs[0]["steps"]} for name, rs in runs_.items()}
    best = min(arms["none"]["median_step_us"], arms["workers"]["median_step_us"])
    return {"data": data, "arms": arms, "auto_vs_best": arms["auto"]["median_step_us"] / best,
            "auto_vs_workers": arms["auto"]["median_step_us"] / arms["workers"]["median_step_us"],
            "auto_vs_none": arms["auto"]["median_step_us"] / arms["none"]["median_step_us"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per arm (fresh processes)")
    ap.add_argument("--steps", type=int, default=300, help="about this many steps per run (whole epochs)")
    ap.add_argument("--quick", action="store_true", help="1 run, 1 epoch: proves the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.steps = 1, 1
    epochs = math.ceil(args.steps / math.ceil(c.N_SAMPLES / BATCH))
    results = {d: _measure(d, epochs, args.runs, args.quick) for d in ("cheap", "costly")}
    rows = []
    for d, r in results.items():
        for name, a in r["arms"].items():
            rows.append([d, name, a["runs"], a["steps"], a["median_step_us"], f"{100 * a['spread']:.1f}%"])
    print(c.table(["data set", "num_workers", "runs", "steps", "median µs/step", "spread"], rows))
    print("(none: 0; workers: every core but one; auto: what torchrig chose after timing a few samples)")
    for d, r in results.items():
        print(f"{d}: auto / faster fixed choice {r['auto_vs_best']:.2f}×; auto / workers {r['auto_vs_workers']:.2f}×; "
              f"auto / none {r['auto_vs_none']:.2f}×")
    payload = {"batch": BATCH, "steps": args.steps, "by_data": results,
               "model": "MLP 64-32-10 (cheap), 64-1024-10 (costly), SGD lr 0.05"}
    path = c.write_result(NAME, payload, quick=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    if not c.child_main(HANDLERS):
        main()
