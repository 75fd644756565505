"""``compile=true`` on the default job's model: the digits CNN on the real 8×8 digits, CPU (inductor).

Two arms, each a fresh process (one thread), alternated; medians over the runs:

- ``eager``     ``Trainer(DigitsCNN(), "adamw", batch_size=64)`` over the digits training set;
- ``compiled``  the same with ``compile=True`` (``torch.compile``, inductor; needs a C compiler).

Reported: the steady-state time per optimizer step (the median step after step ``WARMUP``, so the
compile itself and the recompile for an epoch's short last batch are left out; the mean is kept too), the one-off compile time (the first steps' extra time), and the speed-up
eager / compiled. Usage: ``python benchmarks/compile.py [--runs 3] [--epochs 4] [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "compile"
WARMUP = 10


def _arm(p: dict) -> dict:
    import torch
    from sklearn.datasets import load_digits

    from torchrig import Trainer
    from torchrig.models import DigitsCNN

    c.pin_threads()
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    marks: dict = {}

    class Clock:
        def on_step_end(self, trainer, values):
            marks[trainer.global_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        trainer = Trainer(DigitsCNN(), "adamw", batch_size=64, epochs=p["epochs"], threads=1, run_dir=run_dir,
                          compile=p["compile"], plot=False, progress="none", callbacks=[Clock()],
                          checkpoint_every_epochs=0, **{"checkpoint.save_final": False})
        trainer.fit((x, y))
        steps = trainer.global_step
    first = marks[WARMUP] - t0
    # the median step after the warm-up: a new batch shape (an epoch's short last batch) recompiles once,
    # which is compile time, not step time
    gaps = sorted(marks[k + 1] - marks[k] for k in range(WARMUP, steps))
    steady = gaps[len(gaps) // 2]
    mean = (marks[steps] - marks[WARMUP]) / (steps - WARMUP)
    return {"step_ms": steady * 1e3, "mean_step_ms": mean * 1e3, "first_steps_s": first, "steps": steps}


def main() -> None:
    if c.child_main({"eager": lambda p: _arm(dict(p, compile=False)),
                     "compiled": lambda p: _arm(dict(p, compile=True))}):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        print("no C compiler: torch.compile's CPU backend (inductor) cannot run here")
        return
    params = {"epochs": 1 if args.quick else args.epochs}
    runs = c.alternate(Path(__file__), {"eager": params, "compiled": params}, 1 if args.quick else args.runs,
                       warmup=False, timeout=1200)
    med = {a: c.median([r["step_ms"] for r in rs]) for a, rs in runs.items()}
    mean = {a: c.median([r["mean_step_ms"] for r in rs]) for a, rs in runs.items()}
    first = {a: c.median([r["first_steps_s"] for r in rs]) for a, rs in runs.items()}
    speedup = med["eager"] / med["compiled"]
    print(c.table(["arm", "ms/step (median)", "ms/step (mean, with recompiles)", f"first {WARMUP} steps s"],
                  [[a, med[a], mean[a], first[a]] for a in med]))
    print(f"compile speed-up per step: {speedup:.2f}× (compile time paid once: "
          f"{first['compiled'] - first['eager']:.1f} s)")
    path = c.write_result(NAME, {"step_ms": med, "mean_step_ms": mean, "first_steps_s": first, "speedup": speedup, "runs": runs},
                          quick=args.quick)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
