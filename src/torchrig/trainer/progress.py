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


def _fmt(v: Any) -> str:
    if isinstance(v, float) and abs(v) >= 100:
        return f"{v:.0f}"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


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
                                           "pip install tensorboard or set log.tensorboard=false") from None

    # -- records -----------------------------------------------------------------------------
    def log(self, step: int, values: dict, epoch: Optional[int] = None, kind: Optional[str] = None) -> None:
        if not self.enabled:
            return
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
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    # -- progress ----------------------------------------------------------------------------
    def start_epoch(self, epoch: int, epochs: int, total: int, initial: int = 0) -> None:
        self._epoch, self._epochs, self._total = epoch, epochs, total
        self._t0 = time.perf_counter()
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{epochs}", file=self.stream,
                             dynamic_ncols=True, leave=True, unit="batch")

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def progress(self, batch: int, values: dict) -> None:
        """Called at log steps with the running averages since the last log step."""
        if self.mode == "bar" and self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) for k, v in values.items()}, refresh=False)
        elif self.mode == "lines":
            parts = [f"Epoch [{self._epoch + 1}/{self._epochs}][{batch}/{self._total}]"]
            parts += [f"{k} {_fmt(v)}" for k, v in values.items()]
            print("  ".join(parts), file=self.stream, flush=True)

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
