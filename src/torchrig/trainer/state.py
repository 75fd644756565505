"""What a run is at a given instant, as Stateful objects a checkpoint saves and restores.

Every object here has ``state_dict()`` / ``load_state_dict()``, like a module or an optimizer, so the
checkpoint manager saves a plain ``{name: object}`` mapping and knows nothing of the Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import torch

from .. import runtime


@dataclasses.dataclass
class TrainState:
    """The loop's counters. ``epoch`` / ``batch_in_epoch`` say where the next micro-batch comes from."""

    global_step: int = 0       # optimizer steps taken (skipped ones not counted)
    epoch: int = 0             # 0-based epoch of the next micro-batch
    batch_in_epoch: int = 0    # micro-batches of that epoch already consumed
    skipped_steps: int = 0     # windows not applied: non-finite values, or fp16 overflow
    world_size: int = 1        # processes when saved: a mid-epoch position depends on it

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, int(state[f.name]))

    def resume_at(self, world_size: int) -> tuple[int, int, str]:
        """Where a resumed run goes on: (epoch, micro-batch, a note when that moved to the epoch's start)."""
        saved, self.world_size = self.world_size, world_size
        if self.batch_in_epoch and saved != world_size:
            return self.epoch, 0, (f"torchrig: checkpoint was saved with {saved} process(es), now {world_size}; "
                                   f"resuming at the start of epoch {self.epoch + 1} (mid-epoch position depends "
                                   f"on world size)")
        return self.epoch, self.batch_in_epoch, ""


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
        for m in self.metrics:
            if m.name in state:  # checkpoints load on the CPU; the states live on the run's device
                m.states = {k: (v if self.rank == 0 else torch.zeros_like(v)).to(m.device or v.device, torch.float64)
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
            raise ValueError(f"the training data gives no batch (batch_size={cfg.data.batch_size}, "
                             f"drop_last={cfg.data.drop_last}); lower data.batch_size")
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
