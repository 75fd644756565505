"""Run every benchmark (one after the other, never in parallel), write results/SUMMARY.md and the
table of the README's "Benchmarks" section.

Usage: ``python benchmarks/run_all.py [--quick] [--only NAME ...]``. ``--quick`` runs each script in its
smoke mode (one short repetition) and writes ``results/quick/SUMMARY.md`` instead, leaving the published
numbers and the README alone. ``--only`` runs the benchmarks named (none: just rebuild the tables) and
reads the others' last results from ``results/``; each row says when its numbers were measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

BENCHMARKS = ("whole_run", "overhead", "ddp_scaling", "memory", "async_checkpoint", "activation_checkpointing",
              "compile", "fastpath", "workers", "import_time", "finetune", "lm", "long_context")
README = c.HERE.parent / "README.md"
BEGIN, END = "<!-- benchmark table: written by benchmarks/run_all.py -->", "<!-- end of benchmark table -->"


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
    return _row_more(name, r, ok)


def _row_more(name: str, r: dict, ok: str) -> list:
    if name == "whole_run":
        a, t = r["arms"], {"whole": 1.03, "step": 1.05, "fixed_s": 0.3, **r.get("targets", {})}
        fixed = a["defaults"]["run3_s"] - a["hand"]["run3_s"]
        whole_ok = "meets" if r["whole_ratio"] <= t["whole"] and fixed <= t["fixed_s"] else "misses"
        step_ok = "meets" if r["step_ratio"] <= t["step"] else "misses"
        return [name, "a whole run after `import torch` (model, data, set-up, 3 epochs, all that follows the last "
                "step), MLP 32-64-2, 8,192 samples, batch 64, the same SGD, vs a lean hand-written loop; "
                "marginal ms/step: the median epoch of 15-epoch runs, per step",
                f"defaults **{r['whole_ratio']:.3f}×** ({a['defaults']['run3_s']:.2f} s vs {a['hand']['run3_s']:.2f} s: "
                f"**{fixed:+.2f} s**, the plot drawn before `fit` returns included); "
                f"marginal step with the fast path off, default logging (metrics.jsonl, TensorBoard, progress) and "
                f"the default metric **{r['step_ratio']:.3f}×** ({a['loop_only']['marginal_ms']:.3f} vs "
                f"{a['hand']['marginal_ms']:.3f} ms); with a checkpoint per epoch too "
                f"{a['no_fast_path']['marginal_ms'] / a['hand']['marginal_ms']:.3f}×; "
                f"fast path {a['defaults']['marginal_ms'] / a['hand']['marginal_ms']:.2f}×",
                f"whole ≤ {t['whole']}× and ≤ +{t['fixed_s']} s; step ≤ {t['step']}×", f"whole: {whole_ok}; step: {step_ok}"]
    if name == "ddp_scaling":
        ratio, med = r["trainer_vs_hand_ddp"], r.get("trainer_vs_hand_ddp_median", r["trainer_vs_hand_ddp"])
        return [name, f"torchrig DDP / hand-written DDP, {r['ranks']} ranks (gloo, CPU), samples/s; {r['model']}",
                f"**{med:.3f}×** median ({ratio:.3f}× best); scaling 1 → 2 ranks {r.get('scaling_median', 0):.2f}×",
                "≥ 0.98×", "meets" if med >= 0.98 else "misses"]
    if name == "async_checkpoint":
        a = r["arms"]
        return [name, f"training stall per checkpoint, {a['async']['params'] / 1e6:.0f} M parameters on CPU: "
                "asynchronous / synchronous save",
                f"**{r['ratio']:.3f}×** ({a['async']['median_stall_s']:.2f} s vs {a['sync']['median_stall_s']:.2f} s); "
                f"counting the write still running two steps later, {r['ratio_with_unhidden_write']:.2f}×",
                f"≤ {r['target']}×", ok]
    if name == "activation_checkpointing":
        a = r["arms"]
        return [name, f"activations kept for backward, {r['blocks']} residual MLP blocks of width {r['width']}, "
                "with / without `model.activation_checkpointing`",
                f"**{r['ratios']['saved_activation_mib']:.3f}×** ({a['checkpointed']['saved_activation_mib']:.0f} MiB vs "
                f"{a['plain']['saved_activation_mib']:.0f} MiB); gradients equal: {r['gradients_equal']}", "lower",
                "meets" if r["ratios"]["saved_activation_mib"] < 1 and r["gradients_equal"] else "misses"]
    if name == "compile":
        return [name, "`compile=true` on the digits CNN (inductor, CPU, one thread), median step after warm-up",
                f"**{r['speedup']:.2f}×** faster per step ({r['step_ms']['compiled']:.2f} vs {r['step_ms']['eager']:.2f}"
                f" ms); first steps {r['first_steps_s']['compiled']:.1f} s vs {r['first_steps_s']['eager']:.1f} s "
                "(compiling)", "measured", "—"]
    if name == "workers":
        d = r["by_data"]
        cheap, costly = d["cheap"], d["costly"]
        return [name, "`data.num_workers=auto` / the faster of `0` and one worker per core but one, time per step, "
                "on a user's `Dataset` class: in-memory rows (MLP 64-32-10) and rows through a ~90 µs transform "
                "(MLP 64-1024-10)",
                f"in-memory rows **{cheap['auto_vs_best']:.2f}×** ({cheap['arms']['auto']['median_step_us']:.0f} µs/step; "
                f"workers, as `auto` gave before: {1 / cheap['auto_vs_workers']:.2f}× slower than `auto`); "
                f"transformed rows **{costly['auto_vs_best']:.2f}×** ({costly['arms']['auto']['median_step_us']:.0f} "
                "µs/step); `auto` trains the weights worker processes train", "measured", "—"]
    if name == "finetune":
        a = r["arms"]
        lora, full, bf16 = a["lora"], a["full"], a["lora-bf16"]
        return [name, f"LoRA (rank 8, peft) / every parameter training, GPT-2 of {full['parameters'] / 1e6:.1f} M "
                "parameters on CPU (one thread, batch 8 × 64 tokens): time per step, checkpoint size",
                f"step **{lora['step_ratio']:.2f}×** ({lora['median_step_s'] * 1e3:.0f} vs "
                f"{full['median_step_s'] * 1e3:.0f} ms); checkpoint **{lora['checkpoint_ratio']:.3f}×** "
                f"({lora['checkpoint_bytes'] / 2**20:.2f} vs {full['checkpoint_bytes'] / 2**20:.2f} MiB); bf16 base "
                f"{bf16['step_ratio']:.2f}× (CPU bf16 matmuls)", "measured", "—"]
    if name == "lm":
        return _row_lm(name, r)
    if name == "long_context":
        return _row_long_context(name, r)
    return [name, "", "", "", ok]


def _row_lm(name: str, r: dict) -> list:
    a, p = r["arms"], r["config"]
    keys = "; ".join(f"{n} {x['tokens_per_s_vs_hand']:.2f}×" for n, x in a.items() if n != "hand")
    return [name, f"GPT-style LM ({p['layers']} layers, d={p['dim']}, {p['batch']}×{p['seq']} tokens, "
            f"{a['hand']['device']}): `Trainer` at defaults and with each speed key / hand loop, tokens/s",
            f"{keys} ({a['hand']['median_tokens_per_s']:.0f} tokens/s by hand)", "measured", "—"]


def _row_long_context(name: str, r: dict) -> list:
    s, p, lengths = r["summary"], r["config"], r["lengths"]
    packed = "; ".join(f"{n} tokens **{s[str(n)]['packed_vs_padded']:.1f}×**" for n in lengths)
    used = ", ".join(f"{s[str(n)]['packed_tokens_used']:.1%} vs {s[str(n)]['padded_tokens_used']:.1%}" for n in lengths)
    cp2 = [s[str(n)]["cp2_memory_vs_stream"] for n in lengths if s[str(n)]["cp2_memory_vs_stream"] is not None]
    return [name, f"packed documents (`data.pack`) / one document per padded row, valid tokens/s, a causal LM "
            f"({p['layers']} layers, d={p['dim']}, {r['arms'][f'padded@{lengths[0]}']['device']}) at "
            f"{', '.join(str(n) for n in lengths)} tokens; `parallel.cp=2` / one process, memory per rank",
            f"{packed} (tokens used {used}); cp=2: "
            + (", ".join(f"{x:.2f}×" for x in cp2) if cp2 else "not run (needs two GPUs)"),
            "packed > 1×", "meets" if r["meets_target"] else "misses"]


def collect(folder: Path) -> tuple[list, list, Optional[dict]]:
    """The table rows of the results in ``folder``, the date each was measured, and an environment."""
    rows, dates, env = [], [], None
    for name in BENCHMARKS:
        path = folder / f"{name}.json"
        if not path.exists():
            rows.append([name, "not run", "", "", ""])
            dates.append("")
            continue
        r = json.loads(path.read_text())
        env = r.get("environment", env)
        rows.append(_row(name, r))
        dates.append(r.get("environment", {}).get("time", "")[:10])
    return rows, dates, env


def readme_table(folder: Path = c.RESULTS) -> str:
    rows, dates, _ = collect(folder)
    return _readme_table(rows, dates)


def _readme_table(rows: list, dates: list) -> str:
    head = ["| benchmark | compared | measured (medians) | target | result | measured on |",
            "| --- | --- | --- | --- | --- | --- |"]
    return "\n".join(head + ["| " + " | ".join(str(x) for x in row + [d]) + " |" for row, d in zip(rows, dates)])


def write_readme(table: str) -> bool:
    """Put ``table`` between the README's markers; False when the README has none."""
    text = README.read_text()
    if BEGIN not in text or END not in text:
        return False
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    return True


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
    rows, dates, env = collect(folder)
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
    if not args.quick and write_readme(_readme_table(rows, dates)):
        print(f"wrote the table of {README}")
    return out


if __name__ == "__main__":
    main()
