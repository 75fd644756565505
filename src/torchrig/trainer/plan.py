"""What a run does of its validated config, derived once, and what one ``fit`` call will do.

The config a run was given stays as it was validated: what the run derives from it and from where it runs
(the batch each process loads and how many it accumulates per optimizer step under ``data.global_batch_size``,
whether FLOPs are measured under a pipeline) is a :class:`RunPlan`, made once when the Trainer is built and
recorded in each checkpoint's ``meta.json`` (``plan``). What one ``fit`` call does with its data (epoch length,
optimizer steps, where it ends) is a :class:`FitPlan`; the horizon its schedules were planned for is kept in the
training state (``TrainState.total_steps``), see :func:`keep_horizon`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

from ..config import ConfigError
from ..data.split import split_global_batch
from ..runtime.accel import CUDA_GRAPH_MODES
from .state import TrainState


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What this process does of the validated config (see the module's text)."""

    batch_size: int                          # samples per loaded batch, per process
    accumulate: int                          # loaded batches per optimizer step
    micro_batch_size: Union[int, str, None]  # rows per micro-batch (None: the loaded batch; "auto")
    dp_size: int                             # processes that see different samples
    world_size: int                          # processes in all
    global_batch_size: Optional[int] = None  # data.global_batch_size, when the per-process batch comes from it
    flops: bool = False                      # log.flops, measured (not under a pipeline)
    drop_last: bool = False                  # the short last training batch is dropped (data.drop_last, CUDA graphs)

    @classmethod
    def derive(cls, cfg: Any, dp_size: int, world_size: int, pipelined: bool = False,
               cuda: bool = False) -> "RunPlan":
        """The plan of ``cfg`` on ``dp_size`` data-parallel ranks (of ``world_size``); ``cuda``: the run is on a GPU,
        where ``model.compile_mode=reduce-overhead`` replays CUDA graphs of one batch shape (no short last batch)."""
        d = cfg.data
        batch, accumulate = d.batch_size, cfg.accumulate
        if d.global_batch_size:  # per-process batch and accumulation follow the data-parallel size
            batch, accumulate = split_global_batch(d.global_batch_size, dp_size, d.micro_batch_size)
        graphs = cuda and cfg.model.compile and cfg.model.compile_mode in CUDA_GRAPH_MODES
        return cls(batch, accumulate, d.micro_batch_size, dp_size, world_size, d.global_batch_size or None,
                   bool(cfg.log.flops) and not pipelined, bool(d.drop_last or graphs))

    @property
    def micro_batches_per_window(self) -> int:
        """Micro-batches of one optimizer step on one process: loaded batches × pieces of each."""
        pieces = -(-self.batch_size // self.micro_batch_size) if isinstance(self.micro_batch_size, int) else 1
        return self.accumulate * pieces

    def record(self) -> dict:
        """What a checkpoint's ``meta.json`` records of it."""
        return {"batch_size": self.batch_size, "accumulate": self.accumulate, "dp_size": self.dp_size,
                "world_size": self.world_size}


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
    def for_data(cls, batches: Any, cfg: Any, run: RunPlan, val_data: Any = None) -> "FitPlan":
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
            raise ConfigError(f"config key 'data.batch_size': {run.batch_size} per process is more than {n} give each process "
                              f"(data.drop_last={str(run.drop_last).lower()} drops the only, partial batch); "
                              f"lower data.batch_size or set data.drop_last=false")
        if cfg.data.steps_per_epoch:  # an epoch shorter than the data (a stream's length is this already)
            epoch_len = min(epoch_len, cfg.data.steps_per_epoch * run.accumulate)
        steps_per_epoch = math.ceil(epoch_len / run.accumulate)
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

    def describe(self, cfg: Any, run: RunPlan) -> str:
        """How ``total_steps`` comes about: `` (2 epochs × 24 steps/epoch on 2 processes)``, for messages."""
        if cfg.max_steps is not None and cfg.max_steps == self.total_steps:
            return f" (max_steps={cfg.max_steps})"
        if self.steps_per_epoch is None:
            return ""
        parts = [f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''} × {self.steps_per_epoch} steps/epoch"]
        if run.world_size > 1:
            parts.append(f"on {run.world_size} processes")
        if run.accumulate > 1:
            parts.append(f"accumulating {run.accumulate} batches per step")
        return f" ({' '.join(parts)})"


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
