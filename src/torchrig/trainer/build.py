"""Building what a run trains with: wrapped models, optimizers and schedulers, from names or objects."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from .. import config as C
from .. import parallel, runtime
from ..config import ConfigError
from ..data.batches import signature
from ..optim import optimizers as optim


def wrap_models(model: nn.Module, cfg: C.Config, strategy: str, device: torch.device,
                dtype: Any, layout: Optional[parallel.Layout] = None) -> tuple[nn.Module, dict[str, nn.Module]]:
    """``(what to call, {name: wrapped sub-model})``: DDP / FSDP / DP around the user's module, or the
    layout's split (tensor parallel, then FSDP2 over the data-parallel sub-mesh) when it has a mesh."""
    if layout is not None and layout.context is not None:  # parallel.cp: what the ring cannot run, said first
        layout.context.check_model(model, cfg.loss_normalization, signature(model).accepts("position_ids"))
    runtime.apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    if layout is not None and layout.pp > 1:  # this rank's stages only, cut before anything moves to the device
        model = parallel.split_pipeline(model, layout, cfg.parallel, device)
    if parallel.placed_device(model) is None:  # a model the user spread over several devices stays where it is
        model = model.to(device)
    if runtime.wants_channels_last(model, cfg.model.channels_last, device):
        model = model.to(memory_format=torch.channels_last)
    if layout is not None and layout.mesh is not None:
        wrapped, models = parallel.split_model(model, layout, cfg, device, dtype), {}
    elif isinstance(model, nn.ModuleDict) and strategy in ("ddp", "fsdp", "dp"):
        # Several networks (a GAN): wrap each so that each forward does its own gradient sync.
        models = {k: parallel.wrap_model(m, strategy, device, cfg.dist, dtype) for k, m in model.items()}
        wrapped: nn.Module = model
    else:
        wrapped = parallel.wrap_model(model, strategy, device, cfg.dist, dtype)
        models = dict(model.items()) if isinstance(model, nn.ModuleDict) else {}
    if cfg.model.compile:
        wrapped, models = runtime.compile_models(wrapped, models, model, cfg.model.compile_mode)
    return wrapped, models


def speed_lines(model: nn.Module, cfg: C.Config, device: torch.device, head: Any = None,
                metrics: Sequence = ()) -> list[str]:
    """The start lines of the speed keys: the fused head (``head``) and the training ``metrics`` it leaves to
    evaluation, the blocks recomputed, and what a key does not do where this run is (CUDA graphs off CUDA, a short
    last batch dropped for them)."""
    lines = [head.line([m.name for m in metrics]) if head is not None else None,
             runtime.checkpointing_line(model, cfg.model.activation_checkpointing)]
    if cfg.model.compile:
        lines.append(runtime.compile_line(cfg.model.compile_mode, device, cfg.data.drop_last))
    if cfg.model.activation_offload and device.type != "cuda":
        lines.append(f"torchrig: model.activation_offload: on {device.type} the activations are in host memory "
                     f"already, so it saves no memory (training is unchanged; each saved tensor is copied once)")
    return [line for line in lines if line]


def build_optimizers(spec: Any, model: nn.Module, cfg: C.Config, strategy: str,
                     device: torch.device, split: bool = False) -> dict[str, torch.optim.Optimizer]:
    """Optimizers by name ("default" for one): from names, instances or factories of parameters. ``split``: the
    layout replaced or dropped parameters (FSDP2, tensor or pipeline parallelism), so an optimizer built before
    the Trainer holds the wrong ones; so does one built before ``peft.method`` added the adapters."""
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
            if cfg.peft.method is not None:
                raise ConfigError(f"config key 'peft.method': {cfg.peft.method} puts the adapters in when the Trainer "
                                  f"is built, so an optimizer built before it holds none of them; pass the optimizer "
                                  f"by name or as a factory (a callable taking the parameters)")
            if strategy == "fsdp" or split:
                what = ("strategy 'fsdp' replaces the parameters with sharded ones" if strategy == "fsdp" else
                        "parallel.tp / parallel.pp split the parameters over the ranks")
                raise runtime.RuntimeSetupError(
                    f"{what}, so an optimizer built before the Trainer cannot be used; pass the optimizer by name "
                    f"or as a factory (a callable taking the parameters)")
            return value
        if callable(value):  # with adapters, the parameters that train (the frozen base needs no optimizer)
            return value(p for p in module.parameters() if p.requires_grad or cfg.peft.method is None)
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


def build_schedulers(given: Any, optimizers: dict, cfg: C.Config, total_steps: Optional[int],
                     run: str = "", unknown: str = "") -> tuple[dict, str, str]:
    """``({name: scheduler}, interval, note)``: the user's schedulers, or the configured one per optimizer.

    ``given``: a scheduler object, a factory ``f(optimizer, total_steps=N)`` called here with the optimizer
    steps this ``fit`` takes (``total_steps``), or a dict of either by optimizer name. A scheduler object is
    stepped at the interval its class implies (``scheduler.interval`` overrides); for a class that implies none,
    ``note`` is one line naming the interval used. A given scheduler whose horizon (``total_steps``,
    ``T_max``, ``total_iters``) is not the run's gets one line too (``run`` says how that count comes about),
    or an error when PyTorch would refuse to step it to the end. ``total_steps`` None: not known before
    the run (``unknown`` says why); a schedule that needs it asks for ``data.steps_per_epoch`` or ``max_steps``."""
    s = cfg.scheduler
    fix = "set data.steps_per_epoch (optimizer steps per epoch) or max_steps"
    if given is not None:
        if total_steps is None and any(callable(v) and not _is_scheduler(v) for v in (
                given.values() if isinstance(given, dict) else [given])):
            raise ConfigError(f"the scheduler factory is built with the run's optimizer steps (total_steps), but "
                              f"{unknown}, so their number is not known before the run; {fix}, or pass a "
                              f"scheduler object")
        schedulers = {k: _built(v, optimizers, k, total_steps)
                      for k, v in (given.items() if isinstance(given, dict) else [("default", given)])}
        interval, note = _interval_of(schedulers, s.interval)
        horizon = check_horizons(schedulers, interval, total_steps, cfg.epochs, run)
        return schedulers, interval, "\n".join(n for n in (note, horizon) if n)
    interval = s.interval or "step"
    name = str(s.name).lower().replace("-", "_") if s.name is not None else None
    if total_steps is None and name in optim.OVER_THE_RUN and (s.interval or optim.DEFAULT_INTERVAL[name]) == "step":
        raise ConfigError(f"config key 'scheduler.name': {s.name!r} runs over the run's optimizer steps, but "
                          f"{unknown}, so their number is not known before the run; {fix}, or step it per epoch "
                          f"(scheduler_interval=\"epoch\")")
    schedulers = {}
    for k, opt in optimizers.items():
        sch, interval = optim.build_scheduler(
            s.name, opt, interval=s.interval, total_steps=total_steps, epochs=cfg.epochs,
            step_size=s.step_size, gamma=s.gamma, milestones=s.milestones, warmup_steps=s.warmup_steps,
            min_lr=s.min_lr, max_lr=s.max_lr, pct_start=s.pct_start)
        if sch is not None:
            schedulers[k] = sch
    return schedulers, interval, ""


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def _built(value: Any, optimizers: dict, name: str, total_steps: Optional[int]) -> Any:
    """A scheduler object as it is; a factory called with its optimizer and the run's optimizer steps."""
    if _is_scheduler(value) or not callable(value):
        return value
    if name not in optimizers:
        raise ConfigError(f"scheduler {name!r}: there is no optimizer of that name to build it for; the optimizers "
                          f"are {', '.join(repr(k) for k in optimizers)}")
    made = value(optimizers[name], total_steps=total_steps)
    if not _is_scheduler(made):
        raise TypeError(f"the scheduler factory {getattr(value, '__name__', value)!r} returned "
                        f"{type(made).__name__}, not a torch.optim.lr_scheduler scheduler; it is called as "
                        f"factory(optimizer, total_steps=N) and returns e.g. OneCycleLR(optimizer, max_lr=0.1, "
                        f"total_steps=total_steps)")
    return made


def horizon_of(sch: Any) -> Optional[tuple[str, int]]:
    """``(argument, intervals)`` after which a scheduler has run its course: OneCycleLR's ``total_steps``,
    CosineAnnealingLR's ``T_max``, PolynomialLR's ``total_iters``; None for a scheduler without one (a
    constant, a step decay, a warm-up that ends early by design, a lambda)."""
    S = torch.optim.lr_scheduler
    if isinstance(sch, S.OneCycleLR):
        return "total_steps", sch.total_steps
    if isinstance(sch, S.CosineAnnealingLR):
        return "T_max", sch.T_max
    if isinstance(sch, S.PolynomialLR):
        return "total_iters", sch.total_iters
    return None


def check_horizons(schedulers: dict, interval: str, total_steps: Optional[int], epochs: int, run: str) -> str:
    """One line per given scheduler whose horizon is not the run's; a ``ConfigError`` for a OneCycleLR too short
    to reach the run's end (PyTorch raises "Tried to step N times" there, mid-run)."""
    unit = "optimizer steps" if interval == "step" else "epochs"
    wanted = total_steps if interval == "step" else epochs
    lines = []
    for name, sch in schedulers.items():
        found = horizon_of(sch)
        if found is None:
            continue
        arg, horizon = found
        left = horizon - max(0, getattr(sch, "last_epoch", 0))  # a second fit() goes on from where it is
        kind = type(sch).__name__ + ("" if name == "default" else f" ({name!r})")
        fix = (f"build it from the run's count: Trainer(scheduler=lambda optimizer, total_steps: {type(sch).__name__}"
               f"(optimizer, ..., {arg}=total_steps))" if interval == "step" else f"set {arg}={wanted}")
        if wanted is None:
            if interval == "step":
                lines.append(f"torchrig: scheduler {kind} has {arg}={horizon}; this run's length in optimizer steps "
                             f"is not known before it ends (a stream without a length), so it is not checked")
            continue
        if left == wanted:
            continue
        if isinstance(sch, torch.optim.lr_scheduler.OneCycleLR) and left < wanted:
            raise ConfigError(f"scheduler OneCycleLR has total_steps={horizon}, but this run takes {wanted} "
                              f"{unit}{run}; PyTorch's OneCycleLR cannot step past total_steps (it would stop the "
                              f"run at step {left + 1}); {fix}, or set max_steps={left}")
        what = "stops short of its end" if left > wanted else "reaches its end early and the rest of the run " \
            + ("goes back up the cosine" if isinstance(sch, torch.optim.lr_scheduler.CosineAnnealingLR)
               else "stays at its last value")
        lines.append(f"torchrig: scheduler {kind} has {arg}={horizon}, but this run takes {wanted} {unit}{run}: "
                     f"it {what}; {fix}")
    return "\n".join(lines)


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


def fused_head(model: nn.Module, cfg: C.Config, loss_fn: Any, layout: parallel.Layout,
               device: torch.device) -> Optional[Any]:
    """``model.fused_head``: the named head computing its cross-entropy in its forward (``optim/fused_head.py``), or
    None. Refused in one line where the head's weight is not whole on each rank (FSDP2)."""
    name = cfg.model.fused_head
    if name is None:
        return None
    from ..optim import fused_head as fh
    from ..optim.losses import tensor_loss

    if layout.sharded:
        raise ConfigError(f"config key 'model.fused_head': {name} with {layout.describe() or layout.strategy} is not "
                          f"supported (the fused head needs its whole weight in one process); use dist.strategy=ddp, "
                          f"or set model.fused_head=null")
    return fh.fuse_head(model, name, loss_fn, tensor_loss, device)
