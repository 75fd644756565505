"""Building what a run trains with: wrapped models, optimizers and schedulers, from names or objects."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import config as C
from .. import parallel, runtime
from ..config import ConfigError
from ..optim import optimizers as optim


def wrap_models(model: nn.Module, cfg: C.Config, strategy: str, device: torch.device,
                dtype: Any) -> tuple[nn.Module, dict[str, nn.Module]]:
    """``(what to call, {name: wrapped sub-model})``: DDP / FSDP / DP around the user's module."""
    model = model.to(device)
    if runtime.wants_channels_last(model, cfg.model.channels_last, device):
        model = model.to(memory_format=torch.channels_last)
    runtime.apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    if isinstance(model, nn.ModuleDict) and strategy in ("ddp", "fsdp", "dp"):
        # Several networks (a GAN): wrap each so that each forward does its own gradient sync.
        models = {k: parallel.wrap_model(m, strategy, device, cfg.dist, dtype) for k, m in model.items()}
        wrapped: nn.Module = model
    else:
        wrapped = parallel.wrap_model(model, strategy, device, cfg.dist, dtype)
        models = dict(model.items()) if isinstance(model, nn.ModuleDict) else {}
    if cfg.model.compile:
        wrapped, models = runtime.compile_models(wrapped, models, model)
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


# Scheduler classes whose unit is unambiguous: PyTorch's own examples step these once per epoch, or
# once per optimizer step (their horizon is a number of batches).
PER_EPOCH = ("StepLR", "MultiStepLR", "ExponentialLR", "ReduceLROnPlateau")
PER_STEP = ("OneCycleLR", "CyclicLR")


def build_schedulers(given: Any, optimizers: dict, cfg: C.Config, total_steps: int) -> tuple[dict, str, str]:
    """``({name: scheduler}, interval, note)``: the user's scheduler objects, or the configured one per
    optimizer. A scheduler object is stepped at the interval its class implies (``scheduler.interval``
    overrides); for a class that implies none, ``note`` is one line naming the interval used."""
    s = cfg.scheduler
    if given is not None:
        schedulers = given if isinstance(given, dict) else {"default": given}
        interval, note = _interval_of(schedulers, s.interval)
        return schedulers, interval, note
    interval = s.interval or "step"
    schedulers = {}
    for k, opt in optimizers.items():
        sch, interval = optim.build_scheduler(
            s.name, opt, interval=s.interval, total_steps=total_steps, epochs=cfg.epochs,
            step_size=s.step_size, gamma=s.gamma, milestones=s.milestones, warmup_steps=s.warmup_steps,
            min_lr=s.min_lr, max_lr=s.max_lr, pct_start=s.pct_start)
        if sch is not None:
            schedulers[k] = sch
    return schedulers, interval, ""


def _interval_of(schedulers: dict, configured: Optional[str]) -> tuple[str, str]:
    if configured:
        return configured, ""
    kinds = {type(sch).__name__ for sch in schedulers.values()}
    implied = {"epoch" if k in PER_EPOCH else "step" if k in PER_STEP else None for k in kinds}
    if len(implied - {None}) > 1:
        raise ConfigError(f"config key 'scheduler.interval': the schedulers given ({', '.join(sorted(kinds))}) are "
                          f"stepped per epoch and per step; give them one interval with scheduler_interval=...")
    if None not in implied:
        return implied.pop(), ""
    interval = (implied - {None}).pop() if implied - {None} else "step"
    other = "epoch" if interval == "step" else "step"
    unit = {"step": "optimizer step", "epoch": "epoch"}
    unknown = ", ".join(sorted(k for k in kinds if k not in PER_EPOCH + PER_STEP))
    return interval, (f"torchrig: scheduler {unknown} is stepped every {unit[interval]}; to step it every "
                      f"{unit[other]}, set scheduler_interval=\"{other}\" (config key scheduler.interval)")


def step_epoch_schedulers(schedulers: dict, values: dict, monitor: Optional[str]) -> None:
    """The per-epoch step; ReduceLROnPlateau gets the monitored value (else the epoch's train loss)."""
    for sch in schedulers.values():
        if isinstance(sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            key = monitor if monitor in values else "train/loss"
            if key not in values:
                raise ConfigError(f"ReduceLROnPlateau needs a monitored value, but {monitor or 'train/loss'!r} was "
                                  f"not logged this epoch; set checkpoint.monitor to one of "
                                  f"{', '.join(k for k in values if k != 'lr')}")
            sch.step(values[key])
        else:
            sch.step()
