"""Run every benchmark (one after the other, never in parallel) and write results/SUMMARY.md.

Usage: ``python benchmarks/run_all.py [--quick]``. ``--quick`` runs each script in its smoke mode
(one short repetition) and writes ``results/quick/SUMMARY.md`` instead, leaving the published
numbers alone.
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

BENCHMARKS = ("overhead", "fastpath", "import_time", "memory")


def _row(name: str, r: dict) -> list:
    """benchmark, what is compared, measured, target, verdict."""
    ok = "meets" if r.get("meets_target") else "misses"
    if name == "overhead":
        a = r["arms"]
        cpu_t, cpu_h = a["trainer"]["median_loop_cpu_s"], a["hand"]["median_loop_cpu_s"]
        return [name, "Trainer loop / lean hand-written loop, process CPU time (same DataLoader, fast_path=False)",
                f"{r['ratio']:.3f}× ({cpu_t:.3f} s vs {cpu_h:.3f} s CPU, {a['hand']['steps']} steps; "
                f"wall {r['wall_ratio']:.3f}×, median epoch {r['epoch_ratio']:.3f}×);"
                f" vs the ImageNet example's AverageMeter loop: {r['ratio_vs_seeds_loop']:.3f}×; Trainer defaults (fast path)"
                f" vs lean loop: {r['fast_path_ratio']:.3f}×", f"≤ {r['target']}×", ok]
    if name == "fastpath":
        parts = []
        for b, x in r.get("by_batch", {str(r["batch"]): r}).items():
            a = x["arms"]
            auto = (f"; vs the Trainer's default DataLoader {x['ratio_vs_default_loader']:.1f}×"
                    if x.get("ratio_vs_default_loader") else "")
            parts.append(f"batch {b}: {x['ratio']:.2f}× ({a['dataloader']['median_step_us']:.0f} vs "
                         f"{a['fast']['median_step_us']:.0f} µs/step; data alone {x['data_ratio']:.0f}×{auto})")
        return [name, "DataLoader path (num_workers=0) / fast path, time per training step (tiny MLP)",
                "; ".join(parts) + f"; same parameters: {r['same_parameters']}",
                f"≥ {r['target']}× (headline: batch {r['batch']})", ok]
    if name == "import_time":
        a = r["arms"]
        return [name, "`import torchrig` / `import torch`",
                f"{r['ratio']:.3f}× ({a['torchrig']['median_import_s'] * 1e3:.0f} vs "
                f"{a['torch']['median_import_s'] * 1e3:.0f} ms); `from torchrig import Trainer`: "
                f"{r['trainer_ratio']:.3f}×; optional libraries lazy: {r['optional_modules_clean']}",
                f"≤ {r['target']}×", ok]
    if name == "memory":
        a = r["arms"]
        return [name, "Trainer peak RSS − hand-written loop peak RSS; growth over epochs",
                f"{r['peak_diff_mib']:+.1f} MiB ({a['trainer']['median_peak_mib']:.0f} vs "
                f"{a['hand']['median_peak_mib']:.0f} MiB, {r['ratio']:.3f}×); growth ≤ "
                f"{max(x['max_growth_mib'] for x in a.values()):.1f} MiB over {r['epochs']} epochs",
                f"≤ {r['target']['allowance_mib']:.0f} MiB, flat", ok]
    return [name, "", "", "", ok]


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", choices=BENCHMARKS, help="run only these (others are read from results/)")
    args = ap.parse_args(argv)
    folder = c.RESULTS / "quick" if args.quick else c.RESULTS
    for name in args.only if args.only is not None else BENCHMARKS:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, str(c.HERE / f"{name}.py")] + (["--quick"] if args.quick else [])
        subprocess.run(cmd, check=True, cwd=str(c.HERE.parent))
        print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows, env = [], None
    for name in BENCHMARKS:
        path = folder / f"{name}.json"
        if not path.exists():
            rows.append([name, "not run", "", "", ""])
            continue
        r = json.loads(path.read_text())
        env = r.get("environment", env)
        rows.append(_row(name, r))
    lines = ["# Benchmark summary", ""]
    if env:
        note = " (quick mode: smoke run, not a measurement)" if args.quick else ""
        loads = [json.loads((folder / f"{n}.json").read_text())["environment"].get("loadavg_during_runs")
                 for n in BENCHMARKS if (folder / f"{n}.json").exists()]
        loads = [x for x in loads if x]
        lo, hi = (min(x["min"] for x in loads), max(x["max"] for x in loads)) if loads else (0, 0)
        busy = f"; load average during the runs {lo:.1f}–{hi:.1f}" if loads else ""
        lines += [f"torch {env['torch']}, Python {env['python']}, {env['cpu_cores']} CPU cores shared with other "
                  f"work{busy}, 1 thread per process; {env['time']}{note}.", ""]
    lines += ["| benchmark | compared | measured (medians) | target | result |", "| --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    lines += ["", "Method and details: docs/performance.md; raw numbers: the JSON files beside this one.", ""]
    out = folder / "SUMMARY.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
