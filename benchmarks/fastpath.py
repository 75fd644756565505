"""In-memory fast path against the DataLoader path, on a tiny MLP.

All arms train the same tiny MLP (64-32-10, SGD) with ``Trainer.fit`` on the same
``TensorDataset``; ``fast_path=True`` gathers each batch with one ``index_select`` per tensor,
``fast_path=False`` goes through a DataLoader (per-sample ``__getitem__`` + ``default_collate``):
``dataloader`` with ``num_workers=0`` (the strict comparison, and the headline), ``dataloader_auto``
with the Trainer's defaults (``num_workers="auto"``, per-sample worker seeding) — what turning the
fast path off costs a user. Each run is a fresh process; the arms alternate; medians over the runs.

Reported per step: the whole training step (the loop time of ``fit`` / steps) — the target,
≥ 5× — and the data part alone (iterating the batches without training). Both arms must see the
same samples in the same order: the final parameters are asserted to be identical.
Measured at batch 64 (the Trainer's default; the headline), 256 and 1024.
Each run trains about ``--steps`` steps (whole epochs).
Usage: ``python benchmarks/fastpath.py [--runs 7] [--steps 300] [--batch 64 256 1024] [--quick]``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "fastpath"
TARGET = 5.0


def _tiny_mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(c.N_FEATURES, 32), nn.ReLU(), nn.Linear(32, c.N_CLASSES))


def _arm(p: dict, fast: bool, workers: Any = 0) -> dict:
    import torch
    from torch.utils.data import TensorDataset

    c.pin_threads()
    import torchrig
    from torchrig.data import prepare_train

    x, y = c.make_data(p.get("samples", c.N_SAMPLES))
    data = TensorDataset(x, y)
    kw = dict(batch_size=p["batch"], seed=0, rank=0, world_size=1, device=torch.device("cpu"), num_workers=workers,
              fast_path=fast)
    # the data part alone: iterate the same batches the loop gets, without training
    batches = prepare_train(data, **kw)
    t0 = time.perf_counter()
    n = 0
    for epoch in range(p["epochs"]):
        batches.set_epoch(epoch)
        for _ in batches:
            n += 1
    data_s = time.perf_counter() - t0
    model = _tiny_mlp()
    with tempfile.TemporaryDirectory() as run_dir:
        devnull = open(os.devnull, "w")
        saved, sys.stderr = sys.stderr, devnull
        try:
            trainer = torchrig.Trainer(model, optimizer="sgd", lr=0.05, num_workers=workers,
                                       **dict(c.trainer_kwargs(run_dir, p["epochs"], fast_path=fast),
                                              batch_size=p["batch"]))
            timing = c.time_trainer_fit(trainer, data)
        finally:
            sys.stderr = saved
            devnull.close()
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    return {"loop_s": timing["loop_s"], "steps": timing["steps"], "step_us": timing["loop_s"] / timing["steps"] * 1e6,
            "data_batch_us": data_s / n * 1e6, "params_sha256": digest}


HANDLERS = {"fast": lambda p: _arm(p, True), "dataloader": lambda p: _arm(p, False),
            "dataloader_auto": lambda p: _arm(p, False, "auto")}


def _measure(batch: int, epochs: int, runs: int, quick: bool) -> dict:
    params = {"epochs": epochs, "batch": batch}
    print(f"{NAME}: batch {batch}: {runs} runs per arm, {epochs} epochs, fresh processes, alternating",
          file=sys.stderr)
    arms_in = {"dataloader": params, "fast": params}
    if not quick:  # worker processes take a while to start: left out of the smoke run
        arms_in["dataloader_auto"] = params
    runs_ = c.alternate(Path(__file__), arms_in, runs, warmup=not quick)
    digests = {r["params_sha256"] for rs in runs_.values() for r in rs}
    assert len(digests) == 1, f"fast path and DataLoader path ended with different parameters: {digests}"
    arms = {}
    for name, rs in runs_.items():
        arms[name] = {"runs": len(rs), "step_us": [r["step_us"] for r in rs],
                      "median_step_us": c.median([r["step_us"] for r in rs]),
                      "data_batch_us": [r["data_batch_us"] for r in rs],
                      "median_data_batch_us": c.median([r["data_batch_us"] for r in rs]),
                      "steps": rs[0]["steps"], "spread": c.spread([r["step_us"] for r in rs])}
    ratio = arms["dataloader"]["median_step_us"] / arms["fast"]["median_step_us"]
    data_ratio = arms["dataloader"]["median_data_batch_us"] / arms["fast"]["median_data_batch_us"]
    auto = arms.get("dataloader_auto")
    ratio_auto = auto["median_step_us"] / arms["fast"]["median_step_us"] if auto else None
    return {"batch": batch, "epochs": epochs, "ratio": ratio, "data_ratio": data_ratio,
            "ratio_vs_default_loader": ratio_auto, "meets_target": ratio >= TARGET, "same_parameters": True,
            "arms": arms}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per arm (fresh processes)")
    ap.add_argument("--steps", type=int, default=300, help="about this many steps per run (whole epochs)")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024],
                    help="batch sizes to measure (the first is the headline: the Trainer's default, 64)")
    ap.add_argument("--quick", action="store_true", help="1 run, 1 epoch, batch 64 only: proves the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.batch = 1, 1, [64]
    results = [_measure(b, math.ceil(args.steps / math.ceil(c.N_SAMPLES / b)), args.runs, args.quick)
               for b in args.batch]
    rows = []
    for r in results:
        for name in ("dataloader_auto", "dataloader", "fast"):
            a = r["arms"].get(name)
            if a is None:
                continue
            speed = a["median_step_us"] / r["arms"]["fast"]["median_step_us"]
            rows.append([r["batch"], name, a["runs"], a["steps"], a["median_step_us"], f"{100 * a['spread']:.1f}%",
                         a["median_data_batch_us"], f"{speed:.2f}×"])
    print(c.table(["batch", "path", "runs", "steps", "median µs/step", "spread", "median data µs/batch",
                   "time / fast path's"], rows))
    print("(dataloader: a DataLoader with num_workers=0; dataloader_auto: what the Trainer builds with "
          "fast_path=False and its defaults — num_workers='auto', per-sample worker seeding)")
    print()
    for r in results:
        print(f"batch {r['batch']}: per step DataLoader / fast path = {r['ratio']:.2f}× (target ≥ {TARGET}×: "
              f"{c.verdict(r['ratio'], TARGET, lower_is_better=False)}); data alone {r['data_ratio']:.0f}× per batch"
              + (f"; vs the Trainer's default DataLoader {r['ratio_vs_default_loader']:.2f}×"
                 if r["ratio_vs_default_loader"] else ""))
    print("same parameters at the end in both paths (same sample order): yes")
    head = results[0]
    payload = {"target": TARGET, "ratio": head["ratio"], "data_ratio": head["data_ratio"], "batch": head["batch"],
               "ratio_vs_default_loader": head["ratio_vs_default_loader"],
               "meets_target": head["ratio"] >= TARGET, "same_parameters": True, "steps": args.steps,
               "model": "MLP 64-32-10, SGD lr 0.05", "arms": head["arms"],
               "by_batch": {str(r["batch"]): r for r in results}}
    path = c.write_result(NAME, payload, quick=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    if not c.child_main(HANDLERS):
        main()
