"""Callbacks: plain objects whose methods, when present, the loop calls at fixed points.

    on_fit_start(trainer)                  after data, schedules and resume are ready
    on_step_end(trainer, outputs)          after each optimizer step (``outputs``: the step function's dict)
    on_log(trainer, values, kind)          each logged row; ``kind`` is "interval" or "epoch"
    on_eval_end(trainer, metrics)          after ``evaluate`` (also the per-epoch validation)
    on_save(trainer, path, metrics)        after a checkpoint is written (``path`` None on ranks that wrote none;
                                           with checkpoint.async_save it may still be being written in the
                                           background: ``trainer.checkpoints.wait()`` waits for it)
    on_fit_end(trainer)                    after the last step and the final checkpoint
    on_exception(trainer, exc)             when ``fit`` ends with an exception (then it is re-raised)

No base class is needed. A callback with ``state_dict`` / ``load_state_dict`` is saved in every
checkpoint and restored on resume. Early stopping and best-checkpoint tracking are callbacks too.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from ..config import ConfigError
from ..metrics import Metric, higher_is_better
from ..errors import setting

HOOKS = ("on_fit_start", "on_step_end", "on_log", "on_eval_end", "on_save", "on_fit_end", "on_exception")


class Callbacks:
    """Calls the hooks of a list of callbacks in order; hooks are looked up once, not per call."""

    def __init__(self, callbacks: Optional[list] = None):
        self.items = list(callbacks or [])
        for name in [n for cb in self.items for n in dir(cb) if n.startswith("on_") and n not in HOOKS]:
            raise ConfigError(f"callback method '{name}' is not a hook; hooks are {', '.join(HOOKS)}")
        self.hooks = {h: [getattr(cb, h) for cb in self.items if callable(getattr(cb, h, None))] for h in HOOKS}

    def call(self, hook: str, *args: Any) -> None:
        for fn in self.hooks[hook]:
            fn(*args)

    def _stateful(self) -> dict[str, Any]:
        return {f"{i}-{type(cb).__name__}": cb for i, cb in enumerate(self.items) if hasattr(cb, "state_dict")}

    def state_dict(self) -> dict:
        return {k: cb.state_dict() for k, cb in self._stateful().items()}

    def load_state_dict(self, state: dict) -> None:
        for k, cb in self._stateful().items():
            if k in state:
                cb.load_state_dict(state[k])


def _higher_is_better(name: str, metrics: Sequence[Any]) -> bool:
    """The direction a metric object declares for the key it logs (torchmetrics' ``higher_is_better``, a
    torchrig metric class's own), else the key's name (``loss``, ``error`` … are lower-is-better)."""
    base = name.split("/")[-1]
    for m in metrics:
        if getattr(m, "name", None) == base and _declares_direction(m):
            return bool(m.higher_is_better)
    return higher_is_better(name)


def _declares_direction(metric: Any) -> bool:
    """Whether the object or a class below torchrig's ``Metric`` base sets ``higher_is_better``."""
    if "higher_is_better" in vars(metric):
        return True
    return any("higher_is_better" in vars(k) for k in type(metric).__mro__ if k is not Metric and k is not object)


class Monitor:
    """A logged value to watch (``val/accuracy`` …), whether higher is better, and its best so far."""

    def __init__(self, name: Optional[str], mode: Optional[str] = None, metrics: Sequence[Any] = ()):
        self.name = name
        self.mode = mode or ("max" if name and _higher_is_better(name, metrics) else "min")
        self.best: Optional[float] = None

    @property
    def tie_breaker(self) -> Optional[str]:
        """The loss that ranks checkpoints whose monitored value ties (``val/accuracy`` 1.0 at several epochs):
        the loss of the same split (``val/loss``), lower is better; None when the monitor is that loss."""
        if not self.name:
            return None
        split, _, base = self.name.rpartition("/")
        return None if base == "loss" else (f"{split}/loss" if split else "loss")

    def improved(self, value: float) -> bool:
        """Record ``value``; True if it beats the best so far (NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None or (value > self.best if self.mode == "max" else value < self.best):
            self.best = value
            return True
        return False


class EarlyStopping:
    """Stop after ``patience`` epochs in which the monitored value did not improve."""

    def __init__(self, monitor: Monitor, patience: Optional[int]):
        self.monitor, self.patience = monitor, patience
        self.bad_epochs = 0

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.bad_epochs >= self.patience

    def on_log(self, trainer: Any, values: dict, kind: str) -> None:
        if kind == "epoch" and self.monitor.name in values:
            self.bad_epochs = 0 if self.monitor.improved(float(values[self.monitor.name])) else self.bad_epochs + 1

    def state_dict(self) -> dict:
        return {"best": self.monitor.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.monitor.best, self.bad_epochs = state.get("best"), int(state.get("bad_epochs", 0))


class BestCheckpoint:
    """Keep the ``keep_best`` checkpoints with the best monitored value, and the ``best`` link. A tie of the
    monitored value goes to the lower loss of the same split (``Monitor.tie_breaker``), then to the later step."""

    def __init__(self, monitor: Monitor, explicit: bool):
        self.monitor, self.explicit = monitor, explicit

    def on_save(self, trainer: Any, path: Any, metrics: Optional[dict]) -> None:
        if not metrics:
            return
        if self.monitor.name in metrics:
            if path is not None:
                tie = metrics.get(self.monitor.tie_breaker) if self.monitor.tie_breaker else None
                trainer.checkpoints.track_best(path.name, float(metrics[self.monitor.name]), self.monitor.mode,
                                               loss=None if tie is None else float(tie))
        elif self.explicit and any(k.startswith("val/") for k in metrics):
            # A typo in checkpoint.monitor would silently keep no best checkpoint: say so once validation ran.
            raise ConfigError(f"config key 'checkpoint.monitor': {self.monitor.name!r} is not a logged value; choose "
                              f"one of {', '.join(k for k in metrics if k != 'lr')} (the run is saved: "
                              f"{setting('resume', 'latest')})")
