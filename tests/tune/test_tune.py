"""torchrig tune on the digits default job: small studies (a few trials of 1-3 epochs) that prune, resume
exactly after a SIGKILL and run on two DDP ranks without a hang (--parallel runs in test_readme_tuning.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

import torchrig  # noqa: E402
from helpers import dist_procs, forkserver, read_jsonl, subprocess_env  # noqa: E402
from torchrig.recipes.run import build_config, run_train  # noqa: E402
from torchrig.tune import TuneError  # noqa: E402

QUIET = ["log.progress=none", "log.plot=false", "log.tensorboard=false"]
# The grid sampler shuffles its points by the seed (0): 2e-3, 2.5e-3, 1e-6, 3e-3. Trial 2 (lr 1e-6) learns nothing
# in its first epoch and is pruned there by the median pruner (whose first 2 trials are never pruned); trial 3
# runs after it.
GRID = {"optim.lr": {"choice": [3e-3, 1e-6, 2e-3, 2.5e-3]}}
GRID_ORDER = [2e-3, 2.5e-3, 1e-6, 3e-3]

pytestmark = pytest.mark.usefixtures("restore_threads")


def trials_of(folder: Path) -> list[dict]:
    """Every trial of the study in ``folder``: number, state, params, value, reported values, as Optuna stores them."""
    study = optuna.load_study(study_name="torchrig", storage=f"sqlite:///{folder / 'study.db'}")
    return [{"number": t.number, "state": t.state.name, "params": t.params, "value": t.value,
             "reported": dict(t.intermediate_values)} for t in study.get_trials()]


def test_a_small_study_of_the_digits_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    space = {"optim.lr": {"log_uniform": [1e-5, 1e-2]}, "data.batch_size": {"choice": [32, 64]}}
    result = torchrig.tune(None, space, 5, overrides=["epochs=2", *QUIET], study_dir="study")
    study = tmp_path / "study"
    rows = trials_of(study)
    assert [r["number"] for r in rows] == [0, 1, 2, 3, 4]
    assert {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    assert len({r["params"]["optim.lr"] for r in rows}) == 5  # each trial its own draw
    schedule = set()  # each trial's first epoch's logged lr over its drawn lr: one schedule, the trial's own lr
    for r in rows:  # each trial is a torchrig run of its own, its value the best val/accuracy of its epochs
        run = study / "trials" / str(r["number"])
        record = json.loads((run / "trial.json").read_text())
        assert record["state"] == r["state"].lower() and record["params"] == r["params"]
        epochs = [row for row in read_jsonl(run / "metrics.jsonl") if "val/accuracy" in row]
        assert {e["epoch"]: e["val/accuracy"] for e in epochs} == r["reported"]
        # trained with its parameters: the digits job's 1151 training samples make 36 steps of 32, 18 of 64
        assert epochs[0]["step"] == {32: 36, 64: 18}[r["params"]["data.batch_size"]]
        schedule.add(round(epochs[0]["lr"] / r["params"]["optim.lr"], 9))
        if r["state"] == "COMPLETE":
            assert r["value"] == max(r["reported"].values()) and len(epochs) == 2
            assert (run / "checkpoints" / "latest" / "config.yaml").exists()
        assert (run / "PRUNED").exists() == (r["state"] == "PRUNED")
    assert len(schedule) == 1
    best = max((r for r in rows if r["state"] == "COMPLETE"), key=lambda r: r["value"])
    assert (result.best_trial, result.best_value, result.monitor) == (best["number"], best["value"], "val/accuracy")
    out = capsys.readouterr().out
    table = out[out.index("trial  state"):].splitlines()[:6]
    assert all(len(line) <= 80 for line in table) and table[1 + best["number"]].startswith(f"{best['number']}*")
    assert (study / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((study / "trials.csv").read_text().splitlines()) == 6
    # best.yaml: what torchrig train takes as it is, the best trial's config less its run directory
    text = (study / "best.yaml").read_text()
    assert text.startswith("# torchrig tune: the best of 5 trials") and "train it: torchrig train study/best.yaml" in text
    cfg = build_config("study/best.yaml")
    assert cfg.optim.lr == best["params"]["optim.lr"] and cfg.data.batch_size == best["params"]["data.batch_size"]
    trained = json.loads(json.dumps(torchrig.config.to_dict(cfg)))
    saved = __import__("yaml").safe_load((study / "trials" / str(best["number"]) / "checkpoints" / "latest"
                                          / "config.yaml").read_text())
    for key in ("run_dir", "resume", "overwrite", "log"):  # the run's own keys (a study prints one model summary)
        trained.pop(key), saved.pop(key)
    assert trained == saved
    assert run_train(build_config("study/best.yaml", ["epochs=1", "run_dir=again"]), out=lambda s: None)


def test_the_median_pruner_stops_a_trial_that_learns_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torchrig.tune(None, GRID, 4, sampler="grid", overrides=["epochs=2", *QUIET], study_dir="grid")
    rows = trials_of(tmp_path / "grid")
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"]
    assert [r["params"]["optim.lr"] for r in rows] == GRID_ORDER
    assert list(rows[2]["reported"]) == [1]  # stopped after its first epoch
    pruned = tmp_path / "grid" / "trials" / "2"
    assert (pruned / "PRUNED").read_text().startswith("pruned by the median pruner after epoch 1 (val/accuracy")
    assert "tune: trial 2 pruned after epoch 1" in capsys.readouterr().out


def test_a_study_is_resumed_only_as_it_was_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = {"optim.lr": {"choice": [3e-3]}}
    torchrig.tune(None, space, 1, overrides=["epochs=1", *QUIET], study_dir="s")
    with pytest.raises(TuneError, match="holds a study already; continue it with --resume"):
        torchrig.tune(None, space, 1, overrides=["epochs=1", *QUIET], study_dir="s")
    with pytest.raises(TuneError, match=r"the config differs .*: epochs=2 \(was 1\)"):
        torchrig.tune(None, space, 2, overrides=["epochs=2", *QUIET], study_dir="s", resume=True)
    with pytest.raises(TuneError, match="was started with --sampler tpe, not random"):
        torchrig.tune(None, None, 2, sampler="random", study_dir="s", resume=True)
    with pytest.raises(TuneError, match="was started with the search space"):
        torchrig.tune(None, {"optim.lr": {"choice": [1e-3]}}, 2, study_dir="s", resume=True)
    with pytest.raises(TuneError, match="holds no study"):
        torchrig.tune(None, space, 1, study_dir="elsewhere", resume=True)
    result = torchrig.tune(None, None, 2, study_dir="s", resume=True)  # the manifest has the rest
    assert [r["state"] for r in trials_of(tmp_path / "s")] == ["COMPLETE", "COMPLETE"] and result.best_trial == 0


def test_the_command_line(tmp_path, monkeypatch, capsys):
    from torchrig.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--space", "space.yaml", "--trials", "2"]) == 1
    out, err = capsys.readouterr()
    assert err.strip() == "torchrig: error: search space file 'space.yaml' does not exist; write the keys to search " \
                          "in it, e.g. 'optim.lr: {log_uniform: [1e-4, 3e-2]}' (docs/tuning.md shows every kind)"
    assert "writing to" not in out and not (tmp_path / "runs" / "tune" / "1").exists()  # no folder named, none left
    (tmp_path / "space.yaml").write_text("optim.lrr: {log_uniform: [1e-5, 1e-1]}\n")
    assert main(["tune", "--space", "space.yaml", "--trials", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "torchrig: error: space.yaml: unknown config key 'optim.lrr'; did you mean 'optim.lr'?"
    (tmp_path / "space.yaml").write_text("optim.lr: {choice: [0.003]}\n")
    assert main(["tune", "--space", "space.yaml"]) == 1
    assert "a new study needs --trials N" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tune" / "1" / "study.json").exists()
    assert main(["tune", "--space", "space.yaml", "--trials", "1",
                 *[f"--set={s}" for s in ["epochs=1", "run_dir=elsewhere", *QUIET]]]) == 0
    out = capsys.readouterr().out
    assert "writing to runs/tune/1" in out and "tune: best trial 0 · val/accuracy" in out
    assert f"tune: run_dir elsewhere is not used: each trial is a run in {Path('runs/tune/1/trials')}/N, and the " \
           f"study's folder is --study-dir (study_dir=)" in out
    assert not (tmp_path / "elsewhere").exists()
    assert (tmp_path / "runs" / "tune" / "1" / "best.yaml").exists()


def test_a_storage_url_of_the_users(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    result = torchrig.tune(None, {"optim.lr": {"choice": [3e-3]}}, 1, storage=url, study_dir="mine",
                           overrides=["epochs=1", *QUIET])
    assert not (tmp_path / "mine" / "study.db").exists() and result.best_trial == 0
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert names == [f"torchrig:{(tmp_path / 'mine').resolve()}"]  # named by its directory: one storage, many studies
    with pytest.raises(TuneError, match="was started with --storage"):
        torchrig.tune(None, None, 2, storage=f"sqlite:///{tmp_path / 'other.db'}", study_dir="mine", resume=True)


def test_without_optuna_tune_says_what_to_install(tmp_path):
    blocker = tmp_path / "no_optuna" / "optuna"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named optuna')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env["PYTHONPATH"]])
    r = forkserver.run(["-m", "torchrig", "tune", "--space", "space.yaml", "--trials", "2"], env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == ("torchrig: error: torchrig tune needs Optuna, which is not installed: "
                                "pip install 'torchrig[tune]' (or pip install optuna)")


# ----------------------------------------------------------------------------- processes


def _tune(args: list[str], cwd: Path) -> forkserver.Forked:
    return forkserver.popen(["-m", "torchrig", "tune", *args], env=subprocess_env(), cwd=str(cwd),
                            start_new_session=True)


@pytest.mark.slow
def test_a_study_killed_mid_trial_resumes_to_the_same_trials_and_values(tmp_path):
    """SIGKILL while trial 2 trains (after its first epoch's checkpoint), --resume: the same trials, parameters,
    reported values and states as a study never stopped, with the same seed; trial 2 went on from its checkpoint."""
    (tmp_path / "space.yaml").write_text("optim.lr: {log_uniform: [1e-5, 1e-2]}\n"
                                         "data.batch_size: {choice: [32, 64]}\n")
    args = ["--space", "space.yaml", "--trials", "4", *[f"--set={s}" for s in ["epochs=3", *QUIET]]]
    whole = _tune([*args, "--study-dir", "whole"], tmp_path)
    killed = _tune([*args, "--study-dir", "killed"], tmp_path)
    ckpt = tmp_path / "killed" / "trials" / "2" / "checkpoints"
    assert forkserver.wait_until(lambda: any(ckpt.glob("step-*")) or killed.poll() is not None, timeout=300)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL, killed.communicate()[1][-3000:]
    assert trials_of(tmp_path / "killed")[2]["state"] == "RUNNING"  # killed mid-trial
    resumed = _tune(["--study-dir", "killed", "--resume"], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert "tune: trial 2 (3 of 4) resumed" in out
    assert whole.wait(timeout=300) == 0, whole.communicate()[1][-3000:]
    assert trials_of(tmp_path / "killed") == trials_of(tmp_path / "whole")
    steps = [row["step"] for row in read_jsonl(tmp_path / "killed" / "trials" / "2" / "metrics.jsonl")]
    assert steps == sorted(steps)  # one run read back: the rows after the checkpoint were cut, then trained again


@pytest.mark.slow
def test_two_ddp_ranks_prune_together_without_a_hang(tmp_path):
    (tmp_path / "space.yaml").write_text(json.dumps(GRID))
    r = dist_procs.torchrig(["launch", "--nproc-per-node", "2", "--", "tune", "--space", "space.yaml", "--trials", "4",
                             "--sampler", "grid", "--study-dir", "ddp", *[f"--set={s}" for s in ["epochs=2", *QUIET]]],
                            timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.output[-4000:]
    rows = trials_of(tmp_path / "ddp")
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"]  # and a trial after it
    assert r.output.count("2 process(es) on cpu · strategy ddp") == 4
    assert (tmp_path / "ddp" / "trials" / "2" / "PRUNED").exists()


def test_a_study_given_no_config_searches_the_default_digits_job(tmp_path):
    """Without a config, the trials are the digits job as ``torchrig train`` runs it: its recipe's epochs, optimizer
    and validation split (held out of the training images, never the test split)."""
    from torchrig.recipes.run import build_config
    from torchrig.tune.study import open_study

    session = open_study(tmp_path / "s", base=None, space={"optim.lr": {"log_uniform": [1e-4, 3e-2]}}, trials=1,
                         sampler=None, pruner=None, storage=None, resume=False, out=lambda s: None)
    try:
        config = json.loads((tmp_path / "s" / "study.json").read_text())["config"]
        job = build_config()
        assert (config["epochs"], config["optim"]["name"], config["data"]["val_fraction"], config["metrics"]) == \
            (job.epochs, job.optim.name, job.data.val_fraction, job.metrics) == \
            (15, "adamw", 0.2, ["accuracy", "top5", "f1"])
    finally:
        session.lock.release()

