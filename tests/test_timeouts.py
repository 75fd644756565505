"""The suite's time limit per test (pytest-timeout, ``timeout`` in pyproject.toml, with tests/helpers/timeouts.py):
a hung test fails by name soon after its limit, the processes it started (and theirs) are killed with it, and a
test that cannot even take the signal ends the session instead of hanging it."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from helpers import HELPERS, dist_procs

HUNG = '''
import os, signal, subprocess, time

SHELLS = []

def _start(name, wait):
    """A shell in a session of its own with a sleeping child, which it waits for or leaves (an orphan in its
    process group): the child's pid and the shell's, written down."""
    path = os.path.join(os.path.dirname(__file__), name)
    SHELLS.append(subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {path}" + ("; wait" if wait else "")],
                                   start_new_session=True))
    while not os.path.exists(path) or not open(path).read().strip():
        time.sleep(0.01)
    with open(path, "a") as f:
        f.write(f"{SHELLS[-1].pid}\\n")

def test_sleeps_past_its_limit():
    _start("first", wait=False)
    time.sleep(60)

def test_after_it():
    pass

def test_cannot_take_the_signal():  # as a main thread blocked in C: the signal waits
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    _start("second", wait=True)
    time.sleep(60)

def test_never_runs():
    pass
'''


def _gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    end = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def test_a_hung_test_fails_by_name_and_its_processes_are_killed(tmp_path):
    """Limit 2 s, two sessions side by side. In the first, a test that sleeps fails at 2 s with pytest-timeout's
    message, the child its shell left behind (an orphan) is killed, and the next test runs. In the second, the test blocks
    SIGALRM: 1 s after its limit its processes are killed, 1 s later the session ends (exit 1) naming it, before
    the next test."""
    (tmp_path / "test_hung.py").write_text(HUNG)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 2\ntimeout_method = signal\n")
    pytest = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "timeouts", str(tmp_path)]
    start = time.monotonic()
    signalled, blocked = dist_procs.run_many([[*pytest, "-k", "past or after"], [*pytest, "-k", "cannot or never"]],
                                             timeout=60, env={"PYTHONPATH": HELPERS}, logs=tmp_path)
    assert time.monotonic() - start < 30 and (signalled.returncode, blocked.returncode) == (1, 1), \
        (signalled.output[-3000:], blocked.output[-3000:])
    assert "test_hung.py::test_sleeps_past_its_limit FAILED" in signalled.stdout, signalled.output[-3000:]
    assert "Failed: Timeout (>2.0s) from pytest-timeout." in signalled.stdout
    assert "test_hung.py::test_after_it PASSED" in signalled.stdout and "1 failed, 1 passed" in signalled.stdout
    assert "test_hung.py::test_sleeps_past_its_limit: ran over its 2 s limit: killed the 1 process(es)" in \
        signalled.stdout  # in the failure's captured output: the shell's orphan, through the shell's process group
    said = blocked.stdout
    assert ("test_hung.py::test_cannot_take_the_signal: ran over its 2 s limit (still running 1 s after it): "
            "killed the 2 process(es)") in said, blocked.output[-3000:]
    assert "test_hung.py::test_cannot_take_the_signal: did not end after its 2 s limit; ending the session" in said
    assert "test_never_runs" not in said
    for name in ("first", "second"):
        pids = [int(p) for p in (tmp_path / name).read_text().split()]
        assert len(pids) == 2 and _gone(pids), (name, pids)


TAKES_SIGTERM = r"""
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: print("stop asked: finishing the step", flush=True))  # as torchrig's does
print("pid", os.getpid(), flush=True)
time.sleep(300)
"""


def test_a_child_over_its_limit_is_killed_though_its_stop_handler_takes_sigterm(monkeypatch):
    """dist_procs' time limit: SIGTERM first (torchrig's stop handler says where it was), SIGKILL a grace period
    later, whatever the handler does."""
    monkeypatch.setattr(dist_procs, "GRACE", 0.5)
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        dist_procs.run([sys.executable, "-c", TAKES_SIGTERM], timeout=2)
    said = str(err.value)
    assert time.monotonic() - start < 10 and "did not finish within 2s" in said, said
    assert "stop asked: finishing the step" in said
    assert _gone([int(said.split("pid ")[1].split()[0])])
