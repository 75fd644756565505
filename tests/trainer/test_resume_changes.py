"""Resuming with changed settings: exact, or it refuses (``resume_changes=allow`` forces it and says so).

A change that alters the data order, the position or the mathematics is refused in one line naming the
keys with their old and new values, before anything is loaded or written; a harmless one (logging,
checkpoint frequency, workers, a longer run) passes without a word.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import TinyNet, make_classification

from torchrig.cli import main
from torchrig.config import ConfigError

# Trainer keyword, value of the first run, value on resume, the key and values the message shows.
REFUSED = [
    ("seed", 0, 1, "seed 0 → 1"),
    ("batch_size", 8, 16, "data.batch_size 8 → 16"),
    ("lr", 0.05, 0.1, "optim.lr 0.05 → 0.1"),
    ("accumulate", 1, 2, "accumulate 1 → 2"),
    ("shuffle", True, False, "data.shuffle true → false"),
    ("drop_last", False, True, "data.drop_last false → true"),
    ("optimizer", "sgd", "adam", "optim.name sgd → adam"),
    ("clip_grad_norm", None, 1.0, "clip_grad_norm null → 1.0"),
    ("label_smoothing", 0.0, 0.1, "label_smoothing 0.0 → 0.1"),
    ("ema_decay", None, 0.9, "ema_decay null → 0.9"),
]
HARMLESS = [
    ("log_every", 50, 1), ("keep_last", 2, 5), ("checkpoint_every", 0, 2), ("num_workers", 0, "auto"),
    ("eval_every_epochs", 1, 2), ("threads", None, 1), ("progress", "none", "lines"), ("max_steps", None, 8),
]


def _message(checkpoint, shown: str, cli: bool = False) -> str:
    """The refusal, naming the settings as the user writes them: Trainer keywords in Python, --set on the CLI,
    where the short command that takes the run's own settings is named too."""
    how = ("--set overwrite=true", "--set resume_changes=allow") if cli else ("overwrite=True",
                                                                              'resume_changes="allow"')
    short = f" (torchrig train --set run_dir={checkpoint.parent.parent} --set resume=latest takes the run's own " \
            f"settings)" if cli else ""
    return (f"resuming from '{checkpoint}' with changed settings would not be exact: {shown}; set them back{short}, "
            f"start a new run (another run_dir, or {how[0]}), or resume anyway with {how[1]}")


def _snapshot(run_dir) -> dict:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".torchrig.lock"}


@pytest.mark.parametrize("key, first, then, shown", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_change_that_is_not_exact_is_refused_naming_it(make_trainer, data, run_dir, key, first, then, shown,
                                                         restore_threads):
    make_trainer(**{key: first}).fit(data)
    before = _snapshot(run_dir)
    trainer = make_trainer(epochs=2, resume="latest", **{key: then})
    with pytest.raises(ConfigError) as err:
        trainer.fit(data)
    assert str(err.value) == _message(run_dir / "checkpoints" / "step-00000005", shown)
    assert _snapshot(run_dir) == before  # nothing loaded into the run, nothing written
    assert trainer.global_step == 0


@pytest.mark.parametrize("key, first, then, shown", REFUSED[:3], ids=[r[0] for r in REFUSED[:3]])
def test_resume_changes_allow_resumes_and_says_what_is_no_longer_exact(make_trainer, data, run_dir, capsys, key,
                                                                      first, then, shown):
    make_trainer(**{key: first}).fit(data)
    capsys.readouterr()
    trainer = make_trainer(epochs=2, resume="latest", resume_changes="allow", **{key: then})
    trainer.fit(data)
    assert trainer.global_step > 5
    out, err = capsys.readouterr()
    said = [line for line in (out + err).splitlines() if "resume_changes" in line]
    assert said == [f"torchrig: resume_changes=allow: resuming from '{run_dir / 'checkpoints' / 'step-00000005'}' "
                    f"with changed settings, so the run is no longer exact: {shown}"]


@pytest.mark.parametrize("key, first, then", HARMLESS, ids=[h[0] for h in HARMLESS])
def test_a_harmless_change_resumes_without_a_word(make_trainer, data, run_dir, capsys, key, first, then,
                                                  restore_threads):
    make_trainer(**{key: first}).fit(data)
    capsys.readouterr()
    trainer = make_trainer(epochs=2, resume="latest", **{key: then})
    trainer.fit(data)
    assert trainer.global_step == (8 if key == "max_steps" else 10)
    out, err = capsys.readouterr()
    assert "changed settings" not in out + err


def test_a_new_run_length_passes_and_is_said_when_the_schedule_follows_it(make_trainer, data, run_dir, capsys):
    make_trainer(scheduler="cosine").fit(data)
    capsys.readouterr()
    resumed = make_trainer(scheduler="cosine", epochs=2, resume="latest")
    resumed.fit(data)  # a longer run is how a finished run is continued
    assert resumed.global_step == 10
    out, err = capsys.readouterr()
    assert [line for line in (out + err).splitlines() if "schedule" in line] == [
        "torchrig: the cosine schedule follows the run's length, which changed (epochs 1 → 2): from here on its "
        "learning rates are those of a schedule of the new length (the steps so far followed the old one)"]
    other = str(run_dir.with_name("steps"))  # a schedule of a length of its own: nothing to say
    make_trainer(scheduler="step", run_dir=other).fit(data)
    capsys.readouterr()
    make_trainer(scheduler="step", epochs=2, resume="latest", run_dir=other).fit(data)
    out, err = capsys.readouterr()
    assert "schedule" not in out + err


class Swish(TinyNet):
    """The same parameters as TinyNet, another computation."""

    def forward(self, x):
        h = self.backbone[0](x)
        return self.head(h * torch.sigmoid(h))


def test_another_model_class_with_the_same_keys_is_refused(make_trainer, data, run_dir):
    make_trainer().fit(data)
    torch.manual_seed(0)
    with pytest.raises(ConfigError) as err:
        make_trainer(Swish(), epochs=2, resume="latest").fit(data)
    assert str(err.value) == _message(run_dir / "checkpoints" / "step-00000005",
                                      "model.python_class helpers:TinyNet → test_resume_changes:Swish")


@pytest.mark.parametrize("worlds, before, after, refused", [
    ((2, 1), 4, 8, ""), ((1, 2), 8, 4, ""), ((2, 2), 4, 8, "data.batch_size 4 → 8"),
    ((2, 1), 4, 6, "data.batch_size 4 → 6 (global batch 8 → 6 over 2 → 1 data-parallel ranks)"),
    ((2, 1), 4, 4, "data.batch_size 4 → 4 (global batch 8 → 4 over 2 → 1 data-parallel ranks)"),
    pytest.param((2, 1), 4, 4, "", id="restarted"),
    pytest.param((1, 4), (4, 2), (64, 1), "accumulate 2 → 1, data.batch_size 4 → 64 (global batch 8 → 256 over 1 → 4 "
                 "data-parallel ranks)", id="accumulated")])
def test_the_batch_size_that_must_stay_is_the_global_one(worlds, before, after, refused, request, monkeypatch):
    """data.batch_size is per process: a checkpoint of 2 ranks of 4 resumes exactly in 1 process of 8, and the same
    4 per process on 1 instead of 2 is refused by a resume asked for by hand. A job that torchrun (or Slurm)
    restarted on another number of processes, with the same command line, goes on."""
    from torchrig.trainer import changes

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if "restarted" in request.node.name else "0")

    (before, acc_before), (after, acc_after) = (v if isinstance(v, tuple) else (v, 1) for v in (before, after))
    saved = {"data": {"batch_size": before}, "accumulate": acc_before}
    now = {"data": {"batch_size": after}, "accumulate": acc_after}
    found, _ = changes.changed(saved, now, worlds)
    assert ", ".join(f"{k} {a} → {b}{note}" for k, a, b, note in found) == refused


def test_weights_only_resume_compares_nothing(make_trainer, data, run_dir):
    make_trainer().fit(data)
    trainer = make_trainer(lr=0.5, seed=3, resume=str(run_dir / "checkpoints" / "step-00000005"),
                           resume_weights_only=True, run_dir=str(run_dir.with_name("finetune")))
    trainer.fit(data)  # fine-tuning from weights with new settings is what resume_weights_only is for
    assert trainer.global_step == 5


CLI = ["--set", "epochs=1", "--set", "max_steps=2", "--set", "log.plot=false", "--set", "log.tensorboard=false",
       "--set", "log.progress=none"]


@pytest.mark.parametrize("change, shown", [("seed=7", "seed 0 → 7"), ("data.batch_size=16", "data.batch_size 32 → 16"),
                                           ("optim.lr=0.5", None), ("scheduler.name=step", "scheduler.name cosine → step")])
def test_the_cli_refuses_in_one_line_and_allows_on_request(tmp_path, capsys, change, shown):
    run = tmp_path / "run"
    assert main(["train", *CLI, "--set", f"run_dir={run}"]) == 0
    latest = os.readlink(run / "checkpoints" / "latest")
    before = _snapshot(run)
    resume = ["train", *CLI, "--set", f"run_dir={run}", "--set", "resume=latest", "--set", change]
    capsys.readouterr()
    assert main(resume) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    if shown is None:  # the recipe's own default lr, whatever it is
        assert re.search(r": optim\.lr \S+ → 0\.5; ", lines[0]), lines[0]
    else:
        assert lines[0] == f"torchrig: error: {_message(run / 'checkpoints' / latest, shown, cli=True)}"
    assert _snapshot(run) == before
    capsys.readouterr()
    assert main([*resume, "--set", "resume_changes=allow"]) == 0
    out, err = capsys.readouterr()
    assert "torchrig: resume_changes=allow: resuming from " in out + err


def test_the_cli_resumes_with_harmless_changes(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *CLI, "--set", f"run_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["train", *CLI, "--set", f"run_dir={run}", "--set", "resume=latest", "--set", "max_steps=4",
                 "--set", "log.every_steps=1", "--set", "checkpoint.keep_last=3", "--set", "data.num_workers=0",
                 "--set", "log.progress=lines", "--set", "threads=1"]) == 0
    out, err = capsys.readouterr()
    assert "changed settings" not in out + err
    assert ("torchrig: the cosine schedule follows the run's length, which changed (max_steps 2 → 4)" in out + err)
    assert os.readlink(run / "checkpoints" / "latest") == "step-00000004"


def test_the_saved_position_would_otherwise_be_reinterpreted(make_trainer, data, run_dir):
    """Why batch size is refused: the checkpoint's micro-batch count means another place in the epoch."""
    trainer = make_trainer(max_steps=3)
    trainer.fit(data)
    assert trainer.state.batch_in_epoch == 3  # 24 of 40 samples seen at batch 8; at batch 16 it would be 48
    with pytest.raises(ConfigError, match=r"data.batch_size 8 → 16"):
        make_trainer(batch_size=16, resume="latest").fit(data)
    assert torch.load(run_dir / "checkpoints" / "step-00000003" / "state.pt",
                      weights_only=True)["counters"]["global_step"] == 3


def test_a_section_one_process_has_not_registered_is_not_compared():
    """A recipe's section exists in a process that imported the recipe: a checkpoint saved there resumes in a
    process without it (and the other way round). Its keys cannot change what this run computes; a change of
    a key both sides have is still refused."""
    from torchrig.trainer import changes

    saved = {"seed": 0, "myrecipe": {"vocab_size": 8000}, "other": {"size": 32}}  # sections no process here has
    assert changes.changed(saved, {"seed": 0}) == ([], [])
    assert changes.changed({"seed": 0}, saved) == ([], [])
    found, _ = changes.changed(saved, {"seed": 0, "myrecipe": {"vocab_size": 100}})
    assert [(k, a, b) for k, a, b, _ in found] == [("myrecipe.vocab_size", 8000, 100)]


def _recorded(rows: list):
    """default_step that appends ``(epoch, optimizer step, [sample indices])`` per micro-batch (feature 0 of
    make_classification(40) tells the samples apart)."""
    from torchrig.trainer.step import default_step

    index = {v: i for i, v in enumerate(make_classification(40)[0][:, 0].tolist())}

    def step_fn(step, batch):
        rows.append((step.epoch, step.global_step + 1, [index[v] for v in batch[0][:, 0].tolist()]))
        return default_step(step, batch)

    return step_fn


@pytest.mark.parametrize("batch, accumulate, mid_epoch", [(9, 2, True), (12, 2, False), (8, 2, False)],
                         ids=["at-a-step", "inside-a-step", "inside-a-batch"])
def test_a_changed_global_batch_goes_on_with_the_next_sample_or_starts_the_epoch_over(
        make_trainer, data, run_dir, capsys, batch, accumulate, mid_epoch):
    """A checkpoint after 36 of the epoch's 40 samples (3 steps of 12), resumed with resume_changes=allow at another
    global batch: 9 × 2 has a step starting at sample 37, and the run trains the epoch's last 4 samples; 12 × 2 and
    8 × 2 have none (36 falls inside a step, inside a batch of 8: resuming at the epoch's end would skip samples
    36 … 39), and the epoch starts over, said in one line. Either way no sample of the epoch is lost."""
    before: list = []
    make_trainer(batch_size=12, max_steps=3, step_fn=_recorded(before)).fit(data)
    capsys.readouterr()
    after: list = []
    make_trainer(batch_size=batch, accumulate=accumulate, epochs=3, resume="latest", resume_changes="allow",
                 step_fn=_recorded(after)).fit(data)  # 3 epochs of this run's steps: epoch 1 ends before the run
    out, err = capsys.readouterr()
    over = [line for line in (out + err).splitlines() if "resuming at the start of epoch" in line]
    resumed = [i for epoch, _, samples in after if epoch == 0 for i in samples]
    first = [i for _, _, samples in before for i in samples]
    assert len(first) == 36 and len(set(first)) == 36
    if mid_epoch:
        assert over == [] and sorted(first + resumed) == list(range(40))
        assert [(step, len(samples)) for epoch, step, samples in after if epoch == 0] == [(4, 4)]
    else:
        assert over == ["torchrig: the checkpoint stopped after 36 samples of epoch 1, inside an optimizer step of "
                        "this run (its global batch differs); resuming at the start of epoch 1: keep "
                        "data.global_batch_size the same to resume mid-epoch"]
        assert sorted(resumed) == list(range(40))


@pytest.mark.parametrize("saved_on, now_on, placed, expected", [
    (2, 1, 24, (1, 0)), (2, 2, 24, (1, 0)), (2, 2, -1, (1, 3)), (2, 1, -1, (1, 0))],
    ids=["another-world", "same-world", "same-world-stream-read-by-workers", "another-world-stream"])
def test_a_position_this_run_cannot_find_starts_the_epoch_over(saved_on, now_on, placed, expected):
    """A checkpoint of ``saved_on`` processes stopped 3 batches (24 samples) into epoch 2, where no step of this run
    starts: the epoch starts over, said in one line. Only data that cannot place samples (``placed`` -1: a stream
    read by workers) on the same number of processes keeps the checkpoint's own count of batches."""
    from torchrig.trainer.state import TrainState

    over = ("torchrig: the checkpoint stopped after 24 samples of epoch 2, inside an optimizer step of this run (its "
            "global batch differs); resuming at the start of epoch 2: keep data.global_batch_size the same to resume "
            "mid-epoch")
    state = TrainState(global_step=9, epoch=1, batch_in_epoch=3, world_size=saved_on, samples_in_epoch=24)
    said = over if expected[1] == 0 else ""
    assert state.resume_at(now_on, lambda samples: None, lambda batches: placed) == (*expected, said)
    assert state.world_size == now_on
    found = TrainState(epoch=1, batch_in_epoch=3, world_size=saved_on, samples_in_epoch=24)
    assert found.resume_at(now_on, lambda samples: samples // 6, lambda batches: placed) == (1, 4, "")
