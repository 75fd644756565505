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
