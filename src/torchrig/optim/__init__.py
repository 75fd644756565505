"""Optimisation: optimizers and learning-rate schedules by name, losses by name, loss normalisation
(samples, tokens), the non-finite decision, the EMA of the weights and frozen parameters."""

from .losses import LOSSES, build_loss
from .optimizers import OPTIMIZERS, SCHEDULERS, NameError_, UnknownNameError, build_optimizer, build_scheduler, param_groups

__all__ = ["build_loss", "build_optimizer", "build_scheduler", "param_groups", "LOSSES", "OPTIMIZERS", "SCHEDULERS",
           "NameError_", "UnknownNameError"]
