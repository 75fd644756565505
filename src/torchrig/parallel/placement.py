"""The simplest model parallelism: a model whose parts the user put on different devices, in one process.

``self.a.to("cuda:0")``, ``self.b.to("cuda:1")`` and a ``forward`` that moves the activations between them is
the model parallelism of PyTorch's own tutorial. torchrig trains such a model as it is: it does not move it
(``Trainer`` moves a model only when all of it sits on one device), it sends each batch's inputs to the device
of the model's first parameter, and the targets to the device of the model's output, where the loss and the
metrics are computed. The optimizer's state follows each parameter's device.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def devices_of(model: nn.Module) -> list[torch.device]:
    """The devices of the model's parameters and buffers, in the order they first appear."""
    seen: list[torch.device] = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.device not in seen and t.device.type != "meta":
            seen.append(t.device)
    return seen


def placed_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the first parameter of a model spread over several devices (where its inputs go), or None
    for a model on one device (which the Trainer moves to the run's device)."""
    devices = devices_of(model)
    if len(devices) < 2:
        return None
    first = next((p.device for p in model.parameters()), devices[0])
    return first


def to_output_device(output: Any, target: Any) -> Any:
    """``target`` on the device of ``output`` (a tensor, or the first tensor of a tuple / dict output)."""
    if not isinstance(target, torch.Tensor):
        return target
    out = output
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    elif isinstance(out, dict) and out:
        out = next(iter(out.values()))
    if isinstance(out, torch.Tensor) and out.device != target.device:
        return target.to(out.device, non_blocking=True)
    return target
