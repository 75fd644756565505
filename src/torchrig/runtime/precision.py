"""Precision policy: autocast context and gradient scaler for fp32 / bf16 / fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .device import RuntimeSetupError

PRECISIONS = ("fp32", "bf16", "fp16")
_NO_AUTOCAST = contextlib.nullcontext()  # stateless and reusable: one object, not one per step


@dataclass
class Precision:
    """What a step needs to know: which autocast to enter and whether a GradScaler is in play."""

    name: str
    device: torch.device
    dtype: Optional[torch.dtype]
    scaler: Optional["torch.amp.GradScaler"]

    def autocast(self):
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def make_precision(name: str, device: torch.device) -> Precision:
    name = (name or "fp32").lower()
    aliases = {"32": "fp32", "float32": "fp32", "bfloat16": "bf16", "bf16-mixed": "bf16",
               "16": "fp16", "float16": "fp16", "16-mixed": "fp16"}
    name = aliases.get(name, name)
    if name not in PRECISIONS:
        raise RuntimeSetupError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "fp32":
        return Precision(name, device, None, None)
    if name == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeSetupError(f"precision 'bf16' is not supported by {torch.cuda.get_device_name(device)}; use fp16 or fp32")
        if device.type not in ("cpu", "cuda", "mps"):
            raise RuntimeSetupError(f"precision 'bf16' is not supported on device {device}; use fp32")
        return Precision(name, device, torch.bfloat16, None)
    # fp16
    if device.type != "cuda":
        raise RuntimeSetupError(
            f"precision 'fp16' needs a CUDA device (it uses a gradient scaler), but the device is {device}; "
            f"use precision=bf16 on CPU or fp32")
    return Precision(name, device, torch.float16, torch.amp.GradScaler("cuda"))
