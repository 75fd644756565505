"""What a checkpoint's ``config.yaml`` says about where its model came from.

The command line rebuilds a model from the config (a recipe's ``model.name``, or ``model.factory``).
A model handed to ``Trainer`` in Python cannot be rebuilt that way: its class is recorded as
``model.python_class`` (``module:qualname``, for information), and ``torchrig evaluate`` / ``predict``
refuse such a checkpoint with one line that says so, instead of loading it into the wrong model. Its data
came from Python too, so its ``recipe`` is recorded as ``custom``, the recipe with no data of its own: a
command that rebuilds the model with ``--set model.factory`` then asks for ``--input`` or ``data.factory``
instead of feeding it a recipe's data.

A model or data set built by a factory (``model.factory`` / ``data.factory``, ``module:function``) is
rebuilt by importing that module again: ``meta.json`` records, under ``factories``, the file the module
was imported from and a SHA-256 of its bytes, so that a spec read back from a checkpoint is imported only
when it resolves to that very file (see ``recipes/factory.py``, ``check_saved_spec``). So are a ``loss`` and
``metrics`` named ``MODULE:NAME`` (``loss: mylm:lm_loss``), under the keys ``loss`` and ``metrics[i]``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

from torch import nn

from .. import config as C
from .. import runtime
from ..checkpoint import CheckpointError


PYTHON_RECIPE = "custom"  # the recipe recorded for a run whose model and data came from Python: it has no data


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
    if not config_builds_model:
        out["recipe"] = PYTHON_RECIPE  # the data came from Python: no recipe's
    return out


def is_spec(value: Any) -> bool:
    """Whether a config value names code of the user's, ``MODULE:NAME`` (``loss: mylm:lm_loss``), not a name."""
    return isinstance(value, str) and ":" in value


def code_specs(cfg: C.Config) -> list[tuple[str, str]]:
    """``(key, spec)`` of every ``MODULE:NAME`` the config names: ``model.factory``, ``data.factory``, ``loss``, and
    ``metrics[i]`` for each metric named so; the command line imports them, and a checkpoint read back names them
    only under the rules of ``recipes/factory.py`` (``check_saved_spec``)."""
    specs = [(key, spec) for key, spec in (("model.factory", cfg.model.factory), ("data.factory", cfg.data.factory),
                                           ("loss", cfg.loss)) if spec and (key != "loss" or is_spec(spec))]
    return specs + [(f"metrics[{i}]", m) for i, m in enumerate(cfg.metrics or []) if is_spec(m)]


def factory_files(cfg: C.Config) -> dict[str, dict[str, Any]]:
    """``{"model.factory": {"spec", "module", "file", "sha256"}, ...}`` for each ``MODULE:NAME`` of ``cfg``
    (:func:`code_specs`) whose module is imported (from a file); the record ``meta.json`` keeps beside the spec."""
    out = {}
    for key, spec in code_specs(cfg):
        module = sys.modules.get(spec.partition(":")[0]) if spec else None
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        try:
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
        except OSError:
            continue
        out[key] = {"spec": spec, "module": module.__name__, "file": os.path.realpath(path), "sha256": digest}
    return out


def _shown(base: dict) -> str:
    cls = str(base.get("class", "?")).rpartition(":")[2]
    return f"{cls} sha256 {str(base.get('sha256', ''))[:12]}… ({base.get('parameters', 0):,} parameters)"


def check_base(meta: dict, base: Optional[dict], path: Path) -> None:
    """A checkpoint of adapters (``meta.json``'s ``weights: trainable``) loads only onto the base model they were
    trained on: ``base`` is this model's identity (``optim.adapters.identity``; None: no adapters here)."""
    if meta.get("weights") != "trainable":
        return  # the whole model is in the checkpoint
    saved = meta.get("base")
    if base is None:
        raise CheckpointError(f"checkpoint '{path}' holds the adapters of a fine-tuned model without its base, and "
                              f"this run adds no adapters; set peft.method (and the peft keys) as that run did, or use "
                              f"a checkpoint saved with checkpoint.include_base=true")
    if not isinstance(saved, dict) or saved.get("sha256") != base["sha256"]:
        was = _shown(saved) if isinstance(saved, dict) else "no record of it"
        raise CheckpointError(f"checkpoint '{path}' holds adapters trained on another base model: {was} in the "
                              f"checkpoint, {_shown(base)} here; build the base it was trained on (the same model, "
                              f"model.weights and seed)")
