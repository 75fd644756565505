"""One accumulation window: the micro-batches of one optimizer step, from the first to the step.

:class:`Windows` is made once per ``fit`` (and once per lr-find sweep); the loop asks it for a
:class:`Window` at the first loaded batch of every optimizer step, hands that window each loaded batch
(:meth:`Window.add`), and, once it is full, finishes it (:meth:`Window.finish`): the step's end is counted
and the window's values come back. Everything an accumulation window is made of happens here, in order:

* the step is told where the window starts (:meth:`Step.begin_window`: its size, its samples over all ranks
  when the sampler knows them, whether this step logs a gradient norm), so the loss normalisation weighs
  each micro-batch by its own count and the window's gradients by the global one;
* each loaded batch is cut into micro-batches of ``data.micro_batch_size`` rows (``microbatch.chunks``); each
  micro-batch runs the step function under ``no_sync`` but the window's last (DDP and FSDP2 reduce once);
* each micro-batch's values go to the metrics logger with its own counts, so a logged mean is the mean over
  the items of every rank, as the step's loss is;
* a step function that needs the window's micro-batches together (a pipeline's schedule: a
  :class:`WholeWindowStep`) is handed them one by one and runs them at the window's last; the values of
  every micro-batch come back then, and are logged micro-batch by micro-batch all the same;
* under ``data.micro_batch_size=auto`` an out-of-memory error anywhere in the window drops its partial work,
  halves the micro-batch and runs the window again from its first loaded batch (``microbatch.Retry``);
* at the end, the step counts the optimizer step (:meth:`Step.end_window`) and a skipped update's values are
  left out of the logged means.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


from .. import parallel
from .microbatch import Retry, chunks
from .step import Step


class WholeWindowStep:
    """A step function that runs the micro-batches of a window together (a pipeline's schedule interleaves
    their forwards and backwards over the stages). The window hands it each micro-batch with :meth:`add`,
    after :meth:`Step.begin_micro_batch`, then calls :meth:`run` once after the last: it makes the window's
    optimizer step and returns the values of every micro-batch, in order, to log."""

    def add(self, step: Step, batch: Any) -> None:
        raise NotImplementedError

    def run(self, step: Step) -> list:
        raise NotImplementedError


class Windows:
    """The accumulation windows of one fit: what they share (the step and the step function, the micro-batch
    size, the logger) and the size that ``data.micro_batch_size=auto`` settled on, which a checkpoint saves
    (``state_dict``: the entry ``micro_batch``).

    ``micro_batch_size``: rows per micro-batch (None: the loaded batch whole; ``"auto"``: the loaded batch,
    halved on an out-of-memory error). ``synced``: the wrapped modules whose gradient reduction ``no_sync``
    defers to the window's last micro-batch. ``logger``: where each micro-batch's values go (None: nowhere, an
    lr-find sweep). ``observe``: called with each loaded batch's values (the spike check). ``retry``: the
    out-of-memory retry of ``auto`` (``microbatch.Retry``), or None.
    """

    def __init__(self, step: Step, step_fn: Callable, *, micro_batch_size: Any = None, batch_size: int = 1,
                 synced: Optional[list] = None, logger: Any = None,
                 observe: Optional[Callable[[Optional[dict]], None]] = None, retry: Optional[Retry] = None):
        self.step, self.step_fn = step, step_fn
        self.auto = micro_batch_size == "auto"
        self.micro_batch_size: Optional[int] = batch_size if self.auto else micro_batch_size
        self.synced = synced or []
        self.logger, self.observe, self.retry = logger, observe, retry
        self.whole = isinstance(step_fn, WholeWindowStep)
        self.current: Optional[Window] = None

    # -- Stateful: the micro-batch size ``auto`` settled on ----------------------------------------------
    def state_dict(self) -> dict:
        return {"size": self.micro_batch_size, "auto": self.auto}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.auto and state and state.get("auto") and state.get("size"):
            self.micro_batch_size = min(self.micro_batch_size, int(state["size"]))

    def halve(self) -> int:
        """``auto`` after an out-of-memory error: half the micro-batch (the old size is returned)."""
        old, self.micro_batch_size = self.micro_batch_size, self.micro_batch_size // 2
        return old

    # -- the windows --------------------------------------------------------------------------------------
    def open(self, size: int, *, epoch: int = 0, first: int = 0, samples: Optional[int] = None,
             grad_norm: bool = False) -> "Window":
        """The window of the ``size`` loaded batches from batch ``first`` of ``epoch``. ``samples``: their samples
        over all ranks when the sampler knows them; ``grad_norm``: this step measures the gradient norm (a log
        step, the spike check) even without clipping."""
        self.current = Window(self, size, epoch, first, samples, grad_norm)
        return self.current


class Window:
    """One accumulation window (see the module's text); made by :meth:`Windows.open`."""

    def __init__(self, windows: Windows, size: int, epoch: int, first: int, samples: Optional[int],
                 grad_norm: bool):
        self.windows, self.size, self.epoch, self.first = windows, size, epoch, first
        self.added = 0                 # loaded batches run so far
        self.loaded: list = []         # under auto: (batch, weight, index) of each, to run again after an OOM
        self.held: list = []           # a whole-window step function's micro-batches: their logged counts
        self.values: Optional[dict] = None
        windows.step.begin_window(size, samples, epoch=epoch, grad_norm=grad_norm)
        self.attempt = windows.retry.begin(windows.step) if windows.auto and windows.retry is not None else None

    @property
    def full(self) -> bool:
        return self.added == self.size

    def add(self, batch: Any, weight: int = 1, index: int = 0) -> None:
        """Run loaded batch ``index`` of the epoch (``weight`` 0: a filler that counts nothing) through the step
        function, micro-batch by micro-batch; the last loaded batch of the window ends with the optimizer step."""
        last = self.added == self.size - 1
        self.added += 1
        if self.attempt is None:
            self.values = self.run_loaded(batch, weight, index, last)
        else:
            self.loaded.append((batch, weight, index))
            self.values = self.attempt.run(self, [(batch, weight, index)], last)
            while last and self.attempt.any_failed():
                self.attempt.shrink(self)
                self.values = self.attempt.run(self, self.loaded, last)
        if self.windows.observe is not None:
            self.windows.observe(self.values)

    def finish(self) -> dict:
        """After the last loaded batch: count the optimizer step (``Step.end_window``); the step function's values
        of the window's last micro-batch (those of every micro-batch went to the logger)."""
        step, logger = self.windows.step, self.windows.logger
        step.end_window()
        if logger is not None and logger.staged:
            logger.end_window(step.window_skipped)
        self.loaded, self.held = [], []
        return self.values if self.values is not None else {}  # a step function may return nothing to log

    def run_loaded(self, batch: Any, weight: int, index: int, last: bool) -> Optional[dict]:
        """One loaded batch, cut into micro-batches; the values of its last one."""
        w = self.windows
        step = w.step
        size = w.micro_batch_size
        pieces = [batch] if size is None else chunks(batch, size)
        values = None
        for k, piece in enumerate(pieces):
            final = last and k == len(pieces) - 1
            if step.cp is None:
                values = self._micro_batch(piece, weight, index, final)
            else:  # parallel.cp: this rank's share of the sequences, forward and backward inside PyTorch's context
                with step.sharded(piece) as local:
                    values = self._micro_batch(local, weight, index, final)
        return values

    def _micro_batch(self, piece: Any, weight: int, index: int, last: bool) -> Optional[dict]:
        w = self.windows
        step = w.step
        step.begin_micro_batch(piece, weight, last=last, index=index)
        defer = not step.sync_gradients or (self.attempt is not None and self.attempt.agreeing)
        with parallel.no_sync_all(w.synced, defer, step.world_size):
            if w.whole:
                return self._whole_window(piece)
            values = w.step_fn(step, piece)
            self._record(values, piece)
            return values

    def _whole_window(self, piece: Any) -> Optional[dict]:
        """A :class:`WholeWindowStep`'s micro-batch: handed over now, run with the window's last; each micro-batch's
        values are logged with the counts it had when it was handed over."""
        w, step = self.windows, self.windows.step
        w.step_fn.add(step, piece)
        self.held.append(self._counts(piece))
        if not step.sync_gradients:
            return None
        values = w.step_fn.run(step)
        if w.logger is not None:
            for v, counts in zip(values, self.held):
                w.logger.record(v, *counts)
        self.held = []
        return values[-1] if values else None

    def _counts(self, piece: Any) -> tuple:
        step = self.windows.step
        return step.batch_size * step.weight, step.log_weight, piece if step.weight else None

    def _record(self, values: Optional[dict], piece: Any) -> None:
        if self.windows.logger is not None:
            self.windows.logger.record(values, *self._counts(piece))

    def restart(self) -> None:
        """After an out-of-memory error (``auto``): the window begins again, nothing of it counted yet."""
        self.windows.step.restart_window()
        self.held = []
