"""Trackers honour their own environment variables, as their clients do; a torchrig key set explicitly wins,
and the end-of-run summary says where each tracker wrote.

MLflow: a real ``mlflow server`` on 127.0.0.1 (a free port, an SQLite backend) started by the test, reached
through ``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_NAME`` alone. W&B: offline runs, read back from wandb's
own record file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import tracked_fit

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``http://127.0.0.1:PORT`` of an ``mlflow server`` with an SQLite backend, stopped (its whole process
    group) when the module's tests are done."""
    pytest.importorskip("mlflow")
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    exe = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen([str(exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                             "--default-artifact-root", str(folder / "artifacts")],
                            stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _clear(monkeypatch, prefix: str) -> None:
    for name in [n for n in os.environ if n.startswith(prefix)]:
        monkeypatch.delenv(name)


def test_mlflow_environment_alone_sends_the_run_to_the_server_and_a_key_wins(mlflow_server, tmp_path, monkeypatch,
                                                                             capsys):
    from mlflow.tracking import MlflowClient
    from test_trackers import by_name, jsonl_values

    _clear(monkeypatch, "MLFLOW_")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-digits")
    run = tmp_path / "runs" / "a"
    tracked_fit(run, trackers=["mlflow"], tensorboard=False, epochs=1, progress="lines", log_every=2)
    err = capsys.readouterr().err
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("team-digits")
    got = client.get_run(run_id)
    assert got.info.experiment_id == exp.experiment_id and got.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == \
        sorted(by_name(jsonl_values(run))["train/loss"])
    assert got.data.params["optim.lr"] == "0.001"
    assert not (tmp_path / "runs" / "mlruns").exists()  # nothing beside the runs: the server holds it
    assert (f"torchrig: tracker mlflow run {run_id} in {mlflow_server} (from MLFLOW_TRACKING_URI), experiment "
            f"'team-digits': {mlflow_server}/#/experiments/{exp.experiment_id}/runs/{run_id}") in err

    # the torchrig keys, set, win over the environment
    store = f"sqlite:///{tmp_path / 'mine.db'}"
    other = tmp_path / "runs" / "b"
    tracked_fit(other, trackers=["mlflow"], tensorboard=False, epochs=1, log={"mlflow_uri": store,
                                                                            "project": "mine"})
    other_id = json.loads((other / "trackers.json").read_text())["mlflow"]
    mine = MlflowClient(tracking_uri=store)
    assert mine.get_run(other_id).info.experiment_id == mine.get_experiment_by_name("mine").experiment_id
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]  # none more on the server


def test_mlflow_run_id_and_experiment_id_from_the_environment(mlflow_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from test_trackers import by_name, jsonl_values

    from torchrig.observe.trackers import TrackerError

    _clear(monkeypatch, "MLFLOW_")
    client = MlflowClient(tracking_uri=mlflow_server)
    exp_id = client.create_experiment("by-id")
    parent = client.create_run(exp_id, run_name="made-by-a-pipeline").info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_RUN_ID", parent)  # as mlflow.start_run(): log into that run
    tracked_fit(tmp_path / "r", trackers=["mlflow"], tensorboard=False, epochs=1)
    assert json.loads((tmp_path / "r" / "trackers.json").read_text())["mlflow"] == parent
    assert sorted((m.step, m.value) for m in client.get_metric_history(parent, "train/loss")) == \
        sorted(by_name(jsonl_values(tmp_path / "r"))["train/loss"])

    monkeypatch.delenv("MLFLOW_RUN_ID")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp_id)
    tracked_fit(tmp_path / "s", trackers=["mlflow"], tensorboard=False, epochs=1)
    made = json.loads((tmp_path / "s" / "trackers.json").read_text())["mlflow"]
    assert client.get_run(made).info.experiment_id == exp_id

    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "987654")
    with pytest.raises(TrackerError, match=r"^MLFLOW_EXPERIMENT_ID '987654': the MLflow store 'http://127\.0\.0\.1:"
                                           r"\d+' has no such experiment; unset it, or name one with log\.project$"):
        tracked_fit(tmp_path / "t", trackers=["mlflow"], tensorboard=False, epochs=1)


@pytest.fixture
def fresh_wandb():
    """wandb reads its environment once per process (its setup singleton): set up anew before and after, so
    that these variables neither come from nor leak into another test."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_reads_its_own_variables_and_a_key_wins(tmp_path, monkeypatch, capsys, fresh_wandb):
    from test_trackers import wandb_run

    _clear(monkeypatch, "WANDB_")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "team-project")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-3")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    run = tmp_path / "run"
    tracked_fit(run, trackers=["wandb"], tensorboard=False, epochs=1, progress="lines")
    err = capsys.readouterr().err
    assert not (run / "wandb").exists()
    folders = list((tmp_path / "wandb-home" / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    run_id = wandb_run(folders[0])[0]  # (waits for the file's last record)
    records = _run_records(folders[0])
    assert (records.project, records.entity, records.run_group, records.display_name) == \
        ("team-project", "team", "sweep-3", "run")
    assert (f"torchrig: tracker wandb run {run_id} in {folders[0]} (entity 'team', project 'team-project', group "
            f"'sweep-3'); offline: upload with wandb sync {folders[0]}") in err

    # log.project and log.run_name, set, win over WANDB_PROJECT and WANDB_NAME
    monkeypatch.setenv("WANDB_NAME", "from-env")
    __import__("wandb").teardown()  # WANDB_NAME is read when wandb sets up
    tracked_fit(tmp_path / "other", trackers=["wandb"], tensorboard=False, epochs=1,
                log={"project": "mine", "run_name": "named"})
    newest = max((tmp_path / "wandb-home" / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    wandb_run(newest)
    records = _run_records(newest)
    assert (records.project, records.display_name, records.run_group) == ("mine", "named", "sweep-3")


def _run_records(folder: Path):
    from test_trackers import wandb_records

    return next(r.run for r in wandb_records(folder) if r.WhichOneof("record_type") == "run")
