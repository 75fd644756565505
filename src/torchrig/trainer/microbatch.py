"""Micro-batches: each loaded batch cut into chunks, and ``data.micro_batch_size=auto``.

With ``data.micro_batch_size=N`` every loaded batch of ``data.batch_size`` rows is cut into chunks of
``N`` rows (dim 0 of every tensor, through nested tuples, lists and dicts); the chunks of the
``accumulate`` loaded batches of an optimizer step are the micro-batches of one accumulation window.
The loss of each chunk is weighed by its own count (``Step.backward``) and the window's gradients are
rescaled by the global count at its end (``trainer/normalize.py``), so the optimizer step sees the
same mean as with the whole batch at once (to float rounding).

``auto`` starts with the loaded batch as the micro-batch. When ``torch.cuda.OutOfMemoryError`` is
raised anywhere in a window, the window's partial gradients are dropped, memory is freed, the
micro-batch is halved and the window is run again from its first loaded batch (kept on the device
until the window ends). What the failed attempt touched is put back first: the metric states, the
logged sums, the model's buffers (BatchNorm statistics) and torch's random generators, so the result
equals a run configured with the final size from the start. The size is saved in checkpoints.

With several DDP ranks, an OOM on one rank must not leave another waiting in a gradient all-reduce:
every micro-batch of the window runs under ``no_sync``; before the first optimizer update of the
window every rank all-reduces one flag (max: did any rank run out of memory?), and then, if none
did, each optimizer's gradients are averaged here (one flat all-reduce per dtype) instead of by DDP's
overlapped buckets. The cost is that communication no longer overlaps the backward; it stays so for
the whole run, since a later batch (longer sequences) may still run out of memory. Set
``data.micro_batch_size`` to the logged size to get DDP's overlapped path back. FSDP2 is refused.
"""

from __future__ import annotations

import gc
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed

from .. import parallel, runtime
from ..config import ConfigError
from ..data.batches import batch_size_of
from ..errors import TorchrigError


class MicroBatchError(TorchrigError, RuntimeError):
    """Out of memory even at a micro-batch of one row, or after an optimizer update of the window."""


class _PeerOutOfMemory(TorchrigError, RuntimeError):
    """Another rank ran out of memory in this window (every rank learnt it from the same all-reduce); caught
    by the micro-batching itself, never seen by users."""


def chunks(batch: Any, size: Optional[int]) -> list:
    """``batch`` cut into pieces of ``size`` rows along dim 0 of every tensor (the batch itself when it
    fits). Tensors of another length and non-tensor leaves go to every piece unchanged."""
    if size is None:
        return [batch]
    n = batch_size_of(batch)
    if n <= size:
        return [batch]
    count = math.ceil(n / size)
    return [_slice(batch, k * size, size, n) for k in range(count)]


def _slice(x: Any, start: int, size: int, n: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x.narrow(0, start, min(size, n - start)) if x.ndim and x.shape[0] == n else x
    if isinstance(x, dict):
        return type(x)((k, _slice(v, start, size, n)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_slice(v, start, size, n) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_slice(v, start, size, n) for v in x)
    return x


def check_auto(cfg: Any, model: torch.nn.Module, world_size: int) -> None:
    """Before the model is wrapped: ``auto`` with SyncBatchNorm on several processes is refused. SyncBatchNorm
    all-gathers inside the forward, so an out-of-memory error on one rank would leave the others waiting there
    until the backend's timeout."""
    if cfg.data.micro_batch_size != "auto" or world_size < 2:
        return
    if cfg.dist.sync_batchnorm or any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError("config key 'data.micro_batch_size': 'auto' cannot be used with SyncBatchNorm on several "
                          "processes (an out-of-memory error on one rank would leave the others waiting in its "
                          "forward's all-gather); set data.micro_batch_size to an integer, or dist.sync_batchnorm=false")


class Retry:
    """``data.micro_batch_size=auto``: an out-of-memory error in a window drops the window's work, halves the
    micro-batch and runs the window again (see the module's text). Made once per fit; :meth:`begin` at the
    start of each window (``trainer/window.py``) keeps what the window may have to put back.

    ``model``: the user's module (its buffers), ``synced``: the wrapped modules (DDP's flags), ``metrics`` and
    ``logger``: the sums the window adds to; ``agree``: several DDP ranks, which agree on a failure before any
    update and then average the gradients here (``before_update``, given to the step).
    """

    def __init__(self, *, model: torch.nn.Module, synced: list, metrics: list, logger: Any, optimizers: dict,
                 precision: Any, device: torch.device, agree: bool, batch_size: int, accumulate: int,
                 say: Callable[[str], None]):
        self.model, self.synced, self.metrics, self.logger = model, synced, metrics, logger
        self.optimizers, self.precision, self.device = optimizers, precision, device
        self.agreeing = agree        # every micro-batch under no_sync; the ranks agree before any update
        self.batch_size, self.accumulate, self.say = batch_size, accumulate, say
        self.failed = False          # this rank ran out of memory in the current attempt
        self.agreed: Optional[bool] = None  # whether any rank failed, once the ranks agreed (None: not yet)
        self._saved: Any = None

    def begin(self, step: Any) -> "Retry":
        """At a window's start: what a failed attempt will have to put back."""
        self.step, self.failed, self.agreed = step, False, None
        if self.agreeing:
            self._broadcast_buffers()
        self._saved = self._snapshot()
        return self

    def run(self, window: Any, batches: list, last: bool) -> Optional[dict]:
        """Run ``batches`` ((batch, weight, index) loaded batches) in ``window``; None (and ``failed``) when this
        rank or, as agreed, another ran out of memory (or already had in this attempt)."""
        if self.failed:
            return None
        values = None
        try:
            for j, (b, w, index) in enumerate(batches):
                values = window.run_loaded(b, w, index, last and j == len(batches) - 1)
        except torch.cuda.OutOfMemoryError:
            if self.step.stepped:
                raise MicroBatchError(
                    f"out of memory at micro-batch {window.windows.micro_batch_size} after an optimizer update of "
                    f"this window (a step function that updates before its last forward); the window cannot be run "
                    f"again. Set data.micro_batch_size to a smaller integer") from None
            self.failed = True
        except _PeerOutOfMemory:
            self.failed = True
        return None if self.failed else values

    def any_failed(self) -> bool:
        """At the window's end: whether any rank ran out of memory (one all-reduce with several ranks, unless the
        first optimizer update of the window made it already)."""
        if self.agreed is None:
            self.agreed = self._agree(self.failed)
        return self.agreed

    def _agree(self, failed: bool) -> bool:
        if not self.agreeing:
            return failed
        # in host memory when the group takes CPU tensors (gloo beside NCCL, the default): no GPU round trip
        return bool(runtime.agree_max([1.0 if failed else 0.0], self.device, name="out-of-memory agreement")[0])

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers, as DDP copies them before a window's first forward. Here every rank does it at
        the window's start, and DDP's own copy in ``forward`` is turned off: a forward that raised on one
        rank leaves DDP's flag for it set on that rank only, and the ranks' next forwards would disagree."""
        for m in self.synced:
            if getattr(m, "forward_sync_buffers", getattr(m, "broadcast_buffers", False)):
                _broadcast_flat(list(m.module.buffers()))
            m.require_forward_param_sync = False  # DDP sets it after a synced forward (never under auto)

    def before_update(self, opt: torch.optim.Optimizer) -> None:
        """Several ranks: before an optimizer update, agree that no rank ran out of memory (once per window),
        then average this optimizer's gradients over the ranks (DDP's no_sync left them local)."""
        if self.agreed is None:
            self.agreed = self._agree(False)
        if self.agreed:
            raise _PeerOutOfMemory()
        parallel.average_gradients([p for g in opt.param_groups for p in g["params"]])

    # -- after an out-of-memory error ------------------------------------------------------------
    def shrink(self, window: Any) -> None:
        """Drop the failed attempt (gradients, metric and logged sums, buffers, random state), free memory
        and halve the micro-batch; the window then runs again from its first loaded batch."""
        self._drop_gradients()
        self._restore(self._saved)
        gc.collect()
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.empty_cache()
        windows = window.windows
        if windows.micro_batch_size <= 1:
            raise MicroBatchError(
                f"out of memory at a micro-batch of 1 row (data.micro_batch_size=auto, data.batch_size="
                f"{self.batch_size}); the model does not fit on {self.device}: use a smaller model, "
                f"precision=bf16, model.activation_checkpointing, or more devices with dist.strategy=fsdp")
        old = windows.halve()
        per_step = math.ceil(self.batch_size / windows.micro_batch_size) * self.accumulate
        self.say(f"torchrig: out of memory at micro-batch {old}; now {windows.micro_batch_size} "
                 f"(accumulation x{per_step})")
        window.restart()
        self.failed, self.agreed = False, None
        for m in self.synced if self.agreeing else ():
            m.require_forward_param_sync = False  # left set by a forward that raised (see _broadcast_buffers)

    def _drop_gradients(self) -> None:
        scaler = self.precision.scaler
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
            # an out-of-memory error inside optimizer.step (Adam's first step allocates its state) leaves what
            # GradScaler.step set for it: the fused kernel's inputs and the optimizer's stage ("unscaled"), which
            # would refuse the retry's unscale_ or apply it twice
            for attr in ("grad_scale", "found_inf"):
                opt.__dict__.pop(attr, None)
            if scaler is not None:
                scaler._per_optimizer_states.pop(id(opt), None)

    def _snapshot(self) -> tuple:
        log = self.logger
        metrics = [m.snapshot() for m in self.metrics]
        logged = (dict(log.sums), log.count, log.samples) if log is not None else None
        buffers = [b.detach().clone() for b in self.model.buffers()]
        rng = (torch.get_rng_state(),
               torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return metrics, logged, buffers, rng

    @torch.no_grad()
    def _restore(self, saved: tuple) -> None:
        metrics, logged, buffers, rng = saved
        for m, snap in zip(self.metrics, metrics):
            m.restore(snap)
        if logged is not None:
            self.logger.sums, self.logger.count, self.logger.samples = dict(logged[0]), logged[1], logged[2]
        for b, value in zip(self.model.buffers(), buffers):
            b.copy_(value)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], self.device)


def _broadcast_flat(tensors: list) -> None:
    """Rank 0's values of ``tensors``, one broadcast per bucket instead of one per tensor."""
    parallel.flat_collective([t for t in tensors if t.numel()], lambda flat: torch.distributed.broadcast(flat, 0))
