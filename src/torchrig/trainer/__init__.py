"""Trainer.fit / evaluate / predict, the loop, accumulation, clipping, schedules, progress, early stop."""

from .losses import LOSSES, build_loss
from .optim import OPTIMIZERS, SCHEDULERS, NameError_, build_optimizer, build_scheduler, param_groups
from .step import NonFiniteLossError, Step, default_eval_step, default_step, split_batch
from .trainer import Trainer

__all__ = ["Trainer", "Step", "NonFiniteLossError", "default_step", "default_eval_step", "split_batch",
           "build_loss", "build_optimizer", "build_scheduler", "param_groups", "LOSSES", "OPTIMIZERS", "SCHEDULERS",
           "NameError_"]
