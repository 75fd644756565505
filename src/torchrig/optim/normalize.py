"""Loss normalisation: the loss of one optimizer step is the mean over its whole global batch.

The global batch is every micro-batch of the accumulation window on every rank. Its items are
samples, or, for sequence losses, valid tokens (target elements other than ``ignore_index``, -100).
``loss_normalization`` says which:

* ``samples``: every sample weighs the same, however the samples fall into micro-batches and ranks;
* ``tokens``: every valid token weighs the same (padding and prompt positions labelled -100 count 0);
* ``micro_batches``: every micro-batch weighs the same (the loss divided by the window size), as
  plain gradient accumulation does; a short micro-batch then weighs as much as a full one;
* ``auto`` (the default): ``tokens`` when the target is an integer tensor with a sequence (or pixel)
  dimension, ``samples`` otherwise.

How, with no look-ahead: each micro-batch's backward uses ``loss_i × n_i / unit`` (``n_i`` its items,
``unit`` a constant: the configured per-rank batch size), i.e. the sum of its items' losses. The counts
are summed on the device; at the end of the window one all-reduce (sum) of the count gives the global
``N`` and one ``_foreach_mul_`` by ``ranks × unit / N`` (DDP and FSDP2 have averaged over the ranks)
turns the gradients into the mean over the global batch. The window's first non-finite check, the
unscale, clipping and the optimizer step all see those final gradients.

A causal language model (a Hugging Face model that generates text and is not encoder-decoder) shifts
its labels inside the loss, so position 0 never counts: ``labels[..., 1:] != -100`` are its tokens.
A loss that is not a mean over the items it counts (a sum, a mean over something else) should use
``micro_batches``, or a step function that passes its own count to ``step.backward(loss, count)``.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from .. import runtime
from ..metrics import IGNORE_INDEX  # the target value PyTorch's cross_entropy and Hugging Face labels skip

Count = Union[int, torch.Tensor]


def shifts_labels(model: Any) -> bool:
    """Whether ``model`` (bare or wrapped) is a causal LM that predicts ``labels[..., 1:]``."""
    model = runtime.unwrap(model)
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    return (config is not None and callable(can_generate) and bool(can_generate())
            and not getattr(config, "is_encoder_decoder", False))


def is_hugging_face(model: Any) -> bool:
    """Whether ``model`` (bare or wrapped) is a Hugging Face ``PreTrainedModel`` (without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(runtime.unwrap(model)).__mro__)


def is_sequence_target(target: Any) -> bool:
    """An integer target with more than a batch dimension: token (or pixel) labels."""
    return (isinstance(target, torch.Tensor) and target.ndim >= 2 and not target.is_floating_point()
            and target.dtype != torch.bool)


def tokens_in(target: torch.Tensor, shift: bool) -> torch.Tensor:
    """Valid target elements, as a 0-d tensor on the target's device (no host read)."""
    if shift:
        target = target[..., 1:]
    if target.is_floating_point():
        return torch.tensor(target.numel(), device=target.device)
    return (target != IGNORE_INDEX).sum()


def count_items(mode: str, target: Any, samples: int, shift: bool) -> Count:
    """Items one micro-batch's mean loss is taken over, for ``mode`` (never ``micro_batches``)."""
    if mode == "tokens" or (mode == "auto" and is_sequence_target(target)):
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"loss_normalization=tokens needs a tensor target to count tokens in, got "
                             f"{type(target).__name__}; set loss_normalization=samples, or pass the count to "
                             f"step.backward(loss, count)")
        return tokens_in(target, shift)
    return samples


def window_factor(total: Count, ranks: int, unit: float, device: torch.device,
                  group: Any = None) -> Union[float, torch.Tensor]:
    """``ranks × unit / N``: what turns the window's summed gradients into the global-batch mean.

    ``total`` is this rank's count for the window; with ``ranks > 1`` it is summed over the ranks of ``group``
    (the data-parallel ranks; None: every rank), one all-reduce of one number. A window without any item (every label -100) divides by 1: its
    gradients stay zero. A count that is a tensor (tokens), or one summed over ranks, gives a factor that stays
    a tensor on the device, on the CPU as on a GPU (nothing is read back).
    """
    if ranks == 1 and not isinstance(total, torch.Tensor):
        return ranks * unit / max(total, 1)
    exact = torch.float32 if device.type == "mps" else torch.float64  # float32 counts exactly to 2**24 only
    if isinstance(total, torch.Tensor):
        n = total.to(device, exact).reshape(1)
    else:  # a fill kernel: as_tensor(int, device=cuda) would copy from pageable memory and wait for the GPU
        n = torch.full((1,), float(total), dtype=exact, device=device)
    if ranks > 1:
        n = runtime.all_reduce_sum(n, group, name="loss count")
    return ((ranks * unit) / n.clamp_min(1)).float().reshape(())


def scale_gradients(grads: list, factor: Union[float, torch.Tensor]) -> None:
    """``grads *= factor`` in place, one fused op per (device, dtype) group; FSDP2 shards locally. A factor
    of 1.0 (a full batch in one process) returns at once, before any autograd-mode switch."""
    if isinstance(factor, float) and factor == 1.0:
        return
    groups: dict = {}
    with torch.no_grad():
        for g in grads:
            g = runtime.local_tensor(g)
            if g.is_sparse:
                g.mul_(factor if isinstance(factor, float) else factor.to(g.device, g.dtype))
            else:
                groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), group in groups.items():
            f = factor if isinstance(factor, float) else factor.to(device=device, dtype=dtype)
            torch._foreach_mul_(group, f)
