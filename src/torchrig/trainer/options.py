"""Trainer keywords: the objects it takes as they are, and the config keys they set."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import config as C
from ..errors import suggest

# Trainer keyword -> config key, for the keywords that are not top-level config keys.
KWARG_KEYS = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "momentum": "optim.momentum",
    "nesterov": "optim.nesterov", "betas": "optim.betas", "group_lr": "optim.group_lr",
    "batch_size": "data.batch_size", "eval_batch_size": "data.eval_batch_size",
    "micro_batch_size": "data.micro_batch_size",
    "num_workers": "data.num_workers", "pin_memory": "data.pin_memory", "shuffle": "data.shuffle",
    "drop_last": "data.drop_last", "fast_path": "data.fast_path", "steps_per_epoch": "data.steps_per_epoch",
    "persistent_workers": "data.persistent_workers",
    "input_keys": "data.input_keys", "label_key": "data.label_key",
    "checkpoint_every": "checkpoint.every_steps", "checkpoint_every_epochs": "checkpoint.every_epochs",
    "keep_last": "checkpoint.keep_last", "keep_best": "checkpoint.keep_best", "monitor": "checkpoint.monitor",
    "monitor_mode": "checkpoint.mode", "log_every": "log.every_steps", "progress": "log.progress",
    "tensorboard": "log.tensorboard", "plot": "log.plot", "strategy": "dist.strategy",
    "sync_batchnorm": "dist.sync_batchnorm", "backend": "dist.backend", "init_method": "dist.init_method",
    "rank": "dist.rank", "world_size": "dist.world_size", "dist_timeout": "dist.timeout",
    "find_unused_parameters": "dist.find_unused_parameters", "static_graph": "dist.static_graph",
    "bucket_cap_mb": "dist.bucket_cap_mb", "fsdp_wrap": "dist.fsdp_wrap", "warmup_steps": "scheduler.warmup_steps",
    "scheduler_interval": "scheduler.interval", "channels_last": "model.channels_last", "compile": "model.compile",
    "activation_checkpointing": "model.activation_checkpointing", "broadcast_buffers": "dist.broadcast_buffers",
    "trackers": "log.trackers", "flops": "log.flops",
}


def _apply_kwargs(cfg: C.Config, kwargs: dict) -> None:
    top = {f.name for f in dataclasses.fields(cfg)}
    for key, value in kwargs.items():
        dotted = KWARG_KEYS.get(key, key)
        if dotted not in top and dotted == key:
            hint = suggest(key, sorted(top | set(KWARG_KEYS)))
            raise TypeError(f"Trainer got an unexpected keyword argument '{key}'{hint}")
        C.set_key(cfg, dotted, value)


def resolve_options(config: Optional[C.Config], given: dict[str, Any], kwargs: dict) -> tuple[C.Config, dict]:
    """The run's config, and the objects given as such (an optimizer instance, a loss callable …).

    ``given`` holds the ``optimizer``, ``loss``, ``scheduler`` and ``metrics`` arguments: a name
    becomes a config value, anything else is kept as the object to use.
    """
    import copy

    cfg = copy.deepcopy(config) if config is not None else C.Config()
    objects: dict[str, Any] = {}
    kwargs = dict(kwargs)
    for key, value in given.items():
        if value is None:
            continue
        if key in ("optimizer", "scheduler") and isinstance(value, str):
            kwargs["optim.name" if key == "optimizer" else "scheduler.name"] = value
        elif key == "loss" and isinstance(value, str):
            kwargs["loss"] = value
        elif key == "metrics" and isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value):
            kwargs["metrics"] = list(value)
        else:
            objects[key] = value
    dotted = {k: kwargs.pop(k) for k in list(kwargs) if "." in k}
    _apply_kwargs(cfg, kwargs)
    for k, v in dotted.items():
        C.set_key(cfg, k, v)
    return C.validate(cfg), objects
