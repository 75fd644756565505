"""The GPU paths of the step, run on the CPU with stand-ins, so that a GPU defect fails here first.

A fused optimizer runs on the CPU too; ``step.host_checks = False`` makes the step decide a non-finite
window on the device (the fused kernel's ``found_inf``), as it does on a GPU; ``GradScaler("cpu")`` stands
in for fp16's scaler; a dirty ``empty_like`` stands in for the uninitialised memory a GPU hands out.
"""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET, TinyNet, fp16_precision, make_classification, read_jsonl
from torch.utils.data import TensorDataset

import torchrig


class DeviceDecides:
    """Turns the host checks off, as on a GPU: a non-finite window is dropped by the fused kernel."""

    def on_fit_start(self, trainer):
        trainer.step.host_checks = trainer.metrics_log.host = False


class Record:
    """The learning rate, the EMA's first tensor and whether the weights changed, at every ``on_step_end``."""

    def __init__(self):
        self.rows = []
        self._last = None

    def on_fit_start(self, trainer):
        self._last = [p.detach().clone() for p in trainer.model.parameters()]

    def on_step_end(self, trainer, values):
        params = [p.detach().clone() for p in trainer.model.parameters()]
        changed = any(not torch.equal(a, b) for a, b in zip(params, self._last))
        self._last = params
        ema = trainer.ema.shadow[0].clone() if trainer.ema is not None and trainer.ema.shadow else None
        self.rows.append((trainer.global_step, trainer.optimizers["default"].param_groups[0]["lr"], changed, ema))


def _nan_window_data(n=93, bad=(17,)):
    x, y = make_classification(n)
    for i in bad:
        x[i] = float("nan")
    return TensorDataset(x, y)


def _run(tmp_path, name, optimizer, on_device: bool, bad=(17,), **kw):
    torch.manual_seed(0)
    model = TinyNet()
    record = Record()
    callbacks = [record] + ([DeviceDecides()] if on_device else [])
    opts = dict(QUIET, run_dir=str(tmp_path / name), batch_size=8, epochs=2, num_workers=0, shuffle=False,
                on_nonfinite="skip", ema_decay=0.9, scheduler="cosine", log_every=3, callbacks=callbacks,
                checkpoint={"every_epochs": 0, "save_final": False})
    opts.update(kw)
    trainer = torchrig.Trainer(model, optimizer, **opts)
    trainer.fit(_nan_window_data(bad=bad))
    return trainer, record


def _fused_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, fused=True)


@pytest.mark.parametrize("optimizer", [_fused_sgd, _fused_adamw], ids=["sgd", "adamw"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_skipped_window_counts_alike_on_the_host_and_on_the_device(tmp_path, optimizer, accumulate):
    """One rule: a window is a step (counter, scheduler, on_step_end), a skipped one changes neither the
    weights nor the EMA, and ``skipped_steps`` counts it; whether the host or the device decided."""
    host, h = _run(tmp_path, "host", optimizer, on_device=False, accumulate=accumulate)
    dev, d = _run(tmp_path, "device", optimizer, on_device=True, accumulate=accumulate)
    windows = 2 * -(-(-(-93 // 8)) // accumulate)
    assert host.global_step == dev.global_step == windows
    assert host.skipped_steps == dev.skipped_steps == 2  # sample 17 in both epochs
    assert len(h.rows) == len(d.rows) == windows
    skipped = [k for k, (_, _, changed, _) in enumerate(h.rows) if not changed]
    assert len(skipped) == 2 and skipped == [k for k, (_, _, changed, _) in enumerate(d.rows) if not changed]
    for (s1, lr1, _, e1), (s2, lr2, _, e2) in zip(h.rows, d.rows):
        assert s1 == s2 and lr1 == lr2
        assert torch.equal(e1, e2)
    for k in skipped:  # the EMA stood still on the skipped window, in both
        if k == 0:
            continue
        assert torch.equal(h.rows[k][3], h.rows[k - 1][3]) and torch.equal(d.rows[k][3], d.rows[k - 1][3])
    for a, b in zip(host.model.parameters(), dev.model.parameters()):
        assert torch.equal(a, b)
    assert host.ema.num_updates == dev.ema.num_updates == windows
    rows_h = [r["skipped_steps"] for r in read_jsonl(host.run_dir / "metrics.jsonl") if "skipped_steps" in r]
    rows_d = [r["skipped_steps"] for r in read_jsonl(dev.run_dir / "metrics.jsonl") if "skipped_steps" in r]
    assert rows_h == rows_d and rows_h[-1] == 2


def test_fused_sgd_momentum_after_a_skipped_first_window(tmp_path, monkeypatch):
    """PyTorch's fused SGD makes its momentum buffers with ``empty_like`` and keeps them when its first step
    is skipped on the device: the next step would read garbage. Primed with zeros, the run equals one whose
    first window was dropped on the host (the fused kernel never ran)."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *a, **k: real(t, *a, **k).fill_(123.0))  # dirty memory
    first = dict(bad=(3,), ema_decay=None, scheduler=None, epochs=1)  # sample 3: the first window
    ref, _ = _run(tmp_path, "host", _fused_sgd, on_device=False, **first)
    dev, _ = _run(tmp_path, "device", _fused_sgd, on_device=True, **first)
    assert ref.skipped_steps == dev.skipped_steps == 1
    for a, b in zip(ref.model.parameters(), dev.model.parameters()):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in dev.model.parameters())


def test_fp16_skip_is_read_from_the_scaler_not_from_get_scale(tmp_path, monkeypatch):
    """fp16: whether GradScaler skipped a window is taken from its own record, on the device; ``get_scale``
    (a host read of the scale before and after ``update``) is never called by the step."""
    monkeypatch.setattr(torchrig.runtime, "make_precision", lambda name, device: fp16_precision(2.0 ** 12))
    calls = []
    original = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: calls.append(1) or original(self))
    trainer, rec = _run(tmp_path, "fp16", _fused_adamw, on_device=True, precision="fp16", epochs=1)
    assert calls == []
    assert trainer.skipped_steps == 1 and trainer.global_step == 12
    assert sum(not changed for _, _, changed, _ in rec.rows) == 1
