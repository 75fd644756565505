"""``torchrig train --set run_dir=R --set resume=latest``: a resume from the command line takes the run's own
settings from its checkpoint, with the command's ``--set`` on top; a run_dir that does not exist is refused."""

from __future__ import annotations

import pytest
import yaml
from helpers import one_line_error

from torchrig.cli import main

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none",
         "--set", "log.summary=false"]


def _saved(run, key: str):
    cfg = yaml.safe_load((run / "checkpoints" / "latest" / "config.yaml").read_text())
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Three steps of the digits job with settings a resume would refuse as changed if they were lost."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *QUICK, "--set", "run_dir=runs/cli", "--set", "data.batch_size=64", "--set",
                 "optim.lr=0.01", "--set", "seed=3", "--set", "max_steps=3"]) == 0
    return tmp_path / "runs" / "cli"


def test_a_resume_with_a_run_dir_takes_the_runs_settings_and_the_commands_on_top(run, capsys):
    capsys.readouterr()
    assert main(["train", "--set", "run_dir=runs/cli", "--set", "resume=latest", "--set", "max_steps=5",
                 "--set", "log.plot=false", "--set", "log.tensorboard=false"]) == 0
    out, err = capsys.readouterr()
    assert "torchrig: resume=latest: the run's settings are read back from " \
           f"{run.resolve() / 'checkpoints' / 'step-00000003' / 'config.yaml'}; this command's config file and " \
           "--set go on top" in out
    assert "resumed at step 3" in out + err
    assert _saved(run, "max_steps") == 5  # the command's --set
    assert (_saved(run, "data.batch_size"), _saved(run, "optim.lr"), _saved(run, "seed")) == (64, 0.01, 3)
    assert _saved(run, "log.progress") == "auto"  # a key of this process (log, dist, device …): this command's


def test_a_changed_setting_is_still_refused_and_the_short_command_named(run, capsys):
    line = one_line_error(capsys, ["train", "--set", "run_dir=runs/cli", "--set", "resume=latest", "--set",
                                   "optim.lr=0.02"])
    assert line == "torchrig: error: " + (
        f"resuming from '{run.resolve() / 'checkpoints' / 'step-00000003'}' with changed settings would not be "
        f"exact: optim.lr 0.01 → 0.02; set them back (torchrig train --set run_dir=runs/cli --set resume=latest "
        f"takes the run's own settings), start a new run (another run_dir, or --set overwrite=true), or resume "
        f"anyway with --set resume_changes=allow")


def test_a_resume_never_takes_resume_changes_from_the_run(run, capsys):
    assert main(["train", "--set", "run_dir=runs/cli", "--set", "resume=latest", "--set", "max_steps=4",
                 "--set", "optim.lr=0.02", "--set", "resume_changes=allow", *QUICK]) == 0
    assert _saved(run, "resume_changes") == "allow"  # what that resume was allowed ...
    one_line_error(capsys, ["train", "--set", "run_dir=runs/cli", "--set", "resume=latest", "--set", "optim.lr=0.03"],
                   "with changed settings would not be exact: optim.lr 0.02 → 0.03")  # ... not this one's


def test_a_run_started_from_weights_resumes_with_the_short_command(run, capsys):
    weights = run / "checkpoints" / "latest" / "model.safetensors"
    assert main(["train", *QUICK, "--set", "run_dir=runs/tuned", "--set", f"model.weights={weights}",
                 "--set", "max_steps=2"]) == 0
    # model.weights is this command's (a checkpoint never picks a file to load): not given now, yet no refusal,
    # since the resumed checkpoint's weights replace what it loaded
    assert main(["train", *QUICK, "--set", "run_dir=runs/tuned", "--set", "resume=latest", "--set", "max_steps=3"]) == 0
    assert _saved(run.parent / "tuned", "max_steps") == 3 and _saved(run.parent / "tuned", "model.weights") is None


def test_a_run_dir_that_does_not_exist_is_refused_with_the_nearest_ones(run, capsys, tmp_path):
    (tmp_path / "runs" / "other").mkdir()
    line = one_line_error(capsys, ["train", "--set", "run_dir=runs/clii", "--set", "resume=latest"])
    assert line == "torchrig: error: " + (
        "run_dir 'runs/clii' does not exist, so --set resume=latest has no run to continue; did you mean "
        "'runs/cli'? To start a new run there, leave out --set resume=latest, or create the folder first (an "
        "empty run_dir starts at step 0)")
    one_line_error(capsys, ["train", "--set", "run_dir=rnus/cli", "--set", "resume=best"],  # a typo further up
                   "did you mean 'runs/cli'?")
    assert not (tmp_path / "runs" / "clii").exists() and not (tmp_path / "rnus").exists()


def test_an_existing_empty_run_dir_starts_at_step_0(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job").mkdir()  # a scheduler's first start of a job whose every start resumes
    assert main(["train", *QUICK, "--set", "run_dir=job", "--set", "resume=latest", "--set", "max_steps=2"]) == 0
    assert "torchrig: resume=latest: job holds no checkpoint yet; training starts at step 0" in capsys.readouterr().out
    assert _saved(tmp_path / "job", "max_steps") == 2
