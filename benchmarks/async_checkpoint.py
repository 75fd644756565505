"""How long a checkpoint save stalls training: asynchronous (``checkpoint.async_save=true``) against
synchronous saves of a ~100M-parameter model on CPU.

Each arm runs in a fresh process: a stack of square ``nn.Linear`` layers with about ``--params``
parameters, SGD with momentum (so the optimizer state is as large as the weights), a few training
steps, then ``--saves`` rounds of "save, then train ``--steps`` steps". Measured per round:

- ``stall_s``  the time ``CheckpointManager.save`` keeps the training thread (sync: copy, serialise,
               fsync, rename; async: the copy to host memory)
- ``steps_s``  the time of the training steps after it (the background write competes for the cores)
- ``unhidden_s``  async only: how long the write still ran after those steps (``wait()``); a run whose
               saves are further apart than one write never pays it, a run that saves more often
               pays it at its next save

The ratio is median async stall / median sync stall; target ≤ 0.25. The ratio with the unhidden
wait added is reported too.
Usage: ``python benchmarks/async_checkpoint.py [--params 1e8] [--runs 3] [--saves 3] [--steps 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "async_checkpoint"
TARGET = 0.25
LAYERS = 6


def _model(params: float):
    import torch
    from torch import nn

    width = max(8, int(math.sqrt(params / LAYERS)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)]), width


def _arm(p: dict) -> dict:
    c.pin_threads()
    import torch

    sys.path.insert(0, str(c.HERE.parent / "src"))
    from torchrig.checkpoint import CheckpointManager

    model, width = _model(float(p["params"]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(4, width)

    def train(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        return time.perf_counter() - t0

    train(2)  # the momentum buffers exist from here on
    stalls, steps, unhidden = [], [], []
    with tempfile.TemporaryDirectory(prefix="torchrig-bench-") as run:
        mgr = CheckpointManager(run, keep_last=1, keep_best=0, async_save=p["arm"] == "async")
        for k in range(int(p["saves"])):
            t0 = time.perf_counter()
            mgr.save(k + 1, {"model": model, "optimizers": {"sgd": opt}}, config=None, meta={"step": k + 1})
            stalls.append(time.perf_counter() - t0)
            steps.append(train(int(p["steps"])))
            t0 = time.perf_counter()
            mgr.wait()
            unhidden.append(time.perf_counter() - t0)
        mgr.close()
    n_params = sum(t.numel() for t in model.parameters())
    return {"stall_s": stalls, "steps_s": steps, "unhidden_s": unhidden, "params": n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1e6 parameters, one run (a smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.params, args.runs = 1e6, 1
    base = {"params": args.params, "saves": args.saves, "steps": args.steps}
    arms = {name: dict(base, arm=name) for name in ("sync", "async")}
    runs = c.alternate(Path(__file__), arms, args.runs, warmup=not args.quick)
    summary = {}
    for name, results in runs.items():
        def pooled(key: str) -> list:  # the first save of a process warms caches: left out when there are more
            return [s for r in results for s in (r[key][1:] or r[key])]

        summary[name] = {"median_stall_s": c.median(pooled("stall_s")),
                         "median_steps_s": c.median(pooled("steps_s")),
                         "median_unhidden_s": c.median(pooled("unhidden_s")), "stall_spread": c.spread(pooled("stall_s")),
                         "params": results[0]["params"]}
    sync, lazy = summary["sync"], summary["async"]
    ratio = lazy["median_stall_s"] / sync["median_stall_s"]
    ratio_unhidden = (lazy["median_stall_s"] + lazy["median_unhidden_s"]) / sync["median_stall_s"]
    rows = [[n, s["params"], s["median_stall_s"], s["median_steps_s"], s["median_unhidden_s"]]
            for n, s in summary.items()]
    print(c.table(["arm", "parameters", "stall per save (s)", f"{args.steps} steps after it (s)",
                   "write left after them (s)"], rows))
    print(f"stall async / sync: {ratio:.3f} (target <= {TARGET}): {c.verdict(ratio, TARGET)}; "
          f"with the write left after {args.steps} steps: {ratio_unhidden:.3f}")
    path = c.write_result(NAME, {"arms": summary, "ratio": ratio, "ratio_with_unhidden_write": ratio_unhidden,
                                 "target": TARGET, "meets_target": ratio <= TARGET, "settings": base},
                          quick=args.quick)
    print(f"written to {path}")


if __name__ == "__main__":
    if not c.child_main({"sync": _arm, "async": _arm}):
        main()
