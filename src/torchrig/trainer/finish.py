"""After the last step: the one-line run summary and the plot, without holding the process up.

Drawing the curves means importing matplotlib and rendering (most of a second); by default
(``log.plot=background``) a detached process draws them, so ``fit`` returns as soon as the last
checkpoint is written. ``log.plot=true`` draws them before ``fit`` returns, ``false`` not at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .plot import PLOT_FILE, plot_run_or_say

_DRAW = "import sys; from torchrig.trainer.plot import draw_detached; sys.exit(draw_detached(sys.argv[1]))"


def end_of_run(trainer: Any) -> tuple[list[Path], Optional[subprocess.Popen]]:
    """Print the run summary; start (or draw) the plot. Returns the PNG paths and the drawing process."""
    trainer.checkpoints.wait()  # the last (asynchronous) save has updated the best-checkpoint index
    trainer.print(summary(trainer))
    mode = trainer.cfg.log.plot
    if not mode:
        return [], None
    if mode == "background":
        process = plot_in_background(trainer.run_dir)
        if process is not None:
            return [Path(trainer.run_dir) / "plots" / PLOT_FILE], process
    return plot_run_or_say(trainer.run_dir, trainer.print), None  # log.plot=true, or no process could start


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
    best = trainer.checkpoints.index.get("best") or []
    name = trainer.monitor.name
    if best and name:
        parts.append(f"best {name} {best[0]['value']:.4f} ({best[0]['name']})")
    elif name and trainer.monitor.best is not None:
        parts.append(f"best {name} {trainer.monitor.best:.4f}")
    return " · ".join(parts)


def plot_in_background(run_dir: Path) -> Optional[subprocess.Popen]:
    """A detached Python process that draws the run's curves; it writes ``plots/error.txt`` if it fails."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the torchrig this process runs, whatever the path
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # drawing needs no thread pool; leave the cores to the user
    try:
        return subprocess.Popen([sys.executable, "-c", _DRAW, str(run_dir)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except OSError:
        return None
