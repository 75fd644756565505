"""Trackers: every value of metrics.jsonl, read back through each package's own API.

CSV and TensorBoard files, an MLflow store (SQLite, and the file store) read with ``MlflowClient``,
a W&B offline run folder read with wandb's own record format; a resumed run goes on in the same
tracker run; a tracker whose package is missing stops the run before training, naming the extra.
"""

from __future__ import annotations

import csv
import json
import struct
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from torch.utils.data import TensorDataset

import torchrig
from helpers import QUIET, TRACKED_FINAL, TinyNet, make_classification, tracked_fit
from torchrig.config import ConfigError
from torchrig.observe.trackers import TrackerError

FINAL = TRACKED_FINAL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A runs/ folder shared by the MLflow tests: its mlruns/mlflow.db is created (slowly) once."""
    return tmp_path_factory.mktemp("runs")


def fit(run_dir: Path, trackers: list, **kw):
    """A tiny run (4 optimizer steps per epoch, a row every 2) whose trackers end with FINAL."""
    return tracked_fit(run_dir, trackers=trackers, **kw)


def jsonl_values(run_dir: Path) -> list[tuple[int, str, float]]:
    """(step, name, value) of every number in metrics.jsonl, in order."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out += [(row["step"], k, float(v)) for k, v in row.items()
                if k not in ("step", "epoch", "kind") and isinstance(v, (int, float))]
    return out


def by_name(values) -> dict[str, list[tuple[int, float]]]:
    out = defaultdict(list)
    for step, name, value in values:
        out[name].append((step, value))
    return dict(out)


def test_csv_and_tensorboard_hold_every_logged_value(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    fit(run, ["csv", "tensorboard"], tensorboard="auto")
    logged = jsonl_values(run)
    assert {"train/loss", "samples_per_s", "val/accuracy"} <= {n for _, n, _ in logged}

    with open(run / "csv" / "metrics.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "name", "value"]
    assert [(int(s), n, float(v)) for s, n, v in rows[1:]] == logged
    with open(run / "csv" / "params.csv", newline="") as fh:
        params = dict(list(csv.reader(fh))[1:])
    assert params["optim.lr"] == "0.001" and params["data.batch_size"] == "8" and params["run_dir"] == str(run)
    with open(run / "csv" / "final.csv", newline="") as fh:
        final = dict(list(csv.reader(fh))[1:])
    assert {k: float(final[k]) for k in FINAL} == FINAL and final["run_dir"] == str(run)

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for name, points in by_name(logged).items():
        assert [(e.step, e.value) for e in acc.Scalars(name)] == [(s, pytest.approx(v)) for s, v in points]
    assert acc.Scalars("test/accuracy")[-1].value == pytest.approx(FINAL["test/accuracy"])
    assert acc.Scalars("test/accuracy")[-1].step == 8  # the last step
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(acc.PluginTagToContent("hparams"))


def test_mlflow_sqlite_store_beside_the_run_holds_every_value(runs):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = runs / "1"
    trainer = fit(run, ["mlflow"], tensorboard=False)
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")  # the default store
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "1"
    assert got.data.tags["torchrig.run_dir"] == str(run.resolve())
    assert got.data.params["optim.lr"] == "0.001" and got.data.params["log.trackers"] == "['mlflow']"
    for name, points in by_name(jsonl_values(run)).items():
        history = client.get_metric_history(run_id, name)
        assert sorted((m.step, m.value) for m in history) == sorted(points), name
    assert {k: got.data.metrics[k] for k in FINAL} == FINAL
    assert trainer.logger.trackers.where() == [f"mlflow run {run_id} in sqlite:///{runs.resolve() / 'mlruns' / 'mlflow.db'}"
                                               f", experiment 'torchrig'"]


def test_mlflow_file_store_and_a_project_name(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this to use a file store
    uri = (tmp_path / "store").as_uri()
    run = tmp_path / "run"
    fit(run, ["mlflow"], tensorboard=False, epochs=1, log={"mlflow_uri": uri, "project": "digits",
                                                          "run_name": "first"})
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert [r.info.run_name for r in runs] == ["first"]
    points = by_name(jsonl_values(run))["train/loss"]
    assert sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "train/loss")) == \
        sorted(points)


def wandb_records(run_folder: Path) -> list:
    """The records of an offline run's ``run-ID.wandb`` file, parsed with wandb's own protobuf
    ``Record`` (the file: a 7-byte header, then 32 KiB blocks of checksummed, length-prefixed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_folder.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if size == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + size > len(data):  # a chunk still being written
            break
        buf += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def wandb_run(run_folder: Path) -> tuple[str, dict, dict[int, dict], dict]:
    """(run id, config, history by step, summary) of one offline run folder."""
    run_id, config, history, summary = "", {}, {}, {}
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    deadline = time.monotonic() + 20
    records = wandb_records(run_folder)
    # run.finish() returns before wandb's service process has written the file's last records
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = wandb_records(run_folder)
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":  # the first one names the run; later ones may only update it
            run_id = run_id or r.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            row = {key(i): json.loads(i.value_json) for i in r.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            summary.update({key(u): json.loads(u.value_json) for u in r.summary.update})
    return run_id, config, history, summary


def test_wandb_offline_run_holds_every_value(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    trainer = fit(run, ["wandb"], tensorboard=False, log={"project": "digits"})
    folders = list((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    run_id, config, history, summary = wandb_run(folders[0])
    assert run_id == json.loads((run / "trackers.json").read_text())["wandb"]
    assert config["optim"]["lr"] == 0.001 and config["run_dir"] == str(run)
    expected: dict[int, dict] = defaultdict(dict)
    for step, name, value in jsonl_values(run):  # rows of one step merge; a later value wins
        expected[step][name] = value
    assert history == {s: pytest.approx(v) for s, v in expected.items()}
    assert {k: summary[k] for k in FINAL} == FINAL
    assert trainer.logger.trackers.where() == [f"wandb run {run_id} in {folders[0]} (project 'digits'); offline: "
                                               f"upload with wandb sync {folders[0]}"]


def test_a_resumed_run_goes_on_in_the_same_tracker_runs(runs, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = runs / "2"
    first = fit(run, ["csv", "mlflow", "wandb"], tensorboard=False, max_steps=6, checkpoint_every=2)
    ids = json.loads((run / "trackers.json").read_text())
    assert first.global_step == 6
    fit(run, ["csv", "mlflow", "wandb"], tensorboard=False, resume="latest")
    assert json.loads((run / "trackers.json").read_text()) == ids

    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("torchrig").experiment_id], "attributes.run_name = '2'")
    assert [r.info.run_id for r in found] == [ids["mlflow"]]  # one MLflow run, not two
    assert {m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")} == {2, 4, 6, 8}

    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2  # W&B writes one folder per process; `wandb sync` joins them by id
    parts = [wandb_run(f) for f in folders]
    assert [p[0] for p in parts] == [ids["wandb"]] * 2
    assert sorted(parts[0][2]) == [2, 4, 6] and sorted(parts[1][2]) == [8]

    with open(run / "csv" / "metrics.csv", newline="") as fh:
        steps = [int(r[0]) for r in list(csv.reader(fh))[1:] if r[1] == "train/loss"]
    assert steps == [s for s, n, _ in jsonl_values(run) if n == "train/loss"]


def test_mlflow_keeps_one_point_per_step_when_a_run_resumes_from_an_earlier_checkpoint(runs):
    """The stopped run got to step 6; resumed from step 4, it trains step 6 again. MLflow cannot delete a
    point, so the resumed run does not log a metric at a step that already has it (the same value: resume
    is exact) and the history reads as metrics.jsonl does."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = runs / "resumed-early"
    fit(run, ["mlflow"], tensorboard=False, max_steps=6, checkpoint_every=2)
    fit(run, ["mlflow"], tensorboard=False, resume=str(run / "checkpoints" / "step-00000004"))
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    logged = by_name(jsonl_values(run))
    assert [s for s, _ in logged["train/loss"]] == [2, 4, 4, 6, 8, 8]  # an interval and an epoch row at 4, 8
    for name in ("train/loss", "train/accuracy", "grad_norm"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert history == [(s, pytest.approx(v)) for s, v in sorted(logged[name])], name


def test_mlflow_keeps_the_epoch_row_a_stop_signal_cut_off(runs):
    """A stop signal during the epoch's last step (a log step): the stopped run logs the interval row at
    step 4 and its checkpoint, not the epoch row. Resumed there, the epoch row at step 4 is new to MLflow."""
    pytest.importorskip("mlflow")
    import os
    import signal

    from mlflow.tracking import MlflowClient

    from torchrig.runtime import RunStopped
    from torchrig.trainer.step import default_step

    def step_fn(step, batch):
        out = default_step(step, batch)
        if step.global_step == 3 and not sent:  # optimizer step 4, the epoch's last
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    sent, run = [], runs / "signalled"
    with pytest.raises(RunStopped):
        fit(run, ["mlflow"], tensorboard=False, step_fn=step_fn)
    assert [s for s, _ in by_name(jsonl_values(run))["train/loss"]] == [2, 4]
    fit(run, ["mlflow"], tensorboard=False, step_fn=step_fn, resume="latest")
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    logged = by_name(jsonl_values(run))
    assert [s for s, _ in logged["train/loss"]] == [2, 4, 4, 6, 8, 8]
    for name in ("train/loss", "train/accuracy", "val/accuracy"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert history == [(s, pytest.approx(v)) for s, v in sorted(logged[name])], name


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_missing_tracker_package_stops_the_run_before_training(name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # `import mlflow` now fails, as when it is not installed
    x, y = make_classification(16)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path / "run"), trackers=["csv", name], batch_size=8,
                               epochs=1, **QUIET)
    with pytest.raises(TrackerError) as err:
        trainer.fit(TensorDataset(x, y))
    assert str(err.value) == (f"log.trackers: '{name}' needs the {name} package, which is not installed; "
                              f'pip install "torchrig[{name}]" or remove {name} from log.trackers')
    assert trainer.global_step == 0


def test_tensorboard_listed_and_switched_off_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'log.tensorboard': false, but log.trackers lists"):
        torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), trackers=["tensorboard"], tensorboard=False)


def test_a_second_fit_of_one_trainer_logs_into_the_same_mlflow_run(runs):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    x, y = make_classification(32)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(runs / "3"), batch_size=8, epochs=1, log_every=2,
                               num_workers=0, trackers=["mlflow"], **QUIET)
    trainer.fit(TensorDataset(x, y))
    trainer.fit(TensorDataset(x, y))  # trains 4 more steps
    trainer.close()
    run_id = json.loads((runs / "3" / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == [s for s, n, _ in jsonl_values(runs / "3") if n == "train/loss"] == [2, 4, 4, 6, 8, 8]
    found = client.search_runs([client.get_experiment_by_name("torchrig").experiment_id], "attributes.run_name = '3'")
    assert len(found) == 1


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from torchrig.observe import trackers

    class FullDisk(trackers.CSVTracker):
        def log(self, values, step):
            if step >= 4:
                raise OSError(28, "No space left on device")
            super().log(values, step)

    monkeypatch.setitem(trackers.REGISTRY, "csv", FullDisk)
    trainer = fit(tmp_path, ["csv"])
    assert trainer.global_step == 8
    assert ("torchrig: tracker 'csv' failed at step 4 (OSError: [Errno 28] No space left on device); it is off "
            "for the rest of this run, metrics.jsonl has every value") in capsys.readouterr().err
    with open(tmp_path / "csv" / "metrics.csv", newline="") as fh:
        assert {int(r[0]) for r in list(csv.reader(fh))[1:]} == {2}
    assert max(s for s, _, _ in jsonl_values(tmp_path)) == 8


def test_tensorboard_asked_for_by_log_tensorboard_names_that_key_when_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    x, y = make_classification(16)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), batch_size=8, epochs=1, plot=False,
                               progress="none", tensorboard=True)
    with pytest.raises(TrackerError, match=r"^log.tensorboard: 'tensorboard' needs the tensorboard package, which "
                                           r"is not installed; pip install \"torchrig\[tensorboard\]\" or set "
                                           r"log.tensorboard=false$"):
        trainer.fit(TensorDataset(x, y))


@pytest.mark.slow
def test_under_ddp_only_rank_0_writes_trackers_and_profiles(tmp_path):
    from helpers import dist_procs

    results = dist_procs.pair("trackers", tmp_path, tmp_path / "init-store", timeout=90)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert [json.loads((tmp_path / f"trackers-{r}.json").read_text()) for r in (0, 1)] == [
        {"steps": 4, "wrote": True}, {"steps": 4, "wrote": False}]
    run = tmp_path / "run"
    with open(run / "csv" / "metrics.csv", newline="") as fh:
        assert [(int(s), n, float(v)) for s, n, v in list(csv.reader(fh))[1:]] == jsonl_values(run)  # once, not twice
    per_sample = 4 * 16 * 32 + 6 * 32 * 32 + 6 * 32 * 4  # 16 -> 32 -> 32 -> 4, as in test_throughput
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "flops_per_s" in r] == [1, 2, 3, 4]
    assert all(r["flops_per_s"] == pytest.approx(per_sample * r["samples_per_s"]) for r in rows if "flops_per_s" in r)
    assert (run / "profile" / "trace.json").stat().st_size > 0
    assert "profiled steps 2-3" in results[0].stderr and "profiled" not in results[1].stderr


def test_a_run_that_fails_ends_its_mlflow_run_as_failed(runs):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from torchrig.trainer.step import default_step

    def broken_at_3(step, batch):
        if step.global_step == 2:
            raise RuntimeError("out of memory")
        return default_step(step, batch)

    x, y = make_classification(32)
    trainer = torchrig.Trainer(TinyNet(), step_fn=broken_at_3, run_dir=str(runs / "4"), batch_size=8, epochs=1,
                               log_every=1, num_workers=0, trackers=["mlflow"], **QUIET)
    with pytest.raises(RuntimeError, match="out of memory"), trainer:
        trainer.fit(TensorDataset(x, y))
    run_id = json.loads((runs / "4" / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]


def test_a_store_mlflow_refuses_is_one_line_naming_the_key(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "store").as_uri()
    x, y = make_classification(16)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path / "run"), batch_size=8, epochs=1, trackers=["mlflow"],
                               log={"mlflow_uri": uri}, **QUIET)
    with pytest.raises(TrackerError) as err:
        trainer.fit(TensorDataset(x, y))
    message = str(err.value)
    assert message.startswith(f"log.mlflow_uri {uri!r}: MLflow refused the run: ") and "\n" not in message
    assert "MLFLOW_ALLOW_FILE_STORE" in message and message.endswith("e.g. sqlite:///mlflow.db")
    assert trainer.global_step == 0


def test_importing_torchrig_imports_no_tracker_package():
    import subprocess

    code = ("import sys, torchrig, torchrig.observe.trackers, torchrig.observe.profiling; "
            "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))")
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(torchrig.__file__).parent.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"


def test_a_run_id_that_is_no_id_starts_a_new_tracker_run(tmp_path, capsys):
    """trackers.json lives in a run directory that may come from someone else: only id-like values are
    continued; a path, a traversal or a non-string is dropped with one line naming the file and the tracker."""
    from torchrig.observe.trackers import _read_ids

    path = tmp_path / "trackers.json"
    path.write_text(json.dumps({"mlflow": "0123456789abcdef0123456789abcdef", "wandb": "../../etc/passwd",
                                "csv": "a..b", "tensorboard": 7}))
    assert _read_ids(path) == {"mlflow": "0123456789abcdef0123456789abcdef"}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "'wandb' run id '../../etc/passwd' is not a run id" in err[0] and "trackers.json" in err[0]
    assert "wandb starts a new run" in err[0] and "'csv' run id 'a..b'" in err[1]


@pytest.mark.parametrize("content", ["{not json", '["mlflow", "abc"]', '"abc"', "[" * 100_000])
def test_a_tracker_ids_file_that_is_not_a_mapping_is_said_and_each_tracker_starts_anew(tmp_path, capsys, content):
    from torchrig.observe.trackers import TrackerSet

    path = tmp_path / "trackers.json"
    path.write_text(content)
    TrackerSet.open([], tmp_path, {}, start_step=5)
    assert capsys.readouterr().err.strip().splitlines() == [
        f"torchrig: tracker ids file '{path}' is not a JSON mapping of tracker names to run ids; each tracker starts "
        f"a new run"]
