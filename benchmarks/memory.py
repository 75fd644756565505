"""Peak resident memory of a ``Trainer`` run against the hand-written loop on the same work, and
no growth over epochs.

Each arm runs in a fresh process and reports its own ``ru_maxrss`` (peak resident set size) at the
end, plus its resident size (``/proc/self/statm``) at every epoch end. Arms, as in overhead.py:

- ``hand``              the hand-written loop over a DataLoader.
- ``trainer``           ``Trainer.fit`` over the same DataLoader (``fast_path=False``), logging at its
                        defaults (progress lines, metrics.jsonl, TensorBoard when installed),
                        ``plot=False``, no per-epoch checkpoints. The target applies to this arm:
                        peak within max(5 %, 64 MiB) of ``hand``.
- ``trainer_defaults``  every default (fast path, a checkpoint per epoch, final checkpoint, PNG plot),
                        for information.

Growth: the resident size at the end of the last epoch minus that at the end of epoch 2 (the first
epochs allocate the optimizer state, allocator pools and logging buffers). The logged history is
checked to hold Python numbers only — never tensors that would keep a graph alive.
Usage: ``python benchmarks/memory.py [--runs 5] [--epochs 30] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "memory"
TARGET_FRACTION, TARGET_MIB = 0.05, 64.0
GROWTH_LIMIT_MIB = 4.0  # allocator noise allowance for "flat"
MIB = 1024 * 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _arm_hand(p: dict) -> dict:
    import torch

    c.pin_threads()
    x, y = c.make_data()
    model = c.make_model()
    loader = c.make_loader(x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
    rss: list = []
    with open(os.devnull, "w") as stream:
        c.hand_loop(model, loader, opt, p["epochs"], stream, on_epoch_end=lambda e: rss.append(_rss_mib()))
    return {"peak_mib": _peak_mib(), "epoch_rss_mib": rss, "history_plain": True}


def _arm_trainer(p: dict, defaults: bool) -> dict:
    import torch

    c.pin_threads()
    import torchrig

    x, y = c.make_data()
    model = c.make_model()
    loader = c.make_loader(x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
    rss: list = []
    with tempfile.TemporaryDirectory() as run_dir:
        devnull = open(os.devnull, "w")
        saved, sys.stderr = sys.stderr, devnull
        try:
            trainer = torchrig.Trainer(model, optimizer=opt, **c.trainer_kwargs(run_dir, p["epochs"],
                                                                                 fast_path=defaults,
                                                                                 end_of_fit=defaults))
            inner = trainer._end_epoch

            def end_epoch(*a, **k):
                out = inner(*a, **k)
                rss.append(_rss_mib())
                return out

            trainer._end_epoch = end_epoch
            trainer.fit(loader)
        finally:
            sys.stderr = saved
            devnull.close()
    plain = all(isinstance(v, (int, float, str)) for row in trainer.history for v in row.values())
    return {"peak_mib": _peak_mib(), "epoch_rss_mib": rss, "history_plain": plain}


HANDLERS = {
    "hand": _arm_hand,
    "trainer": lambda p: _arm_trainer(p, defaults=False),
    "trainer_defaults": lambda p: _arm_trainer(p, defaults=True),
}


def _growth(rss: list) -> float:
    if len(rss) < 3:
        return 0.0
    return rss[-1] - rss[1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per arm (fresh processes)")
    ap.add_argument("--epochs", type=int, default=30, help="epochs per run (29 steps each)")
    ap.add_argument("--quick", action="store_true",
                    help="1 run, 3 epochs, no trainer_defaults arm: proves the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.epochs = 1, 3
    params = {"epochs": args.epochs}
    print(f"{NAME}: {args.runs} runs per arm, {args.epochs} epochs each, fresh processes, alternating",
          file=sys.stderr)
    arms_in = {"hand": params, "trainer": params}
    if not args.quick:
        arms_in["trainer_defaults"] = params
    runs = c.alternate(Path(__file__), arms_in, args.runs, warmup=False)
    hand_peak = c.median([r["peak_mib"] for r in runs["hand"]])
    allowance = max(TARGET_FRACTION * hand_peak, TARGET_MIB)
    arms, rows = {}, []
    for name, rs in runs.items():
        peak = c.median([r["peak_mib"] for r in rs])
        growth = max(_growth(r["epoch_rss_mib"]) for r in rs)
        plain = all(r["history_plain"] for r in rs)
        arms[name] = {"runs": len(rs), "peak_mib": [r["peak_mib"] for r in rs], "median_peak_mib": peak,
                      "peak_ratio_vs_hand": peak / hand_peak, "peak_diff_mib": peak - hand_peak,
                      "max_growth_mib": growth, "epoch_rss_mib": rs[0]["epoch_rss_mib"], "history_plain": plain}
        rows.append([name, len(rs), peak, peak - hand_peak, peak / hand_peak, growth,
                     "yes" if plain else "NO"])
    diff = arms["trainer"]["peak_diff_mib"]
    growth_ok = all(a["max_growth_mib"] <= GROWTH_LIMIT_MIB for a in arms.values())
    meets = diff <= allowance and growth_ok and arms["trainer"]["history_plain"]
    print(c.table(["arm", "runs", "median peak MiB", "diff MiB", "ratio", "growth MiB (epoch 2→last)",
                   "logged values plain"], rows))
    print(f"\nTrainer peak − hand peak = {diff:+.1f} MiB ({arms['trainer']['peak_ratio_vs_hand']:.3f}×); "
          f"allowed {allowance:.1f} MiB (max of 5 % and 64 MiB): {c.verdict(diff, allowance)}")
    print(f"growth over epochs ≤ {GROWTH_LIMIT_MIB} MiB in every arm: {'yes' if growth_ok else 'NO'}")
    payload = {"target": {"fraction": TARGET_FRACTION, "mib": TARGET_MIB, "allowance_mib": allowance,
                          "growth_limit_mib": GROWTH_LIMIT_MIB},
               "peak_diff_mib": diff, "ratio": arms["trainer"]["peak_ratio_vs_hand"], "growth_ok": growth_ok,
               "meets_target": meets, "epochs": args.epochs, "arms": arms}
    path = c.write_result(NAME, payload, quick=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    if not c.child_main(HANDLERS):
        main()
