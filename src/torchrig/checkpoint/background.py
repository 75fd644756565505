"""Asynchronous checkpoint writes: the caller copies the state to host memory, one thread writes it.

Training stalls only for the copy (device to host, or a clone of CPU tensors that the next optimizer
step would change); serialising, fsync, the rename into place, keep-last-k pruning and the
``latest`` / ``best`` links run on a single background thread, in the order they were asked for. At
most one save is in flight: the next save waits for it first (so host memory holds at most one
copy). An error of a background write (a full disk …) is kept and raised, with the same one-line
message a synchronous save gives, by the next ``wait`` — which the next save, the end of
``Trainer.fit`` (also after a stop signal) and ``CheckpointManager.close`` call.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to CPU memory of its own (containers rebuilt, other values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple, or a tuple
    return obj


class BackgroundWriter:
    """One writer thread; ``submit`` queues a job, ``wait`` blocks until every queued job is done."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._jobs: list[Future] = []
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """True while a queued job has not finished."""
        return any(not f.done() for f in self._jobs)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-checkpoint")
            job = self._pool.submit(_yielding, fn, *args, **kwargs)
            self._jobs.append(job)
        return job

    def wait(self) -> None:
        """Block until every job is done; raise the first error a job raised (once)."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        error: Optional[BaseException] = None
        for job in jobs:
            exc = job.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the jobs, then stop the thread (a later ``submit`` starts a new one)."""
        try:
            self.wait()
        finally:
            with self._lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)


# While a write runs, the interpreter hands the GIL over at least this often (instead of every 5 ms). The
# training thread gives the GIL up in most PyTorch ops; each time the writer thread takes it, the training
# thread waits the whole switch interval to get it back, which turned about 3 ms of the writer's Python
# work into 20 ms of stalled training on a small model.
SWITCH_INTERVAL_S = 2e-4


def _yielding(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))
    try:
        return fn(*args, **kwargs)
    finally:
        sys.setswitchinterval(before)


def finish_saves(manager: Any, then: Callable[[], None]) -> None:
    """Wait for ``manager``'s save in flight (raising its error, if any), then call ``then`` in any case."""
    try:
        if manager is not None:
            manager.close()
    finally:
        then()
