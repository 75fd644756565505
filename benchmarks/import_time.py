"""Import time: ``import torchrig`` (and ``from torchrig import Trainer``) against ``import torch``.

Each run is a fresh interpreter (``python -c ...``); the arms alternate; medians over the runs.
Two clocks: the import statement alone (``time.perf_counter`` inside the child, interpreter start-up
excluded) and the whole ``python -c`` process (wall time seen by the parent). The target
(≤ 1.15×) is for ``import torchrig``; ``from torchrig import Trainer`` is what training code pays and
is reported beside it.

It also checks that ``import torchrig`` loads none of the optional libraries (yaml, tqdm,
safetensors, matplotlib, tensorboard, torchvision, sklearn), and lists the ones that
``from torchrig import Trainer`` adds beyond what ``import torch`` itself loads.
Usage: ``python benchmarks/import_time.py [--runs 9] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "import_time"
TARGET = 1.15
OPTIONAL = ("yaml", "tqdm", "safetensors", "matplotlib", "tensorboard", "torchvision", "sklearn")

STATEMENTS = {
    "torch": "import torch",
    "torchrig": "import torchrig",
    "torchrig.Trainer": "from torchrig import Trainer",
}
CHILD = ("import time, sys, json\n"
         "t = time.perf_counter()\n"
         "{stmt}\n"
         "dt = time.perf_counter() - t\n"
         "print(json.dumps({{'import_s': dt, 'modules': len(sys.modules)}}))\n")
PROBE = ("import sys, json\n"
         "opt = {optional!r}\n"
         "def loaded():\n"
         "    return sorted(m for m in opt if m in sys.modules)\n"
         "out = {{}}\n"
         "import torchrig\n"
         "out['import torchrig'] = loaded()\n"
         "import torch\n"
         "out['import torch'] = loaded()\n"
         "from torchrig import Trainer\n"
         "out['from torchrig import Trainer'] = loaded()\n"
         "print(json.dumps(out))\n")


def _run(code: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=str(c.HERE.parent))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child failed: {code!r}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9, help="runs per arm (fresh interpreters), at least 7")
    ap.add_argument("--quick", action="store_true", help="1 run per arm: proves the script runs")
    args = ap.parse_args(argv)
    runs = 1 if args.quick else args.runs
    names = list(STATEMENTS)
    for name in names:  # warm-up: page cache and .pyc files, not timed
        if not args.quick:
            _run(CHILD.format(stmt=STATEMENTS[name]))
    data: dict[str, dict[str, list]] = {n: {"import_s": [], "process_s": []} for n in names}
    for r in range(runs):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            c._note_load()
            out, wall = _run(CHILD.format(stmt=STATEMENTS[name]))
            data[name]["import_s"].append(out["import_s"])
            data[name]["process_s"].append(wall)
    base_imp = c.median(data["torch"]["import_s"])
    base_proc = c.median(data["torch"]["process_s"])
    arms, rows = {}, []
    for name in names:
        imp, proc = c.median(data[name]["import_s"]), c.median(data[name]["process_s"])
        arms[name] = {"statement": STATEMENTS[name], "runs": runs, "import_s": data[name]["import_s"],
                      "process_s": data[name]["process_s"], "median_import_s": imp, "median_process_s": proc,
                      "import_ratio_vs_torch": imp / base_imp, "process_ratio_vs_torch": proc / base_proc}
        rows.append([STATEMENTS[name], runs, imp * 1e3, imp / base_imp, proc * 1e3, proc / base_proc])

    # one interpreter: what each statement, in turn, leaves loaded of the optional libraries
    probe = _run(PROBE.format(optional=OPTIONAL))[0]
    by_torch = set(probe["import torch"])
    checks = {"import torchrig": {"loaded": probe["import torchrig"]},
              "import torch": {"loaded": probe["import torch"]},
              "from torchrig import Trainer (after import torch)":
                  {"loaded": probe["from torchrig import Trainer"],
                   "added": sorted(set(probe["from torchrig import Trainer"]) - by_torch)}}
    clean = not checks["import torchrig"]["loaded"] and \
        not checks["from torchrig import Trainer (after import torch)"]["added"]
    ratio = arms["torchrig"]["import_ratio_vs_torch"]
    trainer_ratio = arms["torchrig.Trainer"]["import_ratio_vs_torch"]
    print(c.table(["statement", "runs", "median import ms", "ratio", "median process ms", "process ratio"], rows))
    print(f"\nimport torchrig / import torch = {ratio:.3f}× (target ≤ {TARGET}×: {c.verdict(ratio, TARGET)})")
    print(f"from torchrig import Trainer / import torch = {trainer_ratio:.3f}× "
          f"({c.verdict(trainer_ratio, TARGET)} if held to the same target)")
    for what, res in checks.items():
        print(f"optional libraries loaded by {what}: {', '.join(res['loaded']) or 'none'}"
              + (f"; added by it: {', '.join(res['added']) or 'none'}" if "after" in what else ""))
    print("optional libraries kept out of torchrig's imports: " + ("yes" if clean else "NO"))
    payload = {"target": TARGET, "ratio": ratio, "trainer_ratio": trainer_ratio, "meets_target": ratio <= TARGET,
               "optional_modules_clean": clean, "optional_modules": checks, "arms": arms}
    path = c.write_result(NAME, payload, quick=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
