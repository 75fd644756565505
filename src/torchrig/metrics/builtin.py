"""torchrig's own metrics: classification counts (accuracy, top-k, precision / recall / F1 from a confusion
matrix), mean errors (MSE, MAE) and the mean of a value (a loss); each a :class:`~.base.Metric` of summed states."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .base import IGNORE_INDEX, Metric, MetricError

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
    float32_scores = False  # an argmax: the same in the prediction's own dtype

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
    float32_scores = False  # top-k indices: the same in the prediction's own dtype

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


class Confusion(Metric):
    """Precision / recall / F1 from a confusion matrix (rows: true class, columns: predicted)."""

    batchable = True
    float32_scores = False  # an argmax: the same in the prediction's own dtype

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


class MeanError(Metric):
    higher_is_better = False
    float32_scores = False  # differences taken in float64

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
