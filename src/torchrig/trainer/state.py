"""What a run is at a given instant, as Stateful objects a checkpoint saves and restores.

Every object here has ``state_dict()`` / ``load_state_dict()``, like a module or an optimizer, so the
checkpoint manager saves a plain ``{name: object}`` mapping and knows nothing of the Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Optional

import torch

from .. import runtime
from ..config import ConfigError


@dataclasses.dataclass
class TrainState:
    """The loop's counters. ``epoch`` / ``batch_in_epoch`` say where the next micro-batch comes from."""

    global_step: int = 0       # optimizer steps taken (skipped ones not counted)
    epoch: int = 0             # 0-based epoch of the next micro-batch
    batch_in_epoch: int = 0    # micro-batches of that epoch already consumed
    skipped_steps: int = 0     # windows not applied: non-finite values, or fp16 overflow
    world_size: int = 1        # processes when saved
    samples_in_epoch: int = -1  # samples of the epoch's order consumed over all ranks (-1: not known, a stream)
    total_steps: int = 0       # the global step at which the run ends: its schedules' horizon (0: not known)
    run_length: int = 0        # epochs × 1_000_003 + max_steps + 1 that horizon was planned for (0: not known)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, int(state[f.name]))

    def resume_at(self, world_size: int, locate: Callable[[int], Optional[int]], samples_before: Callable[[int], int],
                  why_not: str = "") -> tuple[int, int, str]:
        """Where a resumed run goes on: (epoch, micro-batch, a note when that moved to the epoch's start).

        The position is the number of samples of the epoch's order consumed over all ranks; ``locate`` turns it
        into this run's micro-batch (None when it falls inside one of this run's optimizer steps), so a run on
        another number of processes goes on with the next sample. ``samples_before`` turns this run's micro-batches
        back into samples (-1 when its data cannot say: a stream read by workers); such a run keeps the checkpoint's
        micro-batch on the same number of processes, as does a checkpoint without a position (a stream's); else the
        epoch starts over (``why_not``: why the data cannot say where)."""
        saved, self.world_size = self.world_size, world_size
        if not self.batch_in_epoch:
            return self.epoch, 0, ""
        if self.samples_in_epoch >= 0:
            batch = locate(self.samples_in_epoch)
            if batch is not None:
                return self.epoch, batch, ""
            if saved == world_size and samples_before(self.batch_in_epoch) < 0:  # the same split, and this run's
                return self.epoch, self.batch_in_epoch, ""  # data cannot place samples (a stream read by workers)
            return self.epoch, 0, (f"torchrig: the checkpoint stopped after {self.samples_in_epoch} samples of epoch "
                                   f"{self.epoch + 1}, inside an optimizer step of this run (its global batch "
                                   f"differs); resuming at the start of epoch {self.epoch + 1}: keep "
                                   f"data.global_batch_size the same to resume mid-epoch")
        if saved != world_size:
            end = f"; the run still ends at step {self.total_steps}" if self.total_steps else ""
            return self.epoch, 0, (f"torchrig: epoch {self.epoch + 1} starts over: the checkpoint stopped "
                                   f"{self.batch_in_epoch} batches into it on {saved} process(es), now "
                                   f"{world_size}, and {why_not or 'holds no position in samples'}{end}")
        return self.epoch, self.batch_in_epoch, ""


def keep_horizon(state: TrainState, plan: "FitPlan", length: int) -> str:
    """After a resume: the run ends at the step the checkpoint's run planned when its length settings (``length``,
    see :func:`run_length`) are unchanged, whatever the steps per epoch here (a stream split over another number of
    processes, a global batch changed with ``resume_changes=allow``). Schedules restore their own horizon from the
    checkpoint (``OneCycleLR``'s total steps, ``CosineAnnealingLR``'s ``T_max``), so the run's end must not move
    past it. Returns a line to say when it differs from what this run alone would plan, else ""."""
    saved, note = state.total_steps, ""
    if saved and plan.total_steps is not None and state.run_length == length and saved != plan.total_steps:
        note = (f"torchrig: the run keeps the length its checkpoint planned, {saved} optimizer steps (this run's "
                f"{plan.steps_per_epoch} steps per epoch alone would make it {plan.total_steps}), so that step-based "
                f"schedules keep their horizon")
        plan.total_steps = saved
    state.total_steps, state.run_length = plan.total_steps or 0, length  # 0: a stream's epochs end the run
    return note


def run_length(cfg: Any) -> int:
    """The settings a run's planned length comes from (``epochs``, ``max_steps``) as one number."""
    return cfg.epochs * 1_000_003 + (cfg.max_steps if cfg.max_steps is not None else -1) + 1


class RNGState:
    """Every rank's Python, NumPy, torch CPU and CUDA generators: ``{"ranks": [rank 0's, rank 1's, …]}``
    (gathered when saved: collective), each rank restoring its own.

    Saved with another number of processes, the streams cannot be continued exactly: every rank then
    restores rank 0's, and :attr:`note` says so.
    """

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self.note = ""

    def state_dict(self) -> dict:
        return {"ranks": runtime.rng_states_of_ranks()}

    def load_state_dict(self, state: dict) -> None:
        ranks = state["ranks"] if "ranks" in state else [state]  # an older checkpoint: one process's generators
        if len(ranks) == self.world_size:
            runtime.set_rng_state(ranks[self.rank])
            return
        runtime.set_rng_state(ranks[0])
        self.note = (f"torchrig: the checkpoint holds the random number generators of {len(ranks)} process(es), "
                     f"now {self.world_size}; dropout and augmentation streams cannot be restored exactly "
                     f"(every process continues from rank 0's)")


class Group:
    """A name -> Stateful mapping saved as one entry (the optimizers, the schedulers)."""

    def __init__(self, items: dict[str, Any]):
        self.items = items

    def state_dict(self) -> dict:
        return {k: v.state_dict() for k, v in self.items.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, v in self.items.items():
            if k in state:
                v.load_state_dict(state[k])


class ScalerState:
    """The fp16 GradScaler's scale and growth tracker (None without one)."""

    def __init__(self, scaler: Any):
        self.scaler = scaler

    def state_dict(self) -> Any:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Any) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class MetricStates:
    """The train metrics' running states, summed over ranks when saved.

    On resume rank 0 takes the sums and the other ranks start from zero, so the next sum over ranks
    is what an unbroken run would have. Loaded states go to the device the metric lives on.
    """

    def __init__(self, metrics: list, rank: int, world_size: int):
        self.metrics, self.rank, self.world_size = metrics, rank, world_size

    def synced(self) -> list:
        """Copies of the metrics with states summed over ranks (collective; the originals keep their own)."""
        if self.world_size == 1:
            return self.metrics
        out = []
        for m in self.metrics:
            c = copy.copy(m)
            c.states = dict(m.states)
            c.sync()
            out.append(c)
        return out

    def values(self) -> dict:
        """``{"train/accuracy": …}`` over every rank's samples so far (collective)."""
        return {f"train/{m.name}": m.compute() for m in self.synced() if m.states}

    def state_dict(self) -> dict:
        return {m.name: dict(m.states) for m in self.synced()}

    def load_state_dict(self, state: dict) -> None:
        # the sums go to one rank of the ranks they are summed over: the first data-parallel rank (of a pipeline's
        # last stage, where metrics are fed)
        keeps = runtime.data_parallel_rank() == 0 and runtime.is_last_stage()
        for m in self.metrics:
            if m.name in state:  # checkpoints load on the CPU; the states live on the run's device
                m.states = {k: (v if keeps else torch.zeros_like(v)).to(m.device or v.device, torch.float64)
                            for k, v in state[m.name].items()}


@dataclasses.dataclass
class FitPlan:
    """What one ``fit`` call will do."""

    batches: Any
    epoch_len: Optional[int]        # micro-batches per epoch (on this rank); None: a stream's, until it runs out
    steps_per_epoch: Optional[int]  # optimizer steps per epoch; None: not known beforehand
    total_steps: Optional[int]      # the global step at which this fit ends; None: when the stream's epochs end
    val_data: Any = None
    start: tuple[int, int] = (0, 0)  # (epoch, micro-batch) the loop starts from

    @classmethod
    def for_data(cls, batches: Any, cfg: Any, val_data: Any = None) -> "FitPlan":
        """The plan for ``batches`` (already built): epoch length, steps per epoch, where ``fit`` ends. A stream
        without a length (``batches.length`` None) leaves them None: its epochs end when it runs out, and the
        run ends there after ``epochs``, or at ``max_steps``."""
        batches.set_epoch(0)
        if getattr(batches, "length", 0) is None:
            return cls(batches, None, None, cfg.max_steps, val_data)
        epoch_len = len(batches)
        if epoch_len == 0:
            sampler = getattr(batches, "sampler", None)
            count = getattr(sampler, "count", None)  # the data set's samples (in every process's order)
            n = f"the {count} training samples" if isinstance(count, int) else "the training data"
            raise ConfigError(f"config key 'data.batch_size': {cfg.data.batch_size} per process is more than {n} give each process "
                              f"(data.drop_last={str(cfg.data.drop_last).lower()} drops the only, partial batch); "
                              f"lower data.batch_size or set data.drop_last=false")
        if cfg.data.steps_per_epoch:  # an epoch shorter than the data (a stream's length is this already)
            epoch_len = min(epoch_len, cfg.data.steps_per_epoch * cfg.accumulate)
        steps_per_epoch = math.ceil(epoch_len / cfg.accumulate)
        total = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        return cls(batches, epoch_len, steps_per_epoch, total, val_data)

    def ends_by(self, step: int) -> bool:
        """Whether the fit has reached its end at global step ``step`` (never, before a stream's epochs end,
        without max_steps)."""
        return self.total_steps is not None and step >= self.total_steps

    @property
    def unknown(self) -> str:
        """Why the run's length in optimizer steps is not known beforehand ('' when it is)."""
        if self.total_steps is not None:
            return ""
        source = getattr(self.batches, "_source", lambda: self.batches)()
        return f"the training data {type(source).__name__} is a stream without a length"

    def describe(self, cfg: Any, world: int = 1) -> str:
        """How ``total_steps`` comes about: `` (2 epochs × 24 steps/epoch on 2 processes)``, for messages."""
        if cfg.max_steps is not None and cfg.max_steps == self.total_steps:
            return f" (max_steps={cfg.max_steps})"
        if self.steps_per_epoch is None:
            return ""
        parts = [f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''} × {self.steps_per_epoch} steps/epoch"]
        if world > 1:
            parts.append(f"on {world} processes")
        if cfg.accumulate > 1:
            parts.append(f"accumulating {cfg.accumulate} batches per step")
        return f" ({' '.join(parts)})"
