"""A model whose parts the user put on different devices trains where it is (parallel/placement.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.parallel import devices_of, placed_device, to_output_device

QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}


class TwoParts(nn.Module):
    """PyTorch's tutorial model parallelism: two halves on two devices, the activations moved between them."""

    def __init__(self, first: str, second: str):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).to(first)
        self.b = nn.Linear(16, 4, bias=False).to(second)  # a bias before a batch norm has no gradient: AdamW would step on noise
        self.bn = nn.BatchNorm1d(4).to(second)

    def forward(self, x):
        return self.bn(self.b(self.a(x).to(self.b.weight.device)))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))


def settings(tmp_path, name: str, **kw) -> dict:
    return dict(optimizer="adamw", lr=0.01, batch_size=8, epochs=2, run_dir=str(tmp_path / name), metrics=["accuracy"],
                num_workers=0, **QUIET, **kw)


def test_a_model_on_one_device_is_moved_and_nothing_else_changes(tmp_path):
    model = TwoParts("cpu", "cpu")
    assert devices_of(model) == [torch.device("cpu")] and placed_device(model) is None
    target = torch.zeros(3)
    assert to_output_device(torch.ones(3), target) is target  # same device: the very tensor, no copy
    t = torchrig.Trainer(model, **settings(tmp_path, "one"))
    weight = model.a[0].weight
    t.fit(data())
    assert model.a[0].weight is weight and weight.device.type == "cpu" and t.device.type == "cpu"
    assert not t.step.spread


def check_spread(tmp_path, first: str, second: str) -> None:
    """Trained where it was put: the parameters never move, and they end as those of the same model on one device
    (float tolerance: the devices' kernels round differently)."""
    spread, whole = TwoParts(first, second), TwoParts("cpu", "cpu")
    a_weight, b_weight = spread.a[0].weight, spread.b.weight
    t = torchrig.Trainer(spread, **settings(tmp_path, "spread", device=first))
    assert t.step is None and t.device == torch.device(first)
    t.fit(data())
    assert t.step.spread
    assert spread.a[0].weight is a_weight and a_weight.device == torch.device(first)
    assert spread.b.weight is b_weight and b_weight.device == torch.device(second)
    assert spread.bn.running_mean.device == torch.device(second)
    torchrig.Trainer(whole, **settings(tmp_path, "whole", device="cpu")).fit(data())
    for (name, p), (_, q) in zip(spread.state_dict().items(), whole.state_dict().items()):
        assert torch.allclose(p.cpu().float(), q.float(), atol=1e-4), name
    assert t.history[-1]["train/accuracy"] >= 0.0  # metrics were computed on the output's device


@pytest.mark.gpu
def test_a_model_spread_over_the_cpu_and_a_gpu_trains_where_it_is(tmp_path):
    check_spread(tmp_path, "cpu", "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_spread_over_two_gpus_trains_where_it_is(tmp_path):
    check_spread(tmp_path, "cuda:0", "cuda:1")
