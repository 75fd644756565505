"""The cheaper per-step paths give the same results as the straightforward ones.

The performance work (docs/performance.md) replaced a few per-step operations by cheaper ones:
metric sample counts kept as Python numbers until read, CPU batches of the train metrics updated
together (``tests/metrics/test_feed.py``), logged scalars summed as Python floats on the CPU, the CPU
non-finite check reading the loss scalar, one TensorBoard event per logged row. These tests pin down
that nothing observable changed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import QUIET, TinyNet, make_classification
from torch.utils.data import TensorDataset

import torchrig
from torchrig.metrics import get_metric
from torchrig.trainer import NonFiniteLossError


def test_counts_fold_into_states_exactly():
    m = get_metric("accuracy")
    out, target = torch.eye(4)[[0, 1, 2, 2]], torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        m.update(out, target)
    assert m.states["total"].dtype == torch.float64 and float(m.states["total"]) == 12.0
    assert float(m.states["correct"]) == 9.0 and m.compute() == 0.75
    # a reader that replaces the states (resume) drops nothing and keeps counting exactly
    m.states = {k: v.clone() for k, v in m.states.items()}
    m.update(out, target)
    assert float(m.states["total"]) == 16.0 and m.compute() == 0.75
    m.reset()
    assert m.states == {} and math.isnan(m.compute())


def test_counts_only_metric_and_large_counts():
    m = get_metric("mae")
    m.update(torch.ones(3), torch.zeros(3))
    assert m.compute() == 1.0
    m.update(torch.zeros(1), torch.zeros(1))
    assert float(m.states["count"]) == 4.0 and m.compute() == 0.75
    big = get_metric("accuracy")
    big._add("total", 2**40)
    big._add("total", 3)
    assert float(big.states["total"]) == 2**40 + 3  # exact in float64


def test_train_metrics_survive_checkpoint_and_resume(tmp_path):
    x, y = make_classification(48)
    data = TensorDataset(x, y)
    kw = dict(epochs=2, batch_size=8, run_dir=str(tmp_path / "run"), **QUIET)

    def net():
        torch.manual_seed(0)
        return TinyNet()

    full = torchrig.Trainer(net(), **dict(kw, run_dir=str(tmp_path / "full")))
    full.fit(data)
    part = torchrig.Trainer(net(), max_steps=9, checkpoint_every=3, **kw)
    part.fit(data)
    resumed = torchrig.Trainer(net(), resume="latest", **kw)
    resumed.fit(data)
    assert resumed.history[-1]["train/accuracy"] == full.history[-1]["train/accuracy"]
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_logged_loss_is_the_float_sum_of_the_step_losses(tmp_path):
    """On the CPU the interval's loss sum is a Python float (no tensor op per step): the mean of exactly the
    losses the steps returned, summed in order; a device-like logger keeps tensors on the device."""
    x, y = make_classification(40)
    losses = []

    class Watch:
        def on_step_end(self, trainer, values):
            losses.append(values["loss"])  # the step's own tensor, handed to callbacks as before
            assert isinstance(trainer.metrics_log.sums["loss"], float)

    trainer = torchrig.Trainer(TinyNet(), epochs=1, batch_size=4, log_every=5, run_dir=str(tmp_path),
                               callbacks=[Watch()], **QUIET)
    trainer.fit(TensorDataset(x, y))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in rows if r.get("kind") == "interval"]
    assert [r["step"] for r in intervals] == [5, 10] and all(isinstance(v, torch.Tensor) for v in losses)
    for row, part in zip(intervals, (losses[:5], losses[5:])):
        assert row["train/loss"] == sum(float(v) for v in part) / 5

    device_like = torchrig.observe.metrics_logger.MetricsLogger(None, every_steps=5, device=torch.device("cpu"))
    device_like.host = False
    for v in losses[:3]:
        device_like.record({"loss": v}, 4)
    assert isinstance(device_like.sums["loss"], torch.Tensor)
    assert float(device_like.sums["loss"]) == pytest.approx(sum(float(v) for v in losses[:3]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_cpu_non_finite_check_catches_every_kind(bad, tmp_path):
    x, y = make_classification(16)
    calls = []

    def loss(out, target):
        calls.append(1)
        value = torch.nn.functional.cross_entropy(out, target)
        return value * bad if len(calls) == 2 else value

    trainer = torchrig.Trainer(TinyNet(), loss=loss, epochs=1, batch_size=4, run_dir=str(tmp_path), **QUIET)
    with pytest.raises(NonFiniteLossError, match=r"^loss is not finite at optimizer step 2 \(epoch 1, batch 2\); "):
        trainer.fit(TensorDataset(x, y))
    assert trainer.global_step == 1  # the bad step was not applied


def test_tensorboard_rows_hold_every_value(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = make_classification(32)
    run = tmp_path / "run"
    trainer = torchrig.Trainer(TinyNet(), epochs=2, batch_size=8, run_dir=str(run), log_every=2, plot=False,
                               tensorboard=True, progress="none")
    trainer.fit(TensorDataset(x, y))
    trainer.logger.close()
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "lr", "samples_per_s"} <= tags
    assert {2, 4, 6, 8} <= {e.step for e in acc.Scalars("train/loss")}  # every log step
    assert acc.Scalars("train/accuracy")[-1].value == pytest.approx(trainer.history[-1]["train/accuracy"])


@pytest.mark.parametrize("data, owned", [("tensors", True), ("dataloader", True), ("own_collate", False)])
def test_train_batches_the_loop_made_are_fed_to_the_metrics_uncopied(data, owned, tmp_path, monkeypatch):
    """The fast path's gathered batches and default_collate's are new for each step, as is the model's
    output: the metrics queue them without a copy. A user's collate function may reuse its buffers."""
    from torch.utils.data import DataLoader, default_collate

    from torchrig.metrics import Metric

    seen = []
    feed = Metric.feed
    monkeypatch.setattr(Metric, "feed", lambda self, o, t, owned=False: (seen.append(owned), feed(self, o, t, owned)))
    x, y = make_classification(32)
    given = {"tensors": TensorDataset(x, y),
             "dataloader": DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
             "own_collate": DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=lambda b: default_collate(b))}
    torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), batch_size=8, epochs=1, **QUIET).fit(given[data])
    assert seen == [owned] * 4
