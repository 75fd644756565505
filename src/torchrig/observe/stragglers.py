"""Stragglers: the rank that makes every other rank wait, named at log steps.

Ranks meet at every gradient averaging, so a slow one costs every step of every rank, and the others' own clocks
only show their wait. What differs between ranks is what each does before it can meet the others: waiting for its
data, and its forward (its backward is its peers' wait and its own at once). Per rank, per log interval:

* ``data_wait_s``: seconds per optimizer step spent waiting for the next batch (the loop measures it anyway);
* ``forward_s``: seconds per optimizer step in the model's forward, from a forward pre-hook and hook on the wrapped
  model: ``time.perf_counter`` on the CPU (where the forward runs as it is called); on CUDA two events recorded
  around every forward (reused: no allocation, no synchronisation) of which the last forward is read at the log step,
  after the synchronisation the logged values make anyway, times the forwards per step.

At each log step one all-gather of those two numbers per rank (``runtime.all_gather_numbers``, in host memory under
gloo) gives every rank the figures of all; they go to ``metrics.jsonl`` (``rank{r}/data_wait_s``,
``rank{r}/forward_s`` up to :data:`PER_RANK_ROWS` ranks; ``ranks/median_s``, ``ranks/slowest``, ``ranks/slowest_s``
always). A rank whose own time (data wait + forward) exceeds the median of the other ranks' by more than
``dist.straggler_factor`` (and by :data:`FLOOR_S` at least) for ``dist.straggler_steps`` log steps in a row is named
in one line, with its host and device, once until it catches up. Nothing runs in the steps between log steps but
the hooks' two clock reads.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

from .. import runtime

FLOOR_S = 0.005      # seconds per step a rank must be slower than the others' median to count (timer noise)
PER_RANK_ROWS = 64   # worlds up to this size log every rank's figures per row


class Stragglers:
    """One fit's straggler check (see the module's text). ``names``: every rank's (host, device), in rank order."""

    def __init__(self, factor: float, steps: int, names: list, say: Callable[[str], None],
                 device: Optional[torch.device] = None):
        self.factor, self.steps, self.names, self.say = factor, steps, names, say
        self.forward, self.forwards = 0.0, 0   # seconds in forward and forwards since the last log step
        self._t = 0.0
        self._slow: dict[int, int] = {}        # rank -> log steps in a row it was slow
        self._named: set[int] = set()
        self._last_step = 0
        cuda = device is not None and device.type == "cuda"
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._handles: list = []

    # -- per forward ------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> "Stragglers":
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before(self, module: Any, args: Any) -> None:
        if self._events is not None:
            self._events[0].record()
        else:
            self._t = time.perf_counter()

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self.forwards += 1
        if self._events is not None:
            self._events[1].record()
        else:
            self.forward += time.perf_counter() - self._t

    # -- per log step ----------------------------------------------------------------------------------
    def flush(self, step: int, wait: float) -> dict:
        """At a log step (collective: every rank calls it): this interval's per-rank figures as row values, and the
        line naming a straggler when one is found."""
        steps = max(1, step - self._last_step)
        self._last_step = step
        forward = self.forward
        if self._events is not None and self.forwards:
            self._events[1].synchronize()
            forward = self._events[0].elapsed_time(self._events[1]) / 1000 * self.forwards
        figures = runtime.all_gather_numbers([wait / steps, forward / steps], name="straggler figures")
        self.forward, self.forwards = 0.0, 0
        self._judge(figures)
        return self.row(figures)

    def row(self, figures: list) -> dict:
        own = [w + f for w, f in figures]
        slowest = max(range(len(own)), key=own.__getitem__)
        out = {"ranks/median_s": statistics.median(own), "ranks/slowest": slowest, "ranks/slowest_s": own[slowest]}
        if len(figures) <= PER_RANK_ROWS:
            for r, (w, f) in enumerate(figures):
                out[f"rank{r}/data_wait_s"], out[f"rank{r}/forward_s"] = w, f
        return out

    def _judge(self, figures: list) -> None:
        own = [w + f for w, f in figures]
        for r, mine in enumerate(own):
            others = statistics.median(own[:r] + own[r + 1:])
            if mine > self.factor * others and mine - others > FLOOR_S:
                self._slow[r] = self._slow.get(r, 0) + 1
            else:
                self._slow.pop(r, None)
                self._named.discard(r)
                continue
            if self._slow[r] >= self.steps and r not in self._named:
                self._named.add(r)
                self.say(self.line(r, figures[r], others))

    def line(self, rank: int, figures: tuple, others: float) -> str:
        wait, forward = figures
        host, device = self.names[rank] if rank < len(self.names) else ("?", "?")
        cause = "its data loading" if wait >= forward else "its forward (a slower device, or one shared)"
        return (f"torchrig: rank {rank} (host {host}, {device}) is a straggler: {wait + forward:.3g}s per step of its "
                f"own (data wait {wait:.3g}s, forward {forward:.3g}s) against the other ranks' median {others:.3g}s "
                f"({(wait + forward) / max(others, 1e-9):.1f}×) for {self._slow[rank]} log steps in a row; every rank "
                f"waits for it at each gradient averaging: look at {cause} (per-rank figures: metrics.jsonl)")
