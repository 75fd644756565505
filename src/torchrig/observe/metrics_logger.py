"""The metrics logger: what the loop logs, when, and the sums behind it.

Two kinds of rows reach ``metrics.jsonl`` (and TensorBoard) through :class:`~.run_logger.RunLogger`,
told apart by their ``kind`` field:

* ``interval`` rows every ``log.every_steps`` optimizer steps: the means of the step function's values
  (``train/loss`` …) over the micro-batches since the previous row, samples/s, data-wait fraction,
  the train metrics so far, lr, grad norm (and tokens/s, FLOP/s, MFU: see :mod:`.throughput`);
* ``epoch`` rows at each epoch's end: means over the whole epoch, validation values, lr.

Per micro-batch, :meth:`MetricsLogger.record` only adds tensors (no ``.item()``); values are read on
the host at log steps. The sums are Stateful, so a resumed run logs what an unbroken one would.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from .. import runtime
from .run_logger import RunLogger
from .throughput import rates, tokens_of


class MetricsLogger:
    def __init__(self, out: RunLogger, every_steps: int, groups: runtime.Groups = runtime.WORLD,
                 device: Optional[torch.device] = None, staged: bool = False, ranks: Any = None):
        self.out, self.every_steps = out, every_steps
        self.ranks = ranks  # observe.stragglers.Stragglers: every rank's figures at each row (None: one process)
        self.groups, self.device = groups, device  # logged means are over the data-parallel ranks of groups
        # ranks of different samples (the cp ranks of one shard count its samples once, each its share of the tokens)
        self.world_size, self.cp = groups.sample_ranks(), groups.cp_size()
        # On the CPU a scalar is read at once (a memory load) and summed as a Python float: no tensor op per
        # step. On an accelerator values stay tensors on the device until a log step reads them.
        self.host = device is None or device.type == "cpu"
        self.sums: dict[str, Any] = {}         # logging interval: running sums
        self.count = 0                          # micro-batches in the interval
        self.samples = 0
        self.tokens: Any = None                 # token count of token-id batches (a tensor until flush)
        self.flops_per_sample: Optional[float] = None  # set once by throughput.FlopCounter (log.flops)
        self.peak_flops: Optional[float] = None
        self.wait = 0.0                         # seconds spent waiting for data in the interval
        self.epoch_sums: dict[str, float] = {}  # folded in at each flush, so per step costs nothing extra
        self.epoch_count = 0
        # with on_nonfinite=skip a window's values wait here until the step decides whether its update was
        # applied: a skipped window's loss (NaN, as a rule) is no part of the logged means
        self.staged = staged
        self._window: dict[str, Any] = {}
        self._window_count: Any = 0
        self._t_last = time.perf_counter()

    # -- per micro-batch ------------------------------------------------------------------------
    def should_log(self, global_step: int) -> bool:
        return bool(self.every_steps) and global_step % self.every_steps == 0

    def record(self, out: Optional[dict], n: int, weight: Any = 1, batch: Any = None) -> None:
        """Add one micro-batch's values, weighted by ``weight``: the items its loss is a mean over (samples
        or valid tokens, a tensor that stays on the device), so that a logged mean is the mean over the
        items of every rank, as the optimizer step's loss is (sums and counts are added over the ranks at a
        row). ``batch`` gives the token count of token data."""
        if self.staged:
            self._window_count = self._window_count + weight
        else:
            self.count = self.count + weight
        self.samples += n
        if batch is not None:
            tokens = tokens_of(batch)
            if tokens is not None:
                self.tokens = tokens if self.tokens is None else self.tokens + tokens
        if out:
            unweighted = not isinstance(weight, torch.Tensor) and weight == 1
            sums = self._window if self.staged else self.sums
            for k, v in out.items():
                if isinstance(v, torch.Tensor):
                    if self.host and v.ndim == 0 and v.is_cpu:
                        v = v.item()
                    elif v.requires_grad:
                        v = v.detach()
                if not unweighted:
                    v = v * weight
                s = sums.get(k)
                sums[k] = v if s is None else s + v

    def end_window(self, skipped: Any) -> None:
        """With ``staged``: the window's values join the interval's sums unless its update was skipped;
        ``skipped`` is a bool (decided on the host) or a 0-d tensor on the device (1.0: skipped), used
        without reading it back."""
        window, count = self._window, self._window_count
        self._window, self._window_count = {}, 0
        if isinstance(skipped, torch.Tensor):
            keep = skipped == 0
            count = torch.where(keep, count, 0.0) if isinstance(count, torch.Tensor) else keep * float(count)
            window = {k: torch.where(keep, torch.as_tensor(v, device=keep.device), 0.0) for k, v in window.items()}
        elif skipped:
            return
        self.count = self.count + count
        for k, v in window.items():
            s = self.sums.get(k)
            self.sums[k] = v if s is None else s + v

    def start_epoch(self, resumed: bool) -> None:
        """A new epoch starts from empty sums, unless it goes on from a checkpoint's."""
        if not resumed:
            self.sums, self.count, self.epoch_sums, self.epoch_count = {}, 0, {}, 0
        # the interval's clock restarts here, and so do the counts measured against it: samples and tokens of
        # the last epoch's tail (after its last row) and the time waited for them are no part of the new interval
        self.samples, self.tokens, self.wait = 0, None, 0.0
        self._t_last = time.perf_counter()

    # -- rows -------------------------------------------------------------------------------------
    def flush(self, step: int, epoch: int, extra: dict) -> dict:
        """An interval row: means since the last row, throughput, and ``extra`` (metrics, lr …)."""
        now = time.perf_counter()
        elapsed = max(now - self._t_last, 1e-9)
        values = _mean_over_items(self._fold(), float(self.count), self.groups, self.device)
        values.update(rates(self.samples, self.tokens, elapsed, self.world_size, self.flops_per_sample,
                            self.peak_flops, self.cp))
        values["data_wait"] = self.wait / elapsed
        if self.ranks is not None:  # one small all-gather: each rank's data wait and forward, a straggler named
            values.update(self.ranks.flush(step, self.wait))
        values.update(extra)
        self.sums, self.count, self.samples, self.tokens, self.wait, self._t_last = {}, 0, 0, None, 0.0, now
        self.out.log(step, values, epoch=epoch, kind="interval")
        return values

    def epoch_means(self) -> dict:
        """Epoch averages of the step's logged values (``train/loss`` …) since this epoch (re)started."""
        self._fold()
        self.sums, self.count = {}, 0
        return _mean_over_items(self.epoch_sums, self.epoch_count, self.groups, self.device)

    def log_epoch(self, step: int, epoch: int, row: dict) -> None:
        self.out.log(step, row, epoch=epoch, kind="epoch")

    def _fold(self) -> dict:
        """Interval sums as floats, added to the epoch totals."""
        sums = {k: float(v) for k, v in self.sums.items()}
        for k, v in sums.items():
            self.epoch_sums[k] = self.epoch_sums.get(k, 0.0) + v
        self.epoch_count += float(self.count)
        return sums

    # -- Stateful ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Logged-value sums and their counts for a checkpoint, averaged over ranks (collective: every rank calls
        it). Every rank of the resumed run loads the averages, so their sum over the ranks is the saved total
        again, and a mean is right whatever the new number of ranks (sums and counts scale alike)."""
        flat = {f"i/{k}": float(v) for k, v in self.sums.items()}
        flat.update({f"e/{k}": v for k, v in self.epoch_sums.items()})
        flat.update({"count": float(self.count), "epoch_count": float(self.epoch_count)})
        flat = _mean_over_ranks(flat, self.groups, self.device)
        return {"sums": {k[2:]: v for k, v in flat.items() if k.startswith("i/")}, "count": flat["count"],
                "epoch_sums": {k[2:]: v for k, v in flat.items() if k.startswith("e/")},
                "epoch_count": flat["epoch_count"]}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:
            self.sums, self.count = dict(state["sums"]), float(state["count"])
            self.epoch_sums, self.epoch_count = dict(state["epoch_sums"]), float(state["epoch_count"])


def _mean_over_items(sums: dict, count: float, groups: runtime.Groups, device: Optional[torch.device]) -> dict:
    """``{"train/k": mean}`` over the items (samples, tokens) of every rank: the weighted sums and their counts are
    added over the ranks, then divided, so a rank with a short last batch weighs by its items, as in the step's
    loss (a mean of the ranks' means would not); all ranks must call it."""
    keys = sorted(sums)
    if groups.dp_size() > 1 and keys:
        total = runtime.all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(count)],
                                                    dtype=torch.float64, device=device), groups.data,
                                       name="metrics").tolist()
        sums, count = dict(zip(keys, total[:-1])), total[-1]
    return {f"train/{k}": v / max(1e-12, float(count)) for k, v in sums.items()}


def _mean_over_ranks(values: dict, groups: runtime.Groups, device: Optional[torch.device]) -> dict:
    """The mean over the data-parallel ranks (each runs the same number of micro-batches); all ranks must call it."""
    if groups.dp_size() == 1 or not values:
        return values
    keys = sorted(values)
    mean = runtime.all_reduce_mean(torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device),
                                   groups.data, name="metrics")
    return dict(zip(keys, mean.tolist()))
