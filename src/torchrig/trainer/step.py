"""The training step, in one place.

``default_step`` is the whole step for "one model, one loss, one optimizer": forward under autocast,
loss, backward (scaled for accumulation), then — at the end of an accumulation window — unscale,
clip, optimizer step and zero_grad. A custom step (a GAN, multi-task losses) is an ordinary function
of ``(step, batch)`` that calls the same four primitives of :class:`Step`:
``step.autocast()``, ``step.backward(loss)``, ``step.optimizer_step(name)`` and returns the values to
log. Precision, accumulation, clipping, gradient sync, checkpoints and logging stay torchrig's job.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import runtime
from ..errors import TorchrigError
from . import outputs
from .outputs import ModelIO, call_model, split_batch
from . import normalize
from .state import TrainState

LABEL_KEYS = outputs.LABEL_KEYS  # a dict batch's target keys, tried in this order (data.label_key overrides)


class NonFiniteLossError(TorchrigError, FloatingPointError):
    """The loss or the gradients became NaN or infinite; the message names the optimizer step."""


def _total_norm(grads: list, norm_type: float) -> torch.Tensor:
    """The norm of all gradients together (a plain tensor also for FSDP2's sharded gradients)."""
    if not grads:
        return torch.zeros(())
    if grads[0].device.type in ("cpu", "cuda") and _plain(grads):
        # get_total_norm's own two ops, without its grouping by device and dtype (half its time on a small model)
        norm_type = float(norm_type)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
    return _total_norm_of(grads, norm_type)


def finite_parameters(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter is finite, on every rank (collective with several ranks; FSDP shards too)."""
    bad = torch.zeros(1, device=device)
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
            bad.fill_(1)
            break
    return not runtime.all_reduce_max(bad).item()


class _FiniteCheck:
    """Whether all gradients are finite, with the fused check GradScaler uses (one op, no allocation).

    ``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1 sets a flag on any NaN / inf
    and leaves the values as they are (x * 1 == x). Sharded (DTensor) or sparse gradients, or several
    devices, take the norm instead. About 7 µs against 24 µs for a norm on a small MLP on one CPU core.
    """

    def __init__(self) -> None:
        self._device: Optional[tuple] = None  # (flag, one) of flag(), which callers read later
        # optimizer id -> (flag, one) of finite() on its gradients' device when they suit the fused check,
        # else None (decided once); finite() never leaves a flag set
        self._host: dict = {}

    def finite(self, grads: list, key: Any = None) -> bool:
        """The host decision for one optimizer's gradients (``key`` names it: what its gradients are like is
        looked at once, not at every step). The flag stays 0 between steps, so no op resets it."""
        if not grads:
            return True
        pair = self._host.get(key, False)
        if pair is False:
            pair = self._host[key] = _flag_pair(None, grads[0].device) if _plain(grads) else None
        if pair is None:
            return not self.flag(grads).item()
        found, one = pair
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        if found.item():
            found.zero_()
            return False
        return True

    def flag(self, grads: list, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """1.0 when any gradient (or ``norm``, when measured) is NaN / inf, else 0.0: a one-element tensor on
        the gradients' device, read by no one here (the caller decides on the host or on the device)."""
        if norm is not None:
            return (~torch.isfinite(norm.detach())).float().reshape(1)
        if not grads:
            return torch.zeros(1)
        if not _plain(grads):
            return (~torch.isfinite(_total_norm_of(grads, 2.0))).float().reshape(1)
        self._device = found, one = _flag_pair(self._device, grads[0].device)
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return found


def _flag_pair(pair: Optional[tuple], device: torch.device) -> tuple:
    """``pair`` (a flag and a one for the fused check) when it lives on ``device``, else a new one there."""
    if pair is None or pair[0].device != device:
        return torch.zeros(1, device=device), torch.ones(1, device=device)
    return pair


def _plain(grads: list) -> bool:
    """Dense tensors of one device and dtype: what the fused check takes."""
    device, dtype = grads[0].device, grads[0].dtype
    return all(type(g) is torch.Tensor and g.layout == torch.strided and g.device == device and g.dtype == dtype
               for g in grads)


# Optimizers whose fused kernels take ``found_inf`` (as GradScaler passes it) and then skip the whole
# update on the device, step counters included: a non-finite step is dropped without a host read.
_DEVICE_SKIP = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` can drop a non-finite update on the device (plain tensors: FSDP2's sharded
    parameters take the host check, one read per step)."""
    if type(opt) not in _DEVICE_SKIP or not opt.defaults.get("fused"):
        return False
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    return first is not None and not hasattr(first, "to_local") and prime_momentum(opt)


def prime_momentum(opt: torch.optim.Optimizer) -> bool:
    """Make a fused SGD's momentum buffers (zeros) before its first step; False if that would change its result.

    PyTorch's fused SGD creates them with ``empty_like`` in its first step and, when that step is skipped on
    the device (``found_inf``: an fp16 overflow, a NaN window), keeps them uninitialised: the next step would
    take garbage as momentum. Zeros give the first step's own result (``buf = momentum·0 + (1 − 0)·grad``,
    bitwise ``grad``) when ``dampening`` is 0; with another dampening the first step differs, so such an
    optimizer is left alone (False) and its non-finite steps are decided on the host.
    """
    if type(opt) is not torch.optim.SGD or not opt.defaults.get("fused"):
        return True
    size = sum(len(g["params"]) for g in opt.param_groups)
    if _PRIMED.get(opt) == size:  # done for these parameters (add_param_group makes more)
        return True
    primed = True
    for group in opt.param_groups:
        if not group["momentum"]:
            continue
        for p in group["params"]:
            state = opt.state[p]
            if state.get("momentum_buffer") is None:
                if group["dampening"]:
                    primed = False
                    continue
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if primed:
        _PRIMED[opt] = size
    return primed


_PRIMED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> parameters primed


def _scaler_found_inf(scaler: Any, opt: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """Whether GradScaler skipped ``opt``'s last update (a 0-d float tensor on the device; None when the scaler
    is disabled). Read from the scaler's per-optimizer record, which its ``step`` fills and ``update`` clears:
    ``get_scale()`` before and after ``update`` would wait for the GPU twice a step."""
    record = scaler._per_optimizer_states.get(id(opt), {}).get("found_inf_per_device")
    if not record:
        return None
    flags = list(record.values())
    found = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).amax()
    return (found > 0).float().reshape(())


def _total_norm_of(grads: list, norm_type: float) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _finite(norm: torch.Tensor) -> bool:
    # One scalar read per optimizer step; on CPU it is a plain memory load.
    return math.isfinite(norm.item())


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, (list, tuple)) and batch:  # the usual (inputs, target): the inputs' length
        batch = batch[0]
        if isinstance(batch, torch.Tensor) and batch.ndim:
            return batch.shape[0]
        return batch_size_of(batch)
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


class Step:
    """What a step function sees, and the owner of each optimizer step's bookkeeping.

    One object per ``fit``. The loop calls :meth:`begin_window` before the first micro-batch of an
    accumulation window (the micro-batches of one optimizer step), the step function for each
    micro-batch, and :meth:`end_window` after the last: GradScaler update, skip counting, the step
    counter and per-step schedulers live there, in one place.
    """

    def __init__(self, *, model: nn.Module, models: dict, optimizers: dict, loss_fn: Optional[Callable],
                 precision: Any, device: torch.device, clip_grad_norm: Optional[float] = None,
                 clip_norm_type: float = 2.0, clip_grad_value: Optional[float] = None,
                 on_nonfinite: str = "error", metrics: Optional[list] = None, state: Optional[TrainState] = None,
                 schedulers: Optional[dict] = None, scheduler_interval: str = "step", io: Optional[ModelIO] = None,
                 loss_normalization: str = "auto", grad_ranks: int = 1, count_unit: float = 1.0):
        self.model = model              # what to call (DDP / FSDP wrapped); the user's module otherwise
        self.models = models            # name -> wrapped sub-model, for nn.ModuleDict models (GANs)
        self.optimizers = optimizers    # name -> optimizer ("default" for a single one)
        self.loss_fn = loss_fn
        self.io = io or ModelIO()     # output_key, data.input_keys, data.label_key (see trainer/outputs.py)
        self.precision = precision
        self.device = device
        self.clip_grad_norm = clip_grad_norm
        self.clip_norm_type = clip_norm_type
        self.clip_grad_value = clip_grad_value
        self.on_nonfinite = on_nonfinite
        self.metrics = metrics or []
        self.state = state if state is not None else TrainState()
        self.schedulers = schedulers or {}
        self.per_step_schedulers = list(self.schedulers.values()) if scheduler_interval == "step" else []
        # loss normalisation (see trainer/normalize.py)
        self.loss_normalization = loss_normalization
        self.grad_ranks = grad_ranks    # ranks whose gradients DDP / FSDP2 average
        self.count_unit = count_unit    # a fixed scale (per-rank batch size): loss × count / unit stays near loss
        self.shift_labels = normalize.shifts_labels(model)
        self.class_last = normalize.is_hugging_face(model)  # token logits (B, T, classes), not PyTorch's (B, C, T)
        self.batch: Any = None          # the current micro-batch, set by the loop
        self.batch_size = 1             # its samples (batch_size_of; 1 for no batch), set with it
        self.weight = 1                 # 0 for a rank's filler micro-batch (its loss counts nothing)
        self.count: normalize.Count = 0  # items of the current micro-batch (set by its first backward)
        self._window_count: Optional[normalize.Count] = None  # None: no backward counted in this window
        self._counted = False
        self._factor: Any = None
        self.window_samples: Optional[int] = None  # the window's global sample count, when known (begin_window)
        self._whole = False             # the window is one whole micro-batch on one process (begin_window)
        self.cuts_batches = False       # set by MicroBatcher when data.micro_batch_size cuts loaded batches
        # where the loop is
        self.epoch = 0
        self.batch_index = 0           # micro-batch index in the epoch
        self.window_size = 1           # micro-batches in the current accumulation window
        self.sync_gradients = True     # True on the last micro-batch of a window
        # per-window results, read by the loop
        self.grad_norm: Optional[torch.Tensor] = None
        self.want_grad_norm = False     # set by the loop on log steps
        self.stepped = False
        self._nonfinite: Optional[torch.Tensor] = None
        self._buffers: list = []
        self._check = _FiniteCheck()
        # Host reads of the non-finite decision: on CPU a scalar read is a memory load; on an accelerator a
        # read waits for the GPU, so the decision stays there (see optimizer_step) and is read at settle().
        self.host_checks = device.type == "cpu"
        self.world_size = runtime.get_world_size()
        # decided on the device (found_inf): this window skipped / non-finite, their sums until settle() reads them
        self._window_found = self._window_bad = None  # type: Optional[torch.Tensor]
        self._unsettled: Optional[torch.Tensor] = None     # [skipped windows, bad windows] on the device
        self._settled_step = 0
        self.before_update: Optional[Callable] = None  # fn(optimizer) before each update (see trainer/microbatch.py)
        self.activation: Optional[Callable] = None  # in predict: the activation asked for (see inference.predict)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    # -- the accumulation window -----------------------------------------------------------------
    def begin_window(self, size: int, samples: Optional[int] = None) -> None:
        """Before the first of the ``size`` micro-batches of one optimizer step. ``samples``: the window's
        samples over all ranks when the sampler knows them and the step counts samples (``default_step``), so
        that the global count needs no all-reduce and a full window no rescaling at all."""
        self.window_size = size
        self.window_samples = samples
        self._window_count, self._factor = None, None
        # One whole micro-batch on one process: the window's count is its own, so its loss weighs exactly 1
        # and the gradients need no rescaling (no op; bitwise what a hand-written loop computes).
        self._whole = size == 1 and self.grad_ranks == 1 and not self.cuts_batches
        self._nonfinite = None
        self._window_found = self._window_bad = None
        self.grad_norm = None
        self.stepped = False
        if self.on_nonfinite == "skip":  # a skipped window must not leave NaN in BatchNorm running stats
            self._buffers = [b.detach().clone() for b in self.model.buffers()]

    def end_window(self) -> bool:
        """After the window's last micro-batch: count the optimizer step. True: the loop goes on to the step's end.

        One rule wherever the decision is taken: every window is an optimizer step (``global_step`` counts
        it, per-step schedulers step, ``on_step_end`` runs), and a window whose update was not applied
        (non-finite values, an fp16 overflow) is also counted in ``skipped_steps`` and leaves the weights and
        the EMA as they were. On a GPU the decision stays on the device (no wait for it): its count is read
        at the next log step or checkpoint (:meth:`settle`); on the CPU it is known at once.
        """
        scaler = self.precision.scaler
        if scaler is not None and self.stepped:
            scaler.update()  # lowers the scale after an overflow, on the device (nothing read here)
        if self._window_found is not None:  # decided on the device: summed there, read at settle()
            bad = self._window_bad if self._window_bad is not None else torch.zeros_like(self._window_found)
            pair = torch.stack([self._window_found, bad])
            self._unsettled = pair if self._unsettled is None else self._unsettled + pair
        elif not self.stepped:  # decided on the host: a non-finite window dropped (once, however many optimizers)
            self.state.skipped_steps += 1
        self.state.global_step += 1
        if self.per_step_schedulers:
            if self.stepped:
                for sch in self.per_step_schedulers:
                    sch.step()
            else:
                with warnings.catch_warnings():  # a first window skipped on the host never called optimizer.step
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                    for sch in self.per_step_schedulers:
                        sch.step()
        if self._unsettled is not None and self.want_grad_norm:  # a log step reads the device anyway
            self.settle(self.state.global_step)
        return True

    @property
    def window_skipped(self) -> Any:
        """Whether the last window's update was not applied: a bool when the host decided, else a 0-d float
        tensor on the device (1.0: skipped), so that what follows (the EMA) can depend on it without a read."""
        return self._window_found if self._window_found is not None else not self.stepped

    def set_batch(self, batch: Any, weight: int = 1) -> None:
        """Before the step function runs on ``batch`` (``weight`` 0: a filler that must count nothing)."""
        self.batch, self.weight = batch, weight
        self.batch_size = batch_size_of(batch)  # samples of this micro-batch (read several times per step)
        self.count, self._counted = 0, False

    def count_of(self, target: Any = None) -> normalize.Count:
        """Items (samples or valid tokens, as ``loss_normalization`` says) of the current micro-batch's
        ``target`` (its own target when None); a device tensor for tokens, so nothing waits."""
        if target is None:
            target = self.split(self.batch)[1]
        mode = self.loss_normalization
        if mode == "micro_batches":
            return 1
        return normalize.count_items(mode, target, self.batch_size, self.shift_labels)

    @property
    def log_weight(self) -> normalize.Count:
        """How much the current micro-batch's logged values weigh: its count (the samples of the batch when
        the step function did not call :meth:`backward`), or 1 per micro-batch with ``micro_batches``. Counts of
        samples are given in full batches (``count / data.batch_size``); only the ratios matter."""
        if self.loss_normalization == "micro_batches":
            return self.weight
        count = self.count if self._counted else self.batch_size * self.weight
        if isinstance(count, torch.Tensor):
            return count
        # in units of a full batch: a full batch weighs 1, and the logger then needs no multiply per step
        return 1 if count == self.count_unit else count / self.count_unit

    # -- the primitives ----------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return next(iter(self.optimizers.values()))

    def autocast(self):
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, count: Optional[normalize.Count] = None, *,
                 retain_graph: bool = False) -> None:
        """Backward of ``loss``, a mean over ``count`` items (samples or valid tokens; by default those of
        the current micro-batch, see :meth:`count_of`), weighted so that the optimizer step sees the mean
        over the whole global batch (and scaled for fp16). The first backward of a micro-batch adds its
        count to the window; further ones (a GAN's second loss) reuse the batch's count."""
        if loss.is_cpu and loss.numel() == 1 and self.host_checks:
            # On CPU reading the scalar is one cheap call; torch.isfinite would be five tensor ops.
            if not math.isfinite(loss.item()):
                self._nonfinite = True
        else:  # on an accelerator the flag stays on the device: no sync before the optimizer step
            finite = torch.isfinite(loss.detach()).all()
            self._nonfinite = ~finite if self._nonfinite is None else self._nonfinite | ~finite
        scaled = self._weighted(loss, count)
        if self.precision.scaler is not None:
            scaled = self.precision.scaler.scale(scaled)
        scaled.backward(retain_graph=retain_graph)

    def _weighted(self, loss: torch.Tensor, count: Optional[normalize.Count]) -> torch.Tensor:
        if self.loss_normalization == "micro_batches":
            if self.weight == 0:
                return loss * 0.0
            return loss / self.window_size if self.window_size > 1 else loss
        default = count is None
        if default:
            count = self.count if self._counted else self.count_of()
        count = count * self.weight
        first = not self._counted
        if first:
            self.count, self._counted = count, True
            self._window_count = count if self._window_count is None else self._window_count + count
        if self._whole:  # a further loss with a count of its own weighs count / the micro-batch's count
            if first or default:
                return loss
            n = self._window_count
            return loss * (count / (n.clamp_min(1) if isinstance(n, torch.Tensor) else max(n, 1)))
        if not isinstance(count, torch.Tensor) and count == self.count_unit:
            return loss  # a full batch of samples: nothing to weigh (and no extra op per micro-batch)
        return loss * (count / self.count_unit)  # a float32 factor even for a bf16 loss (counts stay exact)

    def _window_factor(self) -> Any:
        """What turns the window's summed gradients into the global-batch mean; one all-reduce of the
        count per window, made by every rank before any may reject the window (no rank left waiting).
        None (gradients left as they are) when no loss went through :meth:`backward` in this window, or
        when the window is one whole micro-batch on one process (its count is the global one)."""
        if (self._factor is None and self.loss_normalization != "micro_batches" and self._window_count is not None
                and not self._whole):
            if self.window_samples is not None and not isinstance(self._window_count, torch.Tensor):
                # sample counts whose global sum the sampler knows: the factor is a Python number (1.0, no op,
                # for full batches), the same on every rank, with no all-reduce and no copy to the device
                self._factor = self.grad_ranks * self.count_unit / max(self.window_samples, 1)
            else:
                self._factor = normalize.window_factor(self._window_count, self.grad_ranks, self.count_unit,
                                                       self.device)
        return self._factor

    def optimizer_step(self, name: Optional[str] = None) -> bool:
        """At the end of a window: unscale, check, clip, step, zero_grad. Returns whether a step was taken.

        Nothing non-finite is applied: a NaN / inf gradient skips the step or raises, as ``on_nonfinite``
        says. The decision is the same on every rank: it reads the gradients after their all-reduce (a NaN
        loss on one rank gives NaN gradients on all); in one process a NaN loss decides too. Under fp16 the
        GradScaler finds inf gradients itself and lowers its scale instead (counted as a skipped step).

        On an accelerator with a fused SGD / Adam / AdamW (the default there) the decision stays on the
        device: the fused kernel skips the update, and the count of such windows is read at the next log
        step or checkpoint (``settle``), where ``on_nonfinite=error`` raises. Other optimizers read one
        flag per optimizer step, since they would apply a non-finite update otherwise.
        """
        if not self.sync_gradients:
            return False
        opt = self.optimizers[name] if name is not None else self.optimizer
        if self.before_update is not None:
            self.before_update(opt)
        scaler = self.precision.scaler
        factor = self._window_factor()  # its all-reduce runs before any rank may reject the window
        loss_flag = self._nonfinite if self.world_size == 1 else None  # several ranks: the gradients decide
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if factor is not None:  # before unscale (linear: the same result), clipping and the finite check
            normalize.scale_gradients([p.grad for p in params], factor)
        if scaler is not None:
            # GradScaler decides from the gradients (a non-finite loss makes them non-finite too), on the device
            # for a fused optimizer; the loss flag only says whether on_nonfinite=error reports the window
            if self.clip_grad_norm or self.clip_grad_value or self.want_grad_norm:
                scaler.unscale_(opt)
                self._clip(params)
            prime_momentum(opt)
            scaler.step(opt)  # skips the update itself when the gradients hold inf / NaN
            found = _scaler_found_inf(scaler, opt)
            if found is not None:
                bad = None
                if isinstance(loss_flag, torch.Tensor):
                    bad = loss_flag.to(found.device, torch.float32).reshape(())
                elif loss_flag:  # read on the host already (the CPU's check)
                    bad = torch.ones_like(found)
                self._note_window(found, bad)
        else:
            norm = self._clip(params)  # when a norm is measured anyway, it carries the check
            if not self.host_checks and skips_on_device(opt):
                self._step_on_device(opt, params, norm, loss_flag)
            else:
                if loss_flag is not None and bool(loss_flag):
                    return self._reject(opt, "loss is not finite")
                if not (_finite(norm) if norm is not None else self._check.finite([p.grad for p in params], id(opt))):
                    local = self._nonfinite is not None and bool(self._nonfinite)
                    return self._reject(opt, "gradients are not finite" + (
                        " (this process's loss is not finite)" if local else " (the loss is)"))
                opt.step()
        opt.zero_grad(set_to_none=True)
        self.stepped = True
        return True

    def _step_on_device(self, opt: torch.optim.Optimizer, params: list, norm: Optional[torch.Tensor],
                        loss_flag: Any) -> None:
        """The fused update, skipped by the kernel itself when the flag is set (no host read)."""
        found = self._check.flag([p.grad for p in params], norm) if params else torch.zeros(1, device=self.device)
        found = found.reshape(())  # a new tensor: the check's buffer is reused by the window's next optimizer
        found = torch.maximum(found, loss_flag.float()) if loss_flag is not None else found.clone()
        opt.grad_scale, opt.found_inf = None, found
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf
        if self.on_nonfinite == "skip" and self._buffers:
            with torch.no_grad():
                bad = found.bool()
                for b, saved in zip(self.model.buffers(), self._buffers):
                    b.copy_(torch.where(bad, saved, b))
        self._note_window(found, found)

    def _note_window(self, skipped: torch.Tensor, bad: Optional[torch.Tensor]) -> None:
        """One optimizer's device-side decision in this window (several optimizers: any of them)."""
        w = self._window_found
        self._window_found = skipped if w is None else torch.maximum(w, skipped)
        if bad is not None:
            b = self._window_bad
            self._window_bad = bad if b is None else torch.maximum(b, bad)

    def settle(self, upto: Optional[int] = None) -> None:
        """Read the windows decided on the device since the last call (one host read): count the skipped ones,
        or raise under ``on_nonfinite=error`` if any held non-finite values. The loop calls it at log steps and
        before each checkpoint."""
        if self._unsettled is None:
            return
        skipped, bad = (int(v) for v in self._unsettled.tolist())
        self._unsettled = None
        first, self._settled_step = self._settled_step + 1, upto or self.state.global_step
        if bad and self.on_nonfinite == "error":
            raise NonFiniteLossError(
                f"the loss or the gradients were not finite in {bad} optimizer step(s) between step {first} and "
                f"step {self._settled_step}; those updates were not applied and the last checkpoint is intact. "
                f"Lower optim.lr, set clip_grad_norm, check the data, or set on_nonfinite=skip to skip such steps")
        self.state.skipped_steps += skipped

    def _reject(self, opt: torch.optim.Optimizer, what: str) -> bool:
        """A non-finite window: raise (``on_nonfinite=error``) or drop its gradients and skip it."""
        if self.on_nonfinite == "error":
            raise NonFiniteLossError(
                f"{what} at optimizer step {self.global_step + 1} (epoch {self.epoch + 1}, "
                f"batch {self.batch_index + 1}); the step was not applied and the last checkpoint is intact. "
                f"Lower optim.lr, set clip_grad_norm, check the data, or set on_nonfinite=skip to skip such steps")
        opt.zero_grad(set_to_none=True)
        self._restore_buffers()
        return False

    def _clip(self, params: list) -> Optional[torch.Tensor]:
        """Clip (unscaled) gradients by value and/or norm; the total norm when one is measured (clipping by
        norm, or a log step), else None. A non-finite norm leaves the gradients non-finite, never hidden."""
        if self.clip_grad_value:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        if not (self.clip_grad_norm or self.want_grad_norm):
            return None
        norm = _total_norm([p.grad for p in params], self.clip_norm_type)
        if self.clip_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad_norm, norm)
        self.grad_norm = norm
        return norm

    # -- conveniences --------------------------------------------------------------------------
    def frozen(self, *models: Any):
        """``with step.frozen("D") as D:`` — no gradient reaches these models' parameters in the block.

        For a loss that goes through a network it must not train (a GAN's generator loss through D):
        without it that backward leaves gradients in D which D's next optimizer step would add to its
        own. Takes names of ``step.models`` or modules, and yields the plain module (a tuple for
        several), without its DDP wrapper: call that one inside, since a DDP module whose parameters
        get no gradient would wait for their all-reduce.
        """
        from .freeze import frozen

        return frozen(self.models, models)

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a batch (a dict's target under ``data.label_key``)."""
        return split_batch(batch, self.io.label_key)

    def forward(self, inputs: Any, model: Optional[Callable] = None, target: Any = None) -> Any:
        """Call the model on ``inputs`` (dict keys chosen by ``forward``'s signature or ``data.input_keys``).

        With ``loss="auto"`` a dict batch's ``target`` goes to ``forward`` too when ``forward`` takes it
        (``labels=`` for Hugging Face models, which then return their loss; see ``outputs.label_keyword``)."""
        model = model or self.model
        labels = None
        if target is not None and isinstance(inputs, dict) and outputs.uses_model_loss(self.loss_fn):
            name = outputs.label_keyword(model, self.io.label_key)
            labels = (name, target) if name is not None and name not in inputs else None
        return call_model(model, inputs, self.io.input_keys, labels)

    def loss(self, output: Any, target: Any) -> tuple[Any, torch.Tensor]:
        """``(prediction, loss)``: the user's loss of the prediction, or the model's own (``loss="auto"``)."""
        return outputs.prediction_and_loss(output, target, self.loss_fn, self.io.output_key)

    def update_metrics(self, output: Any, target: Any) -> None:
        """Update the metrics with the prediction of ``output`` (any model output, see ``unpack``)."""
        if target is None or not self.metrics or self.weight == 0:
            return
        out = outputs.unpack(output, self.io.output_key)[0]
        if not isinstance(out, torch.Tensor):
            raise outputs.OutputError(f"metrics need a tensor prediction, got {type(out).__name__}; set "
                                      f"output_key to the prediction's index or key, or metrics=[]")
        out = out.detach()
        if out.is_floating_point() and out.dtype != torch.float32:
            out = out.float()
        if self.class_last and out.ndim == 3 and isinstance(target, torch.Tensor) and target.ndim == 2:
            out, target = self._token_layout(out, target)
        for m in self.metrics:
            m.feed(out, target)

    def _token_layout(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A Hugging Face model's token logits ``(B, T, C)`` as PyTorch's ``(B, C, T)`` for the metrics; a
        causal LM that computes its own loss predicts ``labels[:, 1:]`` from ``logits[:, :-1]``, so its metrics
        compare those."""
        if logits.shape[:2] != target.shape:
            return logits, target
        if self.shift_labels and outputs.uses_model_loss(self.loss_fn):
            logits, target = logits[:, :-1], target[:, 1:]
        return logits.transpose(1, 2), target

    @torch.no_grad()
    def _restore_buffers(self) -> None:
        for b, saved in zip(self.model.buffers(), self._buffers):
            b.copy_(saved)


def default_step(step: Step, batch: Any) -> dict:
    """zero_grad (after the previous step) → forward under autocast → loss → backward → metrics → step."""
    inputs, target = step.split(batch)
    if target is None:
        raise ValueError("training batches carry no target: give (inputs, target) pairs, a dict with a "
                         "'labels' key (or set data.label_key), or a custom step function")
    with step.autocast():
        output = step.forward(inputs, target=target)
        prediction, loss = step.loss(output, target)
    step.backward(loss, step.count_of(target))
    step.update_metrics(prediction, target)  # before the update: a prediction may be a view of a parameter
    step.optimizer_step()
    return {"loss": loss.detach()}


def default_eval_step(step: Step, batch: Any) -> tuple[Any, Any, Optional[torch.Tensor]]:
    """``(prediction, target, loss)`` of one evaluation batch (called under ``inference_mode``)."""
    inputs, target = step.split(batch)
    with step.autocast():
        output = step.forward(inputs, target=target)
        if target is None:
            return outputs.unpack(output, step.io.output_key)[0], None, None
        prediction, loss = step.loss(output, target)
    return prediction, target, loss
