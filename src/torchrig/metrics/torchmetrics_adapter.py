"""A ``torchmetrics.Metric`` (or each member of a ``MetricCollection``) used as a torchrig metric of summed
states."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import Metric, MetricError

class TorchMetric(Metric):
    """A ``torchmetrics.Metric`` used as a torchrig metric: its states, summed batch by batch into
    torchrig's float64 states, are reduced across ranks and saved in checkpoints like any other.

    Each ``update`` runs the torchmetrics object from its reset state on one batch and adds the states it
    ends with: that is the batch's share when every state is a tensor summed across processes
    (``dist_reduce_fx="sum"``, zero at reset), true of counting and error-sum metrics (accuracy, F1,
    precision, recall, confusion matrices, binned ROC / PR curves, MSE, MAE, means). ``compute`` merges the
    totals into the reset object (``merge_state``) and calls its ``compute``. Metrics whose states are
    lists (``"cat"``: exact AUROC, Spearman) or are reduced otherwise are refused by name: their states
    cannot be summed, so no exact multi-process or mid-epoch-resumable total exists for them here.
    """

    def __init__(self, metric: Any, name: Optional[str] = None) -> None:
        super().__init__()
        self.metric = metric
        self.name = name or type(metric).__name__
        if metric.higher_is_better is not None:
            self.higher_is_better = bool(metric.higher_is_better)
        # torchrig sums the states across ranks itself (once, at the end of an evaluation)
        metric.sync_on_compute, metric.dist_sync_on_step = False, False
        self.keys = sorted(metric.metric_state)
        for key in self.keys:
            default, reduce = metric._defaults[key], metric._reductions[key]
            summed = getattr(reduce, "__name__", "") == "dim_zero_sum"
            if not (isinstance(default, torch.Tensor) and summed and not default.any()):
                kind = "a list" if isinstance(default, list) else f"reduced by {getattr(reduce, '__name__', reduce)}"
                raise MetricError(f"metric {self.name} (torchmetrics): its state '{key}' is {kind}, not a "
                                  f"tensor summed across processes, so torchrig cannot total it exactly over "
                                  f"ranks and resumes; use a binned variant (e.g. thresholds=100) or compute it "
                                  f"from predict()'s outputs")

    def update(self, output: Any, target: Any) -> None:
        m = self.metric
        if isinstance(output, torch.Tensor) and m.device != output.device:
            m.to(output.device)
        m.reset()
        try:
            m.update(output, target)
        except (RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            shapes = " and ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in (output, target)
                                  if isinstance(t, torch.Tensor))
            raise MetricError(f"metric {self.name} (torchmetrics) cannot score output and target {shapes}: "
                              f"{first}") from exc
        for key in self.keys:
            self._add(key, getattr(m, key))

    def compute(self) -> float:
        if not self.states:
            return float("nan")
        import warnings

        m = self.metric
        m.reset()
        m.merge_state({k: v.to(m._defaults[k].dtype).to(m.device) for k, v in self.states.items()})
        with warnings.catch_warnings():  # merged states count as updates; torchmetrics warns otherwise
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            value = m.compute()
        m.reset()
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise MetricError(f"metric {self.name} (torchmetrics) computes {what}; torchrig logs one number per "
                              f"metric: ask for an average (average='macro') or put one metric per class in a "
                              f"MetricCollection")
        return float(value)


def torchmetrics_objects(spec: Any) -> Optional[list[TorchMetric]]:
    """A ``torchmetrics.Metric`` or ``MetricCollection`` as torchrig metrics (a copy of each member, named as
    the collection names it, prefix and postfix included), or None for anything else."""
    import sys

    tm = sys.modules.get("torchmetrics")  # a torchmetrics object means torchmetrics is imported already
    if tm is None:
        return None
    import copy

    if isinstance(spec, tm.MetricCollection):
        return [TorchMetric(copy.deepcopy(m), name) for name, m in spec.items(keep_base=False, copy_state=False)]
    if isinstance(spec, tm.Metric):
        return [TorchMetric(copy.deepcopy(spec))]
    return None
