"""Metric names -> metric objects whose states are sums, so reduction across ranks is exact.

A metric keeps tensors of counts or sums (``states``); ``sync`` all-reduces them once at the end of
an evaluation, so distributed evaluation gives the same numbers as one process.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..runtime.dist import all_reduce_sum, data_parallel_group, from_last_stage, pipeline_group
from ..errors import TorchrigError, suggest

IGNORE_INDEX = -100  # a token / pixel target PyTorch's cross_entropy and Hugging Face models skip


class MetricError(TorchrigError, ValueError):
    """An unknown metric name or an output / target pair a metric cannot score."""


class Metric:
    """Base: subclasses create sum-reducible tensors in ``states`` and implement update / compute.

    A subclass whose states are integer counts (correct predictions, confusion cells) may set
    ``batchable = True``: one ``update`` on several batches concatenated then adds exactly what an update
    per batch adds. A subclass that overrides ``update`` is not batchable unless it says so.
    """

    name = "metric"
    higher_is_better = True
    device: Optional[torch.device] = None  # where new states live: the run's device (set by the trainer)
    batchable = False
    QUEUE_LIMIT = 64, 1 << 20  # batches and tensor elements ``feed`` holds before it updates
    FEED_LIMIT = 1 << 16  # a batch with more elements (token logits …) is updated at once, not copied

    def __init__(self) -> None:
        self.states = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``batchable`` vouches for the ``update`` of the class that set it (or one it inherits): an update
        # defined by a subclass of it, or by a mixin before it in the MRO, is not batchable unless it says so
        if "batchable" not in cls.__dict__:
            owner = next(k for k in cls.__mro__ if "update" in k.__dict__)
            declared = next(k for k in cls.__mro__ if "batchable" in k.__dict__)
            if not issubclass(declared, owner):
                cls.batchable = False

    # ``states`` maps names to float64 tensors. Two kinds of update wait instead of costing tensor ops on
    # every training step, and are applied whenever ``states`` is read, so every reader (compute, sync,
    # checkpoints) sees exact totals: Python numbers given to ``_add`` (sample counts) in ``_pending``, and
    # the CPU batches ``feed`` queues for a batchable metric in ``_queue``.
    @property
    def states(self) -> dict[str, torch.Tensor]:
        if self._queue:
            self._update_queued()
        if self._pending:
            # a new count lives beside the metric's other states (on the GPU for a GPU run), so that
            # one all-reduce backend (NCCL) can sum them all
            device = self.device or (next(iter(self._states.values())).device if self._states else None)
            for key, n in self._pending.items():
                if key in self._states:
                    self._states[key] += n
                else:  # a fill kernel: torch.tensor(n, device=cuda) would copy from pageable memory and wait
                    self._states[key] = torch.full((), float(n), dtype=torch.float64, device=device)
            self._pending = {}
        return self._states

    @states.setter
    def states(self, value: dict[str, torch.Tensor]) -> None:
        self._states, self._pending, self._queue, self._queued = value, {}, [], 0

    def reset(self) -> None:
        self.states = {}

    def snapshot(self) -> tuple:
        """The states as they stand, to :meth:`restore` later, without folding in what waits (no tensor op for
        the pending counts, no update of the queued batches): a copy per state tensor, nothing read back."""
        return ({k: v.clone() for k, v in self._states.items()}, dict(self._pending), list(self._queue),
                self._queued, getattr(self, "_queue_inference", False))

    def restore(self, snap: tuple) -> None:
        states, pending, queue, queued, inference = snap
        self._states = {k: v.clone() for k, v in states.items()}
        self._pending, self._queue, self._queued, self._queue_inference = dict(pending), list(queue), queued, inference

    def feed(self, output: Any, target: Any, owned: bool = False) -> None:
        """``update(output, target)``, now or together with the next batches.

        A batchable metric queues CPU tensors and updates once on the concatenated batches when ``states`` is
        read (at log steps, epoch ends, checkpoints) or the queue is full: one ``argmax`` / ``==`` / ``sum``
        per log interval instead of one per step, which is a tenth of a small model's step on one CPU core.
        The first batch after a reset is updated at once, so a bad output or target is reported there.
        What is queued is a copy (a loader or a model may reuse its buffers), unless ``owned``: the caller
        vouches that nothing writes either tensor later (the output of this step's forward, a batch collated
        for it). Batches are queued under the autograd mode of the call (evaluation's states are inference
        tensors); batches over :data:`FEED_LIMIT` elements are updated at once. Accelerator tensors are never
        held: their ops are queued by the device anyway."""
        if (not self.batchable or type(output) is not torch.Tensor or type(target) is not torch.Tensor
                or not output.is_cpu or not target.is_cpu or not (self._queue or self._states)
                or (size := output.numel() + target.numel()) > self.FEED_LIMIT):
            self.update(output, target)
            return
        inference = torch.is_inference_mode_enabled()
        if self._queue and inference != self._queue_inference:
            self._update_queued()
        self._queue_inference = inference
        self._queue.append((output.detach(), target) if owned else (output.detach().clone(), target.clone()))
        self._queued += size
        if len(self._queue) >= self.QUEUE_LIMIT[0] or self._queued >= self.QUEUE_LIMIT[1]:
            self._update_queued()

    def _update_queued(self) -> None:
        """One ``update`` on the queued batches concatenated, or one per batch when they do not concatenate
        (other trailing shapes, or a batch whose output and target differ in rows: its own update reports it)."""
        queue, self._queue, self._queued = self._queue, [], 0
        with torch.inference_mode(self._queue_inference):  # as fed: evaluation's states are inference tensors
            if all(o.ndim and t.ndim and o.shape[0] == t.shape[0] for o, t in queue):
                try:
                    output, target = torch.cat([o for o, _ in queue]), torch.cat([t for _, t in queue])
                except RuntimeError:  # trailing shapes differ
                    pass
                else:
                    self.update(output, target)
                    return
            for pair in queue:
                self.update(*pair)

    def _add(self, key: str, value: Union[torch.Tensor, int, float]) -> None:
        """Add to a float64 state (exact counts); a Python number (a count) needs no tensor op."""
        if not isinstance(value, torch.Tensor):
            self._pending[key] = self._pending.get(key, 0) + value
            return
        if value.requires_grad:
            value = value.detach()
        state = self._states.get(key)
        if state is None:
            self._states[key] = value.to(self.device or value.device, torch.float64, copy=True)
        else:  # in place, promoted to float64 by the add itself: one op per update on the training path
            state += value if value.device == state.device else value.to(state.device)

    def update(self, output: Any, target: Any) -> None:
        raise NotImplementedError

    def compute(self) -> Union[float, dict]:
        raise NotImplementedError

    def sync(self) -> None:
        """Sum every state over the data-parallel ranks (no-op in one process), and take the sums of a pipeline's
        last stage, where the model's outputs are (``runtime.from_last_stage``). Every rank must call it."""
        group = data_parallel_group()
        for key in sorted(self.states):
            self.states[key] = all_reduce_sum(self.states[key], group)
        if pipeline_group() is not None:
            device = self.device
            self.states = {k: v.to(device or v.device) for k, v in from_last_stage(dict(self.states)).items()}


def _class_predictions(output: torch.Tensor) -> torch.Tensor:
    if output.ndim >= 2 and output.shape[1] > 1:
        return output.argmax(dim=1)
    return (output.reshape(output.shape[0], *output.shape[2:]) > 0).long()


def _labelled(target: torch.Tensor) -> Optional[torch.Tensor]:
    """For token / pixel labels (an integer target with more than a batch dimension), where a label is
    given (not -100); None for other targets, which are all labelled."""
    if target.ndim >= 2 and not target.is_floating_point():
        return target != IGNORE_INDEX
    return None


def _check(output: Any, target: Any, name: str) -> None:
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise MetricError(f"metric '{name}' needs tensor output and target, got {type(output).__name__} "
                          f"and {type(target).__name__}; use a custom metric for structured outputs")


class Accuracy(Metric):
    name = "accuracy"
    batchable = True

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        _check(output, target, self.name)
        pred = _class_predictions(output)
        if pred.shape != target.shape:
            if pred.numel() != target.numel():
                raise MetricError(f"metric 'accuracy': predictions of shape {tuple(pred.shape)} do not match "
                                  f"targets of shape {tuple(target.shape)} (targets must be class indices)")
            target = target.reshape(pred.shape)  # (N, 1) float targets of a single-logit classifier
        valid = _labelled(target)
        if valid is not None:
            self._add("correct", ((pred == target) & valid).sum())
            self._add("total", valid.sum())
            return
        self._add("correct", (pred == target).sum())
        self._add("total", target.numel())

    def compute(self) -> float:
        return float(self.states["correct"] / self.states["total"]) if self.states else float("nan")


class TopK(Metric):
    batchable = True

    def __init__(self, k: int = 5) -> None:
        super().__init__()
        if k < 1:
            raise MetricError(f"metric 'top{k}': k must be at least 1 (top1 is the accuracy); use top1, top3, top5 …")
        self.k = k
        self.name = f"top{k}"

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        _check(output, target, self.name)
        if output.ndim != 2:
            raise MetricError(f"metric '{self.name}' needs (batch, classes) scores, got shape {tuple(output.shape)}")
        if self.k >= output.shape[1]:
            raise MetricError(f"metric '{self.name}': the model scores {output.shape[1]} classes, so every sample "
                              f"is in its top {self.k} and {self.name} would always be 1; use k below "
                              f"{output.shape[1]} or remove it from metrics")
        top = output.topk(self.k, dim=1).indices
        self._add("correct", (top == target.view(-1, 1)).any(dim=1).sum())
        self._add("total", target.shape[0])

    def compute(self) -> float:
        return float(self.states["correct"] / self.states["total"]) if self.states else float("nan")


class _Confusion(Metric):
    """Precision / recall / F1 from a confusion matrix (rows: true class, columns: predicted)."""

    batchable = True

    def __init__(self, kind: str, average: str = "macro", num_classes: Optional[int] = None) -> None:
        super().__init__()
        self.kind, self.average, self.num_classes = kind, average, num_classes
        self.name = kind if average == "macro" else f"{kind}_{average}"

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        _check(output, target, self.name)
        valid = _labelled(target)
        pred = _class_predictions(output).reshape(-1)
        target = target.reshape(-1).long()
        c = self.num_classes or (output.shape[1] if output.ndim >= 2 and output.shape[1] > 1 else 2)
        self.num_classes = c
        # A fixed table filled by index_add_: bincount sizes its output from the largest index, which a GPU must
        # read back (twice a step). Cell c·c counts labels outside 0 … c-1 (reported by compute, on the host);
        # unlabelled positions (-100) weigh 0.
        in_range = (target >= 0) & (target < c)
        index = torch.where(in_range, target * c + pred, c * c)
        weights = valid.reshape(-1).double() if valid is not None else torch.ones_like(index, dtype=torch.float64)
        cells = torch.zeros(c * c + 1, dtype=torch.float64, device=target.device).index_add_(0, index, weights)
        self._add("confusion", cells[:-1].reshape(c, c))
        self._add("bad_labels", cells[-1])

    def compute(self) -> float:
        if not self.states:
            return float("nan")
        if "bad_labels" in self.states and float(self.states["bad_labels"]):
            raise MetricError(f"metric '{self.name}': {int(self.states['bad_labels'])} target label(s) outside the "
                              f"{self.num_classes} classes of the output (labels must be 0 … {self.num_classes - 1}, "
                              f"or -100 to skip a position)")
        cm = self.states["confusion"]
        tp = cm.diag()
        support = cm.sum(dim=1)
        predicted = cm.sum(dim=0)
        precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
        recall = torch.where(support > 0, tp / support.clamp(min=1), torch.zeros_like(tp))
        if self.kind == "precision":
            per_class = precision
        elif self.kind == "recall":
            per_class = recall
        else:
            denom = precision + recall
            per_class = torch.where(denom > 0, 2 * precision * recall / denom.clamp(min=1e-12), torch.zeros_like(tp))
        if self.average == "weighted":
            return float((per_class * support).sum() / support.sum().clamp(min=1))
        present = (support > 0) | (predicted > 0)
        return float(per_class[present].mean()) if present.any() else 0.0


class _MeanError(Metric):
    higher_is_better = False

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.name, self.fn = name, fn

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        _check(output, target, self.name)
        if output.shape != target.shape:
            if output.numel() == target.numel():
                output = output.reshape(target.shape)
            else:
                raise MetricError(f"metric '{self.name}': output shape {tuple(output.shape)} does not match "
                                  f"target shape {tuple(target.shape)}")
        diff = output.detach().double() - target.detach().double()
        self._add("sum", self.fn(diff).sum())
        self._add("count", diff.numel())

    def compute(self) -> float:
        return float(self.states["sum"] / self.states["count"]) if self.states else float("nan")


class MeanValue(Metric):
    """Per-sample mean of a value reported per batch as a batch mean (the evaluation loss)."""

    higher_is_better = False

    def __init__(self, name: str = "loss") -> None:
        super().__init__()
        self.name = name

    def update(self, value: torch.Tensor, count: int) -> None:  # type: ignore[override]
        self._add("sum", value.detach().double() * count)
        self._add("count", count)

    def compute(self) -> float:
        return float(self.states["sum"] / self.states["count"]) if self.states else float("nan")


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


def _torchmetrics_objects(spec: Any) -> Optional[list[TorchMetric]]:
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


_FACTORIES: dict[str, Callable[[], Metric]] = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "top1": lambda: TopK(1),
    "top3": lambda: TopK(3),
    "top5": lambda: TopK(5),
    "precision": lambda: _Confusion("precision", "macro"),
    "recall": lambda: _Confusion("recall", "macro"),
    "f1": lambda: _Confusion("f1", "macro"),
    "f1_macro": lambda: _Confusion("f1", "macro"),
    "f1_weighted": lambda: _Confusion("f1", "weighted"),
    "precision_weighted": lambda: _Confusion("precision", "weighted"),
    "recall_weighted": lambda: _Confusion("recall", "weighted"),
    "mse": lambda: _MeanError("mse", lambda d: d * d),
    "mae": lambda: _MeanError("mae", lambda d: d.abs()),
}
METRIC_NAMES = tuple(_FACTORIES)


def get_metrics(specs: Any, device: Optional[torch.device] = None) -> list[Metric]:
    """Fresh metric objects for a name, a Metric, a torchmetrics ``Metric`` / ``MetricCollection``, or a list
    of them (objects are copied), whose states live on ``device`` (the run's: one all-reduce backend, NCCL,
    sums them all). Two metrics may not share a name: each is logged under it."""
    import copy

    if isinstance(specs, (str, Metric)) or _torchmetrics_objects(specs) is not None:
        specs = [specs]
    metrics: list[Metric] = []
    for s in specs:
        wrapped = _torchmetrics_objects(s)
        metrics += wrapped if wrapped is not None else [get_metric(copy.deepcopy(s) if isinstance(s, Metric) else s)]
    names = [m.name for m in metrics]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MetricError(f"metrics: {', '.join(twice)} given twice; each metric is logged under its name: name "
                          f"torchmetrics objects in a MetricCollection({{'name': metric, ...}})")
    for m in metrics:
        m.device = device if device is not None else m.device
    return metrics


def get_metric(spec: Union[str, Metric]) -> Metric:
    """A metric object from a name (``accuracy``, ``top5``, ``top_k=3``, ``f1_weighted``, …) or as given."""
    if isinstance(spec, Metric):
        return spec
    if not isinstance(spec, str):
        raise MetricError(f"a metric must be a name, a torchrig.metrics.Metric or a torchmetrics Metric / "
                          f"MetricCollection, got {type(spec).__name__}")
    key = spec.strip().lower()
    if key.startswith("top") and key[3:].lstrip("_k=").isdigit():
        return TopK(int(key[3:].lstrip("_k=")))
    if key in _FACTORIES:
        return _FACTORIES[key]()
    listing = f"Valid names: {', '.join(METRIC_NAMES)}, topK (e.g. top3)"
    raise MetricError(f"unknown metric '{spec}'{suggest(key, METRIC_NAMES, listing=listing)}")


def higher_is_better(name: str) -> bool:
    """Direction of a monitored key such as ``val/accuracy`` or ``val/loss``."""
    base = name.split("/")[-1]
    if base in ("loss", "mse", "mae") or base.endswith("loss") or base.endswith("error"):
        return False
    return True


__all__ = ["Metric", "MetricError", "Accuracy", "TopK", "MeanValue", "TorchMetric", "get_metric", "METRIC_NAMES",
           "higher_is_better"]
