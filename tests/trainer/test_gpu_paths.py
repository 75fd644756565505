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
import torchrig.runtime


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


class ViewAfterConv(torch.nn.Module):
    """A convolution, then ``.view`` to flatten: fine in the default layout, an error with channels_last."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        h = self.drop(self.bn(self.conv(x)))
        return self.head(h.view(h.size(0), -1))


def _images(n=37):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _fit_images(tmp_path, name, **kw):
    torch.manual_seed(0)
    model = ViewAfterConv()
    t = torchrig.Trainer(model, "sgd", run_dir=str(tmp_path / name), batch_size=8, epochs=2, num_workers=0,
                         **QUIET, **kw)
    t.fit(_images())
    return t, model


def test_channels_last_auto_falls_back_for_a_view_after_a_convolution(tmp_path, monkeypatch, capsys):
    """``auto`` turns channels_last on for a conv model on a GPU; one whose forward flattens with ``.view`` gets
    the default layout back with one line, and trains exactly as with channels_last=false (the probe forward
    leaves the random generators, BatchNorm's statistics and the weights as they were)."""
    _, want = _fit_images(tmp_path, "off", channels_last=False)
    monkeypatch.setattr(torchrig.runtime, "wants_channels_last", lambda model, setting, device: True)  # as on CUDA
    _, got = _fit_images(tmp_path, "auto")
    err = capsys.readouterr().err
    assert "torchrig: model.channels_last=auto turned off: ViewAfterConv's forward needs the default memory format" in err
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), k
    assert got.conv.weight.is_contiguous()


def test_channels_last_true_with_a_view_after_a_convolution_is_one_line(tmp_path):
    with pytest.raises(torchrig.config.ConfigError, match=r"^config key 'model.channels_last': ViewAfterConv's "
                                                          r"forward fails with channels_last weights \(view size"):
        _fit_images(tmp_path, "on", channels_last=True)


class OOMInFirstStep(torch.optim.AdamW):
    """Fused AdamW whose first ``step`` runs out of memory, as Adam's first step does when it allocates its state
    on a full GPU; GradScaler has set its inputs (and, after clipping, unscaled) by then."""

    raised = 0

    def step(self, *args, **kwargs):
        if not OOMInFirstStep.raised:
            OOMInFirstStep.raised += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return super().step(*args, **kwargs)


def test_fp16_auto_micro_batch_recovers_from_an_oom_inside_optimizer_step(tmp_path, monkeypatch, capsys):
    """The retry after an out-of-memory error in ``optimizer.step`` starts from a clean GradScaler: before, it
    raised "unscale_() has already been called", or stepped with the stale scale of the failed attempt."""
    monkeypatch.setattr(torchrig.runtime, "make_precision", lambda name, device: fp16_precision(2.0 ** 8))

    def fit(name, size, opt_cls):
        OOMInFirstStep.raised = 0
        torch.manual_seed(0)
        model = TinyNet()
        t = torchrig.Trainer(model, lambda p: opt_cls(p, lr=0.01, fused=True), run_dir=str(tmp_path / name),
                             precision="fp16", batch_size=8, epochs=1, num_workers=0, shuffle=False,
                             clip_grad_norm=1.0, **{"data.micro_batch_size": size}, **QUIET)
        t.fit(TensorDataset(*make_classification(37)))
        return t, model

    auto, got = fit("auto", "auto", OOMInFirstStep)
    assert OOMInFirstStep.raised == 1 and auto.windows.micro_batch_size == 4
    assert "torchrig: out of memory at micro-batch 8; now 4" in capsys.readouterr().err
    _, want = fit("fixed", 4, torch.optim.AdamW)
    for a, b in zip(want.parameters(), got.parameters()):
        assert torch.equal(a, b)


def test_a_batch_encoding_moves_to_the_device_and_trains(tmp_path):
    """Hugging Face's tokenizers and collators return a ``BatchEncoding`` (a ``UserDict``, not a dict)."""
    from collections import UserDict

    from torchrig.data import to_device

    class BatchEncoding(UserDict):
        pass

    batch = BatchEncoding(x=torch.ones(2, 3), labels=torch.zeros(2, dtype=torch.long))
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["labels"].device.type == "meta"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x)

    x, y = make_classification(24)
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    collate = lambda items: BatchEncoding(x=torch.stack([r["x"] for r in items]),  # noqa: E731
                                          labels=torch.stack([r["labels"] for r in items]))
    loader = torch.utils.data.DataLoader(rows, batch_size=8, collate_fn=collate)
    t = torchrig.Trainer(Model(), "sgd", run_dir=str(tmp_path / "run"), epochs=1, num_workers=0, **QUIET)
    t.fit(loader)
    assert t.global_step == 3


def test_data_parallel_keeps_the_runs_device_first(monkeypatch):
    """``strategy=dp`` on ``cuda:1``: DataParallel gathers on, and keeps the model on, ``device_ids[0]``."""
    from torchrig.parallel import wrap

    made = {}

    class FakeDP(torch.nn.Module):
        def __init__(self, module, device_ids=None, output_device=None):
            super().__init__()
            made.update(device_ids=device_ids, output_device=output_device)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(wrap.nn, "DataParallel", FakeDP)
    with pytest.warns(UserWarning, match="strategy 'dp'"):
        wrap.wrap_model(torch.nn.Linear(2, 2), "dp", torch.device("cuda", 1))
    assert made == {"device_ids": [1, 0, 2], "output_device": 1}


def test_a_gpu_run_pairs_nccl_with_gloo_for_cpu_tensors(monkeypatch):
    """CPU tensors (FSDP2's offloaded gradients, the flags ranks agree on) need gloo beside NCCL."""
    from torchrig.runtime import dist as D

    monkeypatch.setattr(D.dist, "is_nccl_available", lambda: True)
    assert D.default_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert D.default_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(D, "is_initialized", lambda: True)
    for backend, host in (("cpu:gloo,cuda:nccl", True), ("nccl", False), ("gloo", True)):
        monkeypatch.setattr(D.dist, "get_backend", lambda group=None, b=backend: b)
        assert D.host_collectives() is host


def test_averaging_gradients_takes_buckets_not_a_gradient_sized_buffer():
    from torchrig.parallel import buckets as bucketed

    tensors = [torch.zeros(1000) for _ in range(10)] + [torch.zeros(10, dtype=torch.float64)]
    buckets = bucketed(tensors, limit=4 * 2500)  # 2,500 floats a bucket
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2, 1]
    assert all(len({t.dtype for t in b}) == 1 for b in buckets)
    assert sum(len(b) for b in buckets) == len(tensors)


def test_the_channels_last_probe_never_calls_the_compiled_model(tmp_path, monkeypatch):
    """The probe forward (one row, eval mode) goes to the bare module: through ``torch.compile`` it compiled a
    second graph, and made the batch size dynamic (slower kernels) for the rest of the run."""
    import torch._dynamo

    torch._dynamo.reset()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, backend="eager"))  # traces, no codegen
    monkeypatch.setattr(torchrig.runtime, "wants_channels_last", lambda model, setting, device: True)  # as on CUDA
    torch._dynamo.utils.counters.clear()
    probed = []
    real_probe = torchrig.runtime.channels_last_breaks
    monkeypatch.setattr(torchrig.runtime, "channels_last_breaks",
                        lambda model, forward, device: probed.append(model) or real_probe(model, forward, device))

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.head = torch.nn.Linear(4 * 4 * 4, 3)

        def forward(self, x):
            return self.head(self.conv(x).flatten(1))

    torch.manual_seed(0)
    t = torchrig.Trainer(Conv(), "sgd", run_dir=str(tmp_path / "run"), batch_size=8, epochs=1, num_workers=0,
                         compile=True, **QUIET)
    t.fit(_images(32))
    assert [type(m).__name__ for m in probed] == ["Conv"]  # the probe ran, on the bare module
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the compiled model: one graph, batch 8
    torch._dynamo.reset()
