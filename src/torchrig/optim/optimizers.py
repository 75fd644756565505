"""Optimizers and learning-rate schedules by name, with per-group learning rates."""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch import nn

from ..errors import TorchrigError, suggest


class UnknownNameError(TorchrigError, ValueError):
    """An unknown optimizer / loss / scheduler name (the message lists the valid ones)."""


NameError_ = UnknownNameError  # its first name, kept for code that catches it


def unknown_name(kind: str, name: str, valid: list[str]) -> UnknownNameError:
    return UnknownNameError(f"unknown {kind} '{name}'{suggest(name, valid, listing='Valid names: ' + ', '.join(valid))}")


# ----------------------------------------------------------------------------- optimizers

OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")


def param_groups(model: nn.Module, lr: float, group_lr: Optional[dict] = None) -> list[dict]:
    """Parameter groups by module-name prefix, e.g. ``{"backbone": 1e-4, "head": 1e-2}``.

    The longest matching prefix wins; parameters matching none use ``lr``. Frozen parameters
    (``requires_grad=False``) are left out.
    """
    group_lr = group_lr or {}
    prefixes = sorted(group_lr, key=len, reverse=True)
    groups: dict[Optional[str], list] = {p: [] for p in prefixes}
    groups[None] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        match = next((p for p in prefixes if name == p or name.startswith(p + ".")), None)
        groups[match].append(param)
    unused = [p for p in prefixes if not groups[p]]
    if unused:
        names = sorted({n.split(".")[0] for n, _ in model.named_parameters()})
        raise NameError_(f"optim.group_lr prefix {unused[0]!r} matches no parameter; top-level modules are: {', '.join(names)}")
    out = [{"params": groups[p], "lr": float(group_lr[p]), "name": p} for p in prefixes]
    if groups[None]:
        out.append({"params": groups[None], "lr": lr, "name": "default"})
    return out


def build_optimizer(name: str, model: nn.Module, lr: float, *, weight_decay: float = 0.0, momentum: float = 0.9,
                    nesterov: bool = False, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                    group_lr: Optional[dict] = None, device: Optional[torch.device] = None,
                    options: Optional[dict] = None) -> torch.optim.Optimizer:
    key = name.lower()
    groups = param_groups(model, lr, group_lr)
    if not groups:
        raise NameError_("the model has no trainable parameters (all requires_grad=False); unfreeze some with "
                         "p.requires_grad_(True), or pass an optimizer built on the parameters to train")
    opts = dict(options or {})
    # fused: one kernel per step, and a non-finite step is skipped on the GPU (no host read); never beside an
    # explicit foreach choice (PyTorch refuses both)
    fused_ok = device is not None and device.type == "cuda" and "foreach" not in opts
    if key == "sgd":
        if fused_ok and not opts.get("dampening"):  # a fused SGD with dampening cannot skip a first step exactly
            opts.setdefault("fused", True)
        cls, kwargs = torch.optim.SGD, dict(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    elif key in ("adam", "adamw"):
        cls = torch.optim.Adam if key == "adam" else torch.optim.AdamW
        if fused_ok:
            opts.setdefault("fused", True)
        kwargs = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    elif key == "adagrad":
        cls, kwargs = torch.optim.Adagrad, dict(weight_decay=weight_decay, eps=eps if eps != 1e-8 else 1e-10)
    elif key == "rmsprop":
        cls = torch.optim.RMSprop
        kwargs = dict(momentum=momentum if momentum != 0.9 else 0.0, weight_decay=weight_decay, eps=eps)
    else:
        raise unknown_name("optimizer", name, list(OPTIMIZERS))
    unknown = [k for k in options or {} if k not in inspect.signature(cls).parameters]
    if unknown:
        valid = [p for p in inspect.signature(cls).parameters if p not in ("self", "params", "lr")]
        raise NameError_(f"config key 'optim.options': {cls.__name__} (optim.name={name}) takes no keyword "
                         f"{unknown[0]!r}{suggest(unknown[0], valid, listing='Valid keywords: ' + ', '.join(valid))}")
    twice = [k for k in options or {} if k in kwargs or k == "lr"]
    if twice:
        raise NameError_(f"config key 'optim.options': {twice[0]!r} has its own key, optim.{twice[0]}; set that "
                         f"instead")
    return cls(groups, lr=lr, **kwargs, **opts)


# ----------------------------------------------------------------------------- schedulers

SCHEDULERS = ("none", "step", "multistep", "cosine", "onecycle", "warmup_cosine")
DEFAULT_INTERVAL = {"step": "epoch", "multistep": "epoch", "cosine": "step", "onecycle": "step",
                    "warmup_cosine": "step"}
OVER_THE_RUN = ("cosine", "onecycle", "warmup_cosine")  # their horizon is the run's length (per step: optimizer steps)


def build_scheduler(name: Optional[str], optimizer: torch.optim.Optimizer, *, interval: Optional[str],
                    total_steps: int, epochs: int, step_size: int = 30, gamma: float = 0.1,
                    milestones: Optional[list] = None, warmup_steps: int = 0, min_lr: float = 0.0,
                    max_lr: Optional[float] = None, pct_start: float = 0.3):
    """Returns ``(scheduler or None, interval)``; ``interval`` is ``"step"`` or ``"epoch"``.

    Units follow the interval: ``step_size`` and ``milestones`` count epochs for ``interval=epoch``
    (the PyTorch ImageNet example's "divide lr by 10 every 30 epochs") and optimizer steps for ``interval=step``.
    """
    if name is None or str(name).lower() == "none":
        return None, "step"
    key = str(name).lower().replace("-", "_")
    if key not in DEFAULT_INTERVAL:
        raise unknown_name("scheduler", str(name), list(SCHEDULERS))
    interval = interval or DEFAULT_INTERVAL[key]
    if interval not in ("step", "epoch"):
        raise NameError_(f"scheduler.interval must be 'step' or 'epoch', got {interval!r}")
    horizon = max(1, total_steps if interval == "step" else epochs)
    S = torch.optim.lr_scheduler
    if key == "step":
        return S.StepLR(optimizer, step_size=step_size, gamma=gamma), interval
    if key == "multistep":
        if not milestones:
            raise NameError_("scheduler 'multistep' needs scheduler.milestones, e.g. [30, 60, 90]")
        return S.MultiStepLR(optimizer, milestones=list(milestones), gamma=gamma), interval
    if key == "cosine":
        return S.CosineAnnealingLR(optimizer, T_max=horizon, eta_min=min_lr), interval
    if key == "onecycle":
        peak = max_lr or [g["lr"] for g in optimizer.param_groups]
        return S.OneCycleLR(optimizer, max_lr=peak, total_steps=horizon, pct_start=pct_start), interval
    # warmup_cosine: linear warmup from ~0 to the base lr, then cosine to min_lr
    warm = max(0, int(warmup_steps))
    base = [g["lr"] for g in optimizer.param_groups]

    def factor(i: int, base_lr: float) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        progress = min(1.0, (i - warm) / max(1, horizon - warm))
        floor = min_lr / base_lr if base_lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    lambdas = [(lambda i, b=b: factor(i, b)) for b in base]
    return S.LambdaLR(optimizer, lr_lambda=lambdas), interval


def planned_horizon(scheduler: object) -> Optional[dict]:
    """What of ``scheduler``'s state is the run's length (``OneCycleLR``'s cycle, ``CosineAnnealingLR``'s
    ``T_max``), taken before a checkpoint's state replaces it: :func:`follow_new_length` puts it back."""
    S = torch.optim.lr_scheduler
    if isinstance(scheduler, S.OneCycleLR):
        return {k: scheduler.state_dict()[k] for k in ("total_steps", "_schedule_phases")}
    if isinstance(scheduler, S.CosineAnnealingLR):
        return {"T_max": scheduler.T_max}
    return None  # a warmup_cosine's horizon is in its function, not its state: the new one already holds


def follow_new_length(scheduler: object, planned: dict) -> None:
    """A resumed schedule whose run got longer or shorter takes this run's horizon (``planned``) in place of the
    checkpoint's, keeping the steps taken: its learning rate is at once the new schedule's at the current step (a
    closed form in the step), so raising ``max_steps`` or ``epochs`` continues on a schedule of the new length
    (PyTorch's own would stop a one-cycle run, "Tried to step N times", and take a cosine back up)."""
    S = torch.optim.lr_scheduler
    if isinstance(scheduler, S.OneCycleLR):
        if planned["total_steps"] == scheduler.total_steps or planned["total_steps"] < scheduler.last_epoch:
            return  # the same cycle; or a run that already ended, which takes no step
        state = {**scheduler.state_dict(), **planned}
        scheduler.load_state_dict(state)
        scheduler.last_epoch -= 1
        scheduler.step()  # the same step again: the new cycle's learning rate (and momentum) for the next update
    elif isinstance(scheduler, S.CosineAnnealingLR) and planned["T_max"] != scheduler.T_max:
        scheduler.T_max, low = planned["T_max"], scheduler.eta_min
        down = (1 + math.cos(math.pi * scheduler.last_epoch / scheduler.T_max)) / 2
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = low + (base - low) * down
        scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]

