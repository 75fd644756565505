"""Nothing of the forward outlives backward: the model's output (token logits, the largest tensor of a language
model's step) is freed by autograd as in a hand-written loop, whatever the step keeps for the metrics.

A probe model records, when the gradient reaches its output, whether the output's memory (its storage, not only its
Python object: a detached alias would keep the memory) is still alive; a hand loop's is not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import QUIET, make_classification


class Probe(nn.Module):
    """8 features -> 4 classes; ``alive`` lists, per backward, whether the output's storage was still referenced."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.alive: list = []
        self.seen: list = []  # (input row, predicted class) of every training forward

    def forward(self, x):
        out = self.head(self.body(x))
        if out.requires_grad:
            self.seen.extend(zip(x.detach(), out.detach().argmax(1).tolist()))
            memory = StorageWeakRef(out.untyped_storage())
            out.register_hook(lambda grad: self.alive.append(not memory.expired()))
        return out


def _hand_loop_frees_it() -> list:
    model = Probe()
    x, y = make_classification(16)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return model.alive


def test_a_hand_loop_frees_the_output_before_its_gradient():
    assert _hand_loop_frees_it() == [False]  # the probe sees what it is meant to


@pytest.mark.parametrize("extra", [
    {},
    {"metrics": []},
    {"metrics": ["accuracy", "f1", "top2"]},
    {"accumulate": 2},
    {"data.micro_batch_size": 3, "accumulate": 2},
    {"fast_path": False},
], ids=["defaults", "no-metrics", "several-metrics", "accumulation", "micro-batches", "dataloader"])
def test_the_default_step_frees_the_output_before_backward(tmp_path, extra):
    import torchrig

    model = Probe()
    x, y = make_classification(40)
    opts = dict(QUIET, run_dir=str(tmp_path / "run"), batch_size=8, epochs=1, lr=0.05, optimizer="sgd",
                num_workers=0, checkpoint_every_epochs=0)
    opts.update(extra)
    t = torchrig.Trainer(model, **opts)
    t.fit((x, y))
    t.close()
    assert model.alive and not any(model.alive), model.alive
    if extra.get("metrics", ["accuracy"]):  # the metrics still score every sample by the weights of its step
        rows = {tuple(r.tolist()): int(label) for r, label in zip(x, y)}
        correct = sum(int(p == rows[tuple(r.tolist())]) for r, p in model.seen)
        assert len(model.seen) == 40 and t.history[-1]["train/accuracy"] == pytest.approx(correct / 40, abs=1e-9)
