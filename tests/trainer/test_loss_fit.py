"""An output that does not fit the loss is said at the first step, in one line: the output's shape, the
targets' shape and dtype, the loss, and what would fit; PyTorch's own IndexError / broadcast error never
reaches the user, and a loss that would silently train on nothing (cross-entropy over one output) or on
broadcast pairs ((N, 1) against (N,)) stops too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrig.data.batches import BatchError

Y3 = torch.tensor([0, 2, 1, 2, 0, 1, 2, 0] * 2)  # class labels of 3 classes
Y2 = torch.tensor([0, 1] * 8)

CASES = {
    "one output, cross_entropy": (1, "cross_entropy", Y3,
        "the loss cross_entropy (config key 'loss') over the model's output float32 (8, 1) with targets int64 (8,): "
        "over a single output it is 0 whatever the model does; for two classes use loss=bce_with_logits with "
        "targets 0./1. (y.float()), or give the model one output per class"),
    "one output, nn.CrossEntropyLoss, two classes": (1, nn.CrossEntropyLoss(), Y2,
        "the loss CrossEntropyLoss() over the model's output float32 (8, 1) with targets int64 (8,): over a single "
        "output it is 0 whatever the model does; for two classes use loss=bce_with_logits with targets 0./1. "
        "(y.float()), or give the model one output per class"),
    "class labels out of range": (2, nn.CrossEntropyLoss(), Y3,
        "the loss CrossEntropyLoss(): the model's output is float32 (8, 2) and the targets are int64 (8,); the "
        "targets hold class 2, outside the model's 2 outputs (classes 0 to 1); check the labels, or give the model "
        "one output per class (3 or more)"),
    "mse on class labels": (3, "mse", Y3,
        "the loss mse (config key 'loss') compares the model's output with a target of the same shape, but the "
        "output is float32 (8, 3) and the targets int64 (8,); these look like class indices: use "
        "loss=cross_entropy"),
    "nn.MSELoss on class labels": (3, nn.MSELoss(), Y3.float(),
        "the loss MSELoss() compares the output with targets of the same shape, but the model's output is "
        "float32 (8, 3) and the targets are float32 (8,) (The size of tensor a (3) must match the size of tensor "
        "b (8) at non-singleton dimension 1); give targets shaped like the output, (8, 3), or a model with that "
        "many outputs"),
    "nn.MSELoss broadcasting (8, 1) against (8,)": (1, nn.MSELoss(), Y3.float(),
        "the loss MSELoss() compares the model's output float32 (8, 1) with targets float32 (8,) element by "
        "element; PyTorch would broadcast them to (8, 8), a wrong loss; give targets shaped (8, 1) (y.view(8, 1))"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_that_does_not_fit_the_loss_is_one_line_at_the_first_step(make_trainer, case):
    outputs, loss, y, message = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(len(y), 8)
    trainer = make_trainer(nn.Linear(8, outputs), loss=loss, max_steps=2)
    with pytest.raises(BatchError) as info:
        trainer.fit((x, y))
    assert str(info.value) == message
    assert trainer.global_step == 0 and "\n" not in str(info.value)


def _by_hand(model: nn.Module, x, y, loss) -> nn.Module:
    """What two SGD steps (lr 0.05, momentum 0.9: the defaults) over the batches 0 … 7 and 8 … 15 give, written
    out."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for first in (0, 8):
        opt.zero_grad()
        loss(model(x[first:first + 8]), y[first:first + 8]).backward()
        opt.step()
    return model


def test_what_fits_trains(make_trainer):
    """The fits the messages propose, bce_with_logits on one output and targets shaped like the output, train as
    the hand-written loop does: bce_with_logits over an output (8, 1) and targets (8,) is the loss over the output's
    one column."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    fits = [("bce_with_logits", Y2.float(), lambda out, y: F.binary_cross_entropy_with_logits(out[:, 0], y)),
            (nn.MSELoss(), Y3.float().view(16, 1), nn.MSELoss())]
    for loss, y, by_hand in fits:
        start = nn.Linear(8, 1)
        trainer = make_trainer(copy.deepcopy(start), loss=loss, max_steps=2, shuffle=False, overwrite=True)
        trainer.fit((x, y))
        want = _by_hand(copy.deepcopy(start), x, y, by_hand)
        assert trainer.global_step == 2 and (want.weight - start.weight).abs().max() > 1e-3  # the steps moved it
        for got, expected in zip(trainer.model.parameters(), want.parameters()):
            assert torch.allclose(got, expected, atol=1e-6), (loss, got, expected)


def test_a_token_models_output_under_class_dim_one_gets_the_fit_for_positions(make_trainer):
    """(batch, positions, classes) logits with a class per position, read with the classes in dimension 1
    (``class_dim=1``): PyTorch's cross-entropy would read the positions as classes; the message says so and which key
    reads them last, instead of asking for class indices below the positions. (Under ``class_dim=auto`` they train:
    ``tests/trainer/test_class_dim.py``.)"""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 20, (16, 6)), torch.randint(0, 10, (16, 6))
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 10))  # (16, 6) ids -> (16, 6, 10) logits
    with pytest.raises(BatchError) as info:
        make_trainer(model, loss="cross_entropy", max_steps=2, class_dim=1).fit((ids, labels))
    assert str(info.value) == (
        "the loss cross_entropy (config key 'loss'): the model's output is float32 (8, 6, 10) and the targets are "
        "int64 (8, 6): an output of (batch, positions, classes) with a class per position, but the classes are read "
        "in dimension 1 (class_dim=1); set class_dim=-1 (classes last), or have the model return its own loss "
        "(loss=auto takes it)")
