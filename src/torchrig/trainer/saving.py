"""What a checkpoint of a Trainer holds, and saving and resuming it.

A checkpoint is the ``{name: Stateful}`` mapping of :func:`states` (the model and optimizers first),
written by the run's :class:`~torchrig.checkpoint.CheckpointManager`; :func:`resume` loads it back and
says where the loop goes on (epoch, micro-batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import runtime
from ..checkpoint import find_checkpoint, load_weights_only, read_config, read_meta
from . import changes, provenance
from .state import Group, MetricStates, RNGState, ScalerState
from .step import NonFiniteLossError, finite_parameters

if TYPE_CHECKING:
    from .trainer import Trainer


def states(t: "Trainer") -> dict[str, Any]:
    """Everything a checkpoint holds, as Stateful objects (the model and optimizers first)."""
    return {
        "model": runtime.unwrap(t.model),
        "optimizers": t.optimizers,
        "schedulers": Group(t.schedulers),
        "scaler": ScalerState(t.precision.scaler),
        "counters": t.state,
        "tracker": t.early_stopping,
        "train_metrics": MetricStates(t.train_metrics, t.rank, t.world_size),
        "window": t.metrics_log,
        "callbacks": t.callbacks,
        "rng": RNGState(t.rank, t.world_size),
        "data": t._data,  # the training data's position where it can report one
        **({"ema": t.ema} if t.ema is not None else {}),
        "micro_batch": t.micro,  # the size data.micro_batch_size=auto settled on (set up before any save)
    }


def save(t: "Trainer", metrics: Optional[dict] = None, final: bool = False) -> Optional[Path]:
    """A checkpoint of this instant (collective: every rank calls it)."""
    t.step is not None and t.step.settle()  # non-finite steps skipped on the device: count or raise
    if not finite_parameters(runtime.unwrap(t.model), t.device):
        last = t.checkpoints.last_step
        raise NonFiniteLossError(
            f"the model's parameters hold NaN or inf at step {t.global_step}; no checkpoint was written"
            + (f" (the last one, step {last}, is intact)" if last is not None else "")
            + ". Lower optim.lr, set clip_grad_norm, or check a custom step function that changes the weights")
    meta = {"step": t.global_step, "epoch": t.state.epoch, "batch_in_epoch": t.state.batch_in_epoch,
            "final": final, "torch": torch.__version__, "world_size": t.world_size, "precision": t.precision.name}
    factories = provenance.factory_files(t.cfg)
    if factories:
        meta["factories"] = factories
    config = provenance.saved_config(t.cfg, t.model, t.config_builds_model)
    with t._signals.saving():  # however long they take, a stop signal's watchdog lets them finish
        t.checkpoints.wait()  # the save in flight first: at most one; its error, if any, is raised here
        path = t.checkpoints.save(t.global_step, states(t), config=config, meta=meta, metrics=metrics)
    t._run_callbacks.call("on_save", t, path, metrics)
    return path


def resume(t: "Trainer", spec: str) -> tuple[int, int]:
    """Load checkpoint ``spec`` (a path, ``latest`` or ``best``); returns the (epoch, micro-batch) to go on from."""
    path = find_checkpoint(spec, t.run_dir)
    if path is None:  # resume="latest" with nothing saved yet: a fresh start, said once
        t.print(f"torchrig: resume={spec}: {t.run_dir} holds no checkpoint yet; training starts at step 0")
        return 0, 0
    if t.cfg.resume_weights_only:
        load_weights_only(runtime.unwrap(t.model), path, sharded=t.strategy == "fsdp")
        t.print(f"torchrig: loaded the weights of {path}; optimizer, schedule and step start fresh "
                   f"(resume_weights_only=true)")
        return 0, 0
    saved_world = read_meta(path).get("world_size")
    changes.check(read_config(path), provenance.saved_config(t.cfg, t.model, t.config_builds_model), path,
                  allow=t.cfg.resume_changes == "allow", say=t.print,
                  worlds=(saved_world if isinstance(saved_world, int) else t.world_size, t.world_size))
    restored = states(t)
    t.checkpoints.load(path, restored, print_fn=t.print)
    for opt in t.optimizers.values():
        opt._opt_called = True  # it has stepped before: no "scheduler.step() before optimizer.step()"
    t.resumed_from = path
    epoch, batch, note = t.state.resume_at(t.world_size)
    for line in (note, restored["rng"].note):
        if line:
            t.print(line)
    return epoch, batch
