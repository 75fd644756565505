"""torchmetrics objects in ``metrics=[...]`` beside torchrig's own: the same numbers as torchmetrics and
scikit-learn on all the data, in one process and over 2 gloo ranks (93 samples, uneven shards, padding),
logged under their names, and carried by a mid-epoch checkpoint."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("torchmetrics")

from helpers import dist_procs  # noqa: E402
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.classification import (  # noqa: E402
    MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score, MulticlassPrecision)

import torchrig  # noqa: E402
from torchrig.metrics import MetricError, get_metrics  # noqa: E402

sys.path.insert(0, str(dist_procs.HELPERS))
import tm_worker as W  # noqa: E402

NAMES = ("f1", "MulticlassF1Score", "tm_acc", "tm_precision_w")


def expected() -> dict:
    """Each metric on the model's outputs for all 93 samples at once: torchmetrics and scikit-learn."""
    from sklearn import metrics as skm

    x, y = W.data()
    with torch.no_grad():
        logits = W.model()(x)
    pred, true = logits.argmax(1).numpy(), y.numpy()
    tm = {"MulticlassF1Score": float(MulticlassF1Score(W.CLASSES)(logits, y)),
          "tm_acc": float(MulticlassAccuracy(W.CLASSES, average="micro")(logits, y)),
          "tm_precision_w": float(MulticlassPrecision(W.CLASSES, average="weighted")(logits, y))}
    sk = {"f1": skm.f1_score(true, pred, average="macro"), "MulticlassF1Score": skm.f1_score(true, pred, average="macro"),
          "tm_acc": skm.accuracy_score(true, pred), "tm_precision_w": skm.precision_score(true, pred, average="weighted")}
    assert tm == pytest.approx({k: sk[k] for k in tm}, abs=1e-6)
    return sk


def test_one_process_equals_torchmetrics_and_sklearn(tmp_path):
    x, y = W.data()
    t = torchrig.Trainer(W.model(), **W.settings(tmp_path / "run"))
    t.fit((x, y), (x, y))
    want = expected()
    results = t.evaluate((x, y))
    assert {k: results[k] for k in NAMES} == pytest.approx(want, abs=1e-6)
    row = t.history[-1]  # logged under their names, train and val
    assert {k: row[f"val/{k}"] for k in NAMES} == pytest.approx(want, abs=1e-6)
    assert {k: row[f"train/{k}"] for k in NAMES} == pytest.approx(want, abs=1e-6)  # a still model: all 93 samples once
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/tm_precision_w" in r for r in logged)


@pytest.mark.slow
def test_two_gloo_ranks_count_each_of_93_samples_once(tmp_path):
    results = dist_procs.pair("torchmetrics", tmp_path, tmp_path / "store", worker=dist_procs.HELPERS / "tm_worker.py")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    want = expected()
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert {k: report["evaluate"][k] for k in NAMES} == pytest.approx(want, abs=1e-6)
        assert {k: report["train"][f"train/{k}"] for k in NAMES} == pytest.approx(want, abs=1e-6)


def test_a_mid_epoch_checkpoint_carries_their_states(tmp_path):
    x, y = W.data()
    kw = dict(lr=0.1, epochs=1, batch_size=8)
    whole = torchrig.Trainer(W.model(), **W.settings(tmp_path / "whole", **kw))
    whole.fit((x, y))
    first = torchrig.Trainer(W.model(), **W.settings(tmp_path / "cut", max_steps=5, **kw))
    first.fit((x, y))  # stops after 5 of the epoch's 12 steps, with a checkpoint
    assert first.state.global_step == 5 and not first.history  # no epoch ended yet
    rest = torchrig.Trainer(W.model(), **W.settings(tmp_path / "cut", resume="latest", **kw))
    rest.fit((x, y))
    assert rest.resumed_from.name == "step-00000005"
    for k in NAMES:  # the first 5 steps' batches count, though this process never saw them
        assert rest.history[-1][f"train/{k}"] == whole.history[-1][f"train/{k}"], k


def test_what_cannot_be_summed_is_refused_by_name():
    with pytest.raises(MetricError, match=r"MulticlassAUROC \(torchmetrics\): its state 'preds' is a list.*"
                                          r"thresholds=100"):
        get_metrics([MulticlassAUROC(3)])
    assert get_metrics([MulticlassAUROC(3, thresholds=20)])[0].name == "MulticlassAUROC"  # binned: summed counts
    with pytest.raises(MetricError, match="MulticlassF1Score given twice.*MetricCollection"):
        get_metrics([MulticlassF1Score(3), MulticlassF1Score(3, average="weighted")])
    (per_class,) = get_metrics([MulticlassF1Score(3, average=None)])
    per_class.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(MetricError, match=r"computes a tensor of shape \(3,\).*average='macro'"):
        per_class.compute()
    (f1,) = get_metrics(MulticlassF1Score(3))
    with pytest.raises(MetricError, match=r"MulticlassF1Score \(torchmetrics\) cannot score output and target"):
        f1.update(torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))
    c = MetricCollection([MulticlassAccuracy(3)])
    assert [m.name for m in get_metrics(c)] == ["MulticlassAccuracy"]


def test_the_monitor_takes_its_direction_from_the_metric_not_its_name(tmp_path):
    """``MeanSquaredError`` under a name that says nothing ("fit") is lower-is-better because torchmetrics says
    so; a torchrig metric class declares its own; a key with no metric object behind it goes by its name."""
    from torchmetrics import MeanSquaredError

    from torchrig.trainer.callbacks import Monitor

    (fit,) = get_metrics(MetricCollection({"fit": MeanSquaredError()}))
    assert Monitor("val/fit", None, [fit]).mode == "min"
    assert Monitor("val/fit", "max", [fit]).mode == "max"  # checkpoint.mode, when given, decides
    assert Monitor("val/fit", None, []).mode == "max"  # by name alone "fit" would be maximised
    (mae,) = get_metrics("mae")
    assert Monitor("val/mae", None, [mae]).mode == "min" and Monitor("val/val_loss", None, []).mode == "min"

    class Score(torchrig.metrics.MeanValue):  # a user's subclass keeps the direction its class chain declares
        pass

    assert Monitor("val/score", None, [Score("score")]).mode == "min"
    from torchmetrics.classification import MulticlassHammingDistance

    x, y = W.data()  # the Trainer hands its metric objects to the monitor: "val/wrong" is minimised
    t = torchrig.Trainer(W.model(), **W.settings(tmp_path / "run", metrics=[MetricCollection(
        {"wrong": MulticlassHammingDistance(W.CLASSES)})], monitor="val/wrong"))
    t.fit((x, y), (x, y))
    assert t.monitor.name == "val/wrong" and t.monitor.mode == "min"
