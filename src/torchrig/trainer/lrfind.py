"""The learning-rate finder: ``Trainer.find_lr(data)`` and ``torchrig lr-find CONFIG``.

An exponential sweep: step i of N trains one batch at ``lr_i = start · (end / start)^(i / (N - 1))`` on a
copy of the model and of its optimizer (the copy's state loaded from the original's), through the run's own
step (precision, clipping, loss normalisation, a custom ``step_fn``), and records the loss. The model and
optimizer given, and every random generator, are left as they were, bitwise: what a ``fit`` does next does
not depend on whether the finder ran. Under DDP each rank trains its shard of each batch on a DDP-wrapped
copy; the loss is the mean over the ranks, so every rank sees the same curve and stops at the same step.

The curve is smoothed with a bias-corrected exponential moving average (``smooth``); the sweep stops early
once the smoothed loss exceeds ``diverge`` times its minimum, or is not finite. The suggestion's rule,
``steepest``: the learning rate where the smoothed loss falls fastest against log(lr) (the most negative
slope), looked for between the sweep's start and the minimum of the curve — a rate at which training
still makes the most progress per step, below the point where it starts to diverge. The minimum / 10 is
reported beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .. import runtime
from ..config import ConfigError
from ..data import prepare_train, to_device

RULE = "steepest: the smoothed loss falls fastest against log(lr) there, before its minimum"


@dataclass
class LRFinderResult:
    """The sweep: ``lrs`` and ``losses`` (raw, and smoothed), the suggestion and the rule that chose it."""

    lrs: list
    losses: list
    smoothed: list
    suggestion: Optional[float]
    rule: str = RULE
    minimum: Optional[float] = None  # the lr at the smoothed loss's minimum
    stopped: str = ""  # why the sweep ended before its last step ("diverged", "not finite"), or ""
    plot: Optional[Path] = None
    notes: list = field(default_factory=list)

    def describe(self) -> str:
        """What the sweep found, in lines of at most 80 columns."""
        import textwrap

        first = f"torchrig: lr-find · {len(self.lrs)} steps · lr {self.lrs[0]:.3g} to {self.lrs[-1]:.3g}" \
            + (f" · {self.stopped}" if self.stopped else "")
        if self.suggestion is None:
            second = "torchrig: no suggestion: the smoothed loss never fell; widen start_lr / end_lr or raise steps"
        else:
            second = (f"torchrig: suggested lr {self.suggestion:.3g} (rule {self.rule}"
                      + (f"; the minimum's lr / 10: {self.minimum / 10:.3g}" if self.minimum else "") + ")"
                      + (f" · plot {self.plot}" if self.plot else ""))
        return "\n".join(line for text in (first, second)
                         for line in textwrap.wrap(text, 80, subsequent_indent="  ", break_on_hyphens=False))


def copy_optimizer(optimizer: torch.optim.Optimizer, original: torch.nn.Module,
                   clone: torch.nn.Module) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``clone``'s parameters (matched to ``original``'s by
    position), its groups' settings and its state copied (deep: the sweep's updates never reach the original)."""
    mapping = {id(p): q for p, q in zip(original.parameters(), clone.parameters())}
    try:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
    except KeyError:
        raise ConfigError("find_lr: the optimizer holds parameters that are not the model's; give the Trainer an "
                          "optimizer of the model's parameters") from None
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold more (AdamW's)
    new = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    new.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return new


def smooth(values: list, beta: float) -> list:
    """Bias-corrected exponential moving average (``beta`` 0: the values themselves)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i) if beta else v)
    return out


def suggest(lrs: list, smoothed: list) -> tuple[Optional[float], Optional[float]]:
    """(steepest lr before the minimum, lr at the minimum), or (None, …) when the curve has no fall."""
    if len(lrs) < 3:
        return None, None
    low = min(range(len(smoothed)), key=lambda i: smoothed[i])
    if low < 2:
        return None, lrs[low]
    logs = [math.log10(lr) for lr in lrs[:low + 1]]
    slopes = [(smoothed[i + 1] - smoothed[i - 1]) / (logs[i + 1] - logs[i - 1]) for i in range(1, low)]
    steepest = min(range(len(slopes)), key=lambda i: slopes[i]) + 1
    return (lrs[steepest] if slopes[steepest - 1] < 0 else None), lrs[low]


def sweep(trainer: Any, data: Any, loader: dict, start: float, end: float, steps: int, beta: float,
          diverge: float) -> LRFinderResult:
    """Train ``steps`` batches of ``data`` on copies at exponentially growing learning rates (see the module)."""
    if not (0 < start < end) or steps < 3:
        raise ConfigError(f"find_lr: needs 0 < start_lr < end_lr and at least 3 steps, got start_lr={start}, "
                          f"end_lr={end}, steps={steps}")
    if trainer.strategy == "fsdp":
        raise ConfigError("find_lr: not under FSDP (sharded parameters); run it with one process or under DDP "
                          "(dist.strategy=ddp)")
    if len(trainer.optimizers) != 1:
        raise ConfigError(f"find_lr sweeps one optimizer; this Trainer has {len(trainer.optimizers)} "
                          f"({', '.join(trainer.optimizers)}): find each network's rate in a run of its own")
    rng = runtime.rng_state()  # the sweep's dropout and shuffling draws must not shift a later fit's
    try:
        return _sweep(trainer, data, loader, start, end, steps, beta, diverge)
    finally:
        runtime.set_rng_state(rng)


def _sweep(trainer: Any, data: Any, loader: dict, start: float, end: float, steps: int, beta: float,
           diverge: float) -> LRFinderResult:
    from . import build
    from .outputs import ModelIO
    from .step import Step, StepOptions
    from .window import Windows

    original = runtime.unwrap(trainer.model)
    clone = copy.deepcopy(original)
    wrapped, models = build.wrap_models(clone, trainer.cfg, trainer.strategy, trainer.device,
                                        trainer.precision.dtype)
    (name, opt), = trainer.optimizers.items()
    optimizer = copy_optimizer(opt, original, clone)
    grad_ranks = trainer.world_size if trainer.strategy == "ddp" else 1
    options = dataclasses.replace(StepOptions.from_config(trainer.cfg, grad_ranks, trainer.plan.batch_size),
                                  on_nonfinite="skip")
    step = Step(wrapped, {name: optimizer}, trainer.loss_fn, trainer.precision, trainer.device, options,
                models=models, metrics=[], io=ModelIO.from_config(trainer.cfg), groups=trainer.layout.groups)
    windows = Windows(step, trainer.step_fn, synced=[wrapped])  # one loaded batch per optimizer step
    batches = prepare_train(data, **loader)
    lrs, losses, smoothed, stopped = [], [], [], ""
    wrapped.train()
    for i, (index, batch) in zip(range(steps), _forever(batches)):
        lr = start * (end / start) ** (i / (steps - 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        window = windows.open(1, first=index)
        window.add(to_device(batch, trainer.device), batches.weight(index), index)
        values = window.finish()
        loss = float(runtime.all_reduce_mean(values["loss"].detach().float().reshape(1)).item())
        lrs.append(lr)
        losses.append(loss)
        if not math.isfinite(loss):
            stopped = "stopped: the loss is not finite"
            break
        smoothed = smooth(losses, beta)
        if i > 2 and smoothed[-1] > diverge * min(smoothed):
            stopped = f"stopped: loss above {diverge:g}x its minimum"
            break
    finite = [k for k, v in enumerate(losses) if math.isfinite(v)]
    lrs_f, smoothed = [lrs[k] for k in finite], smooth([losses[k] for k in finite], beta)
    best, minimum = suggest(lrs_f, smoothed)
    return LRFinderResult(lrs, losses, smoothed, best, minimum=minimum, stopped=stopped)


def _forever(batches: Any):
    """``(index in its epoch, batch)`` over epoch after epoch."""
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yielded = False
        for index, batch in enumerate(batches):
            yielded = True
            yield index, batch
        if not yielded:
            return
        epoch += 1


def plot(result: LRFinderResult, path: Path, root: Optional[Path] = None) -> Path:
    """Loss against learning rate (log scale): the raw losses, the smoothed curve and the suggestion. ``root``:
    the run directory when ``path`` lies in it (its ``plots`` folder is then never a link followed)."""
    import matplotlib

    from ..observe.plot import save_figure

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_axes((0.11, 0.13, 0.85, 0.78))
    ax.plot(result.lrs, result.losses, color="tab:blue", alpha=0.3, label="loss")
    ax.plot(result.lrs[:len(result.smoothed)], result.smoothed, color="tab:blue", label="smoothed")
    if result.suggestion is not None:
        ax.axvline(result.suggestion, color="tab:red", linestyle="--", label=f"suggested {result.suggestion:.3g}")
    finite = [v for v in result.smoothed + result.losses if math.isfinite(v)]
    if finite:  # the diverging tail would flatten the curve: show up to a little above the start
        top = max(result.smoothed[0] if result.smoothed else finite[0], min(finite))
        ax.set_ylim(min(finite) - 0.05 * abs(top), top * 1.3 + 1e-12)
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title="learning-rate finder")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path, root)
