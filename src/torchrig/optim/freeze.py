"""``step.frozen(...)``: a block in which some networks compute no parameter gradients.

In a GAN step the generator's loss goes through the discriminator. Without care its backward also
fills D's ``.grad``, and D's next optimizer step adds those gradients to its own (zero_grad ran
after D's previous step, not before G's backward). Freezing D (``requires_grad=False`` on its
parameters while G's loss is computed) keeps G's backward out of D and saves that work too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union

from torch import nn

from .. import runtime


def _plain(models: dict, m: Union[str, nn.Module]) -> nn.Module:
    if isinstance(m, str):
        if m not in models:
            raise ValueError(f"step.frozen: no model named '{m}'; step.models holds "
                           f"{', '.join(models) or 'none (the model is not an nn.ModuleDict): pass the module'}")
        m = models[m]
    if not isinstance(m, nn.Module):
        raise TypeError(f"step.frozen takes model names or nn.Modules, got {type(m).__name__}")
    return runtime.unwrap(m)


@contextlib.contextmanager
def frozen(models: dict, names: tuple) -> Iterator[Any]:
    """Freeze the named models' parameters for the block; yields the plain module (a tuple for several)."""
    plain = [_plain(models, m) for m in names]
    params = [p for m in plain for p in m.parameters()]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield plain[0] if len(plain) == 1 else tuple(plain)
    finally:
        for p, flag in zip(params, was):
            p.requires_grad_(flag)
