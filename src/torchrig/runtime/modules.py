"""Looking through the wrappers around a user's module (DataParallel, DDP, ``torch.compile``)."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

# torchao (imported by transformers and peft wherever it is installed) registers enum types with torch's pytree,
# which torch answers with a deprecation line for each on stderr, before any line of the run: those lines alone are
# dropped
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "register_constant() on Enum subclasses" not in record.getMessage())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DataParallel / DDP wrappers (FSDP2 modifies the module in place)."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod
        else:
            return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: a DTensor's local shard (FSDP2, tensor parallel), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_compiled(model: nn.Module) -> bool:
    """A ``torch.compile`` wrapper (``OptimizedModule``), which hides the module it compiled."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def longest_blocks(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """``(name, container)`` of the model's top-level sequence of blocks: the model itself (an ``nn.Sequential``),
    else its longest ``nn.ModuleList`` / ``nn.Sequential`` of two or more that does not lie inside another one (the
    ``mlp`` Sequential inside each block of a ``blocks`` ModuleList is a block's inside, however long); the first
    of equal length; None for a model without one. Pipeline stages are cut there, and ``activation_checkpointing:
    full`` recomputes each block."""
    if isinstance(model, nn.Sequential):
        return "", model
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    outer = [(name, m) for name, m in found if not any(name.startswith(f"{other}.") for other, _ in found)]
    return max(outer, key=lambda nm: len(nm[1]), default=None)
