"""Where an output's classes are (``class_dim``): a token model of the user's own returns ``(batch, positions,
classes)`` with targets ``(batch, positions)``; the named class-index losses, the metrics and predict's softmax read
its classes last, for any model (not only Hugging Face's); PyTorch's ``(batch, classes, positions)`` keeps them in
dimension 1; an output that fits both ways is one line naming the key."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.char_lm import CHARS, SEQ, CharLM, Chars, lm_loss
from torch import nn

from torchrig.data.batches import BatchError

IDS = torch.stack([Chars()[i][0] for i in range(24)])  # (24, 8) token ids
NEXT = torch.stack([Chars()[i][1] for i in range(24)])  # (24, 8) the next character of each position


def _hand_steps(model: nn.Module, steps: int, lr: float) -> nn.Module:
    """What a hand loop over the first ``steps`` batches of 8 computes (SGD, the flattened cross-entropy)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for i in range(steps):
        opt.zero_grad()
        lm_loss(model(IDS[8 * i:8 * i + 8]), NEXT[8 * i:8 * i + 8]).backward()
        opt.step()
    return model


@pytest.mark.parametrize("loss", ["cross_entropy", nn.CrossEntropyLoss(), lm_loss])
def test_class_last_logits_train_with_a_named_loss_and_score_with_accuracy(make_trainer, loss):
    torch.manual_seed(0)
    start = CharLM()
    trainer = make_trainer(copy.deepcopy(start), loss=loss, metrics=["accuracy", "f1"], max_steps=2, shuffle=False)
    trainer.fit((IDS[:16], NEXT[:16]))
    want = _hand_steps(copy.deepcopy(start), 2, 0.05)
    for got, expected in zip(trainer.model.parameters(), want.parameters()):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    results = trainer.evaluate((IDS, NEXT))
    with torch.no_grad():
        logits = want(IDS)
    assert results["loss"] == pytest.approx(lm_loss(logits, NEXT).item(), abs=1e-5)
    # each position's class, over the classes (13), not over the positions (8)
    assert results["accuracy"] == pytest.approx((logits.argmax(-1) == NEXT).float().mean().item(), abs=1e-6)
    assert trainer.step.class_dim == -1


def test_an_output_that_fits_both_layouts_names_the_key(make_trainer):
    """(16, 6, 6) logits with (16, 6) targets: classes in dimension 1 or last cannot be told; one line, then the
    key decides."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 6, (16, 6)), torch.randint(0, 6, (16, 6))
    model = nn.Sequential(nn.Embedding(6, 8), nn.Linear(8, 6))
    with pytest.raises(BatchError) as info:
        make_trainer(copy.deepcopy(model), loss="cross_entropy", max_steps=1).fit((ids, labels))
    assert str(info.value) == (
        "the model's output float32 (8, 6, 6) with targets int64 (8, 6) fits both (batch, classes, positions) and "
        "(batch, positions, classes): which dimension holds the classes cannot be told; set class_dim=1 (PyTorch's "
        "layout) or class_dim=-1 (classes last)")
    out = model(ids[:8]).detach()
    for class_dim, expected in ((-1, F.cross_entropy(out.flatten(0, 1), labels[:8].flatten())),
                                (1, F.cross_entropy(out, labels[:8]))):
        trainer = make_trainer(copy.deepcopy(model), loss="cross_entropy", metrics=["accuracy"], class_dim=class_dim,
                               overwrite=True)
        trainer.fit((ids[:8], labels[:8]))  # one batch: the epoch's train/loss is its loss
        assert trainer.history[-1]["train/loss"] == pytest.approx(expected.item(), abs=1e-5)


def test_class_dim_one_keeps_pytorchs_reading_and_says_the_key(make_trainer):
    torch.manual_seed(0)
    with pytest.raises(BatchError) as info:
        make_trainer(CharLM(), loss="cross_entropy", class_dim=1, max_steps=1).fit((IDS, NEXT))
    assert str(info.value).endswith("but the classes are read in dimension 1 (class_dim=1); set class_dim=-1 (classes "
                                    "last), or have the model return its own loss (loss=auto takes it)")


class Conv(nn.Module):
    """PyTorch's layout: (batch, features, positions) -> (batch, classes, positions)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 3, kernel_size=1)

    def forward(self, x):
        return self.conv(x)


def test_predict_softmax_runs_over_the_classes_of_either_layout(make_trainer, capsys):
    """(batch, classes, positions): over dimension 1; a token model's (batch, positions, classes): over the last."""
    torch.manual_seed(0)
    x = torch.randn(10, 4, 5)
    conv = make_trainer(Conv(), loss="cross_entropy", metrics=[])
    capsys.readouterr()
    probs = conv.predict(x)
    with torch.no_grad():
        torch.testing.assert_close(probs, conv.model(x).softmax(1))
    torch.testing.assert_close(probs.sum(1), torch.ones(10, 5))
    assert capsys.readouterr().out == ("predict: softmax over the classes (from loss=cross_entropy); "
                                       "activation=\"none\" for raw outputs\n")
    conv.predict(x)
    assert capsys.readouterr().out == ""  # said once
    lm = make_trainer(CharLM(), loss="cross_entropy", metrics=[], overwrite=True)  # no fit: told by the input ids
    probs = lm.predict(IDS)
    assert probs.shape == (24, SEQ, len(CHARS))
    with torch.no_grad():
        torch.testing.assert_close(probs, lm.model(IDS).softmax(-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(24, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(lm.predict(IDS, activation="none"), lm.model(IDS))


def test_predict_says_raw_outputs_for_a_loss_of_the_users(make_trainer, capsys):
    trainer = make_trainer(CharLM(), loss=lm_loss, metrics=[])
    capsys.readouterr()
    with torch.no_grad():
        torch.testing.assert_close(trainer.predict(IDS), trainer.model(IDS))
    assert capsys.readouterr().out == ("predict: raw outputs (loss=lm_loss is no classification loss torchrig "
                                       "knows); activation=\"softmax\" for probabilities over the classes\n")
    torch.testing.assert_close(trainer.predict(IDS, activation="softmax").sum(-1), torch.ones(24, SEQ))


def test_an_images_classes_stay_in_dimension_one_even_when_every_size_is_the_same(make_trainer):
    """Segmentation logits (N, C, H, W) with C == H == W against (N, H, W) labels: PyTorch's layout under auto (only
    a sequence output (B, T, C) is read classes-last by itself), trained as F.cross_entropy reads it."""
    torch.manual_seed(0)
    x, labels = torch.randn(8, 1, 4, 4), torch.randint(0, 4, (8, 4, 4))
    model = nn.Conv2d(1, 4, kernel_size=1)
    trainer = make_trainer(copy.deepcopy(model), loss="cross_entropy", metrics=["accuracy"])
    trainer.fit((x, labels))
    with torch.no_grad():
        out = model(x)
    assert trainer.history[-1]["train/loss"] == pytest.approx(F.cross_entropy(out, labels).item(), abs=1e-5)
    assert trainer.step.class_dim == 1
