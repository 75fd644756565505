"""What a checkpoint of a Trainer holds, and saving and resuming it.

A checkpoint is the ``{name: Stateful}`` mapping of :func:`states` (the model and optimizers first),
written by the run's :class:`~torchrig.checkpoint.CheckpointManager`; :func:`resume` loads it back and
says where the loop goes on (epoch, micro-batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import find_checkpoint, load_weights_only, read_config, read_meta
from ..checkpoint.meta import DEGREES
from ..optim.optimizers import follow_new_length, planned_horizon
from . import changes, provenance
from .context import FitContext
from .plan import run_length
from .state import Group, MetricStates, RNGState, ScalerState
from .step import NonFiniteLossError, finite_parameters


def states(c: FitContext) -> dict[str, Any]:
    """Everything a checkpoint holds, as Stateful objects (the model and optimizers first)."""
    return {
        "model": c.model,
        "optimizers": c.optimizers,
        "schedulers": Group(c.schedulers),
        "scaler": ScalerState(c.precision.scaler),
        "counters": c.state,
        "tracker": c.early_stopping,
        "train_metrics": MetricStates(c.train_metrics, c.layout.groups),
        "window": c.metrics_log,
        "callbacks": c.callbacks,
        "rng": RNGState(c.rank, c.world_size),
        "data": c.data,  # the training data's position where it can report one
        **({"ema": c.ema} if c.ema is not None else {}),
        "micro_batch": c.windows,  # the size data.micro_batch_size=auto settled on
        **({"spikes": c.spikes} if c.spikes is not None else {}),  # the spike check's recent steps
        **({"torchft": c.replicas} if c.replicas is not None else {}),  # torchft's manager: its step counters
    }


# What a replica group keeps of its own when it copies a live one's state: its random stream, its manager's counters
# (torchft sets them), and the EMA (its weights are a file of their own in checkpoints).
NOT_COPIED = ("rng", "torchft", "ema")


def live_state(c: FitContext) -> dict:
    """What a replacement replica group copies from a live one (``dist.fault_tolerance=torchft``): the checkpoint's
    state without :data:`NOT_COPIED`, its data position included, as plain state dicts."""
    c.state.samples_in_epoch = c.data.samples_before(c.state.batch_in_epoch)
    out = {k: s.state_dict() for k, s in states(c).items() if k not in ("optimizers", *NOT_COPIED)}
    out["optimizers"] = {k: o.state_dict() for k, o in c.optimizers.items()}
    return out


def load_live_state(c: FitContext, state: dict) -> None:
    """Take a live replica group's :func:`live_state`, as a resume takes a checkpoint's."""
    restored = states(c)
    c.model.load_state_dict(state["model"])
    for k, opt in c.optimizers.items():
        opt.load_state_dict(state["optimizers"][k])
        opt._opt_called = True  # it has stepped before: no "scheduler.step() before optimizer.step()"
    for k, obj in restored.items():
        if k not in ("model", "optimizers", *NOT_COPIED) and k in state:
            obj.load_state_dict(state[k])


def live_position(c: FitContext) -> tuple[int, int]:
    """The (epoch, micro-batch) a replica group goes on from after :func:`load_live_state`."""
    epoch, batch, _ = c.state.resume_at(c.world_size, lambda n: c.data.batch_after(n, c.plan.accumulate),
                                        c.data.samples_before, getattr(c.data, "why_not_elsewhere", ""))
    return epoch, batch


def save(c: FitContext, metrics: Optional[dict] = None, final: bool = False) -> Optional[Path]:
    """A checkpoint of this instant (collective: every rank calls it)."""
    c.step.settle()  # non-finite steps skipped on the device: count or raise
    if not finite_parameters(c.model, c.device):
        last = c.checkpoints.last_step
        raise NonFiniteLossError(
            f"the model's parameters hold NaN or inf at step {c.state.global_step}; no checkpoint was written"
            + (f" (the last one, step {last}, is intact)" if last is not None else "")
            + ". Lower optim.lr, set clip_grad_norm, or check a custom step function that changes the weights")
    c.state.samples_in_epoch = c.data.samples_before(c.state.batch_in_epoch)  # the position, in any world size
    meta = {"step": c.state.global_step, "epoch": c.state.epoch, "batch_in_epoch": c.state.batch_in_epoch,
            "final": final, "torch": torch.__version__, "world_size": c.world_size, "precision": c.precision.name}
    meta["layout"] = c.layout.degrees()  # the degrees it was saved in: a resume in another layout says so
    meta["strategy"] = c.layout.strategy  # the data-parallel wrapper: none, ddp, fsdp
    meta["plan"] = c.plan.record()  # what the run derived from its config: per-process batch, accumulation
    meta["weights"] = "trainable" if c.checkpoints.trainable_only else "all"  # model.safetensors: adapters, or all
    if c.base is not None:
        meta["base"] = c.base  # the base model the adapters belong to (a resume onto another is refused)
    factories = provenance.factory_files(c.cfg)
    if factories:
        meta["factories"] = factories
    config = provenance.saved_config(c.cfg, c.model, c.config_builds_model)
    with c.signals.saving():  # however long they take, a stop signal's watchdog lets them finish
        c.checkpoints.wait()  # the save in flight first: at most one; its error, if any, is raised here
        path = c.checkpoints.save(c.state.global_step, states(c), config=config, meta=meta, metrics=metrics)
    c.notify("on_save", path, metrics)
    return path


def resume(c: FitContext, spec: str) -> tuple[Optional[Path], int, int]:
    """Load checkpoint ``spec`` (a path, ``latest`` or ``best``); returns the checkpoint loaded (None when there
    was none) and the (epoch, micro-batch) to go on from."""
    path = find_checkpoint(spec, c.run_dir)
    if path is None:  # resume="latest" with nothing saved yet: a fresh start, said once
        c.say(f"torchrig: resume={spec}: {c.run_dir} holds no checkpoint yet; training starts at step 0")
        return None, 0, 0
    verify = c.cfg.checkpoint.verify
    meta = read_meta(path)
    provenance.check_base(meta, c.base, path)  # adapters load onto the base they were trained on, or not at all
    if c.cfg.resume_weights_only:
        load_weights_only(c.model, path, sharded=c.sharded, verify=verify, pipeline=c.layout.groups.pipeline,
                          frozen_kept=meta.get("weights") == "trainable")
        c.say(f"torchrig: loaded the weights of {path}; optimizer, schedule and step start fresh "
              f"(resume_weights_only=true)")
        return None, 0, 0
    saved_layout = layout_of(meta)
    now = c.layout.degrees()
    changes.check(read_config(path, verify), provenance.saved_config(c.cfg, c.model, c.config_builds_model), path,
                  allow=c.cfg.resume_changes == "allow", say=c.say,
                  worlds=(data_parallel(saved_layout, c.world_size), data_parallel(now, c.world_size)),
                  run_dir=c.run_dir)
    restored = states(c)
    planned = {k: h for k, s in c.schedulers.items() if (h := planned_horizon(s)) is not None}
    c.checkpoints.load(path, restored, print_fn=c.say, verify=verify)
    if isinstance(meta.get("layout"), dict) and _layout_key(saved_layout) != _layout_key(now):
        c.say(f"torchrig: resumed a checkpoint saved {describe_layout(saved_layout)} ({path.name}) "
              f"{describe_layout(now)}: model and optimizer state resharded, step counters and the data position "
              f"kept; equal to the run in its saved layout up to float rounding, not bitwise")
    for opt in c.optimizers.values():
        opt._opt_called = True  # it has stepped before: no "scheduler.step() before optimizer.step()"
    if c.state.run_length != run_length(c.cfg):  # epochs or max_steps changed: the schedules follow the new length
        for name, horizon in planned.items():
            follow_new_length(c.schedulers[name], horizon)
    epoch, batch, note = c.state.resume_at(c.world_size, lambda n: c.data.batch_after(n, c.plan.accumulate),
                                           c.data.samples_before, getattr(c.data, "why_not_elsewhere", ""))
    for line in (note, restored["rng"].note):
        if line:
            c.say(line)
    return path, epoch, batch


def layout_of(meta: dict) -> dict:
    """The layout a checkpoint was saved in (``meta.json``: its degrees and world size); a checkpoint from
    before layouts were recorded: its world size alone, taken as data-parallel."""
    saved = meta.get("layout")  # its fields checked by their rules when meta.json was read (checkpoint.meta)
    out = {k: v for k, v in saved.items() if k in (*DEGREES, "world_size")} if isinstance(saved, dict) else {}
    if not out and isinstance(meta.get("world_size"), int):
        out = {"dp_replicate": meta["world_size"]}
    if out and isinstance(meta.get("world_size"), int):
        out["world_size"] = meta["world_size"]
    return out


def data_parallel(layout: dict, default: int) -> int:
    """Ranks that see different samples in ``layout`` (``default`` when it is not known)."""
    if not layout:
        return default
    return max(1, layout.get("dp_replicate", 1) * layout.get("dp_shard", 1))


def _layout_key(layout: dict) -> tuple:
    return tuple(layout.get(k, 1) for k in DEGREES) + (layout.get("world_size", 1),)


def describe_layout(layout: dict) -> str:
    """``at tp=2``, ``at dp_shard=2 × tp=2``, ``under DDP on 2 processes``, ``in one process``."""
    split = " × ".join(f"{k}={layout[k]}" for k in DEGREES[1:] if layout.get(k, 1) > 1)
    world = layout.get("world_size", 1)
    if split:
        replicas = layout.get("dp_replicate", 1)
        return "at " + (f"dp_replicate={replicas} × " if replicas > 1 else "") + split
    return f"under DDP on {world} processes" if world > 1 else "in one process"
