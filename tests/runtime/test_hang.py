"""A hang names the rank and the line (``dist.hang_timeout``, runtime/hang.py).

Two real processes on gloo (tests/helpers/hang_worker.py), each a DDP fit with a 4 s limit that saves a checkpoint
every 2 steps; before step 3 rank 1 sleeps in its dataset's ``__getitem__``, skips a collective rank 0 calls, or is
SIGKILLed. Each is named in one summary line within the limit plus a few polls, every rank exits with code 75 (a
lost rank: the error, after the line naming it), and step 2's checkpoint is still there. Without the watch the first
two would wait out dist.timeout (120 s here, 30 minutes by default) and say nothing of the rank.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from helpers import dist_procs
from helpers.dist_procs import HELPERS

from torchrig.cli import doctor
from torchrig.runtime import hang

WORKER = HELPERS / "hang_worker.py"
LIMIT = 4.0


def _pair(tmp_path: Path, what: str, env: dict | None = None) -> tuple[list, float, Path]:
    out, mark = tmp_path / what, tmp_path / f"{what}.mark"
    results = dist_procs.pair(what, out, tmp_path / "store", timeout=90, worker=WORKER,
                              env=dict({"HANG_TIMEOUT": LIMIT, "FAULT_MARK": mark}, **(env or {})))
    ended = time.time()
    return results, ended - float(mark.read_text()), out / "run"


def _line(text: str) -> str:
    found = [line for line in text.splitlines() if "torchrig: hang at step" in line or "was lost at step" in line]
    assert len(found) == 1, text[-3000:]
    return found[0]


def _checkpoint_kept(run: Path) -> None:
    kept = run / "checkpoints" / "step-00000002"
    assert (kept / "meta.json").is_file(), sorted(p.name for p in (run / "checkpoints").iterdir())
    assert json.loads((kept / "meta.json").read_text())["step"] == 2


def test_a_rank_stuck_in_its_data_loader_is_named_with_its_line(tmp_path):
    results, took, run = _pair(tmp_path, "data")
    assert [r.returncode for r in results] == [hang.EXIT_HANG] * 2, results[0].output[-3000:]
    line = _line(results[0].stderr)
    number = re.search(r"rank 0 waits in all_reduce #(\d+) \(gradient averaging\); ", line)
    assert number, line
    getitem = next(i for i, text in enumerate((HELPERS / "hang_worker.py").read_text().splitlines(), 1)
                   if "time.sleep(600)" in text)
    assert (f"rank 1 never reached it: it is in __getitem__ (hang_worker.py:{getitem}), loading data"
            in line), line
    assert line.startswith("torchrig: hang at step 3: ") and "exit code 75" in line
    assert "hang at step" not in results[1].stderr  # one summary, rank 0's
    assert took < LIMIT + 12, f"named {took:.1f}s after rank 1 stopped (limit {LIMIT}s)"
    _checkpoint_kept(run)
    records = {r: json.loads((run / "hang" / f"rank-{r:05d}.json").read_text()) for r in (0, 1)}
    assert records[0]["entered"] == int(number.group(1)) == records[0]["completed"] + 1
    assert records[1]["completed"] == records[0]["completed"] and records[1]["phase"] == "loading data"
    assert "time.sleep(600)" not in (run / "hang" / "rank-00001.txt").read_text()  # a stack, not source
    assert f'line {getitem} in __getitem__' in (run / "hang" / "rank-00001.txt").read_text()
    report = doctor.hang_report(str(run)).splitlines()  # torchrig doctor --hang RUN_DIR
    assert report[1] == "summary: " + line[len("torchrig: "):line.index(". Every rank's stack")], report
    ranks = [i for i, text in enumerate(report) if text.startswith("rank ")]
    assert report[ranks[1]].startswith(f"rank 1 (") and "step 3, it is in __getitem__ (hang_worker.py:" in report[ranks[1]]
    assert report[ranks[1] + 1] == f'File "{HELPERS / "hang_worker.py"}", line {getitem} in __getitem__'.join(["    ", ""])


def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    results, took, run = _pair(tmp_path, "skip")
    assert [r.returncode for r in results] == [hang.EXIT_HANG] * 2, results[0].output[-3000:]
    line = _line(results[0].stderr)
    found = re.search(r"rank 0 waits in all_reduce #(\d+) \(all_reduce_sum\), called from skipping_step "
                      r"\(hang_worker.py:\d+\); rank 1 waits in all_reduce #(\d+) \(gradient averaging\), called from "
                      r"skipping_step \(hang_worker.py:\d+\) instead: the ranks called different collectives there", line)
    assert found and found.group(1) == found.group(2), line
    assert took < LIMIT + 12, f"named {took:.1f}s after rank 0 entered the collective (limit {LIMIT}s)"
    _checkpoint_kept(run)


def test_a_killed_rank_is_named_by_the_survivor(tmp_path):
    results, took, run = _pair(tmp_path, "kill")
    assert results[1].returncode == -9 and results[0].returncode != 0, results[0].output[-3000:]
    line = _line(results[0].stderr)
    assert "rank 1 did not answer: its process is gone or unreachable" in line, line
    assert re.search(r"rank 0 (lost a peer|waits) in all_reduce #\d+ \(gradient averaging\)", line), line
    assert took < LIMIT + 12, f"named {took:.1f}s after rank 1 was killed"
    _checkpoint_kept(run)


# ----------------------------------------------------------------------------- the summary, from records


def _rec(rank: int, entered: int, completed: int, name: str = "gradient averaging", **extra) -> dict:
    rec = {"rank": rank, "host": "h", "pid": 1, "device": "cpu", "step": 812, "episode": 1, "stalled": 9.0,
           "limit": 5.0, "phase": "in the step", "where": "", "entered": entered, "op": "all_reduce", "name": name,
           "completed": completed, "time": 0.0}
    rec.update(extra)
    return rec


def test_summary_names_waiting_ranks_the_rank_that_never_arrived_and_the_silent_ones():
    records = {r: _rec(r, 40211, 40210) for r in range(3)}
    records[3] = _rec(3, 40210, 40210, phase="loading data", where="__getitem__ (mydata.py:88)")
    assert hang.summarize(records, 4) == ("hang at step 812: ranks 0-2 wait in all_reduce #40211 (gradient averaging); "
                                          "rank 3 never reached it: it is in __getitem__ (mydata.py:88), loading data")
    del records[3]
    assert hang.summarize(records, 6).endswith(
        "; ranks 3-5 did not answer: their processes are gone or unreachable (killed, out of memory, a failed machine: "
        "see the log of those ranks)")
    assert hang.ranks_text([7, 0, 1, 2, 5]) == "ranks 0-2, 5, 7"


def test_records_read_back_are_checked_field_by_field():
    assert hang.valid(_rec(0, 1, 0))
    assert not hang.valid(dict(_rec(0, 1, 0), entered="1"))
    assert not hang.valid(dict(_rec(0, 1, 0), stalled=True))
    assert not hang.valid(["not", "a", "record"])


def test_where_is_names_the_users_innermost_frame_and_the_phase():
    frame = sys._getframe()
    phase, where = hang.where_is(frame)
    line = frame.f_lineno - 1
    assert where == f"test_where_is_names_the_users_innermost_frame_and_the_phase (test_hang.py:{line})"
    assert phase == "outside the training loop"
