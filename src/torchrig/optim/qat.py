"""Quantisation-aware training through torchao (``quantize.qat``).

``prepare`` swaps the model's ``nn.Linear`` layers for torchao's fake-quantised ones (``quantize_(model,
QATConfig(scheme, step="prepare"))``): the weights stay float and train as usual, and every forward rounds them
(and, for ``int8-dynamic-act-int4-weight``, the activations) as the quantised model will. The parameters are the
same objects, under the same names, so checkpoints, resume and every layout see an ordinary model. ``convert``
(``torchrig export --quantize``) turns those layers into quantised ones (``step="convert"``); torchao's own tests
hold both schemes here to identical outputs before and after (SQNR inf), and the export checks it within its
tolerance on its example inputs.

A Linear layer whose ``in_features`` is not a multiple of ``quantize.group_size`` cannot be quantised in groups:
it stays float, and the start line names it.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..config import ConfigError

INSTALL = 'pip install "torchrig[finetune]"'


def scheme(q: Any) -> Any:
    """torchao's config of ``quantize.qat`` (the post-training quantisation the fake quantisation imitates)."""
    import torch

    try:
        from torchao.quantization import (Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup)
    except ImportError:
        raise ConfigError(f"config key 'quantize.qat': {q.qat} needs the torchao package; {INSTALL}") from None
    group = PerGroup(q.group_size)
    if q.qat == "int8-dynamic-act-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group)
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=group)


def _layers(model: nn.Module, group_size: int) -> tuple[set[str], list[str]]:
    """(names of the Linear layers quantised, names of those whose in_features the group size does not divide)."""
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return ({n for n, m in linear.items() if m.in_features % group_size == 0},
            [n for n, m in linear.items() if m.in_features % group_size])


def _apply(model: nn.Module, q: Any, step: str) -> tuple[int, list[str]]:
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    kept, left = _layers(model, q.group_size)
    if not kept:
        raise ConfigError(f"config key 'quantize.group_size': {q.group_size} divides the in_features of none of "
                          f"{type(model).__name__}'s Linear layers, so nothing would be quantised; choose a group size "
                          f"that divides them (e.g. 32 for layers of 64, 128 ... features)")
    quantize_(model, QATConfig(scheme(q), step=step), filter_fn=lambda m, fqn: fqn in kept)
    return len(kept), left


def prepare(model: nn.Module, q: Any) -> Optional[str]:
    """Fake-quantised training for ``model`` in place (nothing without ``quantize.qat``); the start line."""
    if q.qat is None:
        return None
    scheme(q)  # the package, before anything changes
    n, left = _apply(model, q, "prepare")
    rest = (f"; {len(left)} left in float (in_features not a multiple of {q.group_size}: "
            f"{', '.join(left[:3])}{' …' if len(left) > 3 else ''})") if left else ""
    return (f"torchrig: quantisation-aware training (torchao {q.qat}, groups of {q.group_size}) on {n} Linear "
            f"layer{'s' if n != 1 else ''}{rest}")


def convert(model: nn.Module, q: Any) -> int:
    """The fake-quantised layers of ``model`` as quantised ones, in place; how many."""
    return _apply(model, q, "convert")[0]
