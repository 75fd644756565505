"""The model summary: counts and sizes by hand, the optimizer state each optimizer keeps, printed at the
start of fit (off with log.summary=false) and by ``torchrig summary``, within 80 columns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import QUIET, TinyNet, make_classification
from torchrig.observe.summary import model_summary, optimizer_state, size

pytestmark = pytest.mark.usefixtures("restore_threads")


def _kb(n_floats: float) -> str:
    return size(n_floats * 4)  # float32: 4 bytes each


def test_sizes_read_as_people_write_them():
    assert [size(n) for n in (512, 848, 123_456, 1.5 * 2 ** 20, 12.3 * 2 ** 20, 1.5 * 2 ** 30)] == \
        ["512 B", "848 B", "120.6 KB", "1.50 MB", "12.3 MB", "1.50 GB"]


def test_counts_sizes_and_memory_by_hand():
    model = TinyNet()  # backbone Linear(8, 16), head Linear(16, 4)
    model.backbone.requires_grad_(False)
    backbone, head = 8 * 16 + 16, 16 * 4 + 4
    text = model_summary(model, torch.optim.AdamW(model.parameters()), "bf16")
    lines = text.splitlines()
    assert lines[0] == f"torchrig: model TinyNet · {backbone + head} parameters ({head} trainable, {backbone} frozen) " \
                       f"· {_kb(backbone + head)}"
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert rows["backbone"][1:5] == ["Sequential", "144", "0", "144"]
    assert rows["head"][1:5] == ["Linear", "68", "68", "0"]
    assert rows["drop"][1:5] == ["Dropout", "0", "0", "0"]
    assert rows["total"][1:4] == ["212", "68", "144"]
    memory = " ".join(line.strip() for line in lines[6:])
    # weights: every parameter; gradients: the trainable ones; AdamW: two moments per trainable parameter
    assert memory.startswith(f"memory per process: weights {_kb(212)} + gradients {_kb(68)} + adamw state "
                             f"{_kb(2 * 68)} = {_kb(212 + 68 + 2 * 68)}")
    assert "bf16 autocast keeps weights, gradients and optimizer state fp32" in memory
    assert all(len(line) <= 80 for line in lines)


@pytest.mark.parametrize("make, per_param", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.0), 0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.Adam(p, amsgrad=True), 3),
    (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3),
    (lambda p: torch.optim.Adagrad(p), 1),
])
def test_the_state_each_optimizer_keeps_is_what_it_keeps_after_a_step(make, per_param):
    model = nn.Linear(8, 4)
    opt = make(model.parameters())
    estimate, _ = optimizer_state({"main": opt}, model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    kept = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)  # the per-parameter tensors (not the step counters)
    assert estimate == kept == per_param * 4 * (8 * 4 + 4)


def test_an_unknown_optimizer_is_said_not_estimated_and_tied_weights_count_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied: one tensor in two modules
    text = model_summary(model, torch.optim.LBFGS(model.parameters()))
    assert "torchrig: model Sequential · 50 parameters, all trainable" in text  # 40 shared + 10 bias
    assert "LBFGS state not estimated" in " ".join(text.split())


def test_fsdp_shares_and_many_modules():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    text = model_summary(model, torch.optim.SGD(model.parameters(), lr=0.1), shards=4)
    lines = text.splitlines()
    assert "… 19 more" in text and len([line for line in lines if line.startswith("  ")]) <= 16
    assert "memory per process (FSDP2: 1/4 each): weights " + _kb(30 * 20 / 4) in " ".join(text.split())


def test_fit_prints_it_first_unless_log_summary_is_false(make_trainer, capsys):
    x, y = make_classification()
    make_trainer().fit((x, y))
    out = "".join(capsys.readouterr())
    assert out.index("torchrig: model TinyNet") < out.index("process(es) on cpu")
    make_trainer(summary=False, overwrite=True).fit((x, y))
    assert "torchrig: model" not in "".join(capsys.readouterr())


def test_the_command_fits_80_columns(capsys, tmp_path, monkeypatch):
    from torchrig.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["summary", "--set", "optim.name=sgd", "--set", "optim.momentum=0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torchrig: model DigitsCNN · 30,890 parameters, all trainable")
    assert "sgd state 0 B" in out and all(len(line) <= 80 for line in out.splitlines())
    assert not (tmp_path / "runs").exists()  # nothing written
    assert QUIET  # the helpers' quiet settings keep the other tests' output short


def test_the_memory_line_never_breaks_between_a_number_and_its_unit():
    from torchrig.observe.summary import _wrap

    text = ("memory per process (tp=2 × pp=2: this process's part): weights 74.8 KB + gradients 74.8 KB + adamw "
            "state 149.6 KB = 299.2 KB; activations not counted")
    for width in range(40, 100):
        lines = _wrap(text, width)
        assert " ".join(" ".join(lines).split()) == text
        assert not any(line.split()[-1][0].isdigit() for line in lines[:-1]), (width, lines)
        assert not any(line.split()[0] in ("B", "KB", "MB", "GB") for line in lines[1:]), (width, lines)


def test_a_module_held_by_another_pipeline_stage_is_named_so():
    from torchrig.observe.summary import model_summary

    class Elsewhere(nn.Module):  # what a pipeline leaves in place of a module another stage holds
        summary_kind = "(other stage)"

    model = nn.Sequential()
    model.add_module("body", nn.Linear(4, 4))
    model.add_module("head", Elsewhere())
    rows = [line.split() for line in model_summary(model).splitlines()]
    assert ["head", "(other", "stage)", "0", "0", "0", "0", "B"] in rows
