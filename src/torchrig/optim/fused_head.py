"""The vocabulary head and its cross-entropy computed together (``model.fused_head``), never the whole logits.

A language model's last layer projects each position's hidden state onto the vocabulary; with a 50 k–128 k vocabulary
those logits (and the float32 copy the cross-entropy makes) are the largest tensors of a step. With
``model.fused_head: NAME`` the named ``nn.Linear`` computes, in training, the cross-entropy of its own output in chunks
of positions inside its forward (where FSDP's and DDP's hooks see its weights in use): through Liger-Kernel's fused
kernel on CUDA when it is installed, else through PyTorch's own ops, one chunk of logits at a time, each recomputed in
backward (``torch.utils.checkpoint``). Its forward then returns its input (the hidden states) as the model's output, and
the step takes the loss computed there. In evaluation and prediction (no gradients) the head computes its logits as
before, so metrics and predictions are unchanged.

The loss is PyTorch's ``cross_entropy`` of the same rows (mean over the positions whose label is not
``ignore_index``, with the loss's ``label_smoothing``): equal to the plain head and loss within float rounding, in the
loss and the gradients (``tests/optim/test_fused_head.py``), and normalised over ranks and micro-batches by the step
as the plain loss is.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TorchrigError

KEY = "model.fused_head"
CHUNK_ELEMENTS = 1 << 23  # logits per chunk (rows × vocabulary): 32 MiB in float32


class FusedHeadError(TorchrigError, ValueError):
    """``model.fused_head`` names no Linear head, or a loss / layout the fused head cannot compute."""


def chunk_rows(vocabulary: int) -> int:
    """Positions per chunk: about :data:`CHUNK_ELEMENTS` logits."""
    return max(1, CHUNK_ELEMENTS // max(vocabulary, 1))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                ignore_index: int, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          target: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                          rows: Optional[int] = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` (mean over the labelled positions) with at most
    ``rows`` positions' logits alive at once: each chunk's sum is checkpointed (its logits recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    rows = rows or chunk_rows(weight.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    total = None
    for start in range(0, h.shape[0], rows):
        args = (h[start:start + rows], weight, bias, t[start:start + rows], ignore_index, label_smoothing)
        part = checkpoint(_chunk_loss, *args, use_reentrant=False) if grad else _chunk_loss(*args)
        total = part if total is None else total + part
    if total is None:  # no position at all: the mean of nothing, as F.cross_entropy gives it
        total = h.sum() * 0.0
    return total / (t != ignore_index).sum()


def liger_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        target: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy (CUDA, Triton): the same loss, its gradients made chunk by chunk in
    the forward. Under autocast the weight is cast to the autocast dtype first, as ``F.linear`` would."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.reshape(-1, hidden.shape[-1])
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, weight = h.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return liger_fused_linear_cross_entropy(h, weight, target.reshape(-1), bias, ignore_index=ignore_index,
                                            label_smoothing=label_smoothing, reduction="mean")


def has_liger() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


class FusedHead:
    """The head named by ``model.fused_head``, whose forward computes the loss while a target is given
    (:meth:`expecting`, in training); :meth:`loss_for` hands that loss to the step."""

    def __init__(self, head: nn.Linear, name: str, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 kernel: str = "torch"):
        self.head, self.name = head, name
        self.ignore_index, self.label_smoothing, self.kernel = ignore_index, label_smoothing, kernel
        self.rows: Optional[int] = None  # positions per chunk of the PyTorch kernel; None: chunk_rows(vocabulary)
        self._target: Any = None
        self._result: Optional[tuple] = None  # (the output the head returned, its loss)
        head.forward = types.MethodType(_fused_forward, head)
        head._torchrig_fused = self

    @contextlib.contextmanager
    def expecting(self, target: Any):
        """The head computes the loss of ``target`` in the forwards inside the block."""
        self._target, self._result = target, None
        try:
            yield
        finally:
            self._target = None

    def loss_for(self, output: Any, model: Any) -> torch.Tensor:
        """The loss the head computed in the forward that returned ``output`` (the model's prediction); one line
        when ``output`` is not what the head returned (the model's forward changed it after the head, or did not
        call the head)."""
        result, self._result = self._result, None
        if result is None or result[0] is not output:
            what = "does not call" if result is None else "changes the output of"
            name = type(getattr(model, "module", model)).__name__
            raise FusedHeadError(f"config key '{KEY}': {name}'s forward {what} {self.name!r} before returning it, so "
                                 f"its loss cannot be computed in the head; return the head's output as it is (its "
                                 f"logits), or set {KEY}=null")
        return result[1]

    def compute(self, hidden: torch.Tensor) -> torch.Tensor:
        head, target = self.head, self._target
        if not isinstance(target, torch.Tensor) or hidden.shape[:-1] != target.shape:
            got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise FusedHeadError(f"config key '{KEY}': {self.name!r} gets hidden states of shape {tuple(hidden.shape)} "
                                 f"and the target is {got}; the fused head needs one class index per position "
                                 f"(a target of shape {tuple(hidden.shape[:-1])})")
        if self.kernel == "liger":
            return liger_cross_entropy(hidden, head.weight, head.bias, target, ignore_index=self.ignore_index,
                                       label_smoothing=self.label_smoothing)
        return chunked_cross_entropy(hidden, head.weight, head.bias, target, ignore_index=self.ignore_index,
                                     label_smoothing=self.label_smoothing, rows=self.rows)

    def record(self, output: torch.Tensor, loss: torch.Tensor) -> None:
        self._result = (output, loss)

    def line(self, metrics: list) -> str:
        """The start line: how the head computes its loss, and the training metrics it cannot feed."""
        how = ("Liger-Kernel's fused kernel" if self.kernel == "liger" else
               f"chunks of {self.rows or chunk_rows(self.head.out_features)} positions (PyTorch ops"
               + (", Liger-Kernel is not installed)" if self.head.weight.device.type == "cuda" else ")"))
        said = (f"; the training metrics ({', '.join(metrics)}) need the logits, which it does not make: they are "
                f"reported by evaluation only") if metrics else ""
        return f"torchrig: {KEY}: {self.name!r} computes its logits and their cross-entropy together, in {how}{said}"

    @property
    def active(self) -> bool:
        return self._target is not None and torch.is_grad_enabled()


@torch.compiler.disable  # the chunks run eagerly under model.compile: one graph break at the head
def _fused_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    fused: FusedHead = self._torchrig_fused
    if not fused.active:  # evaluation, prediction: the logits
        return type(self).forward(self, hidden)
    fused.record(hidden, fused.compute(hidden))
    return hidden


def loss_settings(loss_fn: Any, tensor_fn: Callable) -> tuple[int, float]:
    """``(ignore_index, label_smoothing)`` of a cross-entropy loss the fused head can compute (``loss: cross_entropy``
    / ``auto``, ``nn.CrossEntropyLoss(...)``, ``F.cross_entropy``); a one-line refusal for any other loss."""
    fn = tensor_fn(loss_fn)
    if isinstance(fn, nn.CrossEntropyLoss):
        if fn.weight is not None or fn.reduction != "mean":
            raise FusedHeadError(f"config key '{KEY}': the fused head computes an unweighted mean cross-entropy; the "
                                 f"loss {fn!r} has class weights or reduction={fn.reduction!r}: use the plain head")
        return fn.ignore_index, fn.label_smoothing
    if getattr(fn, "func", fn) is F.cross_entropy:
        options = getattr(fn, "keywords", {}) or {}
        if set(options) - {"label_smoothing", "ignore_index"}:
            raise FusedHeadError(f"config key '{KEY}': the fused head computes an unweighted mean cross-entropy, not "
                                 f"one with {', '.join(sorted(set(options) - {'label_smoothing', 'ignore_index'}))}")
        return options.get("ignore_index", -100), options.get("label_smoothing", 0.0)
    raise FusedHeadError(f"config key '{KEY}': the fused head computes the cross-entropy of the head's logits, but the "
                         f"loss is {loss_fn!r}; set loss=cross_entropy, or model.fused_head=null")


def fuse_head(model: nn.Module, name: str, loss_fn: Any, tensor_fn: Callable, device: torch.device) -> FusedHead:
    """Make ``model``'s sub-module ``name`` (an ``nn.Linear``, the model's last layer) a fused head for ``loss_fn``."""
    modules = dict(model.named_modules())
    head = modules.get(name)
    if not isinstance(head, nn.Linear):
        linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        what = "is not a sub-module" if head is None else f"is a {type(head).__name__}, not an nn.Linear"
        raise FusedHeadError(f"config key '{KEY}': {name!r} {what} of {type(model).__name__}; name its vocabulary "
                             f"projection (its Linear layers: {', '.join(linear[-4:]) or 'none'})")
    if type(head.weight) is not nn.Parameter and not isinstance(head.weight, nn.Parameter):
        raise FusedHeadError(f"config key '{KEY}': {name}'s weight is not a plain parameter")
    from ..data.batches import label_keyword
    from .losses import AutoLoss

    if isinstance(loss_fn, AutoLoss) and label_keyword(model) is not None:
        raise FusedHeadError(f"config key '{KEY}': loss=auto lets {type(model).__name__} compute its own loss from the "
                             f"logits (its forward takes {label_keyword(model)}=); set loss=cross_entropy so that the "
                             f"head computes it")
    ignore_index, smoothing = loss_settings(loss_fn, tensor_fn)
    kernel = "liger" if torch.device(device).type == "cuda" and has_liger() else "torch"
    return FusedHead(head, name, ignore_index=ignore_index, label_smoothing=smoothing, kernel=kernel)
