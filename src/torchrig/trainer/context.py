"""What one ``fit`` is made of, handed to the parts that need it (checkpoints, micro-batching).

``Trainer.fit`` builds a :class:`FitContext` once, after it built the step and before the loop; the
modules that save and restore a run (``saving.py``) and cut batches into micro-batches
(``microbatch.py``) read these fields and nothing else of the Trainer. Each field is documented here,
so a reader can follow where a value comes from without opening the Trainer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclasses.dataclass
class FitContext:
    cfg: Any                        # the run's Config
    device: torch.device
    rank: int
    world_size: int
    strategy: str                   # none, ddp, fsdp or dp (parallel.resolve_strategy)
    model: nn.Module                # the user's module, unwrapped: its weights are the checkpoint's
    wrapped: nn.Module              # what the loop calls (DDP / FSDP / DP around ``model``, maybe compiled)
    models: dict                    # name -> wrapped sub-model of an ``nn.ModuleDict`` (a GAN's), else {}
    optimizers: dict                # name -> optimizer ("default" for one)
    schedulers: dict                # name -> scheduler
    precision: Any                  # runtime.Precision: autocast dtype and the fp16 GradScaler
    state: Any                      # TrainState: the counters
    step: Any                       # the Step of this fit
    step_fn: Callable               # what runs each micro-batch (default_step or the user's)
    train_metrics: list             # torchrig.metrics.Metric objects fed by the step
    metrics_log: Any                # MetricsLogger: the sums behind the logged rows
    checkpoints: Any                # CheckpointManager of the run directory
    early_stopping: Any             # EarlyStopping (with the monitored value's best so far)
    callbacks: Any                  # the user's callbacks (their state is saved)
    data: Any                       # the training batches (a stream's position is saved)
    ema: Optional[Any]              # EMA of the weights, or None
    signals: Any                    # runtime.StopSignal of this fit
    run_dir: Path
    config_builds_model: bool       # the config rebuilds the model (the CLI); else its class is recorded
    say: Callable[[str], None]      # one line for the user, from the main process
    notify: Callable[..., None]     # notify(hook, *args): the fit's callbacks, given the Trainer
    micro: Any = None               # MicroBatcher, set once built (it reads this context)
    sharded: bool = False           # parameters are DTensors (FSDP2, tensor parallel): weights go through DCP
    spikes: Optional[Any] = None    # SpikeGuard (on_spike: rollback): its running statistics are saved
    layout: Any = None              # parallel.Layout: the degrees a checkpoint records and a resume compares
