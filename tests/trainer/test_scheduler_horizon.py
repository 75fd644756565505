"""A scheduler sized by the run: a factory receives the run's optimizer-step count (``Trainer.total_steps``),
and a scheduler object whose horizon is not the run's gets one line (or, for a OneCycleLR too short to reach
the end, one error before the first step)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchrig.config import ConfigError


def _trainer(make_trainer, model, scheduler, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = scheduler(opt) if scheduler is not None else None
    return make_trainer(model, optimizer=opt, scheduler=sched, epochs=2, **kw), opt


def test_a_factory_gets_the_runs_optimizer_steps(make_trainer, data):
    seen = []

    def factory(optimizer, total_steps):
        seen.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    t = make_trainer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=factory, epochs=3,
                     accumulate=2)
    t.fit(data)  # 40 samples, batch 8: 5 batches, 3 steps per epoch with accumulate=2
    assert seen == [9] == [t.total_steps] and t.global_step == 9
    sch = t.schedulers["default"]
    assert sch.last_epoch == sch.total_steps == 9  # the cycle ran to its very end, and no step further


def test_a_given_scheduler_that_stops_short_of_its_end_says_so(make_trainer, data, capsys):
    torch.manual_seed(0)
    t, _ = _trainer(make_trainer, nn.Linear(8, 4),
                    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=96),
                    progress="lines")
    t.fit(data)
    line = [x for x in capsys.readouterr().out.splitlines() if "OneCycleLR" in x]  # said before the run's log
    assert line == ["torchrig: scheduler OneCycleLR has total_steps=96, but this run takes 10 optimizer steps "
                    "(2 epochs × 5 steps/epoch): it stops short of its end; build it from the run's count: "
                    "Trainer(scheduler=lambda optimizer, total_steps: OneCycleLR(optimizer, ..., "
                    "total_steps=total_steps))"]


def test_a_one_cycle_too_short_for_the_run_stops_before_the_first_step(make_trainer, data):
    torch.manual_seed(0)
    t, _ = _trainer(make_trainer, nn.Linear(8, 4),
                    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=7))
    with pytest.raises(ConfigError) as info:
        t.fit(data)
    assert str(info.value) == (
        "scheduler OneCycleLR has total_steps=7, but this run takes 10 optimizer steps (2 epochs × 5 steps/epoch); "
        "PyTorch's OneCycleLR cannot step past total_steps (it would stop the run at step 8); build it from the "
        "run's count: Trainer(scheduler=lambda optimizer, total_steps: OneCycleLR(optimizer, ..., "
        "total_steps=total_steps)), or set max_steps=7")
    assert t.global_step == 0


def test_a_cosine_per_epoch_is_compared_with_the_epochs_and_a_matching_one_is_silent(make_trainer, data, capsys):
    torch.manual_seed(0)
    t, _ = _trainer(make_trainer, nn.Linear(8, 4),
                    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
                    progress="lines", scheduler_interval="epoch")
    t.fit(data)
    assert ("torchrig: scheduler CosineAnnealingLR has T_max=5, but this run takes 2 epochs (2 epochs × 5 "
            "steps/epoch): it stops short of its end; set T_max=2") in capsys.readouterr().out
    t, _ = _trainer(make_trainer, nn.Linear(8, 4),
                    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10), progress="lines",
                    run_dir=str(t.run_dir) + "-b", scheduler_interval="step")
    t.fit(data)
    assert "CosineAnnealingLR" not in str(capsys.readouterr())


@pytest.mark.slow
def test_two_processes_halve_the_steps_and_the_line_says_so(tmp_path):
    from helpers import dist_procs
    from helpers.dist_procs import HELPERS

    results = dist_procs.pair("horizon", tmp_path / "out", tmp_path / "store", worker=HELPERS / "world_worker.py")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    lines = [x for x in results[0].output.splitlines() if "OneCycleLR" in x]
    assert lines == ["torchrig: scheduler OneCycleLR has total_steps=48, but this run takes 24 optimizer steps "
                     "(2 epochs × 12 steps/epoch on 2 processes): it stops short of its end; build it from the "
                     "run's count: Trainer(scheduler=lambda optimizer, total_steps: OneCycleLR(optimizer, ..., "
                     "total_steps=total_steps))"]
    for rank in (0, 1):
        got = json.loads((tmp_path / "out" / f"horizon-{rank}.json").read_text())
        assert got["given_steps"] == 24 and got["factory_got"] == [24] and got["total_steps"] == 24
        assert got["factory_stepped"] == 24


def _lrs(run_dir) -> dict[int, float]:
    from helpers import read_jsonl

    return {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "interval"}


def test_raising_max_steps_continues_a_one_cycle_run_on_a_cycle_of_the_new_length(make_trainer, data, run_dir,
                                                                                  capsys):
    """The image recipe's default schedule: a finished (or stopped) run resumed with a higher max_steps goes on
    (PyTorch's OneCycleLR would stop it: "Tried to step 4 times"), its learning rates from there on exactly those
    of a cycle of the new length."""
    kw = dict(scheduler="onecycle", epochs=3, log_every=1)
    make_trainer(max_steps=3, **kw).fit(data)
    capsys.readouterr()
    resumed = make_trainer(max_steps=8, resume="latest", **kw)
    resumed.fit(data)
    assert resumed.global_step == 8 and resumed.schedulers["default"].total_steps == 8
    assert ("torchrig: the onecycle schedule follows the run's length, which changed (max_steps 3 → 8): from here on "
            "its learning rates are those of a schedule of the new length (the steps so far followed the old one)"
            ) in capsys.readouterr().out
    whole = run_dir.with_name("whole")
    make_trainer(max_steps=8, run_dir=str(whole), **kw).fit(data)
    after = {s: lr for s, lr in _lrs(run_dir).items() if s > 3}
    assert after == {s: lr for s, lr in _lrs(whole).items() if s > 3} and sorted(after) == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("schedule", ["cosine", "warmup_cosine"])
def test_raising_max_steps_continues_a_cosine_on_a_cosine_of_the_new_length(make_trainer, data, run_dir, schedule):
    """PyTorch's CosineAnnealingLR would keep the checkpoint's T_max and go back up the cosine after it; the
    resumed run's learning rates are those of a run that had the new length from the start."""
    kw = dict(scheduler=schedule, epochs=3, log_every=1, warmup_steps=2)
    make_trainer(max_steps=3, **kw).fit(data)
    resumed = make_trainer(max_steps=12, resume="latest", **kw)
    resumed.fit(data)
    assert resumed.global_step == 12
    whole = run_dir.with_name("whole")
    make_trainer(max_steps=12, run_dir=str(whole), **kw).fit(data)
    after, expected = _lrs(run_dir), _lrs(whole)
    assert sorted(s for s in after if s > 3) == list(range(4, 13))
    assert [after[s] for s in range(4, 13)] == pytest.approx([expected[s] for s in range(4, 13)], rel=1e-12)
    assert expected[12] < expected[11] < expected[4]  # down the whole way: none goes back up

