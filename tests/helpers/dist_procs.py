"""Starting and always cleaning up the processes of the distributed tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HELPERS = Path(__file__).resolve().parent
WORKER = HELPERS / "dist_worker.py"


def _env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in a worker shows its Python stack
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a time limit ends a process group


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)


def _stop(procs: list[subprocess.Popen]) -> None:
    """At a time limit: SIGTERM to each process group (torchrig's stop handler then says where it was), SIGKILL to
    each GRACE seconds later: a stop handler that cannot finish (a step or a peer stuck) never keeps a test
    waiting, and no process of the group is left."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _kill_group(p)


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run(cmd: list[str], timeout: float, env: Optional[dict] = None, cwd: Optional[Path] = None) -> Result:
    """Run ``cmd`` in its own session; on timeout (or any error) kill the whole process group."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop([proc])
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} … did not finish within {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        _kill_group(proc)  # leftovers (workers of a failed launcher)
    return Result(proc.returncode, out, err, time.monotonic() - t0)


def torchrig(args: list[str], timeout: float = 120, env: Optional[dict] = None,
             prefix: Optional[list[str]] = None, cwd: Optional[Path] = None) -> Result:
    return run([*(prefix or []), sys.executable, "-m", "torchrig", *args], timeout, env, cwd)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair(scenario: str, out: Path, store: Path, timeout: float = 150, env: Optional[dict] = None,
         init: Optional[str] = None, worker: Path = WORKER) -> list[Result]:
    """Two worker processes (``worker SCENARIO OUT``, by default dist_worker.py) joined through an explicit
    init method (``file://STORE`` unless ``init`` gives one, e.g. ``tcp://127.0.0.1:PORT``); no torchrun."""
    out.mkdir(parents=True, exist_ok=True)
    if store.exists():
        store.unlink()
    cmds = [[sys.executable, str(worker), scenario, str(out)] for _ in (0, 1)]
    envs = [_env(dict(env or {}, TEST_INIT=init or f"file://{store}", TEST_RANK=rank, TEST_WORLD=2)) for rank in (0, 1)]
    files = [(out / f"{scenario}-{rank}.out", out / f"{scenario}-{rank}.err") for rank in (0, 1)]
    try:
        return _together(cmds, envs, files, timeout, f"worker pair '{scenario}'")
    finally:
        if store.exists():
            store.unlink()


def group(scenario: str, out: Path, store: Path, n: int, timeout: float = 150, env: Optional[dict] = None,
          worker: Path = WORKER) -> list[Result]:
    """``n`` worker processes (``worker SCENARIO OUT``) joined through ``file://STORE``, as :func:`pair` does."""
    return processes([scenario, str(out)], n, out, store, timeout, env, worker, logs=scenario)


def group_ok(scenario: str, out: Path, n: int, worker: Path, timeout: float = 400) -> None:
    """:func:`group` with its store beside ``out``, every process asserted to have succeeded (its output's end
    in the message otherwise)."""
    for r in group(scenario, out, out.parent / f"store-{scenario}", n, timeout=timeout, worker=worker):
        assert r.returncode == 0, r.output[-3000:]


def worst(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def processes(args: list[str], n: int, out: Path, store: Path, timeout: float = 150, env: Optional[dict] = None,
              worker: Path = WORKER, logs: Optional[str] = None) -> list[Result]:
    """``n`` worker processes (``worker ARGS…``: several runs in one group) joined through ``file://STORE``; their
    output in ``OUT/LOGS-RANK.out`` / ``.err`` (``LOGS``: ``group-N`` unless named)."""
    out.mkdir(parents=True, exist_ok=True)
    if store.exists():
        store.unlink()
    cmds = [[sys.executable, str(worker), *args] for _ in range(n)]
    envs = [_env(dict(env or {}, TEST_INIT=f"file://{store}", TEST_RANK=rank, TEST_WORLD=n)) for rank in range(n)]
    logs = logs or f"group-{n}"
    files = [(out / f"{logs}-{rank}.out", out / f"{logs}-{rank}.err") for rank in range(n)]
    try:
        return _together(cmds, envs, files, timeout, f"{n} workers '{args[0]}'")
    finally:
        if store.exists():
            store.unlink()


def scenario(tmp_path: Path, name: str, n: int, worker: Path, timeout: float = 400) -> Path:
    """``n`` processes of ``worker NAME OUT`` (see :func:`group`); every one must succeed. Returns OUT."""
    out = tmp_path / name
    for r in group(name, out, tmp_path / "store", n, timeout=timeout, worker=worker):
        assert r.returncode == 0, r.output[-3000:]
    return out


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def run_many(cmds: list[list[str]], timeout: float, env: Optional[dict] = None,
             logs: Optional[Path] = None) -> list[Result]:
    """Run several commands at once (e.g. one launcher per machine); kill all of them on timeout."""
    logs = logs or Path(os.environ.get("TMPDIR", "/tmp"))
    files = [(logs / f"cmd{i}.out", logs / f"cmd{i}.err") for i in range(len(cmds))]
    return _together(cmds, [_env(env)] * len(cmds), files, timeout, f"{len(cmds)} commands", tail=3000)


def _together(cmds: list[list[str]], envs: list[dict], files: list[tuple[Path, Path]], timeout: float, what: str,
              tail: Optional[int] = None) -> list[Result]:
    """Start ``cmds`` at once, each writing to its (stdout, stderr) files, and wait for all of them; on a
    timeout fail with every log (its last ``tail`` characters); every process group is killed at the end."""
    procs, logs = [], []
    t0 = time.monotonic()
    try:
        for cmd, env, (out_path, err_path) in zip(cmds, envs, files):
            o, e = open(out_path, "w+"), open(err_path, "w+")
            logs.append((o, e))
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, start_new_session=True))
        for p in procs:
            try:
                p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                _stop(procs)
                raise AssertionError(f"{what} did not finish within {timeout}s:\n"
                                     + "\n".join(_read(f)[-(tail or 0):] for pair_ in logs for f in pair_))
        return [Result(p.returncode, _read(o), _read(e), time.monotonic() - t0) for p, (o, e) in zip(procs, logs)]
    finally:
        for p in procs:
            _kill_group(p)
        for o, e in logs:
            o.close()
            e.close()
