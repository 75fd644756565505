"""``on_spike: rollback``: a poisoned sample's spike is rolled back and the run replays without its step's samples.

93 samples, not shuffled, a global batch of 12: the sample at index 50 is scaled by 1000, so step 5 (samples
48 … 59) makes a loss far above its mean. The rollback returns to the snapshot of step 4, leaves those 12 samples
out of every epoch and replays: the final parameters equal (1e-6) those of a run whose data set never held them,
and ``skipped_samples.jsonl`` names them. A second poisoned sample right after makes a second spike before the
run passed the first one's step: with ``spike.max_rollbacks=1`` the run stops with one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchrig.trainer.spikes import SpikeError

N, POISON, WINDOW = 93, 50, list(range(48, 60))
ATOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))  # logits grow with the input


def _data(poison=(POISON,)):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    for i in poison:
        x[i] *= 1000.0
    return x, y


def _fit(make_trainer, data, **kw):
    opts = dict(global_batch_size=12, epochs=2, shuffle=False, momentum=0.9, checkpoint_every=0)
    opts.update(kw)
    t = make_trainer(_model(), **opts)
    t.fit(data)
    t.close()
    return t


SPIKE = {"on_spike": "rollback", "spike.warmup_steps": 3, "spike.snapshot_every": 2}


@pytest.mark.parametrize("back_to", [{}, {"spike.snapshot_every": 0, "checkpoint_every": 2}],
                         ids=["snapshot", "checkpoint"])
def test_a_rolled_back_spike_equals_a_run_without_its_samples(make_trainer, run_dir, capfd, restore_threads, back_to):
    """To the in-memory snapshot of step 4, or to the checkpoint of step 4 on disk."""
    rolled = _fit(make_trainer, _data(), **dict(SPIKE, **back_to))
    said = "".join(capfd.readouterr())
    ledger = [json.loads(line) for line in (run_dir / "skipped_samples.jsonl").read_text().splitlines()]
    assert len(ledger) == 1 and ledger[0]["samples"] == WINDOW and POISON in ledger[0]["samples"]
    assert (ledger[0]["step"], ledger[0]["epoch"], ledger[0]["rolled_back_to"]) == (5, 1, 4)
    assert ledger[0]["reason"].startswith("gradient norm ") and "> 10 × its mean" in ledger[0]["reason"]
    assert "torchrig: spike at step 5 (gradient norm " in said and "rolled back to step 4; its 12 samples are left out" in said

    clean = _clean(make_trainer, run_dir)
    assert rolled.global_step == clean.global_step == 14  # 81 samples: 7 steps per epoch
    for a, b in zip(rolled.model.parameters(), clean.model.parameters()):
        assert (a - b).abs().max().item() < ATOL
    untouched = _fit(make_trainer, _data(), run_dir=str(run_dir.parent / "off"))  # off by default: the spike stays
    assert not (run_dir.parent / "off" / "skipped_samples.jsonl").exists()
    assert max((a - b).abs().max().item() for a, b in zip(untouched.model.parameters(), clean.model.parameters())) > 0.1


def test_rollbacks_in_a_row_stop_the_run_in_one_line(make_trainer, run_dir, restore_threads):
    with pytest.raises(SpikeError) as err:
        _fit(make_trainer, _data(poison=(POISON, 62)), **SPIKE, **{"spike.max_rollbacks": 1})
    assert str(err.value).startswith("torchrig: on_spike=rollback: 2 spikes in a row, the last at step 5 (")
    assert "lower optim.lr, set clip_grad_norm, or raise spike.factor or spike.max_rollbacks" in str(err.value)
    assert "\n" not in str(err.value)
    ledger = [json.loads(line) for line in (run_dir / "skipped_samples.jsonl").read_text().splitlines()]
    assert [e["samples"] for e in ledger] == [WINDOW]


def _clean(make_trainer, run_dir):
    """The run whose data set never held the spiking step's samples."""
    x, y = _data(poison=())
    keep = [i for i in range(N) if i not in WINDOW]
    return _fit(make_trainer, (x[keep], y[keep]), run_dir=str(run_dir.parent / "clean"))


def test_a_non_finite_loss_is_rolled_back(make_trainer, run_dir, restore_threads):
    x, y = _data(poison=())
    x[50] = float("inf")
    t = _fit(make_trainer, (x, y), **SPIKE)
    ledger = [json.loads(line) for line in (run_dir / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rolled_back_to"], e["samples"]) for e in ledger] == [(5, 4, WINDOW)]
    assert ledger[0]["reason"] == "a non-finite value (loss inf, gradient norm inf)"
    clean = _clean(make_trainer, run_dir)
    assert t.global_step == clean.global_step == 14
    for a, b in zip(t.model.parameters(), clean.model.parameters()):
        assert (a - b).abs().max().item() < ATOL


def test_a_spike_right_after_the_warmup_is_rolled_back_and_each_step_is_judged_once(make_trainer, run_dir,
                                                                                   restore_threads):
    """spike.warmup_steps=4: step 5 is the first one compared with the mean of the steps before it, and it spikes.
    With snapshot_every=3 the rollback returns to step 3, past the accepted step 4: the history the next steps are
    compared with (saved in the checkpoint) drops it, so the replayed step 4 is in it once."""
    from torchrig.checkpoint import read_checkpoint

    t = _fit(make_trainer, _data(), **dict(SPIKE, **{"spike.warmup_steps": 4, "spike.snapshot_every": 3}))
    ledger = [json.loads(line) for line in (run_dir / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rolled_back_to"], e["samples"]) for e in ledger] == [(5, 3, WINDOW)]
    state, _, _ = read_checkpoint(run_dir / "checkpoints" / "step-00000014")
    assert [h[0] for h in state["spikes"]["history"]] == list(range(1, 15)) and t.global_step == 14


def test_a_resume_from_before_a_rollback_writes_its_ledger_line_once(make_trainer, run_dir, restore_threads):
    """A crash after a rollback and before the next checkpoint (then a restart) resumes from a checkpoint that still
    trains the poisoned samples: the ledger drops the rollback that checkpoint does not hold, and the replay,
    meeting the spike again, writes it once more. The result: one line, and the run without those samples."""
    first = _fit(make_trainer, _data(), **SPIKE, checkpoint_every=4, keep_last=10)
    ledger = run_dir / "skipped_samples.jsonl"
    assert len(ledger.read_text().splitlines()) == 1
    again = _fit(make_trainer, _data(), **SPIKE, checkpoint_every=4, keep_last=10,
                 resume=str(run_dir / "checkpoints" / "step-00000004"))  # saved before the spike at step 5
    assert [(e["step"], e["samples"]) for e in map(json.loads, ledger.read_text().splitlines())] == [(5, WINDOW)]
    assert again.global_step == first.global_step == 14
    for a, b in zip(again.model.parameters(), first.model.parameters()):
        assert (a - b).abs().max().item() < ATOL
    resumed = _fit(make_trainer, _data(), **SPIKE, checkpoint_every=4, keep_last=10, epochs=3,  # after the rollback:
                   resume=str(run_dir / "checkpoints" / "step-00000008"))  # it holds the left-out samples: kept
    assert [e["step"] for e in map(json.loads, ledger.read_text().splitlines())] == [5]
    assert resumed.global_step == 21


def test_a_ledger_line_that_is_not_a_row_is_named_and_a_torn_last_line_dropped(tmp_path):
    """``skipped_samples.jsonl`` read back at a fit's start (a stranger's run folder, or one edited by hand): a line
    that is not a row is one line naming the file and the line (never a bare JSONDecodeError), and nothing is
    rewritten; a last line cut short by a process killed while appending it is dropped."""
    from torchrig.checkpoint.rundir import RunDirError
    from torchrig.trainer.spikes import keep_ledger

    ledger = tmp_path / "skipped_samples.jsonl"
    good = json.dumps({"step": 5, "samples": [3, 4]})
    move = "move it away (the checkpoint itself holds which samples are left out)"
    for bad in ("not json at all", '["a list"]', '{"samples": ["x"]}', '{"samples": [true]}', "[" * 100_000):
        ledger.write_text(f"{good}\n{bad}\n{good}\n")
        with pytest.raises(RunDirError) as err:
            keep_ledger(tmp_path, [3, 4])
        assert str(err.value) == (f"'{ledger}' line 2 is not a row of skipped samples ({{\"step\": ..., \"samples\": "
                                  f"[sample numbers]}}); {move}")
        assert ledger.read_text() == f"{good}\n{bad}\n{good}\n"
    ledger.write_text(f"{good}\n{good[:9]}")
    keep_ledger(tmp_path, [3, 4])
    assert ledger.read_text() == f"{good}\n"
