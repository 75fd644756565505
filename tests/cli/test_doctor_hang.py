"""``torchrig doctor --hang RUN_DIR`` reads a hang's dumps back as a stranger's files: each within its size, of its
kind (a FIFO never blocks it), field by field; what is not a record is listed, not trusted. The dumps of a real hang
are read in tests/runtime/test_hang.py."""

from __future__ import annotations

import json
import os

import pytest

from torchrig.cli import doctor
from torchrig.runtime import hang


def _rec(rank: int, entered: int, completed: int, **extra) -> dict:
    rec = {"rank": rank, "host": "node7", "pid": 1, "device": "cuda:3", "step": 812, "episode": 1, "stalled": 9.5,
           "limit": 5.0, "phase": "in the step", "where": "", "entered": entered, "op": "all_reduce",
           "name": "gradient averaging", "completed": completed, "time": 0.0}
    rec.update(extra)
    return rec


def _write(folder, name: str, obj) -> None:
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


STACK = """{"rank": 1}
Thread 0x00007f (most recent call first):
  File "/x/threading.py", line 982 in run

Current thread 0x00008f (most recent call first):
  File "/home/me/mydata.py", line 88 in __getitem__
  File "/x/torch/utils/data/_utils/fetch.py", line 54 in fetch
  File "/home/me/train.py", line 12 in <module>
"""


def test_the_report_recomputes_a_missing_summary_and_shows_each_ranks_frames_and_nccl_trace(tmp_path):
    folder = tmp_path / "hang"
    folder.mkdir()
    _write(folder, "rank-00000.json", _rec(0, 40211, 40210))
    _write(folder, "rank-00001.json", _rec(1, 40210, 40210, phase="loading data", where="__getitem__ (mydata.py:88)"))
    _write(folder, "rank-00001.txt", STACK)
    _write(folder, "rank-00000.nccl.json", {"entries": [
        {"collective_seq_id": 11, "profiling_name": "nccl:all_reduce", "state": "completed"},
        {"collective_seq_id": 12, "profiling_name": "nccl:all_reduce", "state": "started"}]})
    report = doctor.hang_report(str(tmp_path)).splitlines()
    assert report == [
        f"hang dumps in {folder}: 2 rank(s)",
        "summary (rank 0 wrote none; from the 2 records): hang at step 812: rank 0 waits in all_reduce #40211 "
        "(gradient averaging); rank 1 never reached it: it is in __getitem__ (mydata.py:88), loading data",
        "rank 0 (node7, cuda:3): step 812, waits in all_reduce #40211 (gradient averaging); last collective completed "
        "#40210; no progress for 9.5s",
        "    NCCL trace: nccl:all_reduce seq 12 started, not completed; last completed seq 11",
        "rank 1 (node7, cuda:3): step 812, it is in __getitem__ (mydata.py:88), loading data; last collective "
        "completed #40210; no progress for 9.5s",
        '    File "/home/me/mydata.py", line 88 in __getitem__',
        '    File "/x/torch/utils/data/_utils/fetch.py", line 54 in fetch',
        '    File "/home/me/train.py", line 12 in <module>']


def test_files_that_are_not_records_are_listed_and_never_block(tmp_path):
    folder = tmp_path / "hang"
    folder.mkdir()
    _write(folder, "summary.json", {"summary": "hang at step 3: rank 0 waits in x\x1b[2J"})
    _write(folder, "rank-00000.json", _rec(0, 5, 4))
    _write(folder, "rank-00001.json", dict(_rec(1, 5, 4), entered="5"))    # a field of the wrong type
    _write(folder, "rank-00002.json", _rec(7, 5, 4))                       # another rank's record under this name
    _write(folder, "rank-00003.json", "x" * (hang.RECORD_LIMIT + 1))        # too big for a record
    os.mkfifo(folder / "rank-00004.json")                                   # a read would block for ever
    report = doctor.hang_report(str(tmp_path)).splitlines()
    assert report[:2] == [f"hang dumps in {folder}: 1 rank(s)", "summary: hang at step 3: rank 0 waits in x?[2J"]
    skipped = [line for line in report if line.startswith("skipped: ")]
    assert len(skipped) == 4, report
    assert "rank-00001.json: not a hang record of its rank" in skipped[0]
    assert "rank-00002.json: not a hang record of its rank" in skipped[1]
    assert "more than the 64 KiB such a file may hold" in skipped[2]
    assert "is a FIFO, not a regular file" in skipped[3]


def test_a_run_without_dumps_is_one_line(tmp_path):
    with pytest.raises(doctor.DoctorError, match="wrote no hang dump"):
        doctor.hang_report(str(tmp_path))
