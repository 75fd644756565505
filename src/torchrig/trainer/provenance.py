"""What a checkpoint's ``config.yaml`` says about where its model came from.

The command line rebuilds a model from the config (a recipe's ``model.name``, or ``model.factory``).
A model handed to ``Trainer`` in Python cannot be rebuilt that way: its class is recorded as
``model.python_class`` (``module:qualname``, for information), and ``torchrig evaluate`` / ``predict``
refuse such a checkpoint with one line that says so, instead of loading it into the wrong model.
"""

from __future__ import annotations

from torch import nn

from .. import config as C
from .. import runtime


def class_path(model: nn.Module) -> str:
    """``module:qualname`` of the user's model class (under any DDP / FSDP wrapper)."""
    cls = type(runtime.unwrap(model))
    # FSDP2's fully_shard swaps in a subclass of its own (FSDPNet of Net): name the user's class
    cls = next(c for c in cls.__mro__ if not c.__module__.startswith("torch.distributed.fsdp"))
    return f"{cls.__module__}:{cls.__qualname__}"


def saved_config(cfg: C.Config, model: nn.Module, config_builds_model: bool) -> dict:
    """The mapping written as ``config.yaml`` beside each checkpoint."""
    out = C.to_dict(cfg)
    if not (config_builds_model or cfg.model.factory):
        out["model"]["python_class"] = class_path(model)
    return out
