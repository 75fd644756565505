"""Losses by name: the functional forms of PyTorch's losses, forgiving the usual shape mismatches."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..data.batches import BatchError, describe
from .optimizers import UnknownNameError, unknown_name


class AutoLoss:
    """``loss="auto"``: the model's own loss when its output carries one, else this cross-entropy."""

    def __init__(self, fallback: Callable):
        self.fallback = fallback

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fallback(output, target)

    def __repr__(self) -> str:
        return "loss(auto)"


LOSSES = ("cross_entropy", "nll", "mse", "l1", "smooth_l1", "bce_with_logits")


class _Loss:
    """A named loss that forgives the usual shape mismatches ((N,1) vs (N,)) and target dtypes."""

    def __init__(self, name: str, fn: Callable, float_target: bool):
        self.name, self.fn, self.float_target = name, fn, float_target

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.float_target:
            if output.shape != target.shape:
                if output.numel() != target.numel():  # torch would broadcast them into a wrong loss, or fail
                    raise BatchError(
                        f"the loss {self.name} (config key 'loss') compares the model's output with a target of the "
                        f"same shape, but the output is {describe(output)} and the targets {describe(target)}"
                        + ("; these look like class indices: use loss=cross_entropy" if not target.is_floating_point()
                           and target.ndim == output.ndim - 1 else "; give targets shaped like the output"))
                output = output.reshape(target.shape)
            if not target.is_floating_point():
                target = target.to(output.dtype)
        return self.fn(output, target)

    def __repr__(self) -> str:
        return f"loss({self.name})"


def build_loss(spec: Any, label_smoothing: float = 0.0) -> Callable:
    """The loss to train with: a callable as it is, or a name. ``"auto"`` (the default) is the model's
    own loss when its output carries one (see ``trainer/outputs.py``), else ``cross_entropy``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise UnknownNameError(f"loss must be a name or a callable(output, target), got {type(spec).__name__}")
    key = spec.lower()
    # The functional forms: what nn.CrossEntropyLoss & co. call, without a module call per step.
    table = {
        "cross_entropy": lambda: _Loss("cross_entropy",
                                       functools.partial(F.cross_entropy, label_smoothing=label_smoothing), False),
        "nll": lambda: _Loss("nll", F.nll_loss, False),
        "mse": lambda: _Loss("mse", F.mse_loss, True),
        "l1": lambda: _Loss("l1", F.l1_loss, True),
        "smooth_l1": lambda: _Loss("smooth_l1", F.smooth_l1_loss, True),
        "bce_with_logits": lambda: _Loss("bce_with_logits", F.binary_cross_entropy_with_logits, True),
    }
    if key == "auto":
        return AutoLoss(table["cross_entropy"]())
    if ":" in spec:  # MODULE:FN: the command line imports it (recipes/factory.py) and passes the function
        raise UnknownNameError(f"loss '{spec}' names a function of yours (MODULE:FN), which the torchrig command "
                               f"imports; in Python pass the function itself: Trainer(loss=your_loss)")
    if key not in table:
        raise unknown_name("loss", spec, list(LOSSES))
    return table[key]()


def tensor_loss(loss_fn: Any) -> Any:
    """What ``loss_fn`` calls for a tensor prediction (``loss="auto"``: its cross-entropy) when the target
    needs no conversion: the same function without the wrappers' calls. The user's own callable as it is."""
    if isinstance(loss_fn, AutoLoss):
        loss_fn = loss_fn.fallback
    if isinstance(loss_fn, _Loss) and not loss_fn.float_target:
        loss_fn = loss_fn.fn
    return loss_fn
