"""A hung test fails within its time limit, by name, and takes the processes it started with it.

pytest-timeout ends a test that runs longer than ``timeout`` (pyproject.toml). The tests start processes (the
``torchrig`` command, torchrun and its workers, the worker pairs of ``dist_procs``, forked children of
``forkserver``), and a test ended while they wait on each other would leave them running, holding ports, cores
and files. This plugin (loaded by ``conftest.py``) gives pytest-timeout's ``pytest_timeout_set_timer`` hook
another timer, and cleans up after a failed test:

- ``timeout_method = "signal"``: at the limit SIGALRM kills (SIGKILL) every process the test started, with the
  process groups they lead, then fails the test as pytest-timeout does (its stacks, ``Timeout (>Ns)``), and the
  session goes on with the next test. A main thread blocked in C (a collective, a join) cannot take the signal:
  a watchdog thread then kills the same processes ``grace`` seconds after the limit (which ends most such
  waits), and ``grace`` seconds later, if the test still has not ended, ends the session as the "thread" method
  does (every thread's stack, then exit), after a line naming the test.
- ``timeout_method = "thread"``: at the limit the watchdog kills the test's processes, then ends the session.
- After any test that failed (an assertion while its children still run, a time limit of its own), the processes
  it started and left are killed too. A passing test's processes are left alone: some are meant to outlive it
  (the fork server that a later test reuses).

"The processes a test started" are this process's descendants that were not there when the test began; a
process group is killed only when its leader is one of them (never the session's own group, nor the fork
server's, which a forked child shares). A child of a child whose parent already exited is found through the
process group it shares with its parent (``start_new_session=True`` in ``dist_procs`` and ``forkserver``).
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from typing import Any

import psutil
import pytest

BEFORE = pytest.StashKey[set]()   # the session's descendants when the test began
FAILED = pytest.StashKey[bool]()  # a phase of the test failed


def descendants() -> set[int]:
    """The pids of this process's descendants, taken before every test: from Linux's /proc/PID/task/TID/children
    files, a fraction of a millisecond (psutil reads every process of the machine, some milliseconds: too long
    for every test of the suite); elsewhere from psutil."""
    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children"):
        return {p.pid for p in psutil.Process().children(recursive=True)}
    found, todo = set(), [os.getpid()]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(path) as f:
                    children = {int(c) for c in f.read().split()}
            except OSError:  # gone meanwhile
                continue
            todo.extend(children - found)
            found |= children
    return found


def kill_new(before: set[int], wait: float = 5.0) -> list[int]:
    """SIGKILL this process's descendants not in ``before`` and every process of the process groups they lead
    (one whose leader exited, leaving its children to init, included); wait up to ``wait`` seconds for them to
    be gone (a zombie counts as gone: its parent reaps it). Returns their pids."""
    children = psutil.Process().children(recursive=True)
    new = [p for p in children if p.pid not in before]
    protected = {os.getpgrp()} | {_group(p) for p in children if p.pid in before}
    groups = {_group(p) for p in new} - protected - {None}
    doomed = {p.pid: p for p in [*new, *(p for p in psutil.process_iter() if groups and _group(p) in groups)]
              if _alive(p)}
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in doomed.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    end = time.monotonic() + wait
    while time.monotonic() < end and any(_alive(p) for p in doomed.values()):
        time.sleep(0.05)
    return sorted(doomed)


def _group(p: psutil.Process):
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _say(item: Any, line: str) -> None:
    writer = item.config.get_terminal_writer()
    writer.line(line, red=True)
    writer.flush()


def _kill_for(item: Any, why: str) -> None:
    pids = kill_new(item.stash.get(BEFORE, set()))
    if pids:
        _say(item, f"{item.nodeid}: {why}: killed the {len(pids)} process(es) it started ({', '.join(map(str, pids))})")


class Timer:
    """One test's limit: SIGALRM in the main thread (method "signal") and a watchdog thread (both methods)."""

    def __init__(self, item: Any, settings: Any):
        import pytest_timeout

        self.item, self.settings, self.plugin = item, settings, pytest_timeout
        self.limit = float(settings.timeout)
        self.grace = max(1.0, min(30.0, self.limit / 10))
        self.done = threading.Event()
        self.signal = settings.method == "signal" and threading.current_thread() is threading.main_thread()
        if self.signal:
            signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, self.limit)
        self.watchdog = threading.Thread(target=self._watch, name=f"timeout {item.nodeid}", daemon=True)
        self.watchdog.start()

    def _alarm(self, signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        _kill_for(self.item, f"ran over its {self.limit:g} s limit")
        self.plugin.timeout_sigalrm(self.item, self.settings)  # its stacks, then pytest.fail: the test fails here

    def _watch(self) -> None:
        wait = self.limit + (self.grace if self.signal else 0.0)
        if self.done.wait(wait):
            return
        _kill_for(self.item, f"ran over its {self.limit:g} s limit (still running {wait - self.limit:g} s after it)")
        if self.signal and self.done.wait(self.grace):
            return
        _say(self.item, f"{self.item.nodeid}: did not end after its {self.limit:g} s limit; ending the session")
        self.plugin.timeout_timer(self.item, self.settings)  # every thread's stack, then os._exit(1)

    def cancel(self) -> None:
        self.done.set()
        if self.signal:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: Any, settings: Any) -> bool:
    """pytest-timeout's hook for another timer; its ``pytest_timeout_cancel_timer`` calls ``item.cancel_timeout``."""
    item.cancel_timeout = Timer(item, settings).cancel
    return True


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: Any, nextitem: Any):
    item.stash[BEFORE] = descendants()
    try:
        return (yield)
    finally:
        if item.stash.get(FAILED, False):
            _kill_for(item, "failed")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any):
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report
