"""What a run is at a given instant, as Stateful objects a checkpoint saves and restores.

Every object here has ``state_dict()`` / ``load_state_dict()``, like a module or an optimizer, so the
checkpoint manager saves a plain ``{name: object}`` mapping and knows nothing of the Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

import torch

from .. import runtime


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

    def __init__(self, metrics: list, groups: runtime.Groups = runtime.WORLD):
        self.metrics, self.groups = metrics, groups
        self.world_size = runtime.get_world_size()

    def synced(self) -> list:
        """Copies of the metrics with states summed over ranks (collective; the originals keep their own)."""
        if self.world_size == 1:
            return self.metrics
        out = []
        for m in self.metrics:
            c = copy.copy(m)
            c.states = dict(m.states)
            c.sync(self.groups)
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
        keeps = self.groups.dp_rank() == 0 and self.groups.is_last_stage()
        for m in self.metrics:
            if m.name in state:  # checkpoints load on the CPU; the states live on the run's device
                m.states = {k: (v if keeps else torch.zeros_like(v)).to(m.device or v.device, torch.float64)
                            for k, v in state[m.name].items()}
