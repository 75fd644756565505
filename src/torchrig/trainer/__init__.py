"""Trainer.fit / evaluate / predict: the loop, the one step, training state, callbacks, early stop, inference.

The optimisation names (optimizers, schedules, losses) are re-exported from ``torchrig.optim``."""

from ..data.batches import split_batch
from ..optim.losses import LOSSES, build_loss
from ..optim.optimizers import OPTIMIZERS, SCHEDULERS, NameError_, UnknownNameError, build_optimizer, build_scheduler, param_groups
from .step import NonFiniteLossError, Step, default_eval_step, default_step
from .trainer import Trainer

__all__ = ["Trainer", "Step", "NonFiniteLossError", "default_step", "default_eval_step", "split_batch",
           "build_loss", "build_optimizer", "build_scheduler", "param_groups", "LOSSES", "OPTIMIZERS", "SCHEDULERS",
           "NameError_", "UnknownNameError"]
