"""torchrig: train plain PyTorch models on one CPU, one GPU, many GPUs or many machines.

The public API is what this module exports. Sub-packages are imported on first use so that
``import torchrig`` costs little more than ``import torch``.

Recipes add their own config sections (``image``, ``text``, ``pix2pix``) when they are imported, so
``torchrig.Config`` and ``torchrig.load_config`` import ``torchrig.recipes`` first: a YAML file with
an ``image:`` section loads through them as it does on the command line.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "torchrig.trainer",
    "Step": "torchrig.trainer",
    "NonFiniteLossError": "torchrig.trainer",
    "Config": "torchrig.config",
    "ConfigError": "torchrig.config",
    "load_config": "torchrig.config",
    "CheckpointError": "torchrig.checkpoint",
    "load_weights": "torchrig.checkpoint",
    "Metric": "torchrig.metrics",
    "get_metric": "torchrig.metrics",
    "Mixture": "torchrig.data",
    "get_rank": "torchrig.runtime",
    "get_world_size": "torchrig.runtime",
    "is_main_process": "torchrig.runtime",
    "barrier": "torchrig.runtime",
    "all_reduce_mean": "torchrig.runtime",
    "all_reduce_sum": "torchrig.runtime",
    "broadcast": "torchrig.runtime",
    "gather": "torchrig.runtime",
    "seed_everything": "torchrig.runtime",
    "TorchrigError": "torchrig.errors",
}

_NEED_RECIPE_SECTIONS = {"Config", "load_config"}
# Sub-packages that are public as a whole: ``torchrig.tune(...)`` (the package is callable) and its names.
_MODULES = {"tune"}

__all__ = sorted(_EXPORTS) + sorted(_MODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"torchrig.{name}")
    if name in _EXPORTS:
        if name in _NEED_RECIPE_SECTIONS:
            importlib.import_module("torchrig.recipes")
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchrig' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
