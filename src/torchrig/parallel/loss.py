"""Loss parallelism: the cross-entropy of logits that stay split over the tensor-parallel ranks by class.

A plan that splits the output layer with the style ``colwise_loss_parallel`` (``ColwiseParallel`` with
``use_local_output=False``) leaves the model's output a DTensor sharded on its last (class, vocabulary)
dimension: each rank holds ``1/tp`` of the logits. ``torch.distributed.tensor.parallel.loss_parallel``
computes the cross-entropy of such logits without gathering them (each rank its classes' log-sum-exp
terms, joined by all-reduces of one value per item), forward and backward. ``parallel.loss_parallel``:

``auto``   on when the output is split this way and the loss is a cross-entropy without label smoothing
           (``loss: cross_entropy`` or ``auto``, ``F.cross_entropy``, ``nn.CrossEntropyLoss``); otherwise the
           split output is gathered (``full_tensor``) before the loss, which then sees the whole logits
``true``   on; one line when the plan has no such layer or the loss cannot run split
``false``  the split output is gathered before the loss

Metrics, evaluation and prediction read the whole logits (gathered once per batch): only the training
loss and its backward run split.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import ParallelConfigError

KEY = "parallel.loss_parallel"
STYLE = "colwise_loss_parallel"


def is_cross_entropy(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is a cross-entropy over class indices that ``loss_parallel`` computes split."""
    fn = getattr(loss_fn, "fallback", loss_fn)  # loss="auto": its cross-entropy
    if getattr(fn, "name", None) == "cross_entropy":  # a named torchrig loss: functools.partial(F.cross_entropy, …)
        smoothing = getattr(getattr(fn, "fn", None), "keywords", {}).get("label_smoothing", 0.0)
        return not smoothing
    if isinstance(fn, torch.nn.CrossEntropyLoss):
        return not fn.label_smoothing
    return fn is F.cross_entropy


def resolve(setting: Any, styles: dict[str, str], loss_fn: Any) -> bool:
    """Whether the training loss runs split (``setting``: the key's value; ``styles``: the resolved plan)."""
    heads = [name for name, style in styles.items() if style == STYLE]
    if setting in (False, "false") or not styles:  # not split at all (one process, tp=1): nothing to run split
        return False
    if setting in (True, "true"):
        if not heads:
            raise ParallelConfigError(
                f"config key '{KEY}': true, but no layer of parallel.tp_plan has the style '{STYLE}' (the output "
                f"layer split by class, its output left split); plan the output layer so, or set {KEY}=auto")
        named = getattr(getattr(loss_fn, "fallback", loss_fn), "name", "cross_entropy")  # a callable: the user's word
        if named != "cross_entropy":
            raise ParallelConfigError(f"config key '{KEY}': true needs the cross-entropy loss, but loss={named}; "
                                      f"set loss=cross_entropy or {KEY}=auto")
        if getattr(getattr(getattr(loss_fn, "fallback", loss_fn), "fn", None), "keywords", {}).get("label_smoothing"):
            raise ParallelConfigError(f"config key '{KEY}': true, but label_smoothing is set, which PyTorch's "
                                      f"loss_parallel does not support; set label_smoothing=0 or {KEY}=auto")
        return True
    return bool(heads) and is_cross_entropy(loss_fn)


def is_split(output: Any) -> bool:
    """A DTensor output (a split output layer's)."""
    from torch.distributed.tensor import DTensor

    return isinstance(output, DTensor)


def whole(output: Any) -> Any:
    """The whole tensor of a split output (gathered over the tensor-parallel ranks); anything else as it is."""
    return output.full_tensor() if is_split(output) else output


def context(on: bool) -> Any:
    """PyTorch's ``loss_parallel()`` context (forward and backward of the loss run in it), or a no-op. Nested
    ones are the outer one (a pipeline's schedule runs the loss's forward and backward inside one): PyTorch's
    would switch the split cross-entropy off when the inner one ends."""
    if not on or _active[0]:
        return contextlib.nullcontext()
    return _outermost()


_active = [False]


@contextlib.contextmanager
def _outermost() -> Any:
    from torch.distributed.tensor.parallel import loss_parallel

    _active[0] = True
    try:
        with loss_parallel():
            yield
    finally:
        _active[0] = False


def split_loss(loss_fn: Callable, output: Any, target: Any) -> torch.Tensor:
    """``loss_fn(output, target)`` on the split logits, as a plain tensor (the same value on every rank); its
    backward must run under :func:`context` too."""
    with context(True):
        loss = loss_fn(output, target)
    return loss.to_local() if is_split(loss) else loss
