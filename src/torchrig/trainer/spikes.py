"""``on_spike: rollback``: a loss spike returns the run to a snapshot and replays it without the step's samples.

After every optimizer step the ranks agree (one all-reduce of two numbers, then one host read) on the step's
largest micro-batch loss and its gradient norm. A value that is not finite, or above ``spike.factor`` × its
mean over the last ``spike.window`` accepted steps (once ``spike.warmup_steps`` steps were watched), is a
spike: every rank restores the last snapshot (kept in memory every ``spike.snapshot_every`` steps and at
every epoch start, or the last checkpoint on disk), leaves the spiking step's samples out of every epoch's
order from then on (``Batches.exclude``; the order of the others is kept), appends them to
``RUN_DIR/skipped_samples.jsonl`` and replays. A spike found again before the run passed the last one's step
is a rollback "in a row"; after ``spike.max_rollbacks`` of them the run stops with one line.

A snapshot is the checkpoint's own ``{name: Stateful}`` mapping (``saving.states``), copied: what a resume
restores, a rollback restores, so the replay computes what a run on the remaining samples computes.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

from .. import runtime
from ..checkpoint import find_checkpoint
from ..checkpoint.rundir import RunDirError
from ..config.files import JSON_LIMIT, open_append, read_lines, write_atomic
from ..errors import TorchrigError
from .plan import FitPlan
from .state import TrainState


LEDGER = "skipped_samples.jsonl"  # in the run directory: one line per rollback


class SpikeError(TorchrigError, RuntimeError):
    """Loss spikes that rolling back did not cure; the message names the steps and what to try."""


class Rollback(TorchrigError, RuntimeError):
    """Raised by the loop's step end to leave the epoch; the loop goes on from ``(epoch, batch)`` (caught by the
    loop: never seen by a user)."""

    def __init__(self, epoch: int, batch: int):
        super().__init__(f"rollback to epoch {epoch + 1}, batch {batch}")
        self.epoch, self.batch = epoch, batch


class SpikeGuard:
    """Watches each optimizer step of a fit and rolls the run back on a spike (see the module's text).

    ``settings``: the ``spike`` config section; ``state``: the fit's counters; ``data``: its training batches (a
    rollback leaves samples out of them); ``checkpoints``: where the last checkpoint is, without snapshots in
    memory; ``groups``: the ranks that agree on each step's values; ``say``: one line for the user. What a
    snapshot holds is the checkpoint's own ``{name: Stateful}`` mapping, handed to :meth:`maybe_snapshot` and
    :meth:`check` by the loop (``saving.states``).
    """

    def __init__(self, settings: Any, *, state: TrainState, data: Any, checkpoints: Any, run_dir: Optional[Path],
                 device: torch.device, rank: int, world_size: int, say: Any, verify: bool = True):
        s = settings
        self.state, self.data, self.checkpoints, self.run_dir = state, data, checkpoints, run_dir
        self.verify = verify  # checkpoint.verify: a checkpoint rolled back to is checked against its checksums
        self.device, self.rank, self.world_size, self.say = device, rank, world_size, say
        self.factor, self.window, self.warmup = s.factor, s.window, s.warmup_steps
        self.every, self.most = s.snapshot_every, s.max_rollbacks
        self.history: list[tuple[int, float, float]] = []  # (step, loss, grad norm) of the accepted steps
        self.largest: Optional[torch.Tensor] = None  # the current window's largest micro-batch loss, on the device
        self.snapshot: Optional[dict] = None
        self.snapshot_step = -1
        self.in_a_row, self.last_spike = 0, -1

    # -- during a window -------------------------------------------------------------------------
    def observe(self, values: Optional[dict]) -> None:
        """A micro-batch's values (its ``loss``): the largest of the window is kept on the device, no read."""
        loss = (values or {}).get("loss")
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(-1).max()
            self.largest = loss if self.largest is None else torch.maximum(self.largest, loss)

    # -- snapshots -------------------------------------------------------------------------------
    def maybe_snapshot(self, states: dict) -> None:
        """At a step boundary (and at each epoch's start): copy the run's ``states`` every ``snapshot_every`` steps."""
        step = self.state.global_step
        if self.every and (self.snapshot is None or self.state.batch_in_epoch == 0 or step % self.every == 0) \
                and step != self.snapshot_step:
            self.snapshot = {name: copy.deepcopy(_state_of(obj)) for name, obj in self._own(states).items()}
            self.snapshot_step = step

    def _restore(self, states: dict) -> None:
        if self.every:
            for name, obj in self._own(states).items():
                _load_into(obj, copy.deepcopy(self.snapshot[name]))
            return
        self.checkpoints.wait()  # the save in flight is the latest
        path = find_checkpoint("latest", self.run_dir)
        if path is None:
            raise SpikeError(f"torchrig: on_spike=rollback found a spike at step {self.state.global_step} but no "
                             f"checkpoint to return to (spike.snapshot_every=0); set spike.snapshot_every, or "
                             f"checkpoint.every_steps")
        self.checkpoints.load(path, self._own(states), print_fn=lambda line: None, verify=self.verify)

    def _own(self, states: dict) -> dict:
        """What a rollback restores: the checkpoint's states but this guard's own (its count of spikes in a row
        goes on; its history is cut to the step returned to)."""
        return {name: obj for name, obj in states.items() if obj is not self}

    # -- in a checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The accepted steps the check compares with and the spikes in a row: a resumed run (a restart) judges
        its next steps as the uninterrupted run would."""
        return {"history": [list(h) for h in self.history], "in_a_row": self.in_a_row,
                "last_spike": self.last_spike}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(int(s), float(loss), float(norm)) for s, loss, norm in state.get("history", [])]
        self.in_a_row, self.last_spike = int(state.get("in_a_row", 0)), int(state.get("last_spike", -1))

    # -- after a window --------------------------------------------------------------------------
    def check(self, first_batch: int, batches: int, grad_norm: Optional[torch.Tensor], states: dict) -> None:
        """After the optimizer step made of the epoch's batches ``first_batch …`` (its gradient norm ``grad_norm``):
        raise :class:`Rollback` on a spike (every rank alike), after restoring the snapshot (of ``states``) and
        leaving the step's samples out."""
        step, device = self.state.global_step, self.device
        grad = grad_norm
        numbers = torch.stack([
            (self.largest if self.largest is not None else torch.zeros((), device=device)).float(),
            (grad.detach().float() if isinstance(grad, torch.Tensor) else torch.zeros((), device=device))])
        numbers = torch.nan_to_num(numbers, nan=math.inf)  # a NaN anywhere is a spike everywhere (max keeps inf)
        self.largest = None
        if self.world_size > 1:
            numbers = runtime.all_reduce_max(numbers, name="spike check")
        loss, norm = (float(v) for v in numbers.tolist())  # the one host read of the step
        why = self._why(loss, norm)
        if why is None:
            self.history.append((step, loss, norm))
            del self.history[:-self.window]
            if step > self.last_spike:
                self.in_a_row = 0
            return
        self._roll_back(step, why, first_batch, batches, states)

    def _why(self, loss: float, norm: float) -> Optional[str]:
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return f"a non-finite value (loss {loss:.4g}, gradient norm {norm:.4g})"
        if len(self.history) < self.warmup:
            return None
        mean_loss = sum(h[1] for h in self.history) / len(self.history)
        mean_norm = sum(h[2] for h in self.history) / len(self.history)
        if loss > self.factor * mean_loss > 0:
            return f"loss {loss:.4g} > {self.factor:g} × its mean {mean_loss:.4g}"
        if norm > self.factor * mean_norm > 0:
            return f"gradient norm {norm:.4g} > {self.factor:g} × its mean {mean_norm:.4g}"
        return None

    def _roll_back(self, step: int, why: str, first_batch: int, batches: int, states: dict) -> None:
        epoch = self.state.epoch
        samples = self.data.window_indices(first_batch, batches)
        self.in_a_row = self.in_a_row + 1 if step <= self.last_spike else 1
        self.last_spike = max(self.last_spike, step)
        if self.in_a_row > self.most:
            raise SpikeError(f"torchrig: on_spike=rollback: {self.in_a_row} spikes in a row, the last at step {step} "
                             f"({why}); leaving samples out does not cure them: lower optim.lr, set clip_grad_norm, "
                             f"or raise spike.factor or spike.max_rollbacks")
        self._restore(states)
        self.data.exclude(samples)
        back = self.state.global_step
        self.history = [h for h in self.history if h[0] <= back]
        if self.rank == 0 and self.run_dir is not None:
            with open_append(self.run_dir / LEDGER, "rollback ledger", "move it away, or choose another run_dir",
                             SpikeError, root=self.run_dir) as f:
                f.write(json.dumps({"step": step, "epoch": epoch + 1, "reason": why, "rolled_back_to": back,
                                    "samples": sorted(samples)}) + "\n")
        self.say(f"torchrig: spike at step {step} ({why}): rolled back to step {back}; its {len(samples)} samples "
                 f"are left out from now on (listed in {self.run_dir / 'skipped_samples.jsonl'})")
        raise Rollback(self.state.epoch, self.state.batch_in_epoch)


def keep_ledger(run_dir: Any, excluded: list) -> None:
    """At a fit's start (rank 0): ``skipped_samples.jsonl`` keeps the rollbacks whose samples the restored state
    leaves out. One made after the checkpoint the run resumed from (then a crash, a restart) belongs to a
    stretch the checkpoint does not hold: it is dropped, and the replay, meeting that spike again, writes it
    once more; so the ledger names each left-out sample once, whatever restarts happened."""
    path = None if run_dir is None else Path(run_dir) / LEDGER
    if path is None or not path.exists():
        return
    left_out = set(excluded)
    lines = [(n, line) for n, line in read_lines(path, JSON_LIMIT, "skipped samples list", _MOVE_LEDGER, RunDirError,
                                                 line_limit=JSON_LIMIT) if line.strip()]
    rows = [_ledger_row(path, n, line, last=i == len(lines) - 1) for i, (n, line) in enumerate(lines)]
    keep = [line for (_, line), row in zip(lines, rows) if row is not None and row <= left_out]
    if len(keep) != len(lines):
        write_atomic(path, "".join(line + "\n" for line in keep).encode(), root=path.parent)


_MOVE_LEDGER = "move it away (the checkpoint itself holds which samples are left out)"


def _ledger_row(path: Path, number: int, line: str, last: bool) -> Optional[set]:
    """The samples a line of ``skipped_samples.jsonl`` lists; None for a last line cut short (a process killed
    while appending it); one line naming the file for anything else that is not such a row."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        row = None
        if last:
            return None
    samples = row.get("samples", []) if isinstance(row, dict) else None
    if not (isinstance(samples, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in samples)):
        raise RunDirError(f"'{path}' line {number} is not a row of skipped samples ({{\"step\": ..., \"samples\": "
                          f"[sample numbers]}}); {_MOVE_LEDGER}")
    return set(samples)


def _state_of(obj: Any) -> Any:
    if isinstance(obj, dict):  # the optimizers, by name
        return {k: v.state_dict() for k, v in obj.items()}
    return obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            v.load_state_dict(state[k])
    else:
        obj.load_state_dict(state)


def replan(plan: FitPlan, cfg: Any, accumulate: int) -> None:
    """After samples were left out: the epoch's batches and steps from ``plan.start`` on, and where the run ends."""
    before = plan.steps_per_epoch
    if before is None:  # a stream's epochs end when it runs out: nothing planned to change
        return
    plan.batches.set_epoch(plan.start[0])
    epoch_len = len(plan.batches)
    if cfg.data.steps_per_epoch:
        epoch_len = min(epoch_len, cfg.data.steps_per_epoch * accumulate)
    plan.epoch_len, plan.steps_per_epoch = epoch_len, math.ceil(epoch_len / accumulate)
    if cfg.max_steps is None and plan.total_steps is not None:
        plan.total_steps += (plan.steps_per_epoch - before) * (cfg.epochs - plan.start[0])
