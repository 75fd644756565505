"""Stragglers (observe/stragglers.py): two real gloo processes, rank 1's forward made slow on purpose; rank 0 names
it in one line with its host and device after dist.straggler_steps log steps, and every row of metrics.jsonl carries
each rank's figures. The judgement itself is checked on figures given by hand."""

from __future__ import annotations

import json
import socket

from helpers import dist_procs
from helpers.dist_procs import HELPERS

from torchrig.observe.stragglers import Stragglers


def test_a_rank_with_a_slow_forward_is_named_once_with_its_host_and_device(tmp_path):
    results = dist_procs.pair("slow", tmp_path / "slow", tmp_path / "store", timeout=120,
                              worker=HELPERS / "hang_worker.py", env={"SLOW_FORWARD": 0.05})
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    named = [line for line in results[0].output.splitlines() if "is a straggler" in line]
    assert len(named) == 1, results[0].output
    assert named[0].startswith(f"torchrig: rank 1 (host {socket.gethostname()}, cpu) is a straggler: ")
    assert "for 2 log steps in a row" in named[0] and "look at its forward" in named[0]
    assert "is a straggler" not in results[1].output  # rank 0 prints
    rows = [json.loads(line) for line in (tmp_path / "slow" / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "interval"]
    assert len(rows) == 8
    assert all(r["rank1/forward_s"] >= 0.05 and r["rank0/forward_s"] < r["rank1/forward_s"] / 2 for r in rows), rows
    assert all(r["ranks/slowest"] == 1 for r in rows)


def _check(factor=2.0, steps=2):
    said = []
    return Stragglers(factor, steps, [("a", "cuda:0"), ("b", "cuda:1"), ("c", "cuda:0")], said.append), said


def test_a_rank_slower_than_the_others_median_is_named_after_the_steps_and_again_only_after_it_caught_up():
    check, said = _check()
    slow = [[0.001, 0.010], [0.030, 0.011], [0.001, 0.012]]
    check._judge(slow)
    assert said == []
    check._judge(slow)
    assert said == ["torchrig: rank 1 (host b, cuda:1) is a straggler: 0.041s per step of its own (data wait 0.03s, "
                    "forward 0.011s) against the other ranks' median 0.012s (3.4×) for 2 log steps in a row; every rank "
                    "waits for it at each gradient averaging: look at its data loading (per-rank figures: "
                    "metrics.jsonl)"]
    check._judge(slow)
    assert len(said) == 1  # once per episode
    check._judge([[0.001, 0.010]] * 3)
    check._judge(slow)
    check._judge(slow)
    assert len(said) == 2


def test_differences_under_the_floor_or_the_factor_are_not_stragglers():
    check, said = _check()
    for _ in range(4):
        check._judge([[0.0, 0.0001], [0.0, 0.003], [0.0, 0.0001]])  # 30x, but 3 ms: timer noise
        check._judge([[0.0, 0.100], [0.0, 0.190], [0.0, 0.100]])    # 1.9x < 2
    assert said == []
    row = check.row([[0.0, 0.1], [0.0, 0.19], [0.0, 0.1]])
    assert row["ranks/slowest"] == 1 and row["ranks/median_s"] == 0.1 and row["rank1/forward_s"] == 0.19
