"""The benchmark scripts run (``--quick``: one short repetition) and report what they promise.

Only the structure of their output is checked, never a timing: timings belong to the benchmarks
themselves (see docs/performance.md), not to tests on shared machines. The scripts run one after
another: side by side on two shared cores they only queued behind each other (and behind the tests'
own processes). Their quick results go to benchmarks/results/quick/, never over the published numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
QUICK = BENCH / "results" / "quick"
SCRIPTS = ("overhead", "fastpath", "import_time", "memory", "whole_run", "workers", "lm")


@pytest.fixture(scope="module")
def quick_runs() -> dict:
    out = {}
    for name in SCRIPTS:
        proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick"], cwd=str(ROOT),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"benchmarks/{name}.py --quick failed:\n{proc.stderr[-3000:]}"
        out[name] = (proc.stdout, json.loads((QUICK / f"{name}.json").read_text()))
    return out


def _common(result: dict, name: str) -> None:
    assert result["benchmark"] == name and result["quick"] is True
    assert "torch" in result["environment"] and "target" in result and "meets_target" in result
    assert isinstance(result["meets_target"], bool)


def test_overhead_quick(quick_runs):
    stdout, r = quick_runs["overhead"]
    _common(r, "overhead")
    assert {"hand", "hand_seeds", "trainer", "trainer_fast"} <= set(r["arms"])
    for arm in r["arms"].values():
        assert arm["median_loop_s"] > 0 and arm["steps"] == r["steps"] > 0
    assert r["ratio"] > 0 and r["cpu_ratio"] > 0 and r["ratio_vs_seeds_loop"] > 0
    assert "Trainer (same DataLoader, fast_path=False) / lean hand loop" in stdout


def test_fastpath_quick(quick_runs):
    stdout, r = quick_runs["fastpath"]
    _common(r, "fastpath")
    assert set(r["arms"]) == {"dataloader", "fast"}
    assert r["same_parameters"] is True  # the two paths saw the same samples in the same order
    assert r["ratio"] > 0 and r["data_ratio"] > 0
    assert "per step DataLoader / fast path" in stdout


def test_workers_quick(quick_runs):
    stdout, r = quick_runs["workers"]
    assert r["benchmark"] == "workers" and r["quick"] is True
    assert set(r["by_data"]) == {"cheap", "costly"}
    for d in r["by_data"].values():
        assert set(d["arms"]) == {"none", "workers", "auto"}
        assert all(a["median_step_us"] > 0 and a["steps"] > 0 for a in d["arms"].values())
        assert d["auto_vs_best"] > 0 and d["auto_vs_workers"] > 0
    assert "cheap: auto / faster fixed choice" in stdout  # printed after auto's weights matched the workers'


def test_import_time_quick(quick_runs):
    stdout, r = quick_runs["import_time"]
    _common(r, "import_time")
    assert set(r["arms"]) == {"torch", "torchrig", "torchrig.Trainer"}
    assert all(a["median_import_s"] > 0 for a in r["arms"].values())
    # the lazy-import promise is a fact, not a timing: assert it
    assert r["optional_modules"]["import torchrig"]["loaded"] == []
    assert r["optional_modules"]["from torchrig import Trainer (after import torch)"]["added"] == []
    assert "import torchrig / import torch" in stdout


def test_memory_quick(quick_runs):
    stdout, r = quick_runs["memory"]
    _common(r, "memory")
    assert {"hand", "trainer"} <= set(r["arms"])
    for arm in r["arms"].values():
        assert arm["median_peak_mib"] > 0 and len(arm["epoch_rss_mib"]) == r["epochs"]
        assert arm["history_plain"] is True  # logged values are Python numbers, never tensors
    assert "Trainer peak − hand peak" in stdout


def test_whole_run_quick(quick_runs):
    stdout, r = quick_runs["whole_run"]
    assert r["benchmark"] == "whole_run" and r["quick"] is True
    assert set(r["arms"]) == {"hand", "defaults", "no_fast_path", "loop_only"}
    for arm in r["arms"].values():
        # times only: a load spike on a shared machine can make either run the longer one
        assert arm["run3_s"] > 0 and arm["run15_s"] > 0 and arm["marginal_ms"] > 0
    assert r["whole_ratio"] > 0 and r["step_ratio"] > 0 and r["with_checkpoints_ratio"] > 0
    assert "whole run at defaults:" in stdout


def test_lm_quick(quick_runs):
    stdout, r = quick_runs["lm"]
    _common(r, "lm")
    assert list(r["arms"]) == ["hand", "trainer", "fused_head", "selective_ac"]
    for arm in r["arms"].values():
        assert arm["median_tokens_per_s"] > 0 and arm["tokens_per_s_vs_hand"] > 0 and arm["mfu"] is None  # CPU
        assert arm["memory_kind"] == "cpu_peak_rss_delta"
        assert math.isfinite(arm["loss"]) and arm["loss"] != arm["initial_loss"]  # trained
    # the chunked head and its cross-entropy train what the plain head and loss train
    assert abs(r["arms"]["fused_head"]["loss"] - r["arms"]["trainer"]["loss"]) < 1e-4
    assert "held-out loss" in stdout


def test_run_all_summary(quick_runs):
    # run_all.py reads the quick results just written and writes the summary table
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick", "--only"], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (QUICK / "SUMMARY.md").read_text()
    assert "| benchmark |" in summary
    for name in SCRIPTS:
        assert f"| {name} |" in summary


def test_readme_benchmark_table_is_the_one_run_all_writes(tmp_path, monkeypatch):
    """The README's table is what ``run_all.py`` makes of the published results (rerun it after a
    benchmark), and ``write_readme`` replaces only what lies between the markers."""
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index(run_all.BEGIN) + len(run_all.BEGIN):readme.index(run_all.END)].strip()
    assert table == run_all.readme_table().strip()
    assert "| whole_run |" in table and "| ddp_scaling |" in table

    copy = tmp_path / "README.md"
    copy.write_text(f"before\n{run_all.BEGIN}\nold\n{run_all.END}\nafter\n")
    monkeypatch.setattr(run_all, "README", copy)
    assert run_all.write_readme("| new |")
    assert copy.read_text() == f"before\n{run_all.BEGIN}\n| new |\n{run_all.END}\nafter\n"
    copy.write_text("no markers\n")
    assert not run_all.write_readme("| new |") and copy.read_text() == "no markers\n"


@pytest.mark.slow
def test_model_parallel_logits_quick():
    """``model_parallel.py --quick --logits``: with parallel.loss_parallel at tp=2 each rank reads half of the
    logits (and the loss keeps half for its backward) against one process; without it, all of them."""
    proc = subprocess.run([sys.executable, str(BENCH / "model_parallel.py"), "--quick", "--logits"], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"benchmarks/model_parallel.py --quick --logits failed:\n{proc.stderr[-3000:]}"
    r = json.loads((QUICK / "model_parallel_logits.json").read_text())
    _common(r, "model_parallel_logits")
    assert r["one_process"]["logits"] == r["tokens_per_micro_batch"] * r["vocab"] * 4  # fp32 logits, counted whole
    assert r["ratios"]["logits-tp2-lp"] == {"logits": 0.5, "loss_saved": pytest.approx(0.5, abs=1e-3)}
    assert r["ratios"]["logits-tp2"]["logits"] == 1.0 and r["meets_target"] is True
    assert "logits per rank with loss parallelism / one process: 0.500" in proc.stdout
