"""``model.activation_offload``: the training forward saves its tensors for backward through ``save_on_cpu``."""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET, TinyNet, make_classification
from torch.utils.data import TensorDataset

import torchrig


def _fit(run_dir, offload):
    x, y = make_classification(24)
    torch.manual_seed(0)
    model = TinyNet(dropout=0.2)
    trainer = torchrig.Trainer(model, "adamw", **QUIET, run_dir=str(run_dir), batch_size=8, epochs=1, lr=0.01,
                               num_workers=0, activation_offload=offload,
                               checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(x, y), TensorDataset(x[:8], y[:8]))
    return model.state_dict()


def test_offloaded_run_trains_bitwise_like_one_without(tmp_path, monkeypatch, capsys):
    entered = []
    real = torch.autograd.graph.save_on_cpu

    class Recorded(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            entered.append((pin_memory, torch.is_grad_enabled()))
            super().__init__(pin_memory=pin_memory, device_type=device_type)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recorded)
    off = _fit(tmp_path / "off", False)
    assert entered == []
    on = _fit(tmp_path / "on", True)
    assert entered == [(False, True)] * 3  # each training forward (3 batches), none in evaluation
    assert off.keys() == on.keys() and all(torch.equal(off[k], on[k]) for k in off)
    assert ("torchrig: model.activation_offload: on cpu the activations are in host memory already, so it saves "
            "no memory (training is unchanged; each saved tensor is copied once)") in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_on_cuda_saved_tensors_wait_in_pinned_host_memory(tmp_path, monkeypatch):
    pinned = []
    real = torch.autograd.graph.save_on_cpu

    class Recorded(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            pinned.append(pin_memory)
            super().__init__(pin_memory=pin_memory, device_type=device_type)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recorded)
    x, y = make_classification(16)
    trainer = torchrig.Trainer(TinyNet(), "sgd", **QUIET, run_dir=str(tmp_path), batch_size=8, epochs=1,
                               num_workers=0, device="cuda", activation_offload=True,
                               checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(x, y))
    assert pinned == [True, True]
