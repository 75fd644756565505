"""The plain step (``trainer/plain.py``) against the general step: the same run both ways, bitwise.

Each test trains twice from the same seed: once as torchrig does (ordinary batches of a plain run
take ``PlainStep``) and once with ``PlainStep`` turned off (every batch through the general step).
Weights, optimizer state, metric states, every logged row and the checkpoint's train state must be
equal; a counter shows that the plain step really ran, so the comparison is not vacuous.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import QUIET, TinyNet, make_classification, read_jsonl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.trainer import plain as P
from torchrig.trainer.step import NonFiniteLossError

_FOR_TRAINER = P.PlainStep.for_trainer.__func__  # before any test wraps it
TIMING = ("samples_per_s", "data_wait", "time", "elapsed_s", "steps_per_s")


class _Counted:
    """PlainStep with a count of the batches it took."""

    taken = 0

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, batch, epoch, index):
        out = self.inner(batch, epoch, index)
        if out is not P.GENERAL:
            _Counted.taken += 1
        return out


def _fit(tmp_path, name, plain: bool, monkeypatch, data=None, model=None, **kw):
    monkeypatch.setattr(P.PlainStep, "for_trainer", classmethod(
        lambda cls, t: (_Counted(p) if (p := _FOR_TRAINER(cls, t)) is not None else None) if plain else None))
    _Counted.taken = 0
    torch.manual_seed(0)
    model = model() if model is not None else TinyNet(dropout=0.1)  # a factory: the same weights each run
    x, y = make_classification(n=90)  # 90 = 5 full batches of 16 and a short one
    options = dict(epochs=3, batch_size=16, seed=3, lr=0.05, num_workers=0, log_every=4,
                   metrics=["accuracy", "f1"], run_dir=str(tmp_path / name), **QUIET)
    options.update(kw)
    trainer = _fit.last = torchrig.Trainer(model, "adamw", **options)  # last: for a run that raises
    trainer.fit(data if data is not None else TensorDataset(x, y))
    return trainer, _Counted.taken


def _rows(trainer) -> list:
    rows = read_jsonl(trainer.run_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _same(a, b) -> None:
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), f"{name} differs"
    sa, sb = a.step.optimizer.state_dict()["state"], b.step.optimizer.state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key])), f"optimizer {k}.{key}"
    for m, n in zip(a.train_metrics, b.train_metrics):
        assert m.states.keys() == n.states.keys()
        assert all(torch.equal(m.states[k], n.states[k]) for k in m.states), m.name
    assert _rows(a) == _rows(b)
    assert (a.global_step, a.state.skipped_steps) == (b.global_step, b.state.skipped_steps)


@pytest.mark.parametrize("fast_path", [True, False])
def test_plain_equals_general_bitwise(tmp_path, monkeypatch, fast_path):
    a, taken = _fit(tmp_path, "plain", True, monkeypatch, fast_path=fast_path, scheduler="cosine")
    b, none = _fit(tmp_path, "general", False, monkeypatch, fast_path=fast_path, scheduler="cosine")
    # 6 batches × 3 epochs (the last of each short), log steps included
    assert a.global_step == 18 and none == 0 and taken == 18
    _same(a, b)


def test_plain_equals_general_on_a_dataloader_of_tuples_and_regression(tmp_path, monkeypatch):
    x = torch.randn(64, 8)
    y = x[:, :1] * 2 - x[:, 1:2]
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))  # noqa: E731
    kw = dict(loss="mse", metrics=[], log_every=3)
    a, taken = _fit(tmp_path, "plain", True, monkeypatch, data=data, model=model, **kw)
    b, _ = _fit(tmp_path, "general", False, monkeypatch, data=data, model=model, **kw)
    assert taken > 0
    _same(a, b)


def test_resume_mid_epoch_from_a_plain_run_equals_an_unbroken_one(tmp_path, monkeypatch):
    full, _ = _fit(tmp_path, "full", True, monkeypatch, checkpoint={"every_steps": 7, "keep_last": 5})
    part, _ = _fit(tmp_path, "part", True, monkeypatch, max_steps=7, checkpoint={"every_steps": 7})
    resumed, taken = _fit(tmp_path, "part", True, monkeypatch, resume="latest", checkpoint={"every_steps": 7})
    assert taken > 0 and resumed.global_step == full.global_step
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


class _NaNAt(nn.Module):
    """TinyNet whose output (so its loss) or whose gradients become NaN on one call."""

    def __init__(self, at: int, where: str):
        super().__init__()
        self.net, self.at, self.where, self.calls = TinyNet(), at, where, 0

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        if self.calls == self.at:
            if self.where == "loss":
                return out * math.nan
            out.register_hook(lambda g: g * math.inf)  # finite loss, infinite gradients
        return out


@pytest.mark.parametrize("at", [3, 4])  # step 4 is a log step: the gradient norm carries the check
@pytest.mark.parametrize("where, message", [("loss", "loss is not finite at optimizer step {}"),
                                            ("grads", "gradients are not finite (the loss is) at optimizer step {}")])
def test_non_finite_error_names_the_step_as_the_general_step_does(tmp_path, monkeypatch, where, message, at):
    states = []
    for plain in (True, False):
        with pytest.raises(NonFiniteLossError, match=re.escape(message.format(at))):
            _fit(tmp_path, f"{where}{plain}", plain, monkeypatch, model=lambda: _NaNAt(at, where))
        states.append([{k: v.tolist() for k, v in m.states.items()} for m in _fit.last.train_metrics])
    assert states[0] == states[1]  # both counted the failing batch before raising


@pytest.mark.parametrize("at", [2, 4])
@pytest.mark.parametrize("where", ["loss", "grads"])
def test_non_finite_skip_is_counted_as_the_general_step_does(tmp_path, monkeypatch, where, at):
    a, taken = _fit(tmp_path, "plain", True, monkeypatch, model=lambda: _NaNAt(at, where), on_nonfinite="skip")
    b, _ = _fit(tmp_path, "general", False, monkeypatch, model=lambda: _NaNAt(at, where), on_nonfinite="skip")
    assert taken > 0 and a.state.skipped_steps == 1
    _same(a, b)


@pytest.mark.parametrize("options", [dict(accumulate=2), dict(clip_grad_norm=1.0), dict(precision="bf16"),
                                     dict(micro_batch_size=8), dict(loss_normalization="tokens")])
def test_runs_that_need_the_general_step_never_take_the_plain_one(tmp_path, monkeypatch, options):
    _, taken = _fit(tmp_path, "run", True, monkeypatch, **options)
    assert taken == 0


def test_a_custom_step_function_or_a_flop_count_takes_the_general_step(tmp_path, monkeypatch):
    calls = []

    def my_step(step, batch):
        calls.append(1)
        from torchrig.trainer.step import default_step
        return default_step(step, batch)

    model = TinyNet()
    monkeypatch.setattr(P.PlainStep, "for_trainer", classmethod(lambda cls, t: _Counted(_FOR_TRAINER(cls, t))))
    _Counted.taken = 0
    x, y = make_classification(n=64)
    trainer = torchrig.Trainer(model, "sgd", lr=0.1, epochs=1, batch_size=16, step_fn=my_step,
                               run_dir=str(tmp_path / "custom"), **QUIET)
    trainer.fit(TensorDataset(x, y))
    assert len(calls) == 4 and _Counted.taken == 0
    # log.flops counts the first step through the wrapped step function, then the plain step goes on
    _, taken = _fit(tmp_path, "flops", True, monkeypatch, flops=True, log_every=100)
    assert taken == 18 - 1


def test_callbacks_see_where_the_loop_is(tmp_path, monkeypatch):
    seen = []

    class Where:
        def on_step_end(self, trainer, values):
            seen.append((trainer.step.epoch, trainer.step.batch_index, trainer.global_step, float(values["loss"])))

    a, taken = _fit(tmp_path, "plain", True, monkeypatch, callbacks=[Where()])
    b_seen, seen[:] = list(seen), []
    b, _ = _fit(tmp_path, "general", False, monkeypatch, callbacks=[Where()])
    assert taken > 0 and b_seen == seen and len(seen) == 18


def test_skip_with_batchnorm_keeps_the_general_step(tmp_path, monkeypatch):
    """A skipped window restores running statistics from a copy only the general step takes."""
    bn = lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))  # noqa: E731
    _, taken = _fit(tmp_path, "skip", True, monkeypatch, model=bn, on_nonfinite="skip")
    assert taken == 0
    _, taken = _fit(tmp_path, "error", True, monkeypatch, model=bn)
    assert taken > 0


def test_a_step_function_that_returns_nothing_still_ends_steps(tmp_path):
    """The loop's after-step work (hooks, log rows, checkpoints, max_steps) runs for a step_fn returning None."""
    from torchrig.trainer.step import default_step

    ends = []

    class Count:
        def on_step_end(self, trainer, values):
            ends.append(values)

    x, y = make_classification(n=64)
    trainer = torchrig.Trainer(TinyNet(), "sgd", lr=0.1, epochs=3, batch_size=16, max_steps=6, log_every=2,
                               step_fn=lambda step, batch: default_step(step, batch) and None, callbacks=[Count()],
                               checkpoint_every=3, keep_last=5, run_dir=str(tmp_path), **QUIET)
    trainer.fit(TensorDataset(x, y))
    assert trainer.global_step == 6 and ends == [{}] * 6
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("kind") == "interval"] == [2, 4, 6]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000003", "step-00000004", "step-00000006"]  # every 3 steps, and the end of epoch 1


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = TinyNet()

    def forward(self, x):
        return {"logits": self.net(x), "features": x.sum(dim=1)}


class _TupleOut(_DictOut):
    def forward(self, x):
        out = super().forward(x)
        return out["logits"], out["features"]


class _Frozen(nn.Module):
    """A frozen first layer (no gradients) and an unused parameter (its gradient stays None)."""

    def __init__(self):
        super().__init__()
        self.net, self.unused = TinyNet(), nn.Parameter(torch.zeros(3))
        self.net.backbone.requires_grad_(False)

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("model, options", [
    (_DictOut, dict(output_key="logits")),
    (_TupleOut, {}),
    (_Frozen, {}),
    (TinyNet, dict(loss=nn.CrossEntropyLoss(label_smoothing=0.1))),
    (TinyNet, dict(loss_normalization="micro_batches")),
])
def test_plain_equals_general_for_other_outputs_and_losses(tmp_path, monkeypatch, model, options):
    a, taken = _fit(tmp_path, "plain", True, monkeypatch, model=model, **options)
    b, _ = _fit(tmp_path, "general", False, monkeypatch, model=model, **options)
    assert taken > 0
    _same(a, b)
