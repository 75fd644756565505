"""Progress and logs: a tqdm bar on a terminal, plain lines otherwise, metrics.jsonl, TensorBoard.

Values arrive as Python floats (the loop calls ``.item()`` only at log steps), so nothing logged
keeps a tensor, let alone a graph, alive.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.rundir import RunDirError, describe_os_error, trim_metrics
from . import terminal


def _write_error(exc: OSError, path: Path, doing: str) -> RunDirError:
    """One line naming the file, the OS error and its errno, and that the checkpoints are safe."""
    return RunDirError(f"{describe_os_error(exc)} while {doing} '{path}'; the checkpoints are intact: "
                       f"once it can be written, continue with --set resume=latest")


class RunLogger:
    """Rank-aware: only the main process writes anything; other ranks get a silent logger.

    ``start_step`` (the step a run starts or resumes from) cuts an existing ``metrics.jsonl`` back to
    that step before appending, so the file never mixes two runs.
    """

    def __init__(self, run_dir: Optional[Path], enabled: bool = True, progress: str = "auto",
                 tensorboard: Any = "auto", stream=None, start_step: Optional[int] = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.stream = stream or sys.stderr
        if progress == "auto":
            progress = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = progress if enabled else "none"
        self._jsonl = None
        self._tb = None
        self._bar = None
        self.started = time.perf_counter()  # for the end-of-run summary
        self.start_step = start_step or 0
        self.last_step = self.start_step
        if enabled and self.run_dir is not None:
            self._jsonl_path = self.run_dir / "metrics.jsonl"
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if start_step is not None:
                    trim_metrics(self._jsonl_path, start_step)
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
            except OSError as exc:
                raise _write_error(exc, self._jsonl_path, "opening") from None
            if tensorboard:
                try:
                    from tensorboard.compat.proto.summary_pb2 import Summary
                    from torch.utils.tensorboard import SummaryWriter

                    # purge_step: TensorBoard hides events a stopped run wrote after the step resumed from
                    purge = None if start_step is None else start_step + 1
                    self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)
                    self._tb_summary = Summary
                except Exception:  # tensorboard not installed: "auto" means optional
                    if tensorboard is True or tensorboard == "true":
                        raise RuntimeError("log.tensorboard=true but tensorboard is not installed; "
                                           "pip install 'torchrig[tensorboard]' or set log.tensorboard=false") from None

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
                self._jsonl.write(json.dumps(row, default=float) + "\n")
            except OSError as exc:
                self._drop_jsonl()
                raise _write_error(exc, self._jsonl_path, f"writing step {step} to") from None
        if self._tb is not None:
            # One event per row, not one per value: the event writer checksums every event in pure
            # Python, which made TensorBoard the dearest part of logging.
            scalars = [self._tb_summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
            if scalars:
                self._tb._get_file_writer().add_summary(self._tb_summary(value=scalars), step)

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
        if self.mode == "bar":
            text = terminal.fit_lines(text, terminal.width(self.stream))
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    # -- progress ----------------------------------------------------------------------------
    def start_epoch(self, epoch: int, epochs: int, total: int, initial: int = 0) -> None:
        self._epoch, self._epochs, self._total = epoch, epochs, total
        self._t0 = time.perf_counter()
        if self.mode == "bar":
            from tqdm import tqdm

            # A fixed width (the terminal's at the epoch's start) and a postfix cut to what is left
            # keep the bar itself at least terminal.MIN_BAR cells wide.
            desc = f"epoch {epoch + 1}/{epochs}"
            self._columns = terminal.width(self.stream)
            self._budget = terminal.bar_budget(desc, total, self._columns)
            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, ncols=self._columns,
                             bar_format=terminal.BAR_FORMAT, leave=True, unit="batch")

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def progress(self, batch: int, values: dict) -> None:
        """Called at log steps with the running averages since the last log step."""
        if self.mode == "bar" and self._bar is not None:
            self._bar.set_postfix_str(terminal.postfix(values, self._budget), refresh=False)
        elif self.mode == "lines":
            print(terminal.plain_line(self._epoch + 1, self._epochs, self.last_step, f"batch {batch}/{self._total}",
                                      values), file=self.stream, flush=True)

    def epoch_summary(self, epoch: int, epochs: int, step: int, row: dict) -> None:
        """One line per epoch: on a terminal the values that fit its width, else every value."""
        if self.mode == "bar":
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
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
