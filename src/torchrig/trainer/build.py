"""Building what a run trains with: wrapped models, optimizers and schedulers, from names or objects."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import config as C
from .. import runtime
from . import optim


def wrap_models(model: nn.Module, cfg: C.Config, strategy: str, device: torch.device,
                dtype: Any) -> tuple[nn.Module, dict[str, nn.Module]]:
    """``(what to call, {name: wrapped sub-model})``: DDP / FSDP / DP around the user's module."""
    model = model.to(device)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if isinstance(model, nn.ModuleDict) and strategy in ("ddp", "fsdp", "dp"):
        # Several networks (a GAN): wrap each so that each forward does its own gradient sync.
        models = {k: runtime.wrap_model(m, strategy, device, cfg.dist, dtype) for k, m in model.items()}
        wrapped: nn.Module = model
    else:
        wrapped = runtime.wrap_model(model, strategy, device, cfg.dist, dtype)
        models = dict(model.items()) if isinstance(model, nn.ModuleDict) else {}
    if cfg.model.compile:
        wrapped = torch.compile(wrapped)
    return wrapped, models


def build_optimizers(spec: Any, model: nn.Module, cfg: C.Config, strategy: str,
                     device: torch.device) -> dict[str, torch.optim.Optimizer]:
    """Optimizers by name ("default" for one): from names, instances or factories of parameters."""
    o = cfg.optim
    base = runtime.unwrap(model)

    def by_name(name: str, module: nn.Module) -> torch.optim.Optimizer:
        return optim.build_optimizer(name, module, o.lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                     nesterov=o.nesterov, betas=o.betas, eps=o.eps, group_lr=o.group_lr,
                                     device=device, options=o.options)

    def one(key: str, value: Any) -> torch.optim.Optimizer:
        module = base[key] if isinstance(base, nn.ModuleDict) and key in base else base
        if isinstance(value, str):
            return by_name(value, module)
        if isinstance(value, torch.optim.Optimizer):
            if strategy == "fsdp":
                raise runtime.RuntimeSetupError(
                    "strategy 'fsdp' replaces the parameters with sharded ones, so an optimizer built before "
                    "the Trainer cannot be used; pass the optimizer by name or as a factory "
                    "(a callable taking the parameters)")
            return value
        if callable(value):
            return value(module.parameters())
        raise TypeError(f"optimizer {key!r} must be a name, a torch.optim.Optimizer or a callable(params), "
                        f"got {type(value).__name__}")

    if spec is None:
        return {"default": by_name(o.name, base)}
    if isinstance(spec, dict):
        return {k: one(k, v) for k, v in spec.items()}
    return {"default": one("default", spec)}


def build_schedulers(given: Any, optimizers: dict, cfg: C.Config, total_steps: int) -> tuple[dict, str]:
    """``({name: scheduler}, interval)``: the user's scheduler objects, or the configured one per optimizer."""
    s = cfg.scheduler
    interval = s.interval or "step"
    if given is not None:
        return (given if isinstance(given, dict) else {"default": given}), interval
    schedulers = {}
    for k, opt in optimizers.items():
        sch, interval = optim.build_scheduler(
            s.name, opt, interval=s.interval, total_steps=total_steps, epochs=cfg.epochs,
            step_size=s.step_size, gamma=s.gamma, milestones=s.milestones, warmup_steps=s.warmup_steps,
            min_lr=s.min_lr, max_lr=s.max_lr, pct_start=s.pct_start)
        if sch is not None:
            schedulers[k] = sch
    return schedulers, interval
