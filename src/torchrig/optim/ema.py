"""Exponential moving average (EMA) of the model's weights, for evaluation and a second set of weights.

After every optimizer step whose update was applied, each float parameter's float32 copy moves towards
the parameter: ``ema = ema + (1 - d) * (param - ema)``, one ``torch._foreach_lerp_`` over all of them, with
``d`` a Python float, so no value is read back from the device. With ``ema_warmup`` the decay grows
with the number of updates ``n``: ``d = min(ema_decay, (1 + n) / (10 + n))``, so early averages are
not dominated by the random initial weights.

Under FSDP2 each rank averages its own shard (``DTensor.to_local()``); the full weights are gathered
only to save them. A checkpoint keeps the averaged weights in ``ema.safetensors`` (the model's
``state_dict`` keys, with the model's buffers, so it loads into the bare model with
``load_state_dict``) and the update count in ``state.pt``; a resume restores both exactly.

Evaluation (``Trainer.evaluate`` and the validation of ``fit``) copies the averages into the
parameters, evaluates, and copies the trained values back: device copies only. The metric names do
not change (so ``checkpoint.monitor`` and early stopping watch the evaluated weights); the first
such evaluation prints ``torchrig: evaluation uses the EMA weights ...``, and
``Trainer.evaluate(data, ema=False)`` evaluates the trained weights instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .. import runtime

WEIGHTS_FILE = "ema.safetensors"


class EMA:
    """A float32 moving average of ``model``'s floating-point parameters (a Stateful object).

    The copies are made at the first update (or read from a checkpoint), so weights loaded before
    training starts (a resume, ``resume_weights_only``) are the starting point.
    """

    weights_file = WEIGHTS_FILE  # CheckpointManager writes ``weights()`` to this file beside model.safetensors

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False):
        self.model, self.decay, self.warmup = model, float(decay), bool(warmup)
        self.names = [n for n, p in model.named_parameters() if p.is_floating_point()]
        self.params = [p for n, p in model.named_parameters() if p.is_floating_point()]
        self.num_updates = 0
        self.shadow: Optional[list[torch.Tensor]] = None
        self.announced = False

    def _start(self) -> list[torch.Tensor]:
        with torch.no_grad():
            self.shadow = [runtime.local_tensor(p).detach().to(torch.float32, copy=True) for p in self.params]
        return self.shadow

    def current_decay(self, updates: Optional[int] = None) -> float:
        """The decay of the next update (after ``updates`` earlier ones, by default ``num_updates``)."""
        if not self.warmup:
            return self.decay
        n = self.num_updates if updates is None else updates
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self, skipped: Any = False) -> None:
        """One step of the average (after an optimizer step); no host synchronisation.

        ``skipped`` says the step's update was not applied (a non-finite window, an fp16 overflow): True
        leaves the average as it is; a 0-d tensor on the device (1.0: skipped, as a GPU step decides it
        without a host read) scales the step's weight by ``1 - skipped`` there. Either way the update is
        counted, so ``ema_warmup``'s decay follows the optimizer steps whatever their outcome.
        """
        self.num_updates += 1
        if self.shadow is None:
            self._start()
        if skipped is True:
            return
        weight = 1.0 - self.current_decay(self.num_updates - 1)
        current = [runtime.local_tensor(p).detach() for p in self.params]
        current = [t if t.dtype == torch.float32 else t.float() for t in current]
        if isinstance(skipped, torch.Tensor):  # per-tensor weights: a 0-d tensor would be read as a Python number
            w = (1.0 - skipped.to(self.shadow[0].device, torch.float32)) * weight
            torch._foreach_lerp_(self.shadow, current, [w] * len(current))
        else:
            torch._foreach_lerp_(self.shadow, current, weight)

    # -- evaluation -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model's parameters inside the block, the trained ones after it."""
        if self.shadow is None:  # no update yet: the average is the weights themselves
            yield
            return
        local = [runtime.local_tensor(p).detach() for p in self.params]
        with torch.no_grad():
            saved = [t.clone() for t in local]
            torch._foreach_copy_(local, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(local, saved)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"decay": self.decay, "warmup": self.warmup, "num_updates": self.num_updates,
                "started": self.shadow is not None}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = int(state.get("num_updates", 0))

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` with the averages in place of the parameters, full tensors.

        Collective under FSDP2 (every rank calls it; the shards are gathered into full tensors).
        """
        shadow = self.shadow or [runtime.local_tensor(p).detach().float() for p in self.params]
        out: dict[str, torch.Tensor] = {}
        for name, p, s in zip(self.names, self.params, shadow):
            if hasattr(p, "to_local"):  # DTensor: the same layout as the parameter, gathered
                from torch.distributed.tensor import DTensor

                s = DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            out[name] = s
        for name, t in self.model.state_dict().items():
            if name not in out:
                out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out

    def load_weights(self, full: Optional[dict[str, torch.Tensor]]) -> None:
        """Restore the averages from ``weights()`` as saved; None (a checkpoint without them) starts
        them again from the model's current weights at the next update."""
        if full is None:
            self.shadow, self.num_updates = None, 0
            return
        shadow = []
        for name, p in zip(self.names, self.params):
            t = full[name].to(torch.float32)
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import distribute_tensor

                t = distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
            shadow.append(t.to(runtime.local_tensor(p).device).clone())
        self.shadow = shadow


def build_ema(cfg: Any, model: nn.Module) -> Optional[EMA]:
    """The EMA of ``model`` (the unwrapped module, after FSDP2 sharding) if ``ema_decay`` is set."""
    if cfg.ema_decay is None:
        return None
    return EMA(runtime.unwrap(model), cfg.ema_decay, cfg.ema_warmup)


def ema_weights(ema: Optional[EMA], use: bool = True, say: Callable[[str], None] = print):
    """A context for evaluation: the EMA weights in the model if the run keeps an EMA (``ema``) and ``use``;
    ``say`` announces it the first time."""
    if ema is None or not use:
        return contextlib.nullcontext()
    if not ema.announced:
        ema.announced = True
        say(f"torchrig: evaluation uses the EMA weights (ema_decay={ema.decay:g}, {ema.num_updates} updates); "
            f"Trainer.evaluate(data, ema=False) evaluates the trained weights")
    return ema.applied()
