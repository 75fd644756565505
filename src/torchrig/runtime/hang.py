"""A hang names the rank and the line: a watchdog per rank for ``dist.hang_timeout``.

A collective waits for every rank of its group. When one rank stops taking part (its dataset's ``__getitem__``
blocks on a network file system, it skipped a collective the others entered, its process was killed), the others
wait in the collective until torch's own timeout (``dist.timeout``, 30 minutes by default) and then print torch's
message, which names neither the rank nor the line.

Each rank runs one :class:`HangWatch` thread during the training loop. It sees the loop's progress without costing
the loop anything: the heartbeat the loop already sets per micro-batch for the stop signals, a checkpoint being
written, and the numbers of torchrig's own collectives (``dist.COLLECTIVES``). When none of them moves for the
limit, the rank writes where it is to ``RUN_DIR/hang/rank-NNNNN.{json,txt}``: its step, the collective it entered
and the last one it completed, the innermost frame of the user's own code on its main thread and the phase it is in
(loading data, the step, evaluation), and every thread's Python stack (``faulthandler``); on NCCL, torch's Flight
Recorder trace too (``rank-NNNNN.nccl.json``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set before the group is made).

The ranks talk through the process group's key-value store, not through a collective (a collective is what hangs).
Rank 0, once it makes no progress for the limit, asks every rank where it is; each answers, whether it waits too or
is busy. A rank still making progress (a long save of its own) means there is no hang yet, and rank 0 waits on. When
every rank that answered is stuck, and the ranks that did not answer had a few polls to do so (their process is
gone, or their machine), rank 0 prints one summary::

    torchrig: hang at step 812: ranks 0-2 wait in all_reduce #40211 (gradient averaging); rank 3 never reached it:
    it is in __getitem__ (mydata.py:88), loading data

and every rank exits with :data:`EXIT_HANG` (75). A checkpoint being written is progress (it is never cut), and
the checkpoints already written are kept; the job resumes from the latest with ``resume=latest`` (or by itself
under ``torchrig launch --max-restarts``). Until the fit's first optimizer step the limit is ``dist.timeout``
(compilation, warm-up, the first batches of a slow loader). ``torchrig doctor --hang RUN_DIR`` reads the dumps
back afterwards, as a stranger's files.

Without a store (a process group made without one) each rank still writes its dump and rank 0 says where it is.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .dist import COLLECTIVES

EXIT_HANG = 75  # sysexits' EX_TEMPFAIL: a temporary failure; the job may be run again (it resumes)
FOLDER = "hang"
SUMMARY = "summary.json"
PREFIX = "torchrig/hang/"
RECORD_LIMIT = 64 << 10        # bytes of one rank's record read back
STACK_LIMIT = 4 << 20          # bytes of one rank's stacks read back
TRACE_LIMIT = 64 << 20         # bytes of one rank's NCCL Flight Recorder trace read back
BUSY = 0.5                     # a rank that progressed within this share of its limit is busy, not stuck

_TORCH = os.path.dirname(torch.__file__) + os.sep
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple(p + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
_PHASES = ((os.path.join("torch", "utils", "data") + os.sep, "loading data"),
           (_OWN + "data" + os.sep, "loading data"),
           (_OWN + "checkpoint" + os.sep, "saving a checkpoint"),
           (_OWN + os.path.join("trainer", "inference.py"), "evaluating"),
           (_OWN + "trainer" + os.sep, "in the step"))


@dataclass
class Progress:
    """What the training loop shows of its progress, read from the watch's thread (never written by it)."""

    beat: Callable[[], float]      # the loop's last sign of progress (StopSignal.beat: per micro-batch, eval batch)
    busy: Callable[[], bool]       # a checkpoint being written or waited for
    steps: Callable[[], int]       # optimizer steps done


# ----------------------------------------------------------------------------- where a thread is


def _library(filename: str) -> bool:
    return filename.startswith((_TORCH, _OWN, *_STDLIB)) or filename.startswith("<")


def where_is(frame: Any) -> tuple[str, str]:
    """(phase, the innermost frame of the user's own code as ``function (file.py:line)``, or "") of a thread whose
    innermost frame is ``frame``. Only code torchrig called counts (a dataset, a step function, a callback), not the
    script that called torchrig; a frame of an installed package counts as the user's only when no frame of their
    own files is found (a dataset calling PIL shows the dataset's line)."""
    stack = traceback.extract_stack(frame)[::-1]  # innermost first
    phase = next((name for f in stack for mark, name in _PHASES if mark in f.filename), "outside the training loop")
    entry = max((i for i, f in enumerate(stack) if f.filename.startswith(_OWN)), default=len(stack))
    users = [f for f in stack[:entry] if not _library(f.filename)]
    own = [f for f in users if "site-packages" not in f.filename and "dist-packages" not in f.filename]
    pick = (own or users or [None])[0]
    return phase, "" if pick is None else f"{pick.name} ({os.path.basename(pick.filename)}:{pick.lineno})"


def main_thread_frame() -> Any:
    return sys._current_frames().get(threading.main_thread().ident)


# ----------------------------------------------------------------------------- one summary for every rank


def ranks_text(ranks: list) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(parts)}"


def _waiting(rec: dict) -> bool:
    return rec["entered"] > rec["completed"]


def collective_text(rec: dict) -> str:
    return f"{rec['op']} #{rec['entered']} ({rec['name']})"


def elsewhere_text(rec: dict) -> str:
    where = f"{rec['where']}, {rec['phase']}" if rec["where"] else rec["phase"]
    return f"it is in {where}"


def summarize(records: dict, world_size: int, what: str = "hang") -> str:
    """One line for a hang from every rank's record (``rank -> record``; a rank without one did not answer)."""
    if not records:
        return f"{what}: no rank answered"
    step = min(r["step"] for r in records.values())
    groups: dict[tuple, list] = {}
    for rank, rec in records.items():
        key = (rec["entered"], rec["op"], rec["name"]) if _waiting(rec) else None
        groups.setdefault(key, []).append(rank)
    waits = sorted((k for k in groups if k is not None), key=lambda k: (-len(groups[k]), k[0], min(groups[k])))
    parts = []
    main = waits[0] if waits else None
    for k in waits:
        rec = records[groups[k][0]]
        verb = "lost a peer" if rec["phase"] == "failed" else "waits" if len(groups[k]) == 1 else "wait"
        text = f"{ranks_text(groups[k])} {verb} in {collective_text(rec)}{_user_line(rec, records, groups[k])}"
        if k is not main and k[0] == main[0]:
            text += " instead: the ranks called different collectives there (one skipped a collective, or added one)"
        elif k is not main:
            text += f", {'past' if k[0] > main[0] else 'before'} #{main[0]}"
        parts.append(text)
    for rank in sorted(groups.get(None, [])):
        rec = records[rank]
        reached = "never reached it: " if main is not None and rec["completed"] < main[0] else ""
        parts.append(f"rank {rank} {reached}{elsewhere_text(rec)}")
    missing = [r for r in range(world_size) if r not in records]
    if missing:
        parts.append(f"{ranks_text(missing)} did not answer: {'its process is' if len(missing) == 1 else 'their processes are'} "
                     f"gone or unreachable (killed, out of memory, a failed machine: see the log of "
                     f"{'that rank' if len(missing) == 1 else 'those ranks'})")
    return f"{what} at step {step}: " + "; ".join(parts)


def _user_line(rec: dict, records: dict, ranks: list) -> str:
    """`` from step_fn (train.py:12)`` when the waiting ranks' own code called the collective."""
    where = {records[r]["where"] for r in ranks}
    return f", called from {rec['where']}" if len(where) == 1 and rec["where"] else ""


# ----------------------------------------------------------------------------- the dumps


def dump_name(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}.{suffix}"


Save = Callable[[str, Callable[[Any], None]], None]  # save(name, fill): RUN_DIR/hang/name, whole, fill(binary file)


def write_dump(save: Save, record: dict, nccl: bool) -> None:
    """``rank-N.json`` (the record), ``rank-N.txt`` (the record's line and every thread's Python stack) and, on NCCL,
    ``rank-N.nccl.json`` (torch's Flight Recorder trace), each through ``save``."""
    rank, line = record["rank"], json.dumps(record, sort_keys=True).encode()
    save(dump_name(rank, "json"), lambda fh: fh.write(line))

    def stacks(fh: Any) -> None:
        fh.write(line + b"\n")
        fh.flush()
        faulthandler.dump_traceback(file=fh, all_threads=True)

    save(dump_name(rank, "txt"), stacks)
    trace = flight_recorder() if nccl else None
    if trace is not None:
        save(dump_name(rank, "nccl.json"), lambda fh: fh.write(trace))


def flight_recorder() -> Optional[bytes]:
    """torch's NCCL Flight Recorder trace of this process as JSON bytes, or None (no NCCL, recorder off)."""
    if not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0").strip("0"):
        return None
    try:
        dump = torch._C._distributed_c10d._dump_nccl_trace_json(includeCollectives=True, onlyActive=False)
    except Exception:  # not built with NCCL, or no NCCL group made
        return None
    return dump.encode() if isinstance(dump, str) else bytes(dump)


# ----------------------------------------------------------------------------- the store


def default_store() -> Any:
    """A client of the default process group's key-value store of its own (a clone: the watch's thread never waits
    behind the main thread's store calls), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store().clone()
    except Exception:
        return None


class Board:
    """The keys the ranks exchange during a hang, under ``torchrig/hang/``: ``ask`` (rank 0's question, an episode
    number), ``rank/R`` (rank R's record), ``answered/E`` (how many answered episode E), ``verdict`` (the summary).
    Every call returns None / False instead of raising: the store may be gone with its host."""

    def __init__(self, store: Any, timeout_s: float):
        self.store = store
        if store is not None:
            try:
                import datetime

                store.set_timeout(datetime.timedelta(seconds=timeout_s))
            except Exception:
                pass

    def get(self, key: str) -> Optional[str]:
        try:
            if self.store is not None and self.store.check([PREFIX + key]):
                return self.store.get(PREFIX + key).decode(errors="replace")
        except Exception:
            pass
        return None

    def set(self, key: str, value: str) -> bool:
        try:
            self.store.set(PREFIX + key, value)
            return True
        except Exception:
            return False

    def add(self, key: str, n: int) -> int:
        try:
            return int(self.store.add(PREFIX + key, n))
        except Exception:
            return -1

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(PREFIX + key)
        except Exception:
            pass

    @property
    def usable(self) -> bool:
        return self.store is not None


# ----------------------------------------------------------------------------- the watch


class HangWatch:
    """The watchdog of one rank during a fit (see the module's text). ``timeout``: seconds without progress that
    make a hang (``dist.hang_timeout``); ``first_timeout``: the limit until the fit's first optimizer step
    (``dist.timeout``). ``settle``: waits for a checkpoint still being written in the background, before the
    process exits. ``say``: prints a line (rank 0's summary)."""

    def __init__(self, timeout: float, first_timeout: float, save: Save, progress: Progress, *, rank: int,
                 world_size: int, device: Any = "cpu", nccl: bool = False, store: Any = None, where: str = "",
                 settle: Optional[Callable[[], None]] = None, say: Optional[Callable[[str], None]] = None):
        self.timeout, self.first_timeout = float(timeout), max(float(first_timeout), float(timeout))
        self.save, self.progress, self.rank, self.world_size = save, progress, rank, world_size
        self.where = where  # the run directory, for the summary's line
        self.device, self.nccl, self.settle, self.say = str(device), nccl, settle, say or _say
        self.tick = min(5.0, max(0.2, self.timeout / 10))
        self.grace = 3 * self.tick + 2.0      # for every rank to see a question and answer it
        self.board = Board(store, max(5.0, 4 * self.tick))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._first = progress.steps()
        self._signature: Any = None
        self._since = time.monotonic()
        self._episode, self._asked_at, self._answered = 0, 0.0, 0
        self._dumped = False
        self.host = socket.gethostname()

    def start(self) -> "HangWatch":
        self._thread = threading.Thread(target=self._run, daemon=True, name="torchrig-hang-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.tick + 1)
        if self.rank == 0 and self._asked_at:
            self.board.delete("ask")

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self._check()
            except Exception as exc:  # the watch must never end the run by itself
                self.say(f"torchrig: the hang watch of rank {self.rank} stopped: {type(exc).__name__}: {exc}")
                return

    # -- one poll ---------------------------------------------------------------------------------------
    def stalled(self) -> tuple[float, float]:
        """(seconds without progress, the limit that applies now)."""
        p, now = self.progress, time.monotonic()
        signature = (p.beat(), COLLECTIVES.completed, COLLECTIVES.entered)
        if signature != self._signature or p.busy():
            self._signature, self._since = signature, now
        limit = self.timeout if p.steps() > self._first else self.first_timeout
        return now - self._since, limit

    def _check(self) -> None:
        stalled, limit = self.stalled()
        verdict = self.board.get("verdict")
        if verdict is not None:
            self._end(verdict, judge=False)
        asked = self.board.get("ask")
        if stalled >= limit and not self._dumped:
            self._dump(self.record(stalled, limit, int(asked or 0)))
        if asked is not None and asked.isdigit():
            self._answer(self.record(stalled, limit, int(asked)))
        if self.rank != 0:
            return
        if stalled >= limit:
            self._judge(limit)
        elif self._asked_at:  # rank 0 moves again: the question is withdrawn
            self.board.delete("ask")
            self._asked_at = 0.0

    def record(self, stalled: float, limit: float, episode: int = 0) -> dict:
        frame = main_thread_frame()
        phase, where = where_is(frame) if frame is not None else ("unknown", "")
        log = COLLECTIVES
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "device": self.device,
                "step": self.progress.steps() + 1, "episode": episode, "stalled": round(stalled, 3),
                "limit": limit, "phase": phase, "where": where, "entered": log.entered, "op": log.op,
                "name": log.name, "completed": log.completed, "time": time.time()}

    def _dump(self, record: dict) -> None:
        self._dumped = True
        try:
            write_dump(self.save, record, self.nccl)
        except OSError as exc:
            self.say(f"torchrig: rank {self.rank} could not write its hang dump in {self.where}/{FOLDER}: {exc}")

    def _answer(self, record: dict) -> None:
        self.board.set(f"rank/{self.rank}", json.dumps(record))
        if self._answered != record["episode"]:
            self._answered = record["episode"]
            self.board.add(f"answered/{record['episode']}", 1)

    # -- rank 0 --------------------------------------------------------------------------------------------
    def _judge(self, limit: float) -> None:
        now = time.monotonic()
        if not self._asked_at:
            self._episode = self.board.add("episodes", 1) if self.board.usable else 1
            self._asked_at = now
            if self.board.set("ask", str(self._episode)):
                return  # the answers come at the next polls
        answered = self.board.add(f"answered/{self._episode}", 0)
        if 0 <= answered < self.world_size and now - self._asked_at < self.grace:
            return
        records = self.collect(self._episode)
        records[0] = self.record(*self.stalled(), self._episode)
        if any(r["stalled"] < BUSY * r["limit"] for r in records.values()):
            return  # a rank still moves: not a hang (yet); the others wait for it
        # without a store only this rank is known: the others' dumps are in RUN_DIR/hang
        self._end(summarize(records, self.world_size if self.board.usable else 1), judge=True)

    def collect(self, episode: int) -> dict:
        """The records of the ranks that answered ``episode``."""
        out = {}
        for rank in range(1, self.world_size):
            text = self.board.get(f"rank/{rank}")
            try:
                rec = json.loads(text) if text else None
            except ValueError:
                rec = None
            if isinstance(rec, dict) and rec.get("episode") == episode and valid(rec):
                out[rank] = rec
        return out

    def _end(self, summary: str, judge: bool) -> None:
        """The verdict: the final dump, rank 0's summary (printed, and kept in RUN_DIR/hang/summary.json), exit."""
        self._dump(self.record(*self.stalled(), self._episode))
        if judge:
            self.say(f"torchrig: {summary}. Every rank's stack: {self.where}/{FOLDER} (torchrig doctor --hang "
                     f"{self.where}); stopping with exit code {EXIT_HANG} (dist.hang_timeout={self.timeout:g}s); the "
                     f"checkpoints written are kept: continue with resume=latest")
            kept = json.dumps({"summary": summary, "time": time.time(), "world_size": self.world_size,
                               "episode": self._episode}).encode()
            try:
                self.save(SUMMARY, lambda fh: fh.write(kept))
            except OSError:
                pass
            self.board.set("verdict", summary)
            end = time.monotonic() + 2 * self.tick + 1  # the others leave first: none sees this one's exit as an error
            while time.monotonic() < end and 0 <= self.board.add("left", 0) < self.world_size - 1:
                time.sleep(self.tick / 4)
        else:
            self.board.add("left", 1)
        self._leave()

    def _leave(self) -> None:
        if self.settle is not None:  # a checkpoint being written in the background is finished, if it can be
            done = threading.Thread(target=self.settle, daemon=True)
            done.start()
            done.join(timeout=self.grace)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(EXIT_HANG)

    # -- a collective that failed (a peer's process died) -------------------------------------------------
    def lost(self) -> Optional[str]:
        """From the main thread, after one of torchrig's collectives failed because a peer is gone: every live rank
        answers, and rank 0 returns the line naming the ranks that did not (None on the other ranks)."""
        verdict = self.board.get("verdict")
        if verdict is not None:  # rank 0 found a hang and has left: this rank's collective failed with it
            self._end(verdict, judge=False)
        record = self.record(*self.stalled(), -1)
        record["phase"] = "failed"
        self._answer(record)
        if self.rank != 0 or not self.board.usable:
            return None
        end = time.monotonic() + self.grace
        while time.monotonic() < end and self.board.add("answered/-1", 0) < self.world_size:
            time.sleep(self.tick)
        records = self.collect(-1)
        records[0] = record
        return summarize(records, self.world_size, what="a rank was lost")


def valid(rec: Any) -> bool:
    """Whether ``rec`` (read back from a store or a file) has a record's fields, of their types."""
    kinds = {"rank": int, "step": int, "entered": int, "completed": int, "op": str, "name": str, "where": str,
             "phase": str, "host": str, "device": str, "stalled": (int, float), "limit": (int, float)}
    return isinstance(rec, dict) and all(isinstance(rec.get(k), t) and not isinstance(rec.get(k), bool)
                                         for k, t in kinds.items())


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
