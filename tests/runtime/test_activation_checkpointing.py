"""``model.activation_checkpointing``: recomputed sub-modules give the gradients of the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import QUIET, make_classification
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.runtime import AccelConfigError, apply_activation_checkpointing


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def _grads(model, x, y, seed=5):
    torch.manual_seed(seed)  # the same dropout masks in both models
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_same_gradients_and_the_forward_is_recomputed():
    torch.manual_seed(0)
    plain = Net()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, ["backbone", "head"]) == ["backbone", "head"]
    calls = []
    ckpt.backbone.register_forward_hook(lambda *a: calls.append(1))
    ckpt.backbone[0].register_forward_hook(lambda *a: calls.append(0))
    x, y = make_classification(16)
    expected, got = _grads(plain, x, y), _grads(ckpt, x, y)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # the inner layer ran again in backward (recomputed); the wrapped module's own hooks once
    assert calls.count(0) == 2 and calls.count(1) == 1
    assert list(plain.state_dict()) == list(ckpt.state_dict())  # checkpoints of the plain model


def test_a_copy_of_the_model_checkpoints_itself():
    model = Net()
    apply_activation_checkpointing(model, ["backbone"])
    twin = copy.deepcopy(model)
    calls = []
    twin.backbone[0].register_forward_hook(lambda *a: calls.append(0))
    x, y = make_classification(4)
    nn.functional.cross_entropy(twin(x), y).backward()
    assert calls == [0, 0] and model.backbone[0].weight.grad is None  # the copy ran (twice), not the original
    assert twin.backbone[0].weight.grad is not None


def test_no_recompute_without_gradients():
    model = Net().eval()
    apply_activation_checkpointing(model, ["backbone"])
    calls = []
    model.backbone[0].register_forward_hook(lambda *a: calls.append(0))
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert calls == [0]


def test_unknown_module_name_is_one_clear_error():
    with pytest.raises(AccelConfigError, match=r"model.activation_checkpointing: 'backbon' is not a sub-module "
                                                r"of Net.*did you mean 'backbone'"):
        apply_activation_checkpointing(Net(), ["backbon"])


def test_trainer_with_checkpointing_trains_the_same_weights(tmp_path):
    x, y = make_classification(48)
    finals = []
    for names in ([], ["backbone"]):
        torch.manual_seed(0)
        model = Net()
        trainer = torchrig.Trainer(model, "sgd", **QUIET, run_dir=str(tmp_path / f"r{len(names)}"), batch_size=8,
                                   epochs=1, lr=0.05, num_workers=0, activation_checkpointing=names,
                                   checkpoint={"every_epochs": 0, "save_final": False})
        trainer.fit(TensorDataset(x, y))
        assert getattr(model.backbone, "_torchrig_checkpointed", False) == bool(names)
        finals.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


class Block(nn.Module):
    """A pre-norm transformer block without dropout: attention (SDPA) and an MLP, each with its residual."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self, blocks=3, width=16, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x).transpose(1, 2)  # (batch, classes, time)


def _token_grads(model):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 11, (4, 6), generator=g)
    return _grads(model, tokens, torch.roll(tokens, -1, 1))


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_every_block_recomputed_gives_the_same_gradients(kind):
    torch.manual_seed(0)
    plain = Tiny()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, kind) == ["blocks.0", "blocks.1", "blocks.2"]
    assert [getattr(m, "_torchrig_checkpointed", False) for m in (ckpt.embed, ckpt.head, *ckpt.blocks)] == \
        [False, False, True, True, True]
    expected, got = _token_grads(plain), _token_grads(ckpt)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert list(plain.state_dict()) == list(ckpt.state_dict())


def test_the_start_line_says_which_blocks():
    from torchrig.runtime import checkpointing_line

    assert checkpointing_line(Tiny(), "selective") == (
        "torchrig: activation checkpointing (selective) on 3 blocks (blocks.0 … blocks.2), keeping their matrix "
        "products' outputs")
    assert checkpointing_line(Tiny(), "full") == (
        "torchrig: activation checkpointing (full) on 3 blocks (blocks.0 … blocks.2), each recomputed whole")
    assert checkpointing_line(Tiny(), ["blocks.0"]) is None


def test_full_on_a_model_without_blocks_is_one_clear_error():
    with pytest.raises(AccelConfigError, match=r"^model.activation_checkpointing: full recomputes each block of the "
                                               r"model's sequence of blocks, and Linear has none .*\[encoder\]$"):
        apply_activation_checkpointing(nn.Linear(4, 2), "full")


def _products_in_backward(model):
    """The matrix products (mm, addmm, bmm and attention) run during backward, recomputation included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchrig.runtime.accel import SAVED_OPS

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in SAVED_OPS
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(3))
    loss = nn.functional.cross_entropy(model(tokens), tokens)
    with Count():
        loss.backward()
    return Count.calls


def test_selective_keeps_the_matrix_products_full_recomputes_them():
    torch.manual_seed(0)
    plain = Tiny()
    counts = {"none": _products_in_backward(plain)}
    for kind in ("full", "selective"):
        model = copy.deepcopy(plain)
        apply_activation_checkpointing(model, kind)
        counts[kind] = _products_in_backward(model)
    # per block, full runs the forward's products again (attention and 3 Linear layers: the recomputation stops
    # before the MLP's last one, whose output backward does not need); selective runs none of them again
    assert counts["selective"] == counts["none"]
    assert counts["full"] == counts["none"] + 3 * 4


def test_trainer_says_the_blocks_it_recomputes(tmp_path, capsys):
    tokens = torch.randint(0, 11, (16, 6), generator=torch.Generator().manual_seed(1))
    trainer = torchrig.Trainer(Tiny(), "sgd", **QUIET, run_dir=str(tmp_path), batch_size=8, epochs=1, num_workers=0,
                               activation_checkpointing="selective",
                               checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(tokens, torch.roll(tokens, -1, 1)))
    assert all(getattr(b, "_torchrig_checkpointed", False) for b in trainer.model.blocks)
    assert "torchrig: activation checkpointing (selective) on 3 blocks (blocks.0 … blocks.2)" in capsys.readouterr().err
