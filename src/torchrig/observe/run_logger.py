"""Progress and logs: a tqdm bar on a terminal, plain lines otherwise, metrics.jsonl, the trackers.

Values arrive as Python floats (the loop calls ``.item()`` only at log steps), so nothing logged
keeps a tensor, let alone a graph, alive.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.rundir import RunDirError, describe_os_error, trim_metrics
from ..config import to_dict
from ..config.files import open_append
from ..errors import setting
from ..runtime.notebook import in_jupyter_kernel
from . import terminal
from .trackers import TrackerSet, check_installed, tracker_names


def _write_error(exc: OSError, path: Path, doing: str) -> RunDirError:
    """One line naming the file, the OS error and its errno, and that the checkpoints are safe."""
    return RunDirError(f"{describe_os_error(exc)} while {doing} '{path}'; the checkpoints are intact: "
                       f"once it can be written, continue with {setting('resume', 'latest')}")


def _has_widgets() -> bool:
    """tqdm's notebook bar is an ipywidgets widget; without ipywidgets it would print a warning instead."""
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None


class RunLogger:
    """Rank-aware: only the main process writes anything; other ranks get a silent logger.

    ``start_step`` (the step a run starts or resumes from) cuts an existing ``metrics.jsonl`` back to
    that step before appending, so the file never mixes two runs.
    """

    def __init__(self, run_dir: Optional[Path], enabled: bool = True, progress: str = "auto",
                 tensorboard: Any = "auto", stream=None, start_step: Optional[int] = None, config: Any = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.stream = stream or sys.stderr
        # in a Jupyter kernel (stderr is no terminal there) the bar is tqdm's notebook widget
        self.notebook = progress in ("auto", "bar") and stream is None and in_jupyter_kernel() and _has_widgets()
        if progress == "auto":
            progress = "bar" if self.notebook or getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = progress if enabled else "none"
        self._jsonl = None
        self._reopened = False  # metrics.jsonl was deleted or replaced during the run, and reopened
        self._bar = None
        self.started = time.perf_counter()  # for the end-of-run summary
        self.start_step = start_step or 0
        self.last_step = self.start_step
        self.status = "FINISHED"  # of the tracker runs: FAILED or KILLED when closed by an error or a stop
        # the trackers (TensorBoard, CSV, MLflow, W&B) of ``config.log``, or TensorBoard per ``tensorboard``
        names = tracker_names(getattr(config, "log", None), tensorboard)
        self.trackers = TrackerSet()
        if not (enabled and self.run_dir is not None):
            check_installed(names, getattr(getattr(config, "log", None), "trackers", []))  # every rank stops
            return
        self._jsonl_path = self.run_dir / "metrics.jsonl"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if start_step is not None:
                trim_metrics(self._jsonl_path, start_step)
            self._jsonl = self._open_jsonl()
        except OSError as exc:
            raise _write_error(exc, self._jsonl_path, "opening") from None
        plain = to_dict(config) if config is not None else {}
        self.trackers = TrackerSet.open(names, self.run_dir, plain, getattr(config, "log", None), start_step or 0)

    # -- records -----------------------------------------------------------------------------
    def log(self, step: int, values: dict, epoch: Optional[int] = None, kind: Optional[str] = None) -> None:
        if not self.enabled:
            return
        self.last_step = step
        row: dict[str, Any] = {"step": step}
        if epoch is not None:
            row["epoch"] = epoch
        if kind is not None:
            row["kind"] = kind  # "interval" or "epoch"
        row.update({k: v for k, v in values.items() if v is not None})
        if self._jsonl is not None:
            try:
                self._follow_jsonl(step)
                self._jsonl.write(json.dumps(row, default=float) + "\n")
            except OSError as exc:
                self._drop_jsonl()
                raise _write_error(exc, self._jsonl_path, f"writing step {step} to") from None
        self.trackers.log(values, step)

    def _open_jsonl(self) -> Any:
        """``metrics.jsonl`` opened for appending, one row a line; a symbolic link (never followed), a FIFO or a
        device in its place is refused."""
        return open_append(self._jsonl_path, "metrics file", "move it away, or choose another run_dir", RunDirError,
                           root=self.run_dir)

    def _follow_jsonl(self, step: int) -> None:
        """Reopen ``metrics.jsonl`` (appending) when the file at its path is no longer the one open here:
        rows written to a deleted or replaced file would be lost without a word. Says so once."""
        try:
            moved = not os.path.samestat(os.stat(self._jsonl_path), os.fstat(self._jsonl.fileno()))
            what = "replaced"
        except FileNotFoundError:
            moved, what = True, "deleted"
        if not moved:
            return
        self._jsonl.close()
        self._jsonl = self._open_jsonl()
        if not self._reopened:
            self._reopened = True
            self.print(f"torchrig: '{self._jsonl_path}' was {what} during the run; its rows from step {step} on "
                       f"are appended to the file now at that path")

    def _drop_jsonl(self) -> None:
        """Close a file that failed to write; what it still buffers cannot be written either."""
        fh, self._jsonl = self._jsonl, None
        try:
            fh.close()
        except OSError:
            pass

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.mode == "bar" and not self.notebook:
            text = terminal.fit_lines(text, terminal.width(self.stream))
        if self._bar is not None and self.notebook:
            self._bar.write(text)  # a line above the widget, in the cell's output
        elif self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    # -- progress ----------------------------------------------------------------------------
    def start_epoch(self, epoch: int, epochs: int, total: Optional[int], initial: int = 0,
                    steps: Optional[int] = None, steps_done: int = 0) -> None:
        """``total``: the epoch's batches (``initial`` of them done), which the plain lines count; None for a stream
        without a length. The bar counts optimizer steps, as the epoch's line does: ``steps`` (``steps_done`` of them
        done; None: without a total), one per :meth:`advance`."""
        self._epoch, self._epochs, self._total = epoch, epochs, total
        total, initial = steps, steps_done
        self._t0 = time.perf_counter()
        if self.mode == "bar" and self.notebook:
            from tqdm.notebook import tqdm as notebook_tqdm

            self._budget = 200
            self._bar = notebook_tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{epochs}", leave=True,
                                      unit="step")
        elif self.mode == "bar":
            from tqdm import tqdm

            # A fixed width (the terminal's at the epoch's start) and a postfix cut to what is left
            # keep the bar itself at least terminal.MIN_BAR cells wide.
            desc = f"epoch {epoch + 1}/{epochs}"
            self._columns = terminal.width(self.stream)
            self._budget = terminal.bar_budget(desc, total, self._columns)
            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, ncols=self._columns,
                             bar_format=terminal.BAR_FORMAT if total is not None else terminal.BAR_FORMAT_OPEN,
                             leave=True, unit="step")

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def progress(self, batch: int, values: dict) -> None:
        """Called at log steps with the running averages since the last log step."""
        if self.mode == "bar" and self._bar is not None:
            self._bar.set_postfix_str(terminal.postfix(values, self._budget), refresh=False)
        elif self.mode == "lines":
            where = f"batch {batch}" + (f"/{self._total}" if self._total is not None else "")  # a stream: no total
            print(terminal.plain_line(self._epoch + 1, self._epochs, self.last_step, where, values),
                  file=self.stream, flush=True)

    def epoch_summary(self, epoch: int, epochs: int, step: int, row: dict) -> None:
        """One line per epoch: on a terminal the values that fit its width, else every value."""
        if self.mode == "bar" and not self.notebook:
            self.print(terminal.epoch_summary(epoch, epochs, step, row, terminal.width(self.stream)))
        else:
            self.print(terminal.plain_line(epoch, epochs, step, "epoch end", row))

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.end_epoch()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        exc = sys.exc_info()[1]  # closed while an error or a stop propagates
        if exc is not None and self.status == "FINISHED":
            self.status = "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED"
        self.trackers.flush()

    def finish(self, final_metrics: Optional[dict] = None) -> None:
        """End the tracker runs, with the final metrics (``test/accuracy`` …); once, after ``close``."""
        self.close()
        self.trackers.finish(final_metrics, status=self.status)
