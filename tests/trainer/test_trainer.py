"""Capabilities 5, 6, 9, 10 and the public API: accumulation, clipping, train/eval modes, evaluation,
non-finite losses, progress and logs, the issue's example, and a custom (GAN) step."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, TinyNet, fp16_precision, gan_models, gan_step, make_classification, read_jsonl
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.trainer import NonFiniteLossError


def _count_steps(trainer) -> list:
    calls: list = []
    for opt in trainer.optimizers.values():
        opt.register_step_post_hook(lambda *a: calls.append(1))
    return calls


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("accumulate,big", [(4, 16), (3, 12)])
def test_accumulation_equals_one_big_batch(make_trainer, data, tmp_path, accumulate, big):
    """40 samples in micro-batches of 4: A=4 gives windows of 16, 16, 8 samples and A=3 gives 12, 12, 12, 4,
    the short last window included; each must equal plain batches of that size."""
    acc = make_trainer(batch_size=4, accumulate=accumulate, epochs=2, lr=0.2, run_dir=str(tmp_path / "acc"))
    steps = _count_steps(acc)
    acc.fit(data)
    one = make_trainer(batch_size=big, accumulate=1, epochs=2, lr=0.2, run_dir=str(tmp_path / "big"))
    one.fit(data)
    per_epoch = math.ceil(10 / accumulate)
    assert len(steps) == acc.global_step == one.global_step == 2 * per_epoch
    for p, q in zip(acc.model.parameters(), one.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()


def test_one_step_per_window_with_max_steps_and_logging(make_trainer, data, run_dir):
    trainer = make_trainer(batch_size=4, accumulate=3, epochs=3, max_steps=6, log_every=1)
    steps = _count_steps(trainer)
    trainer.fit(data)
    assert len(steps) == trainer.global_step == 6  # 4 per epoch, stopped at 6 in the second epoch
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "samples_per_s" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["epoch"] for r in rows] == [1, 1, 1, 1, 2, 2]  # 1-based, as printed


# ----------------------------------------------------------------------------- clipping and grad norm


def _first_batch_grads(model, data, n):
    x, y = data.tensors
    m = TinyNet()
    m.load_state_dict(model.state_dict())
    F.cross_entropy(m(x[:n]), y[:n]).backward()
    return [p.grad.clone() for p in m.parameters()]


def _total_norm(grads, norm_type):
    if math.isinf(norm_type):
        return max(float(g.abs().max()) for g in grads)
    return float(torch.norm(torch.stack([torch.norm(g, norm_type) for g in grads]), norm_type))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_any_norm_type(make_trainer, data, run_dir, norm_type):
    torch.manual_seed(0)
    model = TinyNet()
    expected = _first_batch_grads(model, data, 8)
    full = _total_norm(expected, norm_type)
    max_norm = full / 4  # makes the first step clip
    trainer = make_trainer(model, clip_grad_norm=max_norm, clip_norm_type=norm_type, shuffle=False, log_every=1)
    seen = []
    trainer.optimizers["default"].register_step_pre_hook(
        lambda opt, *a: seen.append([p.grad.clone() for p in model.parameters()]))
    trainer.fit(data)
    assert _total_norm(seen[0], norm_type) == pytest.approx(max_norm, rel=1e-4)
    for g, e in zip(seen[0], expected):  # the direction is kept
        assert torch.allclose(g, e * max_norm / full, atol=1e-6)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "grad_norm" in r]
    assert rows[0]["step"] == 1 and rows[0]["grad_norm"] == pytest.approx(full, rel=1e-5)  # before clipping


def test_clip_grad_value(make_trainer, data):
    torch.manual_seed(0)
    model = TinyNet()
    expected = _first_batch_grads(model, data, 8)
    trainer = make_trainer(model, clip_grad_value=0.01, shuffle=False)
    seen = []
    trainer.optimizers["default"].register_step_pre_hook(
        lambda opt, *a: seen.append([p.grad.clone() for p in model.parameters()]))
    trainer.fit(data)
    assert all(float(g.abs().max()) <= 0.01 + 1e-9 for grads in seen for g in grads)
    for g, e in zip(seen[0], expected):
        assert torch.allclose(g, e.clamp(-0.01, 0.01))


def test_grad_norm_logged_without_clipping(make_trainer, data, run_dir):
    trainer = make_trainer(log_every=2, epochs=2)
    trainer.fit(data)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "samples_per_s" in r]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    assert all(isinstance(r["grad_norm"], float) and r["grad_norm"] > 0 for r in rows)


# ----------------------------------------------------------------------------- modes and evaluation


class ModeRecorder(TinyNet):
    def __init__(self):
        super().__init__(dropout=0.5)
        self.calls = []

    def forward(self, x):
        self.calls.append((self.training, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return super().forward(x)


def test_train_eval_switching_and_inference_mode(make_trainer, data):
    model = ModeRecorder()
    trainer = make_trainer(model, epochs=2, batch_size=20)  # 2 train + 2 val batches per epoch
    trainer.fit(data, val_data=data)
    train, val = (True, False, True), (False, True, False)
    check = (False, False, False)  # the validation data's check before training: eval mode under no_grad
    assert model.calls == [check] + [train, train, val, val] * 2
    model.calls.clear()
    trainer.evaluate(data)
    trainer.predict(data)
    assert model.calls == [val] * 4
    assert model.training  # evaluate restores the mode it found
    model.eval()
    trainer.evaluate(data)
    assert not model.training


def test_eval_loss_is_a_per_sample_mean(make_trainer):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g)
    y = torch.randint(0, 4, (10,), generator=g)
    x[8:] *= 50  # the short last batch has very different losses
    trainer = make_trainer(eval_batch_size=4, metrics=["accuracy"])
    res = trainer.evaluate(TensorDataset(x, y))
    with torch.no_grad():
        out = trainer.model(x)
    expected = float(F.cross_entropy(out, y))
    per_batch = sum(float(F.cross_entropy(out[i:i + 4], y[i:i + 4])) for i in (0, 4, 8)) / 3
    assert res["loss"] == pytest.approx(expected, rel=1e-6)
    assert abs(expected - per_batch) > 1e-2  # the test would notice a per-batch mean
    assert res["accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()))
    assert list(res) == ["loss", "accuracy"]


def test_custom_eval_step_is_averaged_per_sample(make_trainer):
    x = torch.arange(10, dtype=torch.float32).view(10, 1)
    trainer = make_trainer(nn.Linear(1, 1), eval_batch_size=4,
                           eval_fn=lambda step, batch: {"mean_x": batch[0].mean()})
    assert trainer.evaluate((x,))["mean_x"] == pytest.approx(4.5)


def test_predict_keeps_order_and_activation(make_trainer, data):
    trainer = make_trainer(eval_batch_size=7)
    x = data.tensors[0]
    with torch.no_grad():
        logits = trainer.model(x)
    assert torch.allclose(trainer.predict(x), logits.softmax(1), atol=1e-6)
    assert torch.allclose(trainer.predict(data, activation="none"), logits, atol=1e-6)
    with pytest.raises(ValueError, match="activation 'relu' is not one of auto, softmax, sigmoid, exp, none"):
        trainer.predict(x, activation="relu")


# ----------------------------------------------------------------------------- non-finite loss


def _nan_data(bad_index=13):
    x, y = make_classification()
    x[bad_index] = float("nan")
    return TensorDataset(x, y)


@pytest.mark.parametrize("accumulate,step", [(1, 4), (2, 2)])
def test_non_finite_loss_stops_naming_the_step(make_trainer, run_dir, accumulate, step):
    from torchrig.checkpoint import load_weights, read_checkpoint, resolve

    trainer = make_trainer(batch_size=4, accumulate=accumulate, shuffle=False, checkpoint_every=1)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(_nan_data())  # sample 13 is in micro-batch 4 (1-based)
    msg = str(err.value)
    assert f"loss is not finite at optimizer step {step} (epoch 1, batch 4)" in msg
    assert "the last checkpoint is intact" in msg and "on_nonfinite=skip" in msg
    assert trainer.global_step == step - 1
    latest = resolve("latest", run_dir)
    assert latest.name == f"step-{step - 1:08d}"
    model = TinyNet()
    load_weights(model, latest)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for p, q in zip(model.parameters(), trainer.model.parameters()):
        assert torch.equal(p, q)  # the failed step changed nothing
    state, meta, cfg = read_checkpoint(latest)
    assert state["counters"]["global_step"] == step - 1 and cfg["accumulate"] == accumulate


def test_non_finite_loss_skip_counts(make_trainer, run_dir):
    trainer = make_trainer(batch_size=4, shuffle=False, on_nonfinite="skip", epochs=2, log_every=1)
    trainer.fit(_nan_data())
    assert trainer.skipped_steps == 2  # once per epoch
    assert trainer.global_step == 2 * 10  # every window is a step; skipped_steps says which were not applied
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "skipped_steps" in r]
    assert rows and rows[-1]["skipped_steps"] == 2
    assert [r["skipped_steps"] for r in rows if r["step"] == 4] == [1]


# ----------------------------------------------------------------------------- progress and logs


def test_plain_progress_lines_when_not_a_terminal(make_trainer, data, capsys):
    trainer = make_trainer(progress="auto", log_every=2, epochs=2, metrics=["accuracy", "top3"])
    trainer.fit(data)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("epoch ") and "· batch " in ln]
    assert len(lines) == 5
    assert re.match(r"^epoch 1/2 · step 2 · batch 2/5  train/loss \d+\.\d+  samples_per_s \d+  data_wait \S+  "
                    r"train/accuracy \d\.\d+  train/top3 \d\.\d+  lr 0\.0500  grad_norm \S+$", lines[0]), lines[0]
    assert lines[-1].startswith("epoch 2/2 · step 10 · batch 5/5  ")
    assert re.search(r"^epoch 2/2 · step 10 · epoch end  train/loss \S+  train/accuracy ", err, re.M), err


def test_progress_bar_and_none(make_trainer, data, capsys):
    trainer = make_trainer(progress="bar", log_every=1)
    trainer.fit(data)
    err = capsys.readouterr().err
    assert "epoch 1/1 |" in err and not re.search(r"· batch \d+/5  ", err)
    make_trainer(progress="none", log_every=1, overwrite=True).fit(data)
    assert not re.search(r"· batch \d+/5  ", capsys.readouterr().err)


def test_the_bar_counts_optimizer_steps_as_the_epoch_line_does(make_trainer, data, capsys):
    """5 batches an epoch, 2 a step (as a pipeline's micro-batches are): 3 steps, counted by the bar too."""
    make_trainer(progress="bar", accumulate=2, epochs=2).fit(data)
    err = capsys.readouterr().err
    assert re.search(r"epoch 2/2 \|[^|]*\| 3/3 ", err), err
    assert "epoch 2/2 · step 6" in err and not re.search(r"\| \d+/5 ", err)


def test_metrics_jsonl_rows_are_plain_numbers(make_trainer, data, run_dir, monkeypatch):
    from torchrig.observe.run_logger import RunLogger

    logged = []
    original = RunLogger.log
    monkeypatch.setattr(RunLogger, "log", lambda self, step, values, epoch=None, kind=None: (
        logged.append(dict(values)), original(self, step, values, epoch, kind))[1])
    trainer = make_trainer(log_every=1, epochs=2, metrics=["accuracy"])
    trainer.fit(data, val_data=data)
    assert logged and all(type(v) in (float, int) for row in logged for v in row.values())
    assert all(type(v) in (float, int) for row in trainer.history for v in row.values())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    step_rows = [r for r in rows if "samples_per_s" in r]
    assert len(step_rows) == 10
    for r in step_rows:
        assert {"step", "epoch", "train/loss", "lr", "samples_per_s", "data_wait", "grad_norm",
                "train/accuracy"} <= set(r)
        assert 0 <= r["data_wait"] <= 1 and r["samples_per_s"] > 0
    epoch_rows = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in epoch_rows] == [5, 10]
    assert {"val/accuracy", "train/accuracy", "lr"} <= set(epoch_rows[0])


def test_logged_loss_holds_no_graph(make_trainer, data):
    trainer = make_trainer(log_every=1000)  # values accumulate between log steps
    from torchrig.observe.metrics_logger import MetricsLogger as T

    windows = []
    real = T.record

    def spy(self, out, n, *rest):
        real(self, out, n, *rest)
        windows.append(self)

    T.record, restore = spy, real
    try:
        trainer.fit(data)
    finally:
        T.record = restore
    sums = windows[-1].sums
    assert all(not (isinstance(v, torch.Tensor) and v.requires_grad) for v in sums.values())


def test_tensorboard_event_files(make_trainer, data, run_dir):
    pytest.importorskip("tensorboard")
    make_trainer(tensorboard="auto", log_every=1).fit(data)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_off(make_trainer, data, run_dir):
    make_trainer(tensorboard=False).fit(data)
    assert not (run_dir / "tensorboard").exists()


# ----------------------------------------------------------------------------- the example


def test_public_api_example_works_as_written(tmp_path):
    torch.manual_seed(0)
    x, y = make_classification(n=120, classes=10, seed=1)
    train_data, val_data, test_data = TensorDataset(x[:80], y[:80]), TensorDataset(x[80:100], y[80:100]), \
        TensorDataset(x[100:], y[100:])
    new_data = x[100:]
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 10))

    trainer = torchrig.Trainer(
        model,
        optimizer="adamw",
        lr=3e-4, loss="cross_entropy",
        metrics=["accuracy", "top5"],
        precision="bf16", accumulate=4, clip_grad_norm=1.0,
        scheduler="cosine", epochs=3, run_dir=str(tmp_path / "exp1"),
    )
    trainer.fit(train_data, val_data=val_data)
    results = trainer.evaluate(test_data)
    assert set(results) == {"loss", "accuracy", "top5"} and all(isinstance(v, float) for v in results.values())
    probs = trainer.predict(new_data)
    assert probs.shape == (20, 10) and torch.allclose(probs.sum(1), torch.ones(20), atol=1e-3)

    run = tmp_path / "exp1"
    assert isinstance(trainer.optimizers["default"], torch.optim.AdamW)
    assert (run / "checkpoints" / "latest" / "model.safetensors").exists()
    assert (run / "checkpoints" / "best").exists()
    assert trainer.plots == [run / "plots" / "curves.png"]  # drawn before fit returned (log.plot=true)
    assert trainer.plots[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # log.tensorboard=auto: event files exactly when TensorBoard is installed
    has_tensorboard = importlib.util.find_spec("tensorboard") is not None
    assert bool(list((run / "tensorboard").glob("events.out.tfevents.*"))) is has_tensorboard
    # plain PyTorch out: the weights load into the bare model
    fresh = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(load_file(run / "checkpoints" / "latest" / "model.safetensors"))
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- a custom step: GAN


def test_gan_custom_step_with_two_optimizers(tmp_path):
    from torchrig.checkpoint import read_checkpoint, resolve

    real = torch.randn(48, 8) * 0.5 + 2
    models = gan_models()
    trainer = torchrig.Trainer(models, optimizer={"G": "adam", "D": "sgd"}, lr=1e-3, step_fn=gan_step,
                               accumulate=2, clip_grad_norm=5.0, checkpoint_every=2, epochs=2, batch_size=8,
                               log_every=1, run_dir=str(tmp_path / "gan"), **QUIET)
    counts = {k: [] for k in trainer.optimizers}
    for k, opt in trainer.optimizers.items():
        opt.register_step_post_hook(lambda *a, k=k: counts[k].append(1))
    before = {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()}
    trainer.fit(real)
    assert trainer.global_step == 6 and len(counts["G"]) == len(counts["D"]) == 6  # 6 micro-batches / 2
    assert isinstance(trainer.optimizers["G"], torch.optim.Adam) and isinstance(trainer.optimizers["D"], torch.optim.SGD)
    for k, m in models.items():
        assert all(not torch.equal(a, b) for a, b in zip(before[k], m.parameters()))
    rows = [r for r in read_jsonl(tmp_path / "gan" / "metrics.jsonl") if "samples_per_s" in r]
    assert {"train/loss_d", "train/loss_g", "grad_norm", "lr"} <= set(rows[0])
    state, meta, _ = read_checkpoint(resolve("latest", tmp_path / "gan"))
    assert set(state["optimizers"]) == {"G", "D"} and meta["step"] == 6
    weights = load_file(resolve("latest", tmp_path / "gan") / "model.safetensors")
    assert {k.split(".")[0] for k in weights} == {"G", "D"}


# ----------------------------------------------------------------------------- stopping


def test_max_steps_writes_a_final_checkpoint(make_trainer, data, run_dir):
    import json

    trainer = make_trainer(epochs=5, max_steps=7)
    trainer.fit(data)
    assert trainer.global_step == 7
    meta = json.loads((run_dir / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["step"] == 7 and meta["final"] is True and (meta["epoch"], meta["batch_in_epoch"]) == (1, 2)


def test_early_stop(make_trainer, data, capsys):
    # validation scores by epoch: 2 improves on 1; 3 only ties (not an improvement) and 4 is worse -> 2 bad epochs
    scores = iter([0.5, 0.6, 0.6, 0.55, 0.9, 0.95])
    trainer = make_trainer(epochs=10, early_stop_patience=2, monitor="val/score", monitor_mode="max",
                           eval_batch_size=40, eval_fn=lambda step, batch: {"score": next(scores)})
    trainer.fit(data, val_data=data)
    assert [(h["epoch"], h["val/score"]) for h in trainer.history] == [(1, 0.5), (2, 0.6), (3, 0.6), (4, 0.55)]
    assert trainer.global_step == 4 * 5
    assert trainer.monitor.best == 0.6
    assert "torchrig: early stop after epoch 4 (val/score did not improve for 2 epochs)" in capsys.readouterr().err


def test_eval_every_epochs(make_trainer, data, run_dir):
    evaluated_at = []

    class Seen:
        def on_eval_end(self, trainer, metrics):
            evaluated_at.append(trainer.global_step)

    trainer = make_trainer(epochs=5, eval_every_epochs=2, metrics=["accuracy"], callbacks=[Seen()])
    last = trainer.fit(data, val_data=data)
    assert evaluated_at == [10, 20]  # after epochs 2 and 4 (5 steps per epoch)
    assert [sorted(k for k in h if k.startswith("val/")) for h in trainer.history] == \
        [[], ["val/accuracy", "val/loss"], [], ["val/accuracy", "val/loss"], []]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val/loss" in r] == [10, 20]
    assert last == {k: v for k, v in trainer.history[3].items() if k.startswith("val/")}  # the last validation


def test_early_stop_counts_validated_epochs_only(make_trainer, data, capsys):
    scores = iter([0.5, 0.4, 0.9])
    trainer = make_trainer(epochs=10, eval_every_epochs=2, early_stop_patience=1, monitor="val/score",
                           monitor_mode="max", eval_batch_size=40, eval_fn=lambda step, batch: {"score": next(scores)})
    trainer.fit(data, val_data=data)
    assert [h["epoch"] for h in trainer.history] == [1, 2, 3, 4]  # epochs 1 and 3 ran no validation: no verdict
    assert "torchrig: early stop after epoch 4 (val/score did not improve for 1 epochs)" in capsys.readouterr().err


def test_fit_twice_trains_as_long_again(make_trainer, data, run_dir):
    trainer = make_trainer(epochs=2, scheduler="cosine", lr=0.1)
    trainer.fit(data)
    assert trainer.global_step == 10
    trainer.fit(data)
    assert trainer.global_step == 20
    assert trainer.optimizers["default"].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert (run_dir / "checkpoints" / "step-00000020").is_dir()


def test_gan_skipped_window_counts_once(tmp_path):
    real = torch.randn(48, 8) * 0.5 + 2
    real[5] = float("nan")
    trainer = torchrig.Trainer(gan_models(), optimizer={"G": "adam", "D": "adam"}, step_fn=gan_step,
                               on_nonfinite="skip", epochs=2, batch_size=8, run_dir=str(tmp_path), **QUIET)
    trainer.fit(real)
    assert trainer.skipped_steps == 2 and trainer.global_step == 12  # one window per epoch, two optimizers


# ----------------------------------------------------------------------------- fp16: the GradScaler path, on CPU




def test_fp16_overflow_skips_the_step_counts_it_and_halves_the_scale(make_trainer, data, run_dir, monkeypatch):
    from torchrig.checkpoint import read_checkpoint, resolve

    monkeypatch.setattr(torchrig.runtime, "make_precision", lambda name, device: fp16_precision(2.0 ** 12))
    calls = []

    class InfGradAtThirdBatch(TinyNet):
        def forward(self, x):
            out = super().forward(x)
            calls.append(1)
            if len(calls) == 3:  # a finite loss whose gradient overflows, as fp16 gradients do
                out.register_hook(lambda g: g * float("inf"))
            return out

    torch.manual_seed(0)
    trainer = make_trainer(InfGradAtThirdBatch(), batch_size=4, shuffle=False, log_every=1)
    assert trainer.precision.scaler is not None and trainer.precision.dtype is torch.float16
    params = []  # the parameters after each real optimizer step
    trainer.optimizers["default"].register_step_post_hook(
        lambda *a: params.append([p.detach().clone() for p in trainer.model.parameters()]))
    calls_at_step = []  # forward calls made when each optimizer.step ran
    trainer.optimizers["default"].register_step_pre_hook(
        lambda *a: calls_at_step.append(len(calls)))
    trainer.fit(data)  # on_nonfinite=error: an fp16 overflow is the scaler's business, not an error
    assert len(calls) == 10 and len(params) == 9  # 10 windows, the third never reached optimizer.step
    assert 3 not in calls_at_step
    assert trainer.skipped_steps == 1
    assert trainer.global_step == 10  # a skipped window is a step (and a scheduler step), not an update
    assert trainer.precision.scaler.get_scale() == 2.0 ** 11  # backed off once (growth needs 1000 good steps)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "samples_per_s" in r]
    assert [r.get("skipped_steps", 0) for r in rows] == [0, 0] + [1] * 8  # a row per window
    state, _, _ = read_checkpoint(resolve("latest", run_dir))
    assert state["scaler"]["scale"] == 2.0 ** 11  # the scale is checkpointed for an exact resume


def test_fp16_gradients_are_unscaled_before_clipping():
    from torchrig.runtime.precision import Precision
    from torchrig.trainer.step import Step, StepOptions

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    step = Step(model, {"default": opt}, None, Precision("fp16", torch.device("cpu"), None, scaler),
                torch.device("cpu"), StepOptions(clip_grad_norm=1.0))
    step.begin_window(1)
    step.backward(model(torch.tensor([[3.0, 4.0]])).sum())  # gradient (3, 4): norm 5, scaled by 1024
    assert torch.equal(model.weight.grad, torch.tensor([[3.0 * 1024, 4.0 * 1024]]))
    assert step.optimizer_step() and step.end_window()
    assert float(step.grad_norm) == pytest.approx(5.0)  # measured on the unscaled gradient
    # clipped to norm 1 -> (0.6, 0.8), then one SGD step at lr 1
    assert torch.allclose(model.weight.detach(), torch.tensor([[0.4, 1.2]]), atol=1e-6)
    assert scaler.get_scale() == 2.0 ** 10 and step.state.skipped_steps == 0


# ----------------------------------------------------------------------------- validation data checked before training


def test_validation_data_that_does_not_fit_the_model_fails_before_the_first_step(make_trainer, data, run_dir):
    from torchrig.data.batches import BatchError

    trainer = make_trainer(epochs=2)
    wrong = TensorDataset(torch.randn(10, 5), torch.randint(0, 3, (10,)))  # TinyNet takes 4 features
    with pytest.raises(BatchError) as err:
        trainer.fit(data, val_data=wrong)
    assert str(err.value).startswith("checking the validation data before training: the model's forward failed on "
                                     "a batch of inputs float32 (2, 5): ")
    assert trainer.global_step == 0 and not (run_dir / "checkpoints").exists()


def test_the_validation_check_leaves_every_random_generator_as_it_was(make_trainer, data, tmp_path):
    """The check reads samples of an augmenting data set (torch, Python and NumPy draws): the generators at the
    first step are those of a fit without validation data, so a resumed run draws what an unbroken one does."""
    import random

    import numpy as np
    from helpers import AugmentedDataset

    x, y = make_classification(n=10)

    def generators_at_start(val_data, where):
        seen = {}

        class Look:
            def on_fit_start(self, trainer):
                seen.update(torch=torch.get_rng_state(), python=random.getstate(), numpy=np.random.get_state()[1])

        make_trainer(epochs=1, callbacks=[Look()], run_dir=str(tmp_path / where)).fit(data, val_data=val_data)
        return seen

    plain, checked = generators_at_start(None, "plain"), generators_at_start(AugmentedDataset(x, y), "checked")
    assert torch.equal(plain["torch"], checked["torch"]) and plain["python"] == checked["python"]
    assert np.array_equal(plain["numpy"], checked["numpy"])
