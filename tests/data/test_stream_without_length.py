"""A finite IterableDataset without ``__len__`` and without ``data.steps_per_epoch``: each epoch reads the
stream to its end (every rank agrees), the progress counts without a total, and only what needs the run's
length in steps beforehand (a schedule over the total steps) asks for ``data.steps_per_epoch`` or
``max_steps``, naming itself. Under DDP each sample is trained once per epoch."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import IterableDataset

import torchrig
from helpers import QUIET, TinyNet, make_classification
from torchrig.config import ConfigError
from torchrig.trainer.step import default_step


class Stream(IterableDataset):
    """``(x, y, id)`` samples in order, no length."""

    def __init__(self, n: int = 40):
        self.x, self.y = make_classification(n=n)

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i], i


def _fit(run_dir, seen=None, **kw):
    seen = {} if seen is None else seen

    def step_fn(step, batch):
        x, y, ids = batch
        seen.setdefault(step.epoch, []).extend(ids.tolist())
        return default_step(step, [x, y])

    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=2, lr=0.05, optimizer="sgd", num_workers=0,
                step_fn=step_fn)
    opts.update(kw)
    trainer = torchrig.Trainer(TinyNet(dropout=0.2), **opts)
    trainer.fit(Stream(40))
    return trainer


def test_epochs_end_when_the_stream_runs_out(tmp_path, capsys):
    seen: dict = {}
    trainer = _fit(tmp_path / "run", seen, progress="lines", log_every=2)
    assert trainer.global_step == 10 and [h["step"] for h in trainer.history] == [5, 10]
    assert {e: sorted(ids) for e, ids in seen.items()} == {0: list(range(40)), 1: list(range(40))}
    err = capsys.readouterr().err
    assert "accumulation = 8 global · epochs end with the stream" in err
    assert "epoch 1/2 · step 4 · batch 4  train/loss" in err  # a count without a total
    assert "ran out" not in err and "steps_per_epoch" not in err


def test_accumulation_windows_and_a_resume_mid_epoch(tmp_path, capsys):
    full = _fit(tmp_path / "full", accumulate=2)  # 5 batches a pass: 2 windows, the 5th batch left over
    assert full.global_step == 4
    assert "ended with 1 batch(es) left, fewer than one accumulation window" in capsys.readouterr().err
    cut = _fit(tmp_path / "cut", accumulate=2, max_steps=3)  # stops in epoch 2
    assert cut.global_step == 3
    resumed = _fit(tmp_path / "cut", accumulate=2, resume="latest")
    assert resumed.global_step == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_only_what_needs_the_length_asks_for_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        _fit(tmp_path / "a", scheduler="cosine")
    assert str(info.value) == (
        "config key 'scheduler.name': 'cosine' runs over the run's optimizer steps, but the training data Stream "
        "is a stream without a length, so their number is not known before the run; set data.steps_per_epoch "
        "(optimizer steps per epoch) or max_steps, or step it per epoch (scheduler_interval=\"epoch\")")
    with pytest.raises(ConfigError, match=r"^the scheduler factory is built with the run's optimizer steps "
                                          r"\(total_steps\), but the training data Stream is a stream without a "
                                          r"length, so their number is not known before the run; set "
                                          r"data\.steps_per_epoch \(optimizer steps per epoch\) or max_steps, or "
                                          r"pass a scheduler object$"):
        _fit(tmp_path / "b", scheduler=lambda optimizer, total_steps: torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.1, total_steps=total_steps))
    assert _fit(tmp_path / "c", scheduler="cosine", max_steps=7).global_step == 7  # max_steps is the horizon
    assert _fit(tmp_path / "d", scheduler="cosine", scheduler_interval="epoch").global_step == 10
    assert _fit(tmp_path / "e", scheduler="step").global_step == 10  # per epoch: nothing to know beforehand


@pytest.mark.slow
def test_two_processes_train_each_sample_once_per_epoch(tmp_path):
    from helpers import dist_procs
    from helpers.dist_procs import HELPERS

    results = dist_procs.pair("stream", tmp_path / "out", tmp_path / "store", worker=HELPERS / "world_worker.py")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"stream-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 10 and ranks[0]["history"] == [5, 10]
    for epoch in ("0", "1"):
        both = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(both) == list(range(40))  # every sample once, on one rank
