"""One run per run directory.

A run directory belongs to one run at a time: global rank 0 holds an OS lock on
``RUN/.torchrig.lock`` (a POSIX record lock, ``lockf``: the kernel drops it when the process ends,
however it ends, so a lock file left by a killed process is simply taken over; unlike ``flock`` it
is not shared with forked DataLoader workers, which outlive a killed parent by seconds). A new run
never writes into a directory that holds another run's checkpoints unless ``overwrite=true`` removes
them first, and without a ``run_dir`` every run gets a fresh numbered directory ``ROOT/N`` with
``ROOT/last`` pointing at the newest. ``metrics.jsonl`` is cut back to the step a run starts from, so it always reads as one run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from .. import runtime
from ..config.files import LINES_LIMIT, open_own, read_lines, refuse_link, replace_link, write_atomic
from ..errors import setting, suggest
from .io import CheckpointError
from .manager import follow_link

try:
    import fcntl
except ImportError:  # not a POSIX system: runs are not locked
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".torchrig.lock"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "plots", "samples")  # what overwrite=true removes


class RunDirError(CheckpointError):
    """A run directory that another process holds, that holds another run, that cannot be written, or whose own
    files (metrics.jsonl, skipped_samples.jsonl) cannot be read back as torchrig wrote them."""


def describe_os_error(exc: OSError) -> str:
    """``no space left on device (errno 28 ENOSPC)``: the reason and the errno, for one-line messages."""
    name = errno.errorcode.get(exc.errno or 0, "unknown")
    return f"{(exc.strerror or str(exc)).lower()} (errno {exc.errno} {name})"


# ----------------------------------------------------------------------------- the lock


# Lock files this process holds. POSIX locks belong to the process, so a second lock taken here would
# succeed, and closing its descriptor would drop the first: a run directory is locked once per process.
_HELD: dict[str, "RunLock"] = {}


class RunLock:
    """An exclusive lock on ``RUN/.torchrig.lock``, whose text names the holder (PID, host, start)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: Optional[int] = None
        self.owner = ""

    def acquire(self) -> None:
        """Take the lock at once or raise RunDirError naming the process that holds it."""
        if fcntl is None or self._fd is not None:
            return
        key = os.path.realpath(self.path)
        if key in _HELD:
            self._refuse(_HELD[key].owner)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = _open_lock(self.path, create=True)
        except OSError as exc:
            raise RunDirError(f"cannot create the lock file '{self.path}': {describe_os_error(exc)}; "
                              f"choose a run_dir this process can write") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: another process holds it
            owner = _owner(fd)
            os.close(fd)
            self._refuse(owner)
        except OSError:  # a file system without locks (some network mounts): run unlocked
            os.close(fd)
            return
        self.owner = (f"PID {os.getpid()} on host {socket.gethostname()} "
                      f"(started {time.strftime('%Y-%m-%d %H:%M:%S')})")
        os.ftruncate(fd, 0)  # our own regular file (checked by _open_lock), locked: nobody else's bytes
        os.pwrite(fd, (self.owner + "\n").encode(), 0)
        self._fd = fd
        _HELD[key] = self

    def _refuse(self, owner: str) -> None:
        raise RunDirError(f"run_dir '{self.run_dir}' is in use by {owner or 'another process'}; wait for it, "
                          f"or choose another run_dir")

    def release(self) -> None:
        if self._fd is None:
            return
        _HELD.pop(os.path.realpath(self.path), None)
        try:
            os.ftruncate(self._fd, 0)  # the file stays (removing it would race with a process opening it)
        except OSError:
            pass
        os.close(self._fd)  # drops the lock
        self._fd = None


def check_not_in_use(run_dir: str | Path) -> None:
    """Raise at once if another process holds ``run_dir``'s lock (a probe: the lock is not kept).

    The command line calls it before building data and model, which can take seconds; the lock itself
    is taken when training starts, as with the Python API.
    """
    path = Path(run_dir) / LOCK_NAME
    if fcntl is None or not os.path.lexists(path) or os.path.realpath(path) in _HELD:
        return
    try:
        fd = _open_lock(path, create=False)  # a lock file that is not one is refused here already
    except OSError:
        return  # unreadable here: the real lock attempt says why
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        RunLock(run_dir)._refuse(_owner(fd))
    except OSError:
        pass
    finally:
        os.close(fd)  # also drops the probe's lock


def _open_lock(path: Path, create: bool) -> int:
    """A descriptor of the lock file, which must be a regular file of its own in the run directory.

    The lock file is truncated and rewritten, so it must be torchrig's (``files.open_own``): a symbolic
    link (to a file of the user's, say) is never followed, and a hard link, a FIFO, a device or a
    directory in its place is refused before a byte of it is touched. The open's own OSError (no
    permission ...) is raised as it is.
    """
    return open_own(path, create, lambda what: _not_a_lock(path, what))


def _not_a_lock(path: Path, what: str) -> RunDirError:
    return RunDirError(f"the lock file '{path}' is {what}, not torchrig's regular lock file; it was left as it "
                       f"is. Remove it (or choose another run_dir) and start again")


def _owner(fd: int, patience: float = 1.0) -> str:
    """The holder's line in the lock file; "" when it has not written it within ``patience`` seconds
    (a holder that took the lock a moment ago writes it right after)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        except OSError:
            return ""
        if text or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def check_resumable(run_dir: Optional[str | Path], resume: Optional[str]) -> None:
    """Refuse ``resume=latest`` (or ``best``) in a ``run_dir`` that does not exist: on the command line most likely a
    typo, which would otherwise train a new run from step 0 and end with success. An existing empty folder (a
    scheduler's first start of a job whose every start says ``resume=latest``) starts at step 0, as does a restart
    by torchrun. (``Trainer(resume="latest")`` in a script that makes its own run_dir on the first start is not
    checked: the script names the folder once, in code.)"""
    if resume not in ("latest", "best") or not run_dir or runtime.restart_count() > 0:
        return
    path = Path(run_dir)
    if path.exists() or path.is_symlink():
        return
    near = suggest(str(run_dir), _run_dirs_near(path), n=3)
    raise RunDirError(f"run_dir '{run_dir}' does not exist, so {setting('resume', resume)} has no run to continue"
                      f"{near}{' ' if near else '. '}To start a new run there, leave out {setting('resume', resume)}, "
                      f"or create the folder first (an empty run_dir starts at step 0)")


def _run_dirs_near(path: Path, limit: int = 2000) -> list[str]:
    """The folders at ``path``'s depth under its nearest existing ancestor (``runs/cli`` for ``runs/clii``, and for
    ``rnus/cli`` too), as ``path`` spells them; at most ``limit`` are looked at."""
    missing: list[str] = []
    base = path
    while not base.is_dir() and base != base.parent:
        missing.insert(0, base.name)
        base = base.parent
    level = [base]
    for _ in missing:
        below: list[Path] = []
        for folder in level:
            try:
                with os.scandir(folder) as entries:
                    below += [folder / e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
            except OSError:
                continue
            if len(below) >= limit:
                break
        level = below[:limit]
    return [str(p) for p in level]


# ----------------------------------------------------------------------------- what a directory holds


def reached_step(run_dir: str | Path) -> Optional[int]:
    """The highest step among the checkpoints in ``run_dir``, or None when it holds none."""
    steps = []
    for p in (Path(run_dir) / "checkpoints").glob("step-*"):
        try:
            steps.append(int(p.name[len("step-"):]))
        except ValueError:
            continue
    return max(steps) if steps else None


def clear_run(run_dir: str | Path) -> list[str]:
    """Remove a previous run's checkpoints and logs from ``run_dir``; returns the names removed."""
    removed = []
    for name in RUN_OUTPUTS:
        p = Path(run_dir) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


def numbered_run_dir(root: str | Path, say: Callable[[str], None] = print, resume: bool = False) -> Path:
    """A new directory ``root/N`` for a run given no run_dir (rank 0 claims it, every rank gets it).

    ``N`` is one more than the highest number there, claimed with ``mkdir`` so that two runs started
    together never share one; ``root/last`` then points at it. A group restarted by torchrun (or a
    requeued Slurm job), and a run asked to ``resume``, go on in ``root/last``, the newest run.
    """
    path, error = None, None
    if runtime.get_rank() == 0:
        root = Path(root)
        last = root / "last"
        try:
            if (resume or runtime.restart_count() > 0) and last.is_dir():
                path = root / follow_link(last).name  # never into a folder outside root
                if resume:
                    say(f"torchrig: run_dir not set; resuming the newest run, {path}")
            else:
                path = _claim(root)
                say(f"torchrig: run_dir not set; writing to {path} ({last.name} -> {path.name})")  # fits 80 columns
        except CheckpointError as exc:  # told to the other ranks too, so that none waits for rank 0
            error = exc
    shared, message = runtime.broadcast((str(path) if path is not None else None, str(error) if error else None))
    if error is not None:
        raise error
    if message is not None:
        raise RunDirError(message)
    return Path(shared)


def discard_unused(path: Path) -> None:
    """Remove a numbered run directory whose run failed before saving anything, and point ``last`` back
    at the newest run that remains: a failed start must not leave ``last`` naming an empty run."""
    if reached_step(path) is not None or any(p.name not in (LOCK_NAME, "metrics.jsonl") for p in path.iterdir()):
        return
    shutil.rmtree(path, ignore_errors=True)
    root, last = path.parent, path.parent / "last"
    if not last.is_symlink() or os.readlink(last) != path.name:
        return
    numbers = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    if numbers:
        replace_link(str(numbers[0]), last, root=root)
    else:
        last.unlink()


def _claim(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    n = max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0) + 1
    while True:
        try:
            (root / str(n)).mkdir()
            break
        except FileExistsError:  # another run took this number a moment ago
            n += 1
    try:
        replace_link(str(n), root / "last", root=root)
    except OSError:  # no symbolic links here, or `last` is a real directory: the number is what counts
        pass
    return root / str(n)


def trim_metrics(path: str | Path, step: int) -> None:
    """Cut ``metrics.jsonl`` back to ``step``, atomically: a resumed run drops the rows its stopped
    predecessor wrote after the checkpoint (and a torn last line); a run starting at step 0 drops a
    file left by a run that saved no checkpoint."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if step <= 0:
        path.unlink()  # (a link itself, never what it names)
        return
    refuse_link(path, "metrics file", "move it away, or choose another run_dir", RunDirError)
    lines = [text for _, text in read_lines(path, LINES_LIMIT, "metrics file", "move it away, or choose another "
                                            "run_dir", RunDirError)]
    keep = [line for line, at in zip(lines, map(_row_step, lines)) if at is not None and at <= step]
    if len(keep) != len(lines):
        write_atomic(path, "".join(line + "\n" for line in keep).encode(), root=path.parent)


def _row_step(line: str) -> Optional[int]:
    try:
        row = json.loads(line)
        return int(row["step"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # not a row: "step" inf, nested ...
        return None


# ----------------------------------------------------------------------------- a Trainer's run directory


class RunDir:
    """The run directory of one Trainer: claimed once, locked for each ``fit``, checked before its first.

    Rank 0 does the work; the outcome (the path, or the error) is broadcast so every rank agrees.
    """

    def __init__(self) -> None:
        self.path: Optional[Path] = None
        self.lock: Optional[RunLock] = None
        self.checked = False  # a second fit() of the same Trainer continues its own run

    def open(self, run_dir: Optional[str], root: str | Path, new_run: bool, overwrite: bool,
             say: Callable[[str], None] = print, newest: bool = False) -> Path:
        """``newest``: without ``run_dir``, go on in the newest numbered run (``resume`` latest / best; a
        restart does anyway) rather than in a new one; a checkpoint named by its path resumes into a new run."""
        if self.path is None:
            self.path = Path(run_dir) if run_dir else numbered_run_dir(root, say, resume=newest)
        error: Optional[BaseException] = None
        if runtime.get_rank() == 0:
            try:
                self._open_main(new_run and not self.checked, overwrite, say)
            except Exception as exc:  # told to the other ranks too, so that none waits for rank 0
                error = exc
        message = runtime.broadcast(f"{error}" if error is not None else None)
        if error is not None:
            raise error
        if message is not None:
            raise RunDirError(message)
        self.checked = True
        return self.path

    def _open_main(self, new_run: bool, overwrite: bool, say: Callable[[str], None]) -> None:
        if self.lock is None:
            self.lock = RunLock(self.path)
        self.lock.acquire()
        try:
            step = reached_step(self.path)
            if new_run and step is not None and not overwrite:
                raise RunDirError(f"run_dir '{self.path}' holds a run that reached step {step}: continue it with "
                                  f"{setting('resume', 'latest')}, choose another run_dir, or "
                                  f"{setting('overwrite', True)}")
            if new_run and overwrite:
                removed = clear_run(self.path)
                if removed:
                    reached = f" (it had reached step {step})" if step is not None else ""
                    say(f"torchrig: overwrite=true: removed the previous run's {', '.join(removed)} "
                        f"from '{self.path}'{reached}")
        except BaseException:
            self.lock.release()
            raise

    def close(self) -> None:
        """Release the lock (the path and the checked state stay for a later fit)."""
        if self.lock is not None:
            self.lock.release()
