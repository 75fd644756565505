"""``model.fused_head``: the vocabulary head and its cross-entropy computed together in chunks, never the whole logits;
equal to the plain head and loss (loss and gradients within 1e-5), through the Trainer too; refusals in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers import QUIET
from torchrig.optim import fused_head as fh

VOCAB, DIM, SEQ = 37, 8, 6


def _inputs(rows=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, rows // 2, DIM, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=g, requires_grad=True)
    bias = torch.randn(VOCAB, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (2, rows // 2), generator=g)
    target[0, 1] = target[1, 3] = -100
    return hidden, weight, bias, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("rows", [1, 3, 10, 64])
def test_chunks_equal_the_plain_loss_and_gradients(smoothing, rows):
    hidden, weight, bias, target = _inputs()
    plain = F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, VOCAB), target.reshape(-1),
                            label_smoothing=smoothing)
    want = torch.autograd.grad(plain, (hidden, weight, bias))
    fused = fh.chunked_cross_entropy(hidden, weight, bias, target, label_smoothing=smoothing, rows=rows)
    got = torch.autograd.grad(fused, (hidden, weight, bias))
    assert abs(float(fused.detach() - plain.detach())) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-6


def test_chunks_keep_no_logits_for_backward():
    """What autograd keeps for backward: the plain loss keeps the log-probabilities of every position (the logits'
    size); the chunks keep their inputs only."""
    hidden, weight, bias, target = _inputs(rows=40)

    def largest_saved(fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn()
        return max(sizes)

    plain = largest_saved(lambda: F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, VOCAB),
                                                  target.reshape(-1)))
    chunked = largest_saved(lambda: fh.chunked_cross_entropy(hidden, weight, bias, target, rows=4))
    assert plain == 40 * VOCAB and chunked == VOCAB * DIM  # the weight itself, no logits


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB)
        self.logits_made = 0  # training forwards whose head made the whole logits

    def forward(self, ids):
        out = self.head(self.body(self.embed(ids)))
        self.logits_made += int(out.shape[-1] == VOCAB and torch.is_grad_enabled())
        return out


def tokens(n=22) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(ids, labels)


def _fit(tmp_path, name, **extra):
    import torchrig

    model = TinyLM()
    kw = dict(QUIET, run_dir=str(tmp_path / name), batch_size=4, epochs=2, lr=0.1, optimizer="adamw", num_workers=0,
              loss="cross_entropy", metrics=[], checkpoint_every_epochs=0, shuffle=False)
    kw.update(extra)
    t = torchrig.Trainer(model, **kw)
    t.fit(tokens())
    t.close()
    return t, model


@pytest.mark.parametrize("extra", [{}, {"label_smoothing": 0.1, "accumulate": 2},
                                   {"data.micro_batch_size": 3, "clip_grad_norm": 0.5}],
                         ids=["plain", "smoothing-accumulation", "micro-batches-clipped"])
def test_the_trainer_with_a_fused_head_trains_the_plain_weights(tmp_path, monkeypatch, extra):
    monkeypatch.setattr(fh, "CHUNK_ELEMENTS", 5 * VOCAB)  # chunks of 5 positions: several per micro-batch
    plain, want = _fit(tmp_path, "plain", **extra)
    fused, got = _fit(tmp_path, "fused", fused_head="head", **extra)
    assert want.logits_made > 0 and got.logits_made == 0  # the fused head never made the whole logits in training
    worst = max(float((a - b).abs().max()) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert worst < 1e-5
    losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(plain.history, fused.history)]
    assert losses and all(abs(a - b) < 1e-5 for a, b in losses)
    ev_plain, ev_fused = plain.evaluate(tokens(8)), fused.evaluate(tokens(8))  # evaluation makes the logits
    assert abs(ev_plain["loss"] - ev_fused["loss"]) < 1e-5


def test_training_metrics_say_in_one_line_they_need_the_logits(tmp_path, capsys):
    t, _ = _fit(tmp_path, "metrics", fused_head="head", metrics=["accuracy"], epochs=1)
    err = capsys.readouterr().err
    assert ("torchrig: model.fused_head: 'head' computes its logits and their cross-entropy together, in chunks of "
            f"{fh.chunk_rows(VOCAB)} positions (PyTorch ops); the training metrics (accuracy) need the logits, which "
            "it does not make: they are reported by evaluation only") in err.splitlines()
    assert "train/accuracy" not in t.history[-1] and "accuracy" in t.evaluate(tokens(8))


class Changes(TinyLM):
    def forward(self, ids):
        return self.head(self.body(self.embed(ids))) * 2.0


@pytest.mark.parametrize("make,extra,words", [
    (TinyLM, {"fused_head": "body"}, "config key 'model.fused_head': 'body' is a Sequential, not an nn.Linear of "
                                     "TinyLM; name its vocabulary projection (its Linear layers: body.0, head)"),
    (TinyLM, {"fused_head": "head", "loss": "mse"}, "config key 'model.fused_head': the fused head computes the "
                                                    "cross-entropy of the head's logits, but the loss is loss(mse); "
                                                    "set loss=cross_entropy, or model.fused_head=null"),
    (TinyLM, {"fused_head": "head", "parallel.tp": 2, "parallel.tp_plan": "auto"},
     "config key 'model.fused_head': head with parallel.tp=2 is not supported"),
])
def test_what_the_fused_head_cannot_do_is_one_line_at_start(tmp_path, make, extra, words):
    import torchrig
    from torchrig.config import ConfigError

    kw = dict(QUIET, run_dir=str(tmp_path / "r"), loss="cross_entropy", metrics=[])
    kw.update(extra)
    with pytest.raises((fh.FusedHeadError, ConfigError)) as err:
        torchrig.Trainer(make(), **kw)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_a_forward_that_changes_the_head_s_output_is_one_line(tmp_path):
    import torchrig

    with pytest.raises(fh.FusedHeadError) as err:
        t = torchrig.Trainer(Changes(), **dict(QUIET, run_dir=str(tmp_path / "c"), loss="cross_entropy", metrics=[],
                                               fused_head="head", batch_size=4, epochs=1))
        t.fit(tokens())
    assert str(err.value) == ("config key 'model.fused_head': Changes's forward changes the output of 'head' before "
                              "returning it, so its loss cannot be computed in the head; return the head's output as "
                              "it is (its logits), or set model.fused_head=null")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_s_kernel_equals_the_plain_loss_on_cuda(dtype):
    """On CUDA the head runs Liger-Kernel's fused kernel: the plain loss and gradients, within float rounding (bf16
    autocast: the kernel's own accumulation order)."""
    pytest.importorskip("liger_kernel")
    hidden, weight, bias, target = (t.detach().cuda().requires_grad_(t.is_floating_point()) for t in _inputs(rows=64))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        plain = F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, VOCAB).float(), target.reshape(-1),
                                label_smoothing=0.1)
        fused = fh.liger_cross_entropy(hidden, weight, bias, target, label_smoothing=0.1)
    want = torch.autograd.grad(plain, (hidden, weight, bias))
    got = torch.autograd.grad(fused, (hidden, weight, bias))
    assert abs(float(fused.detach().float() - plain.detach())) < tolerance
    assert max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)) < tolerance
