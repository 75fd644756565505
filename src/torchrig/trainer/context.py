"""What one ``fit`` is made of, handed to what saves and restores it.

``Trainer.fit`` builds a :class:`FitContext` once, when every part of the fit exists (after the step, the
accumulation windows and the spike check), and never changes it. Saving and resuming a checkpoint
(``saving.py``) reads these fields and nothing else of the Trainer; the other parts of a fit are handed the few
objects each needs when they are made. Each field is documented here, so a reader can follow where a value comes
from without opening the Trainer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from torch import nn

from .. import config as C
from ..checkpoint import CheckpointManager
from ..data import Batches
from ..data.iterable import IterableBatches
from ..metrics import Metric
from ..observe.metrics_logger import MetricsLogger
from ..optim.ema import EMA
from ..parallel import Layout, Replicas
from ..runtime import Precision, StopSignal
from .callbacks import Callbacks, EarlyStopping
from .plan import RunPlan
from .state import TrainState

if TYPE_CHECKING:  # import cycles at run time: these modules take their context from here
    from .spikes import SpikeGuard
    from .step import Step
    from .window import Windows


@dataclasses.dataclass(frozen=True)
class FitContext:
    cfg: C.Config                   # the run's config, as validated
    plan: RunPlan                   # what this process does of it (per-process batch, accumulation, …)
    layout: Layout                  # the degrees, the wrapper and the process groups (a checkpoint records them)
    device: torch.device
    rank: int
    world_size: int
    model: nn.Module                # the user's module, unwrapped: its weights are the checkpoint's
    optimizers: dict[str, torch.optim.Optimizer]  # name -> optimizer ("default" for one)
    schedulers: dict                # name -> scheduler
    precision: Precision            # autocast dtype and the fp16 GradScaler
    state: TrainState               # the counters
    step: "Step"                    # the Step of this fit
    windows: "Windows"              # its accumulation windows (the micro-batch size auto settled on is saved)
    train_metrics: list[Metric]     # fed by the step
    metrics_log: MetricsLogger      # the sums behind the logged rows
    checkpoints: CheckpointManager  # of the run directory
    early_stopping: EarlyStopping   # with the monitored value's best so far
    callbacks: Callbacks            # the user's callbacks (their state is saved)
    data: Union[Batches, IterableBatches]  # the training batches (a stream's position is saved)
    ema: Optional[EMA]              # EMA of the weights, or None
    spikes: Optional["SpikeGuard"]  # on_spike=rollback: its running statistics are saved
    signals: StopSignal             # this fit's stop signals
    run_dir: Path
    config_builds_model: bool       # the config rebuilds the model (the CLI); else its class is recorded
    say: Callable[[str], None]      # one line for the user, from the main process
    notify: Callable[..., None]     # notify(hook, *args): the fit's callbacks, given the Trainer
    base: Optional[dict] = None     # peft adapters: the base model's identity (optim.adapters.identity), else None
    replicas: Optional[Replicas] = None  # dist.fault_tolerance=torchft: parallel.Replicas (its manager's counters are saved)

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors or stages (FSDP2, tensor or pipeline parallel): weights go through DCP."""
        return self.layout.sharded
