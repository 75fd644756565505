"""LoRA adapters through the ``peft`` package, put into the user's model in place before any wrapping.

``peft.method: lora`` records the base model's identity (its class, its Hugging Face config when it has one and
a sha256 of its weights), then puts peft's LoRA layers into the modules ``peft.target_modules`` names with
``peft.get_peft_model``, which changes the model in place: the model keeps its class, its ``forward`` and its
parameter names, the adapters are added beside the layers they adapt (``...c_attn.lora_A.default.weight``) and
every other parameter is frozen; ``peft.modules_to_save`` train in full (peft keeps a trainable copy beside the
frozen original). The Trainer trains the model itself; peft's ``PeftModel`` around it is kept for what only it
does (``merge_and_unload``, ``save_pretrained`` of the adapter folder: ``torchrig export``).
Checkpoints then hold what trains and the base's identity (``trainer/saving.py``), so adapters are never
resumed onto, or loaded into, another base.

``peft.base_dtype``: ``bf16`` / ``fp16`` cast the frozen parameters only (adapters, their gradients and their
optimizer state stay fp32; autocast computes the two together); ``nf4`` / ``fp4`` replace the base's
``nn.Linear`` layers by bitsandbytes' 4-bit ones before the adapters go in (QLoRA), on CUDA only.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ..config import ConfigError
from ..errors import suggest

INSTALL = 'pip install "torchrig[finetune]"'
# the layer types peft's LoRA adapts (transformers' Conv1D by class name: GPT-2's layers)
ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
ADAPTABLE_NAMES = "Linear, Embedding, Conv1d/2d/3d, transformers Conv1D and MultiheadAttention"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Adapted:
    """What ``peft.method`` made of the model: the adapters, the parameter counts and the base's identity."""

    method: str
    rank: int
    modules: int                # layers that got adapters
    trainable: int              # parameters that train (adapters and modules_to_save)
    total: int                  # every parameter, counted once
    base: dict                  # the base model's identity: class, config, sha256, parameters
    base_dtype: Optional[str]
    wrapper: Any = field(default=None, compare=False, repr=False)  # peft's PeftModel around the model

    def line(self) -> str:
        """``torchrig: LoRA r=8 on 24 modules: 0.59 M of 124 M parameters train`` (and the base's dtype)."""
        dtype = f" · frozen base in {self.base_dtype}" if self.base_dtype else ""
        return (f"torchrig: LoRA r={self.rank} on {self.modules} modules: {count(self.trainable, self.total)} of "
                f"{count(self.total, self.total)} parameters train{dtype}")


def count(n: int, total: int) -> str:
    """``n`` in millions (``124 M``, ``12.3 M``, ``0.59 M``) when ``total`` is a million or more, else in full."""
    if total < 1_000_000:
        return f"{n:,}"
    x = n / 1e6
    return f"{x:.0f} M" if x >= 100 else f"{x:.1f} M" if x >= 10 else f"{x:.2f} M"


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(f"config key 'peft.method': lora needs the peft package; {INSTALL}") from None
    return peft


def is_peft_module(module: nn.Module) -> bool:
    """A layer peft put into a model (a LoRA layer, a modules_to_save wrapper)."""
    return type(module).__module__.startswith("peft.")


def identity(model: nn.Module) -> dict:
    """The base model's identity: ``{"class", "config", "sha256", "parameters"}``; the sha256 is over every tensor
    of its ``state_dict`` (name, dtype, shape and bytes, in name order), the config a Hugging Face model's own."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(state[name].shape)};".encode())
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the bytes in place, no copy
    config = getattr(model, "config", None)
    hf = json.loads(config.to_json_string(use_diff=True)) if hasattr(config, "to_json_string") else None
    cls = type(model)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "config": hf, "sha256": digest.hexdigest(),
            "parameters": sum(p.numel() for p in model.parameters())}


def _supported(module: nn.Module) -> bool:
    return isinstance(module, ADAPTABLE) or type(module).__name__ == "Conv1D"


def resolve(model: nn.Module, patterns: list, key: str, layers_only: bool = False) -> list[str]:
    """The module names ``patterns`` match (fnmatch on ``named_modules()`` names; a bare name also at any depth);
    one line with the nearest names for a pattern that matches nothing. ``layers_only``: only layers LoRA adapts."""
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    out: list[str] = []
    for pattern in patterns:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, f"*.{pattern}")]
        if not matched:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            near = suggest(pattern, names, n=3) or suggest(pattern.rsplit(".", 1)[-1], leaves, n=3)
            raise ConfigError(f"config key '{key}': {pattern!r} matches no module of {type(model).__name__}{near} "
                              f"(module names such as {', '.join(names[:4])})")
        if layers_only:
            kept = [n for n in matched if _supported(modules[n])]
            if not kept:
                first = matched[0]
                raise ConfigError(f"config key '{key}': {pattern!r} matches {first!r}, a {type(modules[first]).__name__}"
                                  f"; LoRA adapts {ADAPTABLE_NAMES} layers: name those (module names as in "
                                  f"named_modules())")
            matched = kept
        out += [n for n in matched if n not in out]
    return out


def lora_config(model: nn.Module, p: Any) -> Any:
    """peft's ``LoraConfig`` for the ``peft`` section ``p``: patterns resolved here to exact module names (a regex
    peft matches whole), so what is adapted is what the patterns say."""
    import re

    from peft import LoraConfig

    if p.target_modules == "all-linear":
        targets: Any = "all-linear"
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    else:
        names = resolve(model, p.target_modules, "peft.target_modules", layers_only=True)
        targets = "^(?:" + "|".join(re.escape(n) for n in names) + ")$"
        modules = dict(model.named_modules())
        conv1d = any(type(modules[n]).__name__ == "Conv1D" for n in names)
    save = resolve(model, p.modules_to_save, "peft.modules_to_save") if p.modules_to_save else None
    # GPT-2's Conv1D stores its weight transposed (fan_in_fan_out); peft corrects a wrong guess per layer
    return LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=targets,
                      modules_to_save=save, fan_in_fan_out=conv1d)


def inject(model: nn.Module, p: Any) -> tuple[Any, int]:
    """peft's LoRA layers into ``model``, in place; returns peft's ``PeftModel`` around it and how many layers got
    adapters."""
    peft = _peft()
    config = lora_config(model, p)
    try:
        with warnings.catch_warnings():  # its per-layer fan_in_fan_out corrections, transformers' deprecations
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            wrapper = peft.get_peft_model(model, config)
    except (ValueError, TypeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config key 'peft.target_modules': peft cannot adapt {type(model).__name__}: {text}") \
            from None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return wrapper, sum(isinstance(m, BaseTunerLayer) for m in model.modules())


def prepare(model: nn.Module, cfg: Any, device: torch.device) -> Optional[Adapted]:
    """Apply ``cfg.peft`` to ``model`` in place (nothing without ``peft.method``); the adapters and counts."""
    p = cfg.peft
    if p.method is None:
        return None
    if any(is_peft_module(m) for m in model.modules()):
        raise ConfigError("config key 'peft.method': lora, but the model already holds peft adapters; pass the base "
                          "model, or set peft.method=null to train the adapted model as it is")
    base = identity(model)  # before anything changes: what the checkpoints' adapters belong to
    if p.base_dtype in ("nf4", "fp4"):
        quantize_4bit(model, p, device)  # before the adapters: peft then picks its bitsandbytes LoRA layers
    wrapper, modules = inject(model, p)
    if p.base_dtype in DTYPES:
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(DTYPES[p.base_dtype])
    params = {id(q): q for q in model.parameters()}.values()
    return Adapted(p.method, p.r, modules, sum(q.numel() for q in params if q.requires_grad),
                   sum(q.numel() for q in params), base, p.base_dtype, wrapper)


def quantize_4bit(model: nn.Module, p: Any, device: torch.device) -> None:
    """QLoRA's base: every ``nn.Linear`` but the output layer and ``peft.modules_to_save`` becomes bitsandbytes'
    ``Linear4bit`` (its weights quantised when the model moves to the GPU), computing in bf16."""
    if device.type != "cuda":
        raise ConfigError(f"config key 'peft.base_dtype': {p.base_dtype} keeps the base in 4 bits through "
                          f"bitsandbytes, whose kernels run on CUDA, and this run is on {device}; use "
                          f"peft.base_dtype=bf16 (with precision=bf16) or null")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(f"config key 'peft.base_dtype': {p.base_dtype} needs the bitsandbytes package; pip install "
                          f"bitsandbytes") from None
    keep = set(resolve(model, p.modules_to_save, "peft.modules_to_save")) if p.modules_to_save else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or child is head or full in keep:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type=p.base_dtype)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type=p.base_dtype)
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, child_name, layer)
