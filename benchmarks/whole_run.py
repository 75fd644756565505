"""Whole runs, set-up to exit: a tiny MLP 32-64-2 on 8,192 samples, batch 64, SGD, one thread.

Each arm is a fresh process that imports torch, then times everything after that import: building
the model and data, the runner's set-up, 3 (or 15) epochs, and everything after the last step
(summaries, plots, trackers, final checkpoint). Arms alternate; medians over the runs.

- ``hand``          a lean hand-written loop (``_common.hand_loop``: loss and accuracy kept as tensors,
                    a progress line every 50 steps) over a shuffled DataLoader.
- ``defaults``      ``Trainer(model, optimizer, epochs=E, batch_size=64).fit((x, y))`` with the hand loop's own
                    ``torch.optim.SGD(lr=0.05)`` and nothing else: every default (fast path, a checkpoint
                    per epoch, metrics.jsonl, TensorBoard, the plot, which ``fit`` draws before it returns).
- ``no_fast_path``  the same over the hand loop's DataLoader (``fast_path=False`` path), with every default:
                    the per-epoch checkpoint and TensorBoard included.
- ``loop_only``     ``no_fast_path`` without the per-epoch checkpoint and the plot: default logging (progress
                    lines, metrics.jsonl, TensorBoard) and the default accuracy metric stay. This is the
                    per-step target's arm: the loop's own cost per step against the hand loop's.

"Marginal per step" is the median epoch of the 15-epoch runs (the first epoch left out) per step, the
median over the runs: what a step costs once the run is going, the per-epoch work (a checkpoint, the
epoch row) shared by the epoch's steps. ``(15-epoch run − 3-epoch run) / (their step difference)``
estimates the same from whole runs and is printed beside it; it is much noisier (two ~3 s times
subtracted). Targets: a whole 3-epoch run at defaults ≤ 1.03× the hand loop, and its fixed cost (the
defaults' 3-epoch run − the hand loop's) ≤ 0.3 s; marginal per step with the fast path off, default logging
and the default metric (``loop_only``) ≤ 1.05× the hand loop's.

Usage: ``python benchmarks/whole_run.py [--runs 9] [--quick]``.
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

NAME = "whole_run"
N, FEATURES, HIDDEN, CLASSES, BATCH, LR = 8192, 32, 64, 2, 64, 0.05
TARGET_WHOLE, TARGET_STEP, TARGET_FIXED_S = 1.03, 1.05, 0.3


def _job(n: int = N):
    import torch
    from torch import nn

    c.pin_threads()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    return torch, x, y, model


def _arm_hand(p: dict) -> dict:
    t0 = time.perf_counter()
    torch, x, y, model = _job(p.get("n", N))
    loader = c.make_loader(x, y, BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with open(os.devnull, "w") as stream:
        epochs = c.hand_loop(model, loader, opt, p["epochs"], stream)
    return {"wall_s": time.perf_counter() - t0, "steps": p["epochs"] * len(loader),
            "step_ms": _per_step_ms(epochs, len(loader))}


def _per_step_ms(epoch_s: list, steps_per_epoch: int) -> float:
    """The median epoch (the first left out: warm-up) per step, in ms."""
    return c.median(epoch_s[1:] or epoch_s) / steps_per_epoch * 1e3


class _EpochClock:
    """Epoch-end times of a Trainer (``on_log`` of each epoch row): an epoch's interval holds its steps,
    its end-of-epoch work and the previous epoch's checkpoint, as a run pays them."""

    def __init__(self) -> None:
        self.ends = [time.perf_counter()]

    def on_log(self, trainer, values, kind) -> None:
        if kind == "epoch":
            self.ends.append(time.perf_counter())


def _arm_trainer(p: dict) -> dict:
    t0 = time.perf_counter()
    torch, x, y, model = _job(p.get("n", N))
    from torchrig import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        data = (x, y) if p["fast_path"] else c.make_loader(x, y, BATCH)
        kw = {} if p["fast_path"] else {"fast_path": False}
        kw.update(p.get("extra", {}))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # the hand loop's: the same update
        clock = _EpochClock()
        trainer = Trainer(model, optimizer, epochs=p["epochs"], batch_size=BATCH, threads=1,
                          run_dir=run_dir, progress="lines", callbacks=[clock], **kw)
        stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # progress lines, as the hand loop's
        try:
            trainer.fit(data)
            trainer.close()
        finally:
            sys.stderr.close()
            sys.stderr = stderr
        wall = time.perf_counter() - t0  # the plot included: it is drawn before fit returns
        steps = trainer.global_step
    epochs = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return {"wall_s": wall, "steps": steps, "step_ms": _per_step_ms(epochs, steps // p["epochs"])}


ARMS = {"hand": _arm_hand, "defaults": lambda p: _arm_trainer(dict(p, fast_path=True)),
        "no_fast_path": lambda p: _arm_trainer(dict(p, fast_path=False)),
        "loop_only": lambda p: _arm_trainer(dict(p, fast_path=False, extra=LOOP_ONLY))}
LOOP_ONLY = {"checkpoint_every_epochs": 0, "plot": False}


def main() -> None:
    if c.child_main({f"{arm}@{e}": (lambda fn, e: lambda p: fn(dict(p, epochs=e)))(fn, e)
                     for arm, fn in ARMS.items() for e in (3, 15)}):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)  # the step ratio moves by ±0.03 between 5-run sets
    ap.add_argument("--quick", action="store_true", help="one run of each arm, to check the script works")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    arms = {f"{arm}@{e}": {"n": N // 8} if args.quick else {} for arm in ARMS for e in (3, 15)}  # quick: 16 steps/epoch
    out = c.alternate(Path(__file__), arms, runs, warmup=not args.quick)
    med = {name: c.median([r["wall_s"] for r in rs]) for name, rs in out.items()}
    steps = {name: rs[0]["steps"] for name, rs in out.items()}
    rows, result = [], {}
    for arm in ARMS:
        marginal = (med[f"{arm}@15"] - med[f"{arm}@3"]) / (steps[f"{arm}@15"] - steps[f"{arm}@3"])
        result[arm] = {"run3_s": med[f"{arm}@3"], "run15_s": med[f"{arm}@15"],
                       "marginal_ms": c.median([r["step_ms"] for r in out[f"{arm}@15"]]),
                       "marginal_3_15_ms": marginal * 1e3}
    for arm, r in result.items():
        rows.append([arm, r["run3_s"], r["run3_s"] / result["hand"]["run3_s"], r["run15_s"],
                     r["marginal_ms"], r["marginal_ms"] / result["hand"]["marginal_ms"], r["marginal_3_15_ms"]])
    print(c.table(["arm", "3 epochs s", "× hand", "15 epochs s", "ms/step", "× hand", "ms/step (3 vs 15)"], rows))
    whole = result["defaults"]["run3_s"] / result["hand"]["run3_s"]
    step = result["loop_only"]["marginal_ms"] / result["hand"]["marginal_ms"]
    with_checkpoints = result["no_fast_path"]["marginal_ms"] / result["hand"]["marginal_ms"]
    fixed = result["defaults"]["run3_s"] - result["hand"]["run3_s"]
    print(f"whole run at defaults: {whole:.3f}× ({c.verdict(whole, TARGET_WHOLE)} ≤ {TARGET_WHOLE}), fixed cost "
          f"{fixed:+.3f} s ({c.verdict(fixed, TARGET_FIXED_S)} ≤ {TARGET_FIXED_S} s); "
          f"marginal step, fast path off, default logging and metric: {step:.3f}× "
          f"({c.verdict(step, TARGET_STEP)} ≤ {TARGET_STEP}); with a checkpoint per epoch too: {with_checkpoints:.3f}×")
    path = c.write_result(NAME, {"arms": result, "whole_ratio": whole, "step_ratio": step, "fixed_cost_s": fixed,
                                  "with_checkpoints_ratio": with_checkpoints,
                                  "targets": {"whole": TARGET_WHOLE, "step": TARGET_STEP, "fixed_s": TARGET_FIXED_S},
                                  "runs": out},
                          quick=args.quick)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
