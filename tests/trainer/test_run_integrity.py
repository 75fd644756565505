"""A finished run stays finished, nothing non-finite is saved, and resume is exact or refuses."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from helpers import QUIET, TinyNet, make_classification, record_checksums
from torchrig.checkpoint import CheckpointError, read_checkpoint, resolve
from torchrig.trainer import NonFiniteLossError, default_step


def _trainer(run_dir, model=None, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=4, epochs=2, optimizer="sgd", lr=0.05, num_workers=0,
                shuffle=False)
    opts.update(kw)
    return torchrig.Trainer(model or TinyNet(), **opts)


def _data(n=40):
    return TensorDataset(*make_classification(n))


# ----------------------------------------------------------------------------- a finished run stays finished


@pytest.mark.parametrize("limit", [{"max_steps": 7}, {}])  # stopped mid-epoch by max_steps; all epochs done
def test_resuming_a_finished_run_trains_no_step(tmp_path, capsys, limit):
    run = tmp_path / "run"
    first = _trainer(run, **limit)
    first.fit(_data())
    latest = resolve("latest", run)
    before = {p.name: p.stat().st_mtime_ns for p in latest.iterdir()}
    again = _trainer(run, resume="latest", **limit)
    again.fit(_data())
    assert again.global_step == first.global_step
    assert f"torchrig: the run in {run} already finished at step {first.global_step} ({latest.name}); nothing " \
           f"to train. To train further, raise epochs or max_steps, or start a new run" in capsys.readouterr().out
    assert resolve("latest", run) == latest
    assert {p.name: p.stat().st_mtime_ns for p in latest.iterdir()} == before  # not rewritten
    for a, b in zip(first.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_raising_max_steps_continues_a_finished_run(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_steps=7).fit(_data())
    more = _trainer(run, resume="latest", max_steps=12)
    more.fit(_data())
    assert more.global_step == 12


# ----------------------------------------------------------------------------- nothing non-finite is applied or saved


class InfGradOnce(nn.Module):
    """A finite loss whose gradient is infinite at one chosen optimizer step (a sqrt at 0 would do the same)."""

    def __init__(self, bad_call: int):
        super().__init__()
        self.net = TinyNet()
        self.calls, self.bad_call = 0, bad_call

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        if self.calls == self.bad_call:
            out.register_hook(lambda g: g * float("inf"))
        return out


def test_non_finite_gradient_with_finite_loss_stops_before_the_step(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(run, model=InfGradOnce(bad_call=3), checkpoint_every=1)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(_data())
    assert str(err.value).startswith("gradients are not finite (the loss is) at optimizer step 3 (epoch 1, batch 3); "
                                     "the step was not applied and the last checkpoint is intact.")
    assert trainer.global_step == 2
    assert resolve("latest", run).name == "step-00000002"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    saved = torchrig.checkpoint.load_weights_file(resolve("latest", run))
    for name, p in trainer.model.state_dict().items():
        assert torch.equal(saved[name], p)  # the refused step changed nothing


def test_non_finite_gradient_is_skipped_with_on_nonfinite_skip(tmp_path):
    trainer = _trainer(tmp_path / "run", model=InfGradOnce(bad_call=3), on_nonfinite="skip", epochs=1)
    trainer.fit(_data())
    assert trainer.skipped_steps == 1 and trainer.global_step == 10
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_skipped_window_is_left_out_of_the_logged_loss(tmp_path, capsys, accumulate):
    """One NaN sample in 93 (batch 16): its window is skipped and the logged epoch loss is the mean over the
    other windows' samples, not NaN. The learning rate is so small that the weights do not move, so the
    expected value is the still model's loss over those samples, computed by hand."""
    torch.manual_seed(0)
    x, y = torch.randn(93, 8), torch.randint(0, 3, (93,))
    x[20] = float("nan")  # the second batch of 16, in the first window of 2 batches under accumulation
    model = nn.Linear(8, 3)
    bad = slice(16 * accumulate * (20 // (16 * accumulate)), 16 * accumulate * (20 // (16 * accumulate) + 1))
    keep = torch.ones(93, dtype=torch.bool)
    keep[bad] = False
    with torch.no_grad():
        want = nn.functional.cross_entropy(model(x[keep]), y[keep]).item()
    t = torchrig.Trainer(model, "sgd", lr=1e-30, batch_size=16, accumulate=accumulate, epochs=1, shuffle=False,
                         on_nonfinite="skip", run_dir=str(tmp_path / "run"), **QUIET)
    t.fit((x, y))
    assert t.skipped_steps == 1
    assert t.history[-1]["train/loss"] == pytest.approx(want, rel=1e-6)
    # said where a user looks: the epoch row (terminal, metrics.jsonl, history) and the last line
    assert t.history[-1]["skipped_steps"] == 1
    assert "1 skipped (non-finite values or an fp16 overflow)" in capsys.readouterr().err


def test_a_checkpoint_is_never_written_with_non_finite_parameters(tmp_path):
    def poisoning_step(step, batch):
        out = default_step(step, batch)
        if step.global_step == 5:  # after step 6 the weights are damaged outside the optimizer
            with torch.no_grad():
                next(step.model.parameters())[0, 0] = float("nan")
        return out

    run = tmp_path / "run"
    trainer = _trainer(run, step_fn=poisoning_step, checkpoint_every=2)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(_data())
    assert str(err.value).startswith("the model's parameters hold NaN or inf at step 6; no checkpoint was written "
                                     "(the last one, step 4, is intact).")
    assert resolve("latest", run).name == "step-00000004"


# ----------------------------------------------------------------------------- resume is exact or refuses


def test_checkpoint_without_training_state_refuses_to_resume(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_steps=6, checkpoint_every=3).fit(_data())
    latest = resolve("latest", run)
    os.remove(latest / "state.pt")
    with pytest.raises(CheckpointError) as err:
        _trainer(run, resume="latest").fit(_data())
    assert str(err.value) == (f"checkpoint '{latest}' has no training state (state.pt), so it cannot resume exactly; "
                              f"set resume_weights_only=true to load its weights and start a fresh optimizer and "
                              f"schedule, or resume from another checkpoint")


def test_resume_weights_only_starts_a_fresh_schedule(tmp_path, capsys):
    run = tmp_path / "run"
    first = _trainer(run, max_steps=6)
    first.fit(_data())
    latest = resolve("latest", run)
    os.remove(latest / "state.pt")
    other = tmp_path / "fine-tune"
    tuned = _trainer(other, resume=str(latest), resume_weights_only=True, max_steps=1, lr=1e-9)
    tuned.fit(_data())
    assert tuned.global_step == 1  # counted from 0, not from 6
    assert f"torchrig: loaded the weights of {latest}; optimizer, schedule and step start fresh " \
           f"(resume_weights_only=true)" in capsys.readouterr().out
    for a, b in zip(first.model.parameters(), tuned.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)  # one step at lr 1e-9 from the loaded weights


def test_resume_best_without_a_best_checkpoint_fails(tmp_path):
    run = tmp_path / "run"
    _trainer(run, max_steps=3).fit(_data())  # no validation data: no best checkpoint
    with pytest.raises(CheckpointError) as err:
        _trainer(run, resume="best").fit(_data())
    assert str(err.value) == (f"resume='best': {run}/checkpoints has no best checkpoint (one is kept when "
                              f"checkpoint.monitor names a validation value and keep_best >= 1); use resume=latest "
                              f"or a checkpoint directory")


def _drop(key: str):
    def drop(state: dict) -> None:
        del state[key]
    return drop


def _drop_optimizer(state: dict) -> None:
    del state["optimizers"]["default"]  # the entry is there, the run's optimizer is not in it


@pytest.mark.parametrize("edit, lacks", [(_drop("counters"), "counters"), (_drop("rng"), "rng"),
                                         (_drop("optimizers"), "optimizers"),
                                         (_drop_optimizer, "the state of optimizer 'default'")],
                         ids=["counters", "rng", "optimizers", "one_optimizer"])
def test_state_without_counters_rng_or_optimizer_refuses(tmp_path, edit, lacks):
    """Without any one of them a resume would silently start that part afresh (step 0, new random
    streams, an optimizer without momentum): refused, the checkpoint left as it was."""
    run = tmp_path / "run"
    _trainer(run, max_steps=3).fit(_data())
    latest = resolve("latest", run)
    state, _, _ = read_checkpoint(latest)
    edit(state)
    torch.save(state, latest / "state.pt")
    record_checksums(latest)  # a whole checkpoint, only without that part
    before = (latest / "state.pt").read_bytes()
    with pytest.raises(CheckpointError) as err:
        _trainer(run, resume="latest", max_steps=5).fit(_data())
    assert str(err.value) == (f"checkpoint '{latest}' state.pt lacks {lacks}, so it cannot resume exactly; set "
                              f"resume_weights_only=true to load its weights only")
    assert (latest / "state.pt").read_bytes() == before and resolve("latest", run) == latest
