"""Metric names -> metric objects: the names the config and the Trainer take, and the direction of a monitored
value."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..errors import suggest
from .base import Metric, MetricError
from .builtin import Accuracy, Confusion, MeanError, TopK
from .torchmetrics_adapter import torchmetrics_objects

_FACTORIES: dict[str, Callable[[], Metric]] = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "top1": lambda: TopK(1),
    "top3": lambda: TopK(3),
    "top5": lambda: TopK(5),
    "precision": lambda: Confusion("precision", "macro"),
    "recall": lambda: Confusion("recall", "macro"),
    "f1": lambda: Confusion("f1", "macro"),
    "f1_macro": lambda: Confusion("f1", "macro"),
    "f1_weighted": lambda: Confusion("f1", "weighted"),
    "precision_weighted": lambda: Confusion("precision", "weighted"),
    "recall_weighted": lambda: Confusion("recall", "weighted"),
    "mse": lambda: MeanError("mse", lambda d: d * d),
    "mae": lambda: MeanError("mae", lambda d: d.abs()),
}
METRIC_NAMES = tuple(_FACTORIES)


def get_metrics(specs: Any, device: Optional[torch.device] = None) -> list[Metric]:
    """Fresh metric objects for a name, a Metric, a torchmetrics ``Metric`` / ``MetricCollection``, or a list
    of them (objects are copied), whose states live on ``device`` (the run's: one all-reduce backend, NCCL,
    sums them all). Two metrics may not share a name: each is logged under it."""
    import copy

    if isinstance(specs, (str, Metric)) or torchmetrics_objects(specs) is not None:
        specs = [specs]
    metrics: list[Metric] = []
    for s in specs:
        wrapped = torchmetrics_objects(s)
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
    if ":" in key:  # MODULE:NAME: the command line imports it (recipes/factory.py) and passes the metric
        raise MetricError(f"metric '{spec}' names a metric of yours (MODULE:NAME), which the torchrig command "
                          f"imports; in Python pass the metric object itself: Trainer(metrics=[YourMetric()])")
    listing = f"Valid names: {', '.join(METRIC_NAMES)}, topK (e.g. top3)"
    raise MetricError(f"unknown metric '{spec}'{suggest(key, METRIC_NAMES, listing=listing)}")


def higher_is_better(name: str) -> bool:
    """Direction of a monitored key such as ``val/accuracy`` or ``val/loss``."""
    base = name.split("/")[-1]
    if base in ("loss", "mse", "mae") or base.endswith("loss") or base.endswith("error"):
        return False
    return True
