"""Capability 1 (metrics): every named metric against scikit-learn on random data, fed in batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn import metrics as skm
from torch.utils.data import TensorDataset

from torchrig.metrics import METRIC_NAMES, Metric, MetricError, get_metric, higher_is_better


def _scores(n=203, c=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=g)
    target = torch.randint(0, c, (n,), generator=g)
    # make predictions better than chance so that every class is predicted and measured
    logits[torch.arange(n), target] += torch.rand(n, generator=g) * 1.5
    return logits, target


def _feed(metric, output, target, batch=32):
    for i in range(0, len(output), batch):
        metric.update(output[i:i + batch], target[i:i + batch])
    return metric.compute()


@pytest.mark.parametrize("seed", [0, 1])
def test_accuracy(seed):
    out, y = _scores(seed=seed)
    expected = skm.accuracy_score(y.numpy(), out.argmax(1).numpy())
    assert _feed(get_metric("accuracy"), out, y) == pytest.approx(expected, abs=1e-12)
    assert _feed(get_metric("acc"), out, y) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(k):
    out, y = _scores()
    expected = skm.top_k_accuracy_score(y.numpy(), out.numpy(), k=k, labels=np.arange(out.shape[1]))
    m = get_metric(f"top{k}")
    assert m.name == f"top{k}"
    assert _feed(m, out, y) == pytest.approx(expected, abs=1e-12)


def test_top_k_spellings():
    assert get_metric("top_k=3").k == 3 and get_metric("top10").k == 10


@pytest.mark.parametrize("name,fn,average", [
    ("precision", skm.precision_score, "macro"),
    ("recall", skm.recall_score, "macro"),
    ("f1", skm.f1_score, "macro"),
    ("f1_macro", skm.f1_score, "macro"),
    ("f1_weighted", skm.f1_score, "weighted"),
    ("precision_weighted", skm.precision_score, "weighted"),
    ("recall_weighted", skm.recall_score, "weighted"),
])
@pytest.mark.parametrize("seed", [0, 3])
def test_precision_recall_f1(name, fn, average, seed):
    out, y = _scores(seed=seed)
    expected = fn(y.numpy(), out.argmax(1).numpy(), average=average, zero_division=0)
    assert _feed(get_metric(name), out, y) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("name,fn,average", [
    ("accuracy", None, None),
    ("f1", skm.f1_score, "macro"),
    ("precision_weighted", skm.precision_score, "weighted"),
    ("recall", skm.recall_score, "macro"),
])
def test_token_targets_leave_out_positions_labelled_minus_100(name, fn, average):
    """(batch, classes, positions) scores with (batch, positions) labels: -100 positions count nowhere."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 4, 9, generator=g)
    target = torch.randint(0, 4, (12, 9), generator=g)
    target[torch.rand(12, 9, generator=g) < 0.3] = -100
    pred = logits.argmax(1)
    keep = target != -100
    y, p = target[keep].numpy(), pred[keep].numpy()
    expected = skm.accuracy_score(y, p) if fn is None else fn(y, p, average=average, zero_division=0)
    assert _feed(get_metric(name), logits, target, batch=5) == pytest.approx(expected, abs=1e-12)


def test_f1_with_a_class_never_predicted_and_one_absent():
    # class 3 never appears in the targets or predictions; class 2 is never predicted
    y = torch.tensor([0, 0, 1, 1, 2, 2, 4, 4])
    pred = torch.tensor([0, 1, 1, 1, 0, 1, 4, 0])
    out = torch.nn.functional.one_hot(pred, 5).float()
    for name, fn, avg in [("f1", skm.f1_score, "macro"), ("precision", skm.precision_score, "macro"),
                          ("recall_weighted", skm.recall_score, "weighted")]:
        expected = fn(y.numpy(), pred.numpy(), average=avg, zero_division=0)
        assert _feed(get_metric(name), out, y, batch=3) == pytest.approx(expected, abs=1e-12)


def test_binary_single_logit():
    g = torch.Generator().manual_seed(5)
    out = torch.randn(50, 1, generator=g)
    y = torch.randint(0, 2, (50,), generator=g)
    pred = (out.view(-1) > 0).long().numpy()
    assert _feed(get_metric("accuracy"), out, y) == pytest.approx(skm.accuracy_score(y.numpy(), pred))
    assert _feed(get_metric("f1"), out, y) == pytest.approx(skm.f1_score(y.numpy(), pred, average="macro"))
    # float targets shaped like the output (bce_with_logits style)
    assert _feed(get_metric("accuracy"), out, y.float().view(-1, 1)) == pytest.approx(
        skm.accuracy_score(y.numpy(), pred))


@pytest.mark.parametrize("name,fn", [("mse", skm.mean_squared_error), ("mae", skm.mean_absolute_error)])
def test_regression_metrics(name, fn):
    g = torch.Generator().manual_seed(2)
    out, y = torch.randn(77, 3, generator=g), torch.randn(77, 3, generator=g)
    assert _feed(get_metric(name), out, y, batch=10) == pytest.approx(fn(y.double().numpy(), out.double().numpy()),
                                                                      rel=1e-12)
    out1, y1 = torch.randn(20, 1, generator=g), torch.randn(20, generator=g)  # (N,1) vs (N,)
    assert _feed(get_metric(name), out1, y1) == pytest.approx(fn(y1.double().numpy(), out1.view(-1).double().numpy()),
                                                            rel=1e-12)


def test_unknown_metric_lists_valid_names(tmp_path):
    import torchrig

    with pytest.raises(MetricError, match="unknown metric 'acuracy'; did you mean 'accuracy'"):  # at once, as a loss
        torchrig.Trainer(torch.nn.Linear(3, 2), metrics=["acuracy"], run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(MetricError) as err:
        get_metric("acuracy")
    msg = str(err.value)
    assert "unknown metric 'acuracy'; did you mean 'accuracy'? Valid names:" in msg
    assert "Valid names: " + ", ".join(METRIC_NAMES) in msg and "topK (e.g. top3)" in msg
    with pytest.raises(MetricError, match="a metric must be a name, a torchrig.metrics.Metric or a torchmetrics Metric / MetricCollection, got int"):
        get_metric(3)


def test_unknown_metric_through_trainer(make_trainer, data):
    with pytest.raises(MetricError) as err:  # when the Trainer is made, as an unknown loss or optimizer
        make_trainer(metrics=["accuracy", "f2"])
    assert str(err.value) == f"unknown metric 'f2'. Valid names: {', '.join(METRIC_NAMES)}, topK (e.g. top3)"


def test_shape_errors_are_explained():
    with pytest.raises(MetricError, match=r"metric 'accuracy': predictions of shape \(4,\) do not match targets "
                                          r"of shape \(4, 3\) \(targets must be class indices\)"):
        get_metric("accuracy").update(torch.randn(4, 3), torch.randn(4, 3))
    with pytest.raises(MetricError, match=r"metric 'top5' needs \(batch, classes\) scores, got shape \(4,\)"):
        get_metric("top5").update(torch.randn(4), torch.zeros(4))
    with pytest.raises(MetricError, match=r"metric 'mse': output shape \(4, 2\) does not match target shape \(4, 3\)"):
        get_metric("mse").update(torch.randn(4, 2), torch.randn(4, 3))
    with pytest.raises(MetricError, match="needs tensor output and target, got tuple and Tensor"):
        get_metric("accuracy").update((torch.randn(4, 2),), torch.zeros(4))


def test_empty_metric_is_nan_and_reset():
    m = get_metric("accuracy")
    assert np.isnan(m.compute())
    m.update(torch.eye(3), torch.arange(3))
    assert m.compute() == 1.0
    m.reset()
    assert np.isnan(m.compute())


@pytest.mark.parametrize("key,higher", [("val/accuracy", True), ("val/top5", True), ("val/f1", True),
                                        ("val/loss", False), ("val/mse", False), ("val/mae", False),
                                        ("train/recon_loss", False)])
def test_monitor_direction(key, higher):
    assert higher_is_better(key) is higher


def test_metric_objects_and_custom_metric_in_trainer(make_trainer, data):
    class Positives(Metric):
        name = "positives"

        def update(self, output, target):
            self._add("n", (output.argmax(1) == 0).sum())

        def compute(self):
            return float(self.states["n"])

    custom = Positives()
    trainer = make_trainer(metrics=[custom, "accuracy"], epochs=1)
    trainer.fit(data)
    res = trainer.evaluate(data)
    assert list(res) == ["loss", "positives", "accuracy"]
    with torch.no_grad():
        pred = trainer.model(data.tensors[0]).argmax(1)
    assert res["positives"] == float((pred == 0).sum())  # every sample counted once, over all batches
    assert res["accuracy"] == pytest.approx(float((pred == data.tensors[1]).float().mean()))
    assert custom.states == {}  # the user's object is a template, copied for each use


def test_evaluate_metrics_match_sklearn(make_trainer, data):
    trainer = make_trainer(metrics=["accuracy", "top3", "f1_weighted", "recall"], batch_size=7, epochs=2)
    trainer.fit(data)
    x, y = data.tensors
    with torch.no_grad():
        out = trainer.model(x)
    res = trainer.evaluate(TensorDataset(x, y))
    pred = out.argmax(1).numpy()
    assert res["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert res["top3"] == pytest.approx(skm.top_k_accuracy_score(y, out.numpy(), k=3, labels=np.arange(4)))
    assert res["f1_weighted"] == pytest.approx(skm.f1_score(y, pred, average="weighted", zero_division=0))
    assert res["recall"] == pytest.approx(skm.recall_score(y, pred, average="macro", zero_division=0))
    assert res["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-5)


@pytest.mark.parametrize("name", ["accuracy", "top3", "precision", "recall", "f1", "f1_weighted", "mse", "mae"])
def test_every_built_in_update_runs_on_the_meta_device(name):
    """An update that read a value back (bincount's size, a mask's count) would fail on ``meta``, as it would
    wait for a GPU on CUDA: every built-in metric updates there without one."""
    m = get_metric(name)
    m.device = torch.device("meta")
    regression = name in ("mse", "mae")
    out = torch.empty(6, 1 if regression else 5, device="meta")
    target = torch.empty(6, 1, device="meta") if regression else torch.zeros(6, dtype=torch.long, device="meta")
    for _ in range(2):
        m.update(out, target)
    assert all(v.device.type == "meta" for v in m.states.values())


@pytest.mark.parametrize("name", ["precision", "recall", "f1"])
def test_a_label_outside_the_classes_is_reported_when_read(name):
    m = get_metric(name)
    m.update(torch.eye(4)[[0, 1, 2]], torch.tensor([0, 1, 7]))
    with pytest.raises(MetricError, match=rf"metric '{name}': 1 target label\(s\) outside the 4 classes"):
        m.compute()
