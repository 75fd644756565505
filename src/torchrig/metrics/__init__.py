"""Metric names -> metric objects whose states are sums, so reduction across ranks is exact.

``base.py``: the :class:`Metric` object and its reduction; ``builtin.py``: torchrig's own metrics;
``torchmetrics_adapter.py``: torchmetrics objects as torchrig metrics; ``registry.py``: names -> objects.
"""

from .base import IGNORE_INDEX, Metric, MetricError
from .builtin import Accuracy, Confusion, MeanError, MeanValue, TopK
from .registry import METRIC_NAMES, get_metric, get_metrics, higher_is_better
from .torchmetrics_adapter import TorchMetric

__all__ = ["Metric", "MetricError", "Accuracy", "TopK", "MeanValue", "TorchMetric", "get_metric", "get_metrics",
           "METRIC_NAMES", "higher_is_better", "IGNORE_INDEX", "Confusion", "MeanError"]
