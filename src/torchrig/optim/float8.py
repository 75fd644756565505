"""float8 training through torchao (``float8``).

``prepare`` swaps the model's ``nn.Linear`` layers for torchao's ``Float8Linear``
(``convert_to_float8_training``): their matrix products run in float8 with the scaling of ``float8.recipe``
(``Float8LinearConfig.from_recipe_name``), while the weight stays the same ``nn.Parameter`` in the model's own
dtype under the same name, so optimizers, checkpoints, resume and export see the plain model. Left in high
precision: the output head (``model.fused_head``, else the last Linear layer), layers whose dimensions are not
multiples of 16 (float8 kernels need them), and those ``float8.skip`` names.

float8 matrix products need an NVIDIA GPU of compute capability 8.9 or later (H100, H200, L40S, RTX 4090). On
another GPU the key is refused; on the CPU torchao's emulation runs instead (the same casts and scales, products
in high precision): slower than without, for checking a config before it goes to the GPU.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Optional

import torch
from torch import nn

from ..config import ConfigError

INSTALL = 'pip install "torchrig[finetune]"'
MIN_CAPABILITY = (8, 9)


def plan(model: nn.Module, f8: Any, head: Optional[str]) -> tuple[list[str], dict[str, str]]:
    """(names of the Linear layers converted, {name of a layer left in high precision: why})."""
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = head if head is not None else (linear[-1][0] if linear else None)
    kept, left = [], {}
    for name, m in linear:
        if name == head:
            left[name] = "the output head"
        elif any(fnmatch.fnmatchcase(name, p) for p in f8.skip):
            left[name] = "float8.skip"
        elif m.in_features % 16 or m.out_features % 16:
            left[name] = "dimensions not multiples of 16"
        else:
            kept.append(name)
    return kept, left


def emulated(device: torch.device, recipe: str) -> bool:
    """Whether float8 runs emulated here (off CUDA); a CUDA GPU without float8 matrix products is refused."""
    if device.type != "cuda":
        return True
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"config key 'float8.recipe': {recipe} needs float8 matrix products, which need an NVIDIA "
                          f"GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (H100, H200, "
                          f"L40S); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; set "
                          f"float8.recipe=null")
    return False


def prepare(model: nn.Module, cfg: Any, device: torch.device, fsdp: bool = False) -> Optional[str]:
    """float8 training for ``model`` in place (nothing without ``float8.recipe``); the start line. ``fsdp``: the
    model is sharded by FSDP2, whose all-gather then sends float8 weights (``float8.fsdp_all_gather``, tensorwise)."""
    f8 = cfg.float8
    if f8.recipe is None:
        return None
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(f"config key 'float8.recipe': {f8.recipe} needs the torchao package; {INSTALL}") from None
    emulate = emulated(device, f8.recipe)
    kept, left = plan(model, f8, cfg.model.fused_head)
    if not kept:
        raise ConfigError(f"config key 'float8.recipe': {f8.recipe} converts none of {type(model).__name__}'s Linear "
                          f"layers (left: {_listed(left)}); float8 needs layers whose in and out features are "
                          f"multiples of 16 besides the output head; set float8.recipe=null")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(f8.recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp and f8.fsdp_all_gather and f8.recipe == "tensorwise")
    names = set(kept)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in names)
    where = f", emulated on {device.type}: no speed-up there" if emulate else ""
    return (f"torchrig: float8 training (torchao, {f8.recipe} scaling{where}) on {len(kept)} Linear "
            f"layer{'s' if len(kept) != 1 else ''}" + (f"; left in high precision: {_listed(left)}" if left else ""))


def _listed(left: dict) -> str:
    items = [f"{n} ({why})" for n, why in left.items()]
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "") if items else "none"
