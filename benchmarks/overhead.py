"""Framework overhead: the same model, data, DataLoader and optimizer through a hand-written loop
and through ``torchrig.Trainer``.

Arms (each run in a fresh process, arms alternated, medians over the runs):

- ``hand``          a lean hand-written loop (``_common.hand_loop``), the reference for the target:
                    per-step loss and accuracy summed as tensors, ``.item()`` + a progress line
                    every 50 steps.
- ``hand_seeds``    the loop of the PyTorch ImageNet example (``_common.hand_loop_seeds``):
                    AverageMeters for time, data time, loss and accuracy, ``loss.item()`` every step.
- ``trainer``       ``Trainer.fit`` over the *same* DataLoader with ``fast_path=False``; logging at
                    its defaults (train accuracy every step, progress lines every 50 steps to a file,
                    metrics.jsonl, TensorBoard when installed); ``plot=False`` and no per-epoch
                    checkpoints so that it times the loop. The target (≤ 1.03×) applies to this arm.
- ``trainer_fast``  the same with the Trainer's defaults for data: the in-memory fast path.
- ``trainer_full``  every default (fast path, a checkpoint each epoch, final checkpoint, PNG plot):
                    what a plain ``fit`` costs end to end, reported for information.

"loop" is the time of the epochs (batches, steps, logging, end-of-epoch work); "fit" adds the
set-up at the start of ``fit`` (loaders, logger, TensorBoard writer) and the end (final checkpoint,
plots). Usage: ``python benchmarks/overhead.py [--runs 15] [--epochs 20] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "overhead"
TARGET = 1.03


# ----------------------------------------------------------------------------- child arms
def _arm_hand_loop(p: dict, loop) -> dict:
    """A hand-written arm: ``loop`` is ``c.hand_loop`` (lean) or ``c.hand_loop_seeds`` (AverageMeter)."""
    import torch

    c.pin_threads()
    x, y = c.make_data()
    model = c.make_model()
    loader = c.make_loader(x, y, batch_size=p.get("batch", c.BATCH))
    opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
    epoch_cpu: list = []
    with open(os.devnull, "w") as stream:
        t0, c0 = time.perf_counter(), time.process_time()
        epochs = loop(model, loader, opt, p["epochs"], stream, cpu_times=epoch_cpu)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"loop_s": total, "loop_cpu_s": cpu, "fit_s": total, "fit_cpu_s": cpu, "outside_loop_s": 0.0,
            "epoch_s": epochs, "epoch_cpu_s": epoch_cpu, "steps": p["epochs"] * len(loader)}


def _arm_trainer(p: dict, fast_path: bool, full: bool = False) -> dict:
    import torch

    c.pin_threads()
    import torchrig

    x, y = c.make_data()
    model = c.make_model()
    loader = c.make_loader(x, y, batch_size=p.get("batch", c.BATCH))
    opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
    with tempfile.TemporaryDirectory() as run_dir:
        devnull = open(os.devnull, "w")
        saved, sys.stderr = sys.stderr, devnull  # progress lines go to /dev/null, as the hand loop's do
        try:
            kw = c.trainer_kwargs(run_dir, p["epochs"], fast_path=fast_path, end_of_fit=full)
            trainer = torchrig.Trainer(model, optimizer=opt, **dict(kw, batch_size=p.get("batch", c.BATCH)))
            result = c.time_trainer_fit(trainer, loader)
        finally:
            sys.stderr = saved
            devnull.close()
    return result


HANDLERS = {
    "hand": lambda p: _arm_hand_loop(p, c.hand_loop),
    "hand_seeds": lambda p: _arm_hand_loop(p, c.hand_loop_seeds),
    "trainer": lambda p: _arm_trainer(p, fast_path=False),
    "trainer_fast": lambda p: _arm_trainer(p, fast_path=True),
    "trainer_full": lambda p: _arm_trainer(p, fast_path=True, full=True),
}


# ----------------------------------------------------------------------------- parent
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="timed runs per arm (fresh processes)")
    ap.add_argument("--epochs", type=int, default=20, help="epochs per run (29 steps each at batch 64)")
    ap.add_argument("--batch", type=int, default=c.BATCH,
                    help="batch size (64; larger batches show how the fixed per-step cost fades)")
    ap.add_argument("--quick", action="store_true",
                    help="1 run, 1 epoch, no warm-up, no trainer_full arm: proves the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.epochs = 1, 1
    params = {"epochs": args.epochs, "batch": args.batch}
    arms = {"hand": params, "hand_seeds": params, "trainer": params, "trainer_fast": params}
    print(f"{NAME}: {args.runs} runs per arm, {args.epochs} epochs each, fresh processes, alternating", file=sys.stderr)
    runs = c.alternate(Path(__file__), arms, args.runs, warmup=not args.quick)
    if not args.quick:  # every default, for the end-of-fit cost: 3 runs are enough
        runs["trainer_full"] = [c.run_child(Path(__file__), "trainer_full", params) for _ in range(min(3, args.runs))]

    steps = runs["hand"][0]["steps"]
    stats = {}
    for name, rs in runs.items():
        stats[name] = {
            "wall": c.median([r["loop_s"] for r in rs]),
            "cpu": c.median([r["loop_cpu_s"] for r in rs]),
            # median epoch of each run (epoch 1 left out: lazy initialisation), then median over runs:
            # robust to a burst of load from other processes during one epoch
            "epoch": c.median([c.median(r["epoch_s"][1:] or r["epoch_s"]) for r in rs]),
        }
    h = stats["hand"]
    rows, arms_out = [], {}
    for name, rs in runs.items():
        st = stats[name]
        ratios = {k: st[k] / h[k] for k in st}
        fit = c.median([r["fit_s"] for r in rs])
        outside = c.median([r["outside_loop_s"] for r in rs])
        arms_out[name] = {"runs": len(rs), "steps": rs[0]["steps"], "loop_s": [r["loop_s"] for r in rs],
                          "loop_cpu_s": [r["loop_cpu_s"] for r in rs], "fit_s": [r["fit_s"] for r in rs],
                          "median_loop_s": st["wall"], "median_loop_cpu_s": st["cpu"], "median_epoch_s": st["epoch"],
                          "median_fit_s": fit, "median_outside_loop_s": outside,
                          "median_step_us": st["wall"] / steps * 1e6, "spread": c.spread([r["loop_s"] for r in rs]),
                          "loop_ratio_vs_hand": ratios["wall"], "cpu_ratio_vs_hand": ratios["cpu"],
                          "epoch_ratio_vs_hand": ratios["epoch"]}
        rows.append([name, len(rs), rs[0]["steps"], st["wall"], st["wall"] / steps * 1e6, ratios["wall"],
                     f"{100 * c.spread([r['loop_s'] for r in rs]):.1f}%", ratios["cpu"], ratios["epoch"], fit, outside])
    t = arms_out["trainer"]
    # The verdict uses process CPU time: on cores shared with other work it is the stable measure of
    # the work each loop does (wall time also counts the time other processes held the core).
    ratio = t["cpu_ratio_vs_hand"]
    print(c.table(["arm", "runs", "steps", "loop s", "µs/step", "wall ratio", "spread", "CPU-time ratio",
                   "epoch ratio", "fit s", "fit − loop s"], rows))
    print("(medians over runs; wall ratio = loop wall time / hand loop's; CPU-time ratio = process CPU time in the "
          "loop, all threads; epoch ratio = median epoch wall time, epoch 1 left out)")
    seeds = stats["trainer"]["cpu"] / stats["hand_seeds"]["cpu"]
    print(f"\nTrainer (same DataLoader, fast_path=False) / lean hand loop = {ratio:.3f}× CPU time "
          f"({t['loop_ratio_vs_hand']:.3f}× wall, {t['epoch_ratio_vs_hand']:.3f}× median epoch)  "
          f"(target ≤ {TARGET}×: {c.verdict(ratio, TARGET)})")
    print(f"Trainer (same DataLoader, fast_path=False) / the ImageNet example's loop (AverageMeter, loss.item() every step) = "
          f"{seeds:.3f}× CPU time ({c.verdict(seeds, TARGET)})")
    print(f"Trainer with its defaults (fast path) / lean hand loop = "
          f"{arms_out['trainer_fast']['cpu_ratio_vs_hand']:.3f}× CPU time")
    full = arms_out.get("trainer_full")
    if full is not None:
        print(f"All defaults (checkpoint each epoch, final checkpoint, plot): fit {full['median_fit_s']:.2f} s, of "
              f"which {full['median_fit_s'] - full['median_loop_s']:.2f} s outside the epochs (set-up, final "
              f"checkpoint, plot)")
    payload = {"target": TARGET, "ratio": ratio, "cpu_ratio": ratio, "wall_ratio": t["loop_ratio_vs_hand"],
               "epoch_ratio": t["epoch_ratio_vs_hand"],
               "fast_path_ratio": arms_out["trainer_fast"]["cpu_ratio_vs_hand"], "ratio_vs_seeds_loop": seeds,
               "meets_target": ratio <= TARGET, "epochs": args.epochs, "steps": steps, "arms": arms_out,
               "workload": {"model": "MLP 64-256-256-10", "samples": c.N_SAMPLES, "batch": args.batch,
                            "optimizer": "AdamW", "lr": c.LR, "log_every": c.LOG_EVERY}}
    path = c.write_result(NAME if args.batch == c.BATCH else f"{NAME}_batch{args.batch}", payload, quick=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    if not c.child_main(HANDLERS):
        main()
