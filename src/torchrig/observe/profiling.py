"""The profiler callback: ``profile.steps=[first, last]`` (or ``torchrig train --profile``).

Records optimizer steps ``first`` … ``last`` (1-based, as logged) with ``torch.profiler`` (CPU, and
CUDA on a GPU; shapes and memory), then writes into ``RUN_DIR/profile``:

* ``trace.json``: a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing);
* ``ops.txt``: the 20 operators with the most self time;
* ``memory_snapshot.pickle`` with ``profile.memory_snapshot=true`` on CUDA: the allocator's history
  over those steps (drag it onto https://pytorch.org/memory_viz). On CPU it is skipped, with a message.

Only the main process profiles; the steps of other processes run as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..config.files import make_dir, staged, write_atomic

TOP_OPS = 20


class Profiler:
    def __init__(self, steps: list, memory_snapshot: bool = False):
        self.first, self.last = int(steps[0]), int(steps[1])
        self.memory_snapshot = memory_snapshot
        self.prof: Optional[Any] = None
        self.snapshot = False
        self.done = False
        self.files: list[Path] = []

    # -- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any) -> None:
        self.done = not trainer.is_main
        if trainer.is_main and self.memory_snapshot and trainer.device.type != "cuda":
            trainer.print(f"torchrig: profile.memory_snapshot skipped: the run is on {trainer.device.type}, and a "
                          f"memory snapshot records the CUDA allocator (run on a GPU for one)")
            self.memory_snapshot = False
        self._maybe_start(trainer)

    def on_step_end(self, trainer: Any, outputs: Any) -> None:
        if self.prof is not None and trainer.global_step >= self.last:
            self._stop(trainer)
        else:
            self._maybe_start(trainer)

    def on_fit_end(self, trainer: Any) -> None:
        if self.prof is not None:
            self._stop(trainer)  # the run ended inside the window: what was recorded is still written
        elif not self.done:
            trainer.print(f"torchrig: profile.steps [{self.first}, {self.last}]: the run ended at step "
                          f"{trainer.global_step} before step {self.first}; nothing was profiled. Choose "
                          f"steps within the run, e.g. --set profile.steps=[2,4]")

    def on_exception(self, trainer: Any, exc: BaseException) -> None:
        if self.prof is not None:
            self._stop(trainer)

    # -- recording --------------------------------------------------------------------------------
    def _maybe_start(self, trainer: Any) -> None:
        """Start before step ``first`` runs: the last finished step is ``first - 1`` (or later, on resume)."""
        if self.done or self.prof is not None or trainer.global_step + 1 < self.first:
            return
        if trainer.global_step >= self.last:
            self.done = True  # resumed past the window: nothing to record
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.snapshot = True
        self.prof.start()
        self.started_at = trainer.global_step + 1

    def _stop(self, trainer: Any) -> None:
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        run_dir = Path(trainer.run_dir)
        out = make_dir(run_dir / "profile", root=run_dir)  # never a link: the files below are written where it leads
        with staged(out / "trace.json", root=run_dir) as trace:  # torch writes the trace to a path: a new one
            prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
        write_atomic(out / "ops.txt", (prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS) + "\n").encode(),
                     root=run_dir)
        self.files = [out / "trace.json", out / "ops.txt"]
        if self.snapshot:
            with staged(out / "memory_snapshot.pickle", root=run_dir) as snapshot:
                torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
            self.files.append(out / "memory_snapshot.pickle")
        trainer.print(f"torchrig: profiled steps {self.started_at}-{trainer.global_step}: Chrome trace "
                      f"{out / 'trace.json'} (open in https://ui.perfetto.dev), top {TOP_OPS} operators "
                      f"{out / 'ops.txt'}" + (f", memory snapshot {self.files[-1]} (https://pytorch.org/memory_viz)"
                                              if len(self.files) > 2 else ""))
