"""One trial: a torchrig run in its own directory, reporting ``checkpoint.monitor`` to the study each epoch.

Every rank runs the trial; only global rank 0 talks to the study. At each epoch's end rank 0 reports the
validation value and asks the pruner; its answer reaches every rank through one all-reduce of a flag (the
others add 0), so every rank leaves the loop after the same epoch, by the same exception, with no
collective left waiting. A pruned trial keeps the checkpoints it saved before the decision.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import config as C
from .. import runtime
from ..errors import TorchrigError


class Pruned(TorchrigError, RuntimeError):
    """Raised on every rank when the study prunes the trial at the end of ``epoch`` (caught by ``run_trial``)."""

    def __init__(self, epoch: int, value: Optional[float]):
        super().__init__(f"pruned after epoch {epoch}")
        self.epoch, self.value = epoch, value


class PruningCallback:
    """A plain torchrig callback: report ``monitor`` each epoch (rank 0), stop every rank when pruned.

    ``trial`` is the Optuna trial on rank 0 (None elsewhere); ``reported`` the epochs and values a run
    stopped before this one reported already (a resumed trial reports only the epochs after them).
    """

    def __init__(self, trial: Any, monitor: str, reported: Optional[dict] = None, clock: Optional["Clock"] = None):
        self.trial, self.monitor = trial, monitor
        self.values: dict[int, float] = dict(reported or {})
        self.clock = clock or Clock()

    def on_log(self, trainer: Any, values: dict, kind: str) -> None:
        if kind != "epoch":
            return
        epoch, prune = trainer.epoch, False  # the epoch just finished, counted from 1
        value = values.get(self.monitor)
        if value is not None:
            value = float(value)
            if self.trial is not None:
                if epoch not in self.values:
                    self.trial.report(value, epoch)
                    self.trial.set_user_attr("seconds", round(self.clock.seconds(), 3))
                # after the last epoch pruning saves nothing: the trial completes with its value
                prune = epoch < trainer.cfg.epochs and self.trial.should_prune()
            self.values[epoch] = value
        if runtime.agree_max([float(prune)], trainer.device)[0]:  # rank 0's answer, on every rank
            raise Pruned(epoch, value)


class Clock:
    """A trial's training time, over the runs of a stopped and resumed trial (``before``: earlier runs)."""

    def __init__(self, before: float = 0.0):
        self.before, self.start = before, time.monotonic()

    def seconds(self) -> float:
        return self.before + time.monotonic() - self.start


def seconds_of(attrs: dict) -> float:
    """A trial's recorded training seconds (its ``user_attrs``, read back): a finite number >= 0, else 0."""
    value = attrs.get("seconds")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else 0.0


@dataclass
class Outcome:
    """How a trial's run ended on this rank: ``state`` complete, pruned or failed; ``values`` epoch -> value."""

    state: str
    values: dict = field(default_factory=dict)
    epoch: Optional[int] = None
    error: str = ""


def run_trial(cfg: C.Config, callback: PruningCallback, say=print) -> Outcome:
    """Train ``cfg`` (its run_dir the trial's directory) with ``callback``; the ways a trial ends as an Outcome.

    A non-finite loss or an out-of-memory error fails this trial alone (its parameters were bad); any other
    error, and a stop signal, end the study as they end ``torchrig train``.
    """
    import torch

    from ..recipes.run import build_run
    from ..trainer import NonFiniteLossError

    try:
        recipe, data, trainer = build_run(cfg, callbacks=[callback])
        try:
            run = trainer.open_run()
            if trainer.is_main:
                recipe.save_artifacts(cfg, run)
            trainer.fit(data["train"], val_data=data.get("val"))
        finally:
            trainer.close()
    except Pruned as exc:
        return Outcome("pruned", callback.values, exc.epoch)
    except (NonFiniteLossError, torch.cuda.OutOfMemoryError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Outcome("failed", callback.values, error=text)
    return Outcome("complete", callback.values, max(callback.values, default=None))


def best_of(values: dict, direction: str) -> Optional[float]:
    """The trial's value: the best monitored value of its epochs (the one its ``best`` checkpoint holds)."""
    finite = [v for v in values.values() if not math.isnan(v)]
    if not finite:
        return None
    return max(finite) if direction == "maximize" else min(finite)
