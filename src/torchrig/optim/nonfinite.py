"""Whether a window's update may be applied: the non-finite decision, in one place.

A window (the micro-batches of one optimizer step) whose loss or gradients hold NaN / inf is never
applied: ``on_nonfinite=error`` raises, ``skip`` drops it. Where the decision is taken depends on where
the run is, not on what is decided:

* **on the host** (a CPU run, or an optimizer without a fused kernel): the loss flag and the gradients'
  check are read at once; a bad window is raised or dropped before ``optimizer.step``;
* **on the device** (a fused SGD / Adam / AdamW on a GPU, the default there; GradScaler under fp16): the
  flag goes to the fused kernel as ``found_inf``, which skips the update itself; nothing waits for the GPU,
  and the count of such windows is read at the next log step or checkpoint (:meth:`NonFiniteGuard.settle`).

One rule for both: every window is an optimizer step (the counter, the per-step schedule and
``on_step_end`` advance), ``skipped_steps`` counts the windows not applied, and a skipped window leaves
the weights, the BatchNorm statistics and the EMA as they were.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch

from .. import runtime
from ..errors import TorchrigError


class NonFiniteLossError(TorchrigError, FloatingPointError):
    """The loss or the gradients became NaN or infinite; the message names the optimizer step."""


ADVICE = "Lower optim.lr, set clip_grad_norm, check the data, or set on_nonfinite=skip to skip such steps"

# Optimizers whose fused kernels take ``found_inf`` (as GradScaler passes it) and then skip the whole
# update on the device, step counters included: a non-finite step is dropped without a host read.
_DEVICE_SKIP = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_PRIMED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> parameters primed


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


def plain_tensors(grads: list) -> bool:
    """Dense tensors of one device and dtype: what the fused check takes."""
    device, dtype = grads[0].device, grads[0].dtype
    return all(type(g) is torch.Tensor and g.layout == torch.strided and g.device == device and g.dtype == dtype
               for g in grads)


def total_norm(grads: list, norm_type: float) -> torch.Tensor:
    """The norm of all gradients together (a plain tensor also for FSDP2's sharded gradients)."""
    if not grads:
        return torch.zeros(())
    if grads[0].device.type in ("cpu", "cuda") and plain_tensors(grads):
        # get_total_norm's own two ops, without its grouping by device and dtype (half its time on a small model)
        norm_type = float(norm_type)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
    groups: dict = {}  # tensor-parallel runs mix DTensor gradients (by mesh) with plain ones: a norm per kind
    for g in grads:
        groups.setdefault(id(g.device_mesh) if hasattr(g, "device_mesh") else None, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), float(norm_type))


def norm_over_ranks(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm of the gradients of every rank of ``group`` together, from each rank's ``norm`` of its own (pipeline
    stages hold different parameters): the largest for ``inf``, else ``(Σ normᵖ)^(1/p)``, summed in float64."""
    p = float(norm_type)
    if math.isinf(p):
        out = norm.detach().clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
        return out
    total = runtime.all_reduce_sum(norm.detach().double() ** p, group, name="gradient norm")
    return (total ** (1.0 / p)).to(norm.dtype)


def finite(norm: torch.Tensor) -> bool:
    """One scalar read (on CPU a plain memory load)."""
    return math.isfinite(norm.item())


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
            pair = self._host[key] = _flag_pair(None, grads[0].device) if plain_tensors(grads) else None
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
        if not plain_tensors(grads):
            return (~torch.isfinite(total_norm(grads, 2.0))).float().reshape(1)
        self._device = found, one = _flag_pair(self._device, grads[0].device)
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return found


def _flag_pair(pair: Optional[tuple], device: torch.device) -> tuple:
    """``pair`` (a flag and a one for the fused check) when it lives on ``device``, else a new one there."""
    if pair is None or pair[0].device != device:
        return torch.zeros(1, device=device), torch.ones(1, device=device)
    return pair


def scaler_found_inf(scaler: Any, opt: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """Whether GradScaler skipped ``opt``'s last update (a 0-d float tensor on the device; None when the scaler
    is disabled). Read from the scaler's per-optimizer record, which its ``step`` fills and ``update`` clears:
    ``get_scale()`` before and after ``update`` would wait for the GPU twice a step."""
    record = scaler._per_optimizer_states.get(id(opt), {}).get("found_inf_per_device")
    if not record:
        return None
    flags = list(record.values())
    found = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).amax()
    return (found > 0).float().reshape(())


class NonFiniteGuard:
    """The decision of every window, on the host or on the device (see the module's text).

    ``host`` is whether flags may be read at once (True on a CPU run; tests turn it off to run the GPU's
    path on the CPU). ``model`` is the module whose buffers a skipped window restores.
    """

    def __init__(self, mode: str, device: torch.device, world_size: int, model: torch.nn.Module, *,
                 agree: bool = False, host: Optional[bool] = None):
        self.mode, self.world_size, self.model = mode, world_size, model
        self.host = device.type == "cpu" if host is None else host
        # ``agree``: ranks whose gradients differ after the all-reduce (tensor parallel: each holds its shard): the
        # host decision is agreed (any rank's non-finite gradients drop the window everywhere), never on the device.
        self.agree = agree
        self.check = _FiniteCheck()
        self.loss_flag: Any = None       # this window's loss flag: True (host), a device bool, or None
        self.found: Optional[torch.Tensor] = None  # this window decided on the device: skipped (1.0) or not
        self.bad: Optional[torch.Tensor] = None    # ... and whether it held non-finite values (error's business)
        self.unsettled: Optional[torch.Tensor] = None  # [skipped windows, bad windows] until settle() reads them
        self.settled_step = 0
        self._buffers: list = []

    def begin_window(self) -> None:
        self.loss_flag, self.found, self.bad = None, None, None
        if self.mode == "skip":  # a skipped window must not leave NaN in BatchNorm running stats
            self._buffers = [b.detach().clone() for b in self.model.buffers()]

    def note_loss(self, loss: torch.Tensor) -> None:
        """Called by every backward: on CPU reading the scalar is one cheap call (torch.isfinite would be five
        tensor ops); on an accelerator the flag stays on the device, read by no one before the update."""
        if loss.is_cpu and loss.numel() == 1 and self.host:
            if not math.isfinite(loss.item()):
                self.loss_flag = True
        else:
            ok = torch.isfinite(loss.detach()).all()
            self.loss_flag = ~ok if self.loss_flag is None else self.loss_flag | ~ok

    def apply(self, opt: torch.optim.Optimizer, params: list, norm: Optional[torch.Tensor],
              where: Callable[[], str]) -> bool:
        """``opt.step()`` unless the window is non-finite (``norm``: the gradients' norm when measured, which
        carries the check; ``where()``: the step, for a message). Returns False for a window dropped on the host
        (raised under ``error``)."""
        loss_flag = self.loss_flag if self.world_size == 1 else None  # several ranks: the gradients decide
        if not self.host and not self.agree and skips_on_device(opt):
            self._apply_on_device(opt, params, norm, loss_flag)
            return True
        if loss_flag is not None and bool(loss_flag):
            return self.reject(opt, "loss is not finite", where)
        grads = [p.grad for p in params]
        if self.agree:  # each rank checks its own pieces; the ranks then agree
            grads = [runtime.local_tensor(g) for g in grads if g is not None]
        ok = finite(norm) if norm is not None else self.check.finite(grads, id(opt))
        if self.agree:
            ok = not runtime.agree_max([0.0 if ok else 1.0], _device(opt), name="non-finite check")[0]
        if not ok:
            local = self.loss_flag is not None and bool(self.loss_flag)
            return self.reject(opt, "gradients are not finite" + (
                " (this process's loss is not finite)" if local else " (the loss is)"), where)
        opt.step()
        return True

    def _apply_on_device(self, opt: torch.optim.Optimizer, params: list, norm: Optional[torch.Tensor],
                         loss_flag: Any) -> None:
        """The fused update, skipped by the kernel itself when the flag is set (no host read)."""
        found = self.check.flag([p.grad for p in params], norm) if params else torch.zeros(1, device=_device(opt))
        found = found.reshape(())  # a new tensor: the check's buffer is reused by the window's next optimizer
        if isinstance(loss_flag, torch.Tensor):
            found = torch.maximum(found, loss_flag.to(found.device).float())
        else:
            found = torch.ones_like(found) if loss_flag else found.clone()
        opt.grad_scale, opt.found_inf = None, found
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf
        if self.mode == "skip" and self._buffers:
            with torch.no_grad():
                bad = found.bool()
                for b, saved in zip(self.model.buffers(), self._buffers):
                    b.copy_(torch.where(bad, saved, b))
        self.note(found, found)

    def note_scaler(self, scaler: Any, opt: torch.optim.Optimizer) -> None:
        """After ``scaler.step(opt)``: GradScaler decided from the gradients, on the device (a non-finite loss
        makes them non-finite too); the loss flag only says whether ``on_nonfinite=error`` reports the window."""
        found = scaler_found_inf(scaler, opt)
        if found is None:
            return
        bad = None
        if isinstance(self.loss_flag, torch.Tensor) and self.world_size == 1:
            bad = self.loss_flag.to(found.device, torch.float32).reshape(())
        elif self.loss_flag is True and self.world_size == 1:
            bad = torch.ones_like(found)
        self.note(found, bad)

    def note(self, skipped: torch.Tensor, bad: Optional[torch.Tensor]) -> None:
        """One optimizer's device-side decision in this window (several optimizers: any of them)."""
        self.found = skipped if self.found is None else torch.maximum(self.found, skipped)
        if bad is not None:
            self.bad = bad if self.bad is None else torch.maximum(self.bad, bad)

    def reject(self, opt: torch.optim.Optimizer, what: str, where: Callable[[], str]) -> bool:
        """A non-finite window decided on the host: raise (``on_nonfinite=error``) or drop it."""
        if self.mode == "error":
            raise NonFiniteLossError(f"{what} at {where()}; the step was not applied and the last checkpoint is "
                                     f"intact. {ADVICE}")
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self._buffers):
                b.copy_(saved)
        return False

    def end_window(self, applied: bool) -> bool:
        """The window's outcome once it ended: True when it was dropped on the host (count it now); a device
        decision is summed on the device, for :meth:`settle`."""
        if self.found is None:
            return not applied
        bad = self.bad if self.bad is not None else torch.zeros_like(self.found)
        pair = torch.stack([self.found, bad])
        self.unsettled = pair if self.unsettled is None else self.unsettled + pair
        return False

    def skipped(self, applied: bool) -> Any:
        """Whether the last window's update was not applied: a bool when the host decided, else a 0-d float
        tensor on the device (1.0: skipped), so that what follows (the EMA) can depend on it without a read."""
        return self.found if self.found is not None else not applied

    def settle(self, upto: int) -> int:
        """Read the windows decided on the device since the last call (one host read): the number skipped, or
        ``NonFiniteLossError`` under ``on_nonfinite=error`` if any held non-finite values."""
        if self.unsettled is None:
            return 0
        skipped, bad = (int(v) for v in self.unsettled.tolist())
        self.unsettled = None
        first, self.settled_step = self.settled_step + 1, upto
        if bad and self.mode == "error":
            raise NonFiniteLossError(
                f"the loss or the gradients were not finite in {bad} optimizer step(s) between step {first} and "
                f"step {upto}; those updates were not applied and the last checkpoint is intact. {ADVICE}")
        return skipped


def _device(opt: torch.optim.Optimizer) -> torch.device:
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    return first.device if first is not None else torch.device("cpu")
