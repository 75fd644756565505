"""After the last step: the one-line run summary, then the plot, drawn before ``fit`` returns.

The plot (``log.plot=true``, the default) is drawn in this process with matplotlib's Agg backend and a
figure without a layout engine (drawing ~0.3 s on a CPU core; matplotlib's import, ~0.7 s cold, runs on
a thread while the run trains), so that ``RUN_DIR/plots/curves.png`` exists when ``fit`` (and ``torchrig train``) returns and no process outlives
the run. ``log.plot=false`` draws nothing; ``torchrig plot RUN_DIR`` draws it later.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..runtime.notebook import in_jupyter_kernel
from .plot import import_in_background, plot_run_or_say


def start_of_run(trainer: Any) -> None:
    """At ``fit``'s start on rank 0, when the run ends with its plot: matplotlib is imported on a daemon
    thread meanwhile, so that the plot at the end costs only its drawing."""
    if trainer.cfg.log.plot and trainer.is_main:
        import_in_background()


def end_of_run(trainer: Any) -> list[Path]:
    """Print the run summary and draw the plot. Returns the PNG paths."""
    trainer.checkpoints.wait()  # the last (asynchronous) save has updated the best-checkpoint index
    trainer.print(summary(trainer))
    for where in trainer.metrics_log.out.trackers.where():  # each tracker's run: its id, store, project
        trainer.print(f"torchrig: tracker {where}")
    if not trainer.cfg.log.plot:
        return []
    paths = plot_run_or_say(trainer.run_dir, trainer.print)
    if trainer.cfg.log.plot == "inline" and trainer.is_main and in_jupyter_kernel():
        from IPython.display import Image, display

        for path in paths:
            display(Image(filename=str(path)))
    return paths


def finished_where(trainer: Any) -> str:
    """What a stop signal after the loop interrupts, for its line: training is over; where its result is."""
    step, last = trainer.global_step, trainer.checkpoints.last_step
    if last == step:
        kept = f"checkpoint {Path(trainer.run_dir) / 'checkpoints'}/step-{step:08d} holds it"
    else:
        kept = (f"the latest checkpoint is step {last}" if last is not None else "no checkpoint was saved") \
            + " (checkpoint.save_final=false)"
    return f"after training finished at step {step}; {kept}"


def summary(trainer: Any) -> str:
    """``torchrig: done · 450 steps in 12.3 s · 36.6 steps/s · best val/accuracy 0.9812 (step-00000450)``."""
    out = trainer.metrics_log.out
    seconds = time.perf_counter() - out.started
    steps = trainer.global_step - out.start_step
    parts = [f"torchrig: done · {steps} step{'s' if steps != 1 else ''} in {seconds:.1f} s",
             f"{steps / max(seconds, 1e-9):.1f} steps/s"]
    if trainer.step is not None:
        trainer.step.settle()  # windows decided on the device, read once here
    if trainer.skipped_steps:
        why = "a replica group was lost during them" if trainer.cfg.dist.fault_tolerance == "torchft" else \
            "non-finite values or an fp16 overflow"
        parts.append(f"{trainer.skipped_steps} skipped ({why})")
    best = trainer.checkpoints.index.get("best") or []
    name = trainer.monitor.name
    if best and name:
        parts.append(f"best {name} {best[0]['value']:.4f} ({best[0]['name']})")
    elif name and trainer.monitor.best is not None:
        parts.append(f"best {name} {trainer.monitor.best:.4f}")
    return " · ".join(parts)
