"""Stop a run cleanly on SIGTERM, SIGINT (Ctrl-C) or SIGUSR1.

A cluster scheduler asks a job to end with a signal (Slurm: SIGTERM before the kill, or SIGUSR1 some
seconds before the time limit with ``--signal=USR1@90``); a person presses Ctrl-C. While the training
loop runs the handler only records the signal: the loop asks :meth:`StopSignal.check` at each
optimizer-step boundary, then saves a checkpoint and exits with ``128 + signal number`` (143, 130, 138).
Anywhere else (start-up, after training, a final evaluation) there is no step to finish: the handler
raises :class:`RunStopped` at once, with a line that says what the signal stopped and what is safe,
and the same exit code; a checkpoint being written is finished first. The ``torchrig`` command keeps
a handler installed from its start to the interpreter's exit, so that no window ends in a bare kill or
a traceback.

Under DDP / FSDP every rank must stop after the same step, or the save (a collective) would hang. The
ranks agree through one tiny all-reduce of a CPU integer per step on a gloo group, started
asynchronously at step k and read at step k+1: it never touches the accelerator, so it adds no
device-to-host synchronisation, and it has a whole step to complete in the background.

A second signal while the first is being handled exits at once, and so does a process that makes no
progress (no micro-batch, no evaluation batch; a checkpoint being written counts as progress) for
``stop_timeout`` seconds after the signal: a step stuck on a dead peer, which is how torchrun's SIGTERM
finds the survivors when another worker failed, must not hold the launcher until its SIGKILL. A signal
that reaches a process already stopping with its peers (torchrun's SIGTERM to the ranks left after
one exits) lets it finish. DataLoader workers forked after :meth:`install` inherit the handler, which
does nothing in a process other than the one that installed it, so a Ctrl-C sent to the whole process
group cannot kill a worker under the loop.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..errors import continue_run
from .dist import enter_collective, is_main_process, leave_collective

HANDLED = ("SIGTERM", "SIGINT", "SIGUSR1")
STARTING = "during start-up; no step was trained and nothing was written: run the same command again"
AGREEMENT = "stop agreement"  # the collective of the ranks' agreement on a stop signal, as a hang's summary names it
FAILED_LOOP = "after an error ended the training loop; the checkpoints written before it are kept"


class RunStopped(SystemExit):
    """A stop by a signal: exit code ``128 + signum``; ``str()`` is the line that says where it stopped."""

    def __init__(self, signum: int, where: str, step: Optional[int] = None):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step
        self.message = f"stopped by {signal_name(signum)} {where}"

    @classmethod
    def at_step(cls, signum: int, step: int, run_dir: Any) -> "RunStopped":
        """The loop's stop: after optimizer step ``step``, whose checkpoint is in ``run_dir``. The way on names
        the run: ``resume=latest`` alone would resume the newest run of the recipe, which may be another."""
        return cls(signum, f"at step {step}; checkpoint {run_dir}/checkpoints/step-{step:08d}; continue with "
                           f"{continue_run(run_dir)}", step)

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignal:
    """Records SIGTERM / SIGINT / SIGUSR1 and lets every rank agree on when to stop.

    It starts in the immediate mode: a signal raises :class:`RunStopped` with the line ``stopped by
    SIGTERM {where}``. :meth:`stop_at_steps` switches to the loop's mode (record, stop at a step
    boundary), :meth:`immediately` back, :meth:`saving` marks a checkpoint being written, and
    :meth:`at_exit` the interpreter's exit (say so, and leave at once).
    """

    def __init__(self, world_size: int = 1, stop_timeout: float = 10.0, where: str = STARTING):
        self.received = 0            # the first signal's number, 0 if none
        self.world_size = world_size
        self.stop_timeout = stop_timeout
        self.where = where           # what a signal would stop now, for the line of an immediate stop
        self.at_steps = False        # the loop runs: stop after the current optimizer step
        self.exiting = False         # the interpreter is exiting: say so and leave at once
        self.beat = time.perf_counter()  # the loop's last sign of progress (set per micro-batch)
        self._saving = 0             # checkpoints being written (nested)
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[Any] = None
        self._agreed = 0             # the signal this process stops for, once decided

    # -- handlers ----------------------------------------------------------------------------
    def install(self) -> "StopSignal":
        """Install the handlers (main thread only; elsewhere signals keep their old behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in HANDLED:
            num = getattr(signal, name, None)
            if num is not None:
                self._previous[num] = signal.signal(num, self._handle)
        _Watcher.start()
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            # gloo works on CPU tensors whatever the main backend; reuse the default group when it is gloo
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.uninstall()
        if exc_type is None:
            self.immediately(self.where)  # a signal that came while the last checkpoint was being written

    def uninstall(self) -> None:
        """Put the previous handlers back. Another StopSignal's (the command's, around ``fit``) learns what this
        one received (a signal after a stop is the second) and what a signal would now stop."""
        try:
            self.settle()
        except Exception:  # a failed group (a peer died): the error that ended the loop is already on its way
            pass
        for num, previous in self._previous.items():
            outer = getattr(previous, "__self__", None)
            if isinstance(outer, StopSignal):
                outer.received = outer.received or self.received
                outer._agreed = outer._agreed or self._agreed
                outer.where = self.where
            try:
                signal.signal(num, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        if self._previous:
            _Watcher.stop()
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the main process decides
            return
        _Watcher.handled += 1
        name = signal_name(signum)
        # a launcher (torchrun, srun) passes a signal to every rank: what they would all say, rank 0 says once
        say = _say if is_main_process() else (lambda line: None)
        if self.received:
            lost = ", without a checkpoint" if self.at_steps or self._saving else ""
            say(f"\ntorchrig: second {name}: exiting now{lost}")
            os._exit(128 + signum)
        self.received = signum
        if self._agreed:  # already stopping (with the other ranks): let it finish
            return
        if self.exiting:
            _say(f"\nstopped by {name} {self.where}")
            os._exit(128 + signum)
        if self.at_steps:
            say(f"\ntorchrig: {name} received; stopping after the current optimizer step with a checkpoint "
                f"(send it again to exit at once)")
        elif self._saving:
            say(f"\ntorchrig: {name} received; stopping once the checkpoint being written is complete "
                f"(send it again to exit at once)")
        else:
            raise self.stopped(signum)

    # -- modes ----------------------------------------------------------------------------------
    def stop_at_steps(self) -> None:
        """The loop starts: a signal now stops the run after the optimizer step under way. Should the loop end
        on an error instead (a peer died), a signal that comes after it is said to have come then."""
        self.at_steps, self.where = True, FAILED_LOOP

    def immediately(self, where: str) -> None:
        """No step to finish from here on: a signal stops the process at once, saying ``stopped by SIG… {where}``.
        Raises now for a signal that came while it could not (during a save, or before the loop noticed)."""
        self.at_steps, self.where = False, where
        if self.received and not self._agreed:
            raise self.stopped(self.received)

    def stopped(self, signum: int) -> RunStopped:
        """The immediate stop for ``signum`` (its line printed): the process is now stopping."""
        self._agreed = signum
        stop = RunStopped(signum, self.where)
        _say(str(stop))
        return stop

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint being written (or waited for): progress for the watchdog, however long it takes,
        and not cut by an immediate stop (which :meth:`immediately` raises afterwards)."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
            self.beat = time.perf_counter()

    def at_exit(self) -> None:
        """The program has finished (the ``torchrig`` command returns): a signal now ends it at once, with its
        line and exit code, instead of a traceback from the interpreter's clean-up."""
        self.exiting, self.where = True, "while exiting; the run had ended"

    # -- agreement ---------------------------------------------------------------------------
    def beat_now(self) -> None:
        """A sign of progress outside the training loop (an evaluation batch), for the watchdog."""
        self.beat = time.perf_counter()

    def check(self) -> int:
        """At an optimizer-step boundary: the signal every rank agrees to stop on, else 0.

        In one process that is the signal received so far. With several ranks it is the largest
        signal number any rank had received by the previous boundary (every rank reads the same
        all-reduce result, so all of them stop after the same step).
        """
        if self.world_size == 1:
            self._agreed = self.received
            return self.received
        if self._agreed:
            return self._agreed
        if self._pending is not None:
            self.settle()
            if self._agreed:
                return self._agreed
        self._flag.fill_(self.received)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return 0

    def check_now(self) -> int:
        """A blocking agreement (at epoch ends and the end of the loop): every rank must call it."""
        if self.world_size == 1:
            self._agreed = self.received
            return self.received
        self.settle()
        if not self._agreed:
            self._flag.fill_(self.received)
            n = enter_collective("all_reduce", AGREEMENT)
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            leave_collective(n)
            self._agreed = int(self._flag.item())
        return self._agreed

    def settle(self) -> None:
        """Wait for an all-reduce still in flight (before leaving the loop, so none is left behind)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            n = enter_collective("all_reduce", AGREEMENT)
            pending.wait()
            leave_collective(n)
            self._agreed = self._agreed or int(self._flag.item())  # a CPU tensor: no device synchronisation

    @property
    def saving_now(self) -> bool:
        """Whether a checkpoint is being written (or waited for): progress, for a watchdog."""
        return self._saving > 0


class _Watcher:
    """Sees each signal as it arrives, even while the main thread is stuck, and ends a stop that does not end.

    Python runs a signal's handler in the main thread, and only once that thread is back in Python: one
    stuck in a C++ call (a rendezvous waiting for a peer, a collective with a dead one) would never run it.
    The interpreter also writes every signal's number to a "wakeup" pipe the moment it arrives; one thread
    per process reads it. If the installed StopSignal's handler has not run within its ``stop_timeout``,
    or in the loop the process makes no progress (no micro-batch, no evaluation batch; a checkpoint being
    written counts) for that long before the ranks agree, it says so and exits with ``128 + signal``.
    Forked children (DataLoader workers) do not write to the pipe.
    """

    handled = 0  # signals a StopSignal's handler has run for in this process
    _users = 0
    _fds: tuple[int, int, int] = (-1, -1, -1)  # the pipe's read and write ends, the wakeup fd before it

    @classmethod
    def start(cls) -> None:
        """With the first StopSignal installed (main thread)."""
        cls._users += 1
        if cls._users > 1:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        cls._fds = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        threading.Thread(target=cls._run, args=(read, cls._fds[2], cls.handled), daemon=True,
                         name="torchrig-stop-watch").start()

    @classmethod
    def stop(cls) -> None:
        """With the last StopSignal uninstalled: the wakeup fd as it was; the thread sees the pipe close."""
        cls._users -= 1
        if cls._users == 0:
            read, write, previous = cls._fds
            signal.set_wakeup_fd(previous)
            os.close(write)

    @classmethod
    def forget_in_child(cls) -> None:
        """After a fork: the child's signals are its own (its handler ignores them), not the parent's."""
        if cls._users:
            cls._users = 0
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass

    @classmethod
    def _run(cls, read: int, previous: int, arrived: int) -> None:
        handled = {getattr(signal, n) for n in HANDLED if hasattr(signal, n)}
        signum, since = 0, 0.0  # the signal being watched, and when it arrived
        try:
            while True:
                if select.select([read], [], [], 0.2 if signum else None)[0]:
                    data = os.read(read, 64)
                    if not data:
                        return
                    if previous != -1:  # someone else's wakeup fd (an event loop): it still gets its bytes
                        try:
                            os.write(previous, data)
                        except OSError:
                            pass
                    for num in data:
                        if num in handled:
                            arrived += 1
                            signum, since = num, since or time.perf_counter()
                if signum and not cls._still_stopping(signum, since, arrived - cls.handled):
                    signum, since = 0, 0.0
        finally:
            os.close(read)

    @staticmethod
    def _still_stopping(signum: int, since: float, unhandled: int) -> bool:
        """False once the stop is no longer this thread's to watch; exits the process when it is stuck."""
        owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if not isinstance(owner, StopSignal) or owner._agreed:
            return False
        name, now = signal_name(signum), time.perf_counter()
        if unhandled > 1:  # a second signal the stuck main thread could not act on either
            _say(f"\ntorchrig: second {name}: exiting now")
            os._exit(128 + signum)
        loop = owner.at_steps or owner._saving
        if unhandled <= 0 and not loop:  # the handler ran: an immediate stop is under way
            return False
        idle = 0.0 if owner._saving else now - max(owner.beat, since)
        if idle > owner.stop_timeout:
            _say(f"torchrig: no progress for {idle:.0f}s after {name} (a step, or a peer, is stuck); exiting "
                 f"without a checkpoint (dist.stop_timeout)" if loop else f"stopped by {name} {owner.where}")
            os._exit(128 + signum)
        return True


os.register_at_fork(after_in_child=_Watcher.forget_in_child)


def stop_phase(where: str) -> None:
    """Say what a signal would stop from now on (see :meth:`StopSignal.immediately`), to the StopSignal whose
    handler is installed, if any (the ``torchrig`` command's around a final evaluation, say)."""
    owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(owner, StopSignal):
        owner.immediately(where)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def requeue_slurm_job() -> Optional[str]:
    """``scontrol requeue $SLURM_JOB_ID``; returns a line to print (None when not under Slurm)."""
    import shutil
    import subprocess

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    exe = shutil.which("scontrol")
    if exe is None:
        return f"torchrig: dist.requeue=true but 'scontrol' is not on PATH; job {job} was not requeued"
    done = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"torchrig: 'scontrol requeue {job}' failed ({why[0] if why else done.returncode}); requeue it by hand"
    return f"torchrig: requeued Slurm job {job}"
