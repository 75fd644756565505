"""Child processes forked from one helper process that imported torch once, so that a child costs a fork
instead of an interpreter start (``import torch`` takes 3-6 s on the shared CI cores): the pattern of
``tests/checkpoint/test_kill_during_save.py``, for any script, ``-c`` code or ``-m`` module.

    proc = forkserver.popen([script, *args], env=subprocess_env(), start_new_session=True)

``popen`` returns a :class:`Forked`, which does what the tests used of ``subprocess.Popen(..., text=True)``
(``pid``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``returncode``; stdout and stderr
are collected in files and returned as text); :func:`run` is ``subprocess.run(..., capture_output=True,
text=True)``. A child runs as ``python ARGV`` would, in its own environment and directory: ``sys.argv``,
``sys.path`` (the script's folder, then ``PYTHONPATH``), ``__main__``, stdin from /dev/null, its exit code,
its death by SIGINT after an uncaught KeyboardInterrupt, non-daemon threads joined and ``atexit`` run.

The server imports torch, numpy, yaml and safetensors but not torchrig or the tests' helpers, so a child
imports those itself under its own environment (a variable read at import time is seen); it never touches
CUDA, sets no signal handler and starts no thread before it forks. Children that test the interpreter
itself (what a fresh start does with threads or imports, start-up and exit windows of the command line),
that use CUDA, or that are ``torchrig launch`` / torchrun, keep their own interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from . import REPO, TESTS

# Reads one JSON request per line, forks, prints "started ID PID"; prints "exited PID STATUS" for each child.
SERVER = r'''
import json, os, select, sys
import numpy, safetensors.torch, torch, torch.distributed, yaml  # the slow imports, once
torch.set_num_threads(1)

CHILD = r"""
import atexit, faulthandler, os, runpy, signal, sys, threading, traceback, types

def child(req):
    if req["session"]:
        os.setsid()
    if req["cwd"]:
        os.chdir(req["cwd"])
    if req["rlimits"]:
        import resource
        for name, limits in req["rlimits"].items():
            resource.setrlimit(getattr(resource, name), tuple(limits))
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, (path, flags) in enumerate([(os.devnull, os.O_RDONLY), (req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                        (req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)]):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    argv = req["argv"]
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # the server's own "" (its -c); the child's comes below
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        if argv[0] == "-c":
            sys.argv, sys.path[:0] = ["-c", *argv[2:]], ["", *extra]
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv, sys.path[:0] = [argv[1], *argv[2:]], [os.getcwd(), *extra]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[:0] = list(argv), [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        if code == -signal.SIGINT:  # as an interpreter ends on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)
"""
exec(CHILD)

def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        print("exited", pid, status, flush=True)

stdin = sys.stdin.fileno()
pending = b""
while True:
    ready, _, _ = select.select([stdin], [], [], 0.02)
    reap()
    if not ready:
        continue
    chunk = os.read(stdin, 65536)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                child(req)
            finally:
                os._exit(70)
        print("started", req["id"], pid, flush=True)
reap()
'''


class Server:
    """The fork server and a thread that reads what it says (which child started, which exited)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(TESTS), env.get("PYTHONPATH", "")])
        self.log = open(Path(tempfile.gettempdir()) / f"torchrig-forkserver-{os.getpid()}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, start_new_session=True)
        self.lock = threading.Condition()
        self.started: dict[int, int] = {}
        self.exited: dict[int, int] = {}
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            words = raw.decode().split()
            with self.lock:
                if words[0] == "started":
                    self.started[int(words[1])] = int(words[2])
                elif words[0] == "exited":
                    self.exited[int(words[1])] = int(words[2])
                self.lock.notify_all()
        with self.lock:
            self.lock.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, argv: list[str], env: dict, cwd: Optional[str], out: Path, err: Path, session: bool,
              rlimits: Optional[dict] = None) -> int:
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            request = {"id": ident, "argv": [str(a) for a in argv], "env": {k: str(v) for k, v in env.items()},
                       "cwd": cwd, "out": str(out), "err": str(err), "session": session, "rlimits": rlimits or {}}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            if not self.lock.wait_for(lambda: ident in self.started or not self.alive(), timeout=60):
                raise RuntimeError("the fork server did not start a child within 60 s")
            if ident not in self.started:
                raise RuntimeError(f"the fork server died: see {self.log.name}")
            return self.started.pop(ident)

    def status(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The child's wait status once it exited (waiting up to ``timeout`` seconds), else None."""
        with self.lock:
            self.lock.wait_for(lambda: pid in self.exited or not self.alive(), timeout=timeout)
            if pid not in self.exited and not self.alive():
                raise RuntimeError(f"the fork server died: see {self.log.name}")
            return self.exited.get(pid)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


_server: Optional[Server] = None


def server() -> Server:
    global _server
    if _server is None or not _server.alive():
        _server = Server()
        atexit.register(_server.close)
    return _server


class Forked:
    """A forked child, used as the tests used ``subprocess.Popen(..., text=True)``."""

    def __init__(self, argv: list, env: Optional[dict] = None, cwd=None, start_new_session: bool = False,
                 rlimits: Optional[dict] = None):
        self.args = [str(a) for a in argv]
        self.dir = Path(tempfile.mkdtemp(prefix="forked-"))
        self._out, self._err = self.dir / "stdout", self.dir / "stderr"
        self.returncode: Optional[int] = None
        self.pid = server().start(self.args, dict(os.environ if env is None else env),
                                  None if cwd is None else str(cwd), self._out, self._err, start_new_session, rlimits)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            status = server().status(self.pid, timeout=0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            status = server().status(self.pid, timeout=timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def output(self) -> tuple[str, str]:
        """What the child wrote so far to stdout and stderr."""
        return (self._out.read_text(errors="replace") if self._out.exists() else "",
                self._err.read_text(errors="replace") if self._err.exists() else "")

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never signal a pid the server has reaped (it may be someone else's by now)
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen(argv: list, env: Optional[dict] = None, cwd=None, start_new_session: bool = False,
          rlimits: Optional[dict] = None) -> Forked:
    """``subprocess.Popen([sys.executable, *argv], stdout=PIPE, stderr=PIPE, text=True, ...)``, forked; ``rlimits``
    (``{"RLIMIT_DATA": (soft, hard)}``) are set in the child before it runs, as a ``preexec_fn`` would."""
    return Forked(argv, env, cwd, start_new_session, rlimits)


def run(argv: list, env: Optional[dict] = None, cwd=None, timeout: Optional[float] = None, check: bool = False,
        rlimits: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, forked; on a timeout the
    child is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    proc = Forked(argv, env, cwd, rlimits=rlimits)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise
    out, err = proc.output()
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_until(predicate, timeout: float, every: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(every)
    return True
