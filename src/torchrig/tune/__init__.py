"""Hyperparameter search over torchrig runs, built on Optuna (the optional extra ``torchrig[tune]``).

``torchrig.tune(config, space, trials, ...)`` (this module is callable: it is :func:`tune`) and
``torchrig tune CONFIG --space space.yaml --trials N``. Modules: ``space`` (the search space, checked by the
config keys' own rules), ``trial`` (one trial: a torchrig run that reports to the study and stops when
pruned, on every rank at once), ``study`` (the study directory, its manifest and Optuna study, exact
resume), ``manifest`` (what a resume takes from a study folder, a stranger's file, and by which rule), ``run`` (the loop, ``--parallel`` workers, the end), ``report`` (table, best.yaml, tune.png).
This layer sits above the trainer, beside the recipes, whose runs its trials are.
"""

from __future__ import annotations

import sys
import types

from .run import TuneResult, tune
from .space import Space, TuneError, load_space

__all__ = ["TuneError", "TuneResult", "Space", "load_space", "tune"]


class _CallableModule(types.ModuleType):
    """``torchrig.tune`` is this package once imported; calling it calls :func:`tune`."""

    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
