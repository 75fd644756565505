"""Stop a run cleanly on SIGTERM, SIGINT (Ctrl-C) or SIGUSR1.

A cluster scheduler asks a job to end with a signal (Slurm: SIGTERM before the kill, or SIGUSR1 some
seconds before the time limit with ``--signal=USR1@90``); a person presses Ctrl-C. The handler only
records the signal. The training loop asks :meth:`StopSignal.check` at each optimizer-step boundary,
then saves a checkpoint and exits with ``128 + signal number`` (143, 130, 138).

Under DDP / FSDP every rank must stop after the same step, or the save (a collective) would hang. The
ranks agree through one tiny all-reduce of a CPU integer per step on a gloo group, started
asynchronously at step k and read at step k+1: it never touches the accelerator, so it adds no
device-to-host synchronisation, and it has a whole step to complete in the background.

A second signal while the first is being handled exits at once (no checkpoint), and so does a process
that makes no progress (no micro-batch, no evaluation batch; a checkpoint being written counts as
progress, however long it takes) for ``stop_timeout`` seconds after the signal: a step stuck on a dead
peer, which is how torchrun's SIGTERM finds the survivors when another worker failed, must not hold
the launcher until its SIGKILL. DataLoader workers forked after :meth:`install` inherit the handler, which does nothing in a process other than the one
that installed it, so a Ctrl-C sent to the whole process group cannot kill a worker under the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

HANDLED = ("SIGTERM", "SIGINT", "SIGUSR1")


class RunStopped(SystemExit):
    """Raised by ``fit`` after a signal's checkpoint is saved; its exit code is ``128 + signum``."""

    def __init__(self, signum: int, step: int, checkpoints: Any):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step
        self.message = (f"stopped by {signal_name(signum)} at step {step}; checkpoint "
                        f"{checkpoints}/step-{step:08d}; continue with --set resume=latest")

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignal:
    """Records SIGTERM / SIGINT / SIGUSR1 during ``fit`` and lets every rank agree on when to stop."""

    def __init__(self, world_size: int = 1, stop_timeout: float = 10.0):
        self.received = 0            # the first signal's number, 0 if none
        self.world_size = world_size
        self.stop_timeout = stop_timeout
        self.beat = time.perf_counter()  # the loop's last sign of progress (set per micro-batch)
        self._saving = 0             # checkpoints being written (nested)
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[Any] = None
        self._agreed = 0

    # -- handlers ----------------------------------------------------------------------------
    def install(self) -> "StopSignal":
        """Install the handlers (main thread only; elsewhere signals keep their old behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in HANDLED:
            num = getattr(signal, name, None)
            if num is not None:
                self._previous[num] = signal.signal(num, self._handle)
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            # gloo works on CPU tensors whatever the main backend; reuse the default group when it is gloo
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self

    def uninstall(self) -> None:
        try:
            self.settle()
        except Exception:  # a failed group (a peer died): the error that ended the loop is already on its way
            pass
        for num, previous in self._previous.items():
            try:
                signal.signal(num, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the main process decides
            return
        if self.received:
            sys.stderr.write(f"\ntorchrig: second {signal_name(signum)}: exiting now, without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received = signum
        sys.stderr.write(f"\ntorchrig: {signal_name(signum)} received; stopping after the current optimizer "
                         f"step with a checkpoint (send it again to exit at once)\n")
        sys.stderr.flush()
        threading.Thread(target=self._watch, args=(signum,), daemon=True, name="torchrig-stop-watch").start()

    def _watch(self, signum: int) -> None:
        """Exit at once if the loop stops making progress before the ranks agree to stop."""
        self.beat = max(self.beat, time.perf_counter())
        while not self._agreed and self._previous:
            idle = 0.0 if self._saving else time.perf_counter() - self.beat
            if idle > self.stop_timeout:
                sys.stderr.write(f"torchrig: no progress for {idle:.0f}s after {signal_name(signum)} (a step, or a "
                                 f"peer, is stuck); exiting without a checkpoint (dist.stop_timeout)\n")
                sys.stderr.flush()
                os._exit(128 + signum)
            time.sleep(0.2)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint being written (or the one before it waited for): progress for the watchdog."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
            self.beat = time.perf_counter()

    # -- agreement ---------------------------------------------------------------------------
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
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            self._agreed = int(self._flag.item())
        return self._agreed

    def settle(self) -> None:
        """Wait for an all-reduce still in flight (before leaving the loop, so none is left behind)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self._agreed = self._agreed or int(self._flag.item())  # a CPU tensor: no device synchronisation


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
