"""Experiment trackers: CSV, TensorBoard, MLflow and Weights & Biases behind one small interface.

Each tracker is one class with ``start(config, run_dir, resume_id) -> run id or None``,
``log(values, step)`` and ``finish(final_metrics)``; :data:`REGISTRY` maps the names of
``log.trackers`` to them. :class:`TrackerSet` runs the chosen ones for the main process: it gives
each the flattened config as hyperparameters, every logged row with its optimizer step, the final
metrics and the run directory, and keeps the tracker run ids in ``trackers.json`` in the run
directory, so that a resumed run goes on logging into the same MLflow run / W&B run.

Tracker packages are imported when a tracker starts (TensorBoard's by the tracker's own thread, off the
training path), never when torchrig is imported.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from ..config.files import UnsafePathError, make_dir, open_append, write_atomic
from ..config import files
from ..config.loading import flat_keys
from ..checkpoint.rundir import describe_os_error
from ..errors import TorchrigError

IDS_FILE = "trackers.json"


class TrackerError(TorchrigError, RuntimeError):
    """A tracker that cannot start: its package is missing, or its store refuses the run."""


def _numbers(values: dict) -> dict[str, float]:
    """The plain numbers of a row (no bools, strings or None)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """One destination of the logged values. ``log`` is called on rank 0 only, at log steps."""

    name = ""
    package = ""  # the import that must succeed; the extra to install is torchrig[<name>]
    failed_step: Optional[int] = None  # set by a tracker that writes in a thread: the row its error came from

    def __init__(self, options: Any = None, start_step: int = 0):
        self.options, self.start_step = options, start_step
        self.last_step = start_step
        self.where = ""  # for the end-of-run summary: where to find this run

    def start(self, config: dict, run_dir: Path, resume_id: Optional[str]) -> Optional[str]:
        return None

    def log(self, values: dict, step: int) -> None:
        pass

    def finish(self, final_metrics: dict, status: str = "FINISHED") -> None:
        """``status``: FINISHED, FAILED (an error), or KILLED (a stop signal or Ctrl-C: resumable)."""

    def flush(self) -> None:
        pass

    def _option(self, key: str) -> Any:
        return getattr(self.options, key, None)


class CSVTracker(Tracker):
    """Plain files under ``RUN_DIR/csv``: ``metrics.csv`` (step,name,value, one row per value),
    ``params.csv`` (the config and the run directory) and ``final.csv`` (the final metrics)."""

    name = "csv"

    def start(self, config: dict, run_dir: Path, resume_id: Optional[str]) -> Optional[str]:
        self.dir = make_dir(run_dir / "csv", root=run_dir)
        _write_pairs(self.dir / "params.csv", {**flat_keys(config), "run_dir": str(run_dir)})
        path = self.dir / "metrics.csv"
        kept = _csv_rows_up_to(path, self.start_step) if path.exists() else []
        write_atomic(path, _csv_text([["step", "name", "value"], *kept]), root=run_dir)  # then appended to
        self._fh = open_append(path, "CSV tracker file", "move it away, or choose another run_dir", TrackerError,
                               root=run_dir)
        self._csv = csv.writer(self._fh)
        self.where = f"csv {self.dir}"
        return None

    def log(self, values: dict, step: int) -> None:
        self._csv.writerows([step, k, repr(v)] for k, v in _numbers(values).items())
        self.last_step = step

    def flush(self) -> None:
        self._fh.flush()

    def finish(self, final_metrics: dict, status: str = "FINISHED") -> None:
        if not self._fh.closed:
            self._fh.close()
        _write_pairs(self.dir / "final.csv", {**_numbers(final_metrics), "run_dir": str(self.dir.parent)})


def _csv_text(rows: list) -> bytes:
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue().encode()


def _write_pairs(path: Path, pairs: dict) -> None:
    rows = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v] for k, v in pairs.items()]
    write_atomic(path, _csv_text([["name", "value"], *rows]), root=path.parent.parent)


def _csv_rows_up_to(path: Path, step: int) -> list[list[str]]:
    """The rows of an earlier part of this run up to ``step``: a resumed run rewrites what came after. Read as
    a stranger's file: a regular file of a log's size, line by line (a FIFO, a device, a huge file: one line)."""
    lines = (text for _, text in files.read_lines(path, files.LINES_LIMIT, "tracker file",
                                                  "move it away, or leave csv out of log.trackers", TrackerError))
    rows = list(csv.reader(lines))[1:]
    return [r for r in rows if len(r) == 3 and r[0].isdigit() and int(r[0]) <= step]


class TensorBoardTracker(Tracker):
    """Event files under ``RUN_DIR/tensorboard``, written by ``torch.utils.tensorboard.SummaryWriter``:
    one event per row (its finite values), the hyperparameters for the HPARAMS tab, ``run_dir`` as text.

    Importing tensorboard takes ~0.25 s, so the training thread does not: a thread of this tracker
    (:class:`EventThread`) imports it, opens the writer and writes the rows, which reach it through a queue.
    Each row is flushed to the file when the queue is empty, so TensorBoard shows it live. A resumed run's
    writer starts with ``purge_step``: TensorBoard hides what the stopped run logged after the checkpoint."""

    name = "tensorboard"
    package = "tensorboard"

    def start(self, config: dict, run_dir: Path, resume_id: Optional[str]) -> Optional[str]:
        folder = run_dir / "tensorboard"
        try:
            folder.mkdir(parents=True, exist_ok=True)  # now: a folder that cannot be made stops the run at once
            make_dir(folder, root=run_dir)  # and not a link: TensorBoard writes its event files where it leads
        except UnsafePathError:
            raise
        except OSError as exc:
            listed = "tensorboard" in (self._option("trackers") or [])
            undo = "remove tensorboard from log.trackers" if listed else "set log.tensorboard=false"
            raise TrackerError(f"{'log.trackers' if listed else 'log.tensorboard'}: cannot write event files in "
                               f"'{folder}' ({describe_os_error(exc)}); make it a writable folder or {undo}") from None
        params = None if self.start_step else {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                               for k, v in flat_keys(config).items()}
        self._writer = EventThread(folder, self.start_step + 1, params, str(run_dir))
        return None

    def log(self, values: dict, step: int) -> None:
        self._writer.put({k: v for k, v in _numbers(values).items() if math.isfinite(v)}, step)
        self.last_step = step

    @property
    def failed_step(self) -> Optional[int]:
        return self._writer.failed_step

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, final_metrics: dict, status: str = "FINISHED") -> None:
        try:
            self.log(final_metrics, self.last_step)
        finally:
            self._writer.close()


class EventThread:
    """A thread that imports tensorboard, opens a ``SummaryWriter`` in ``folder`` and writes the rows put
    in its queue, one event each. A failure (a broken install, a full disk) is raised by the next ``put``,
    ``flush`` or ``close``, which also ends the thread; ``failed_step`` is then the row it failed on."""

    def __init__(self, folder: Path, purge_step: int, params: Optional[dict], run_dir: str):
        self._jobs: queue.Queue = queue.Queue()
        self.error: Optional[BaseException] = None
        self.failed_step: Optional[int] = None
        self._thread = threading.Thread(target=self._run, args=(str(folder), purge_step, params, run_dir),
                                        name="torchrig-tensorboard", daemon=True)
        self._thread.start()

    def put(self, values: dict, step: int) -> None:
        self._check()
        if values:
            self._jobs.put((values, step))

    def flush(self) -> None:
        """Wait until every row put so far is in the file."""
        if self._thread.is_alive():
            self._jobs.join()
        self._check()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            if self._thread.is_alive():
                self._jobs.put(None)  # nothing more is written: let the thread end
            raise self.error

    def _run(self, folder: str, purge_step: int, params: Optional[dict], run_dir: str) -> None:
        writer = None
        _quiet_writer_threads()
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            writer = SummaryWriter(folder, purge_step=purge_step)
            if params is not None:
                for summary in hparams(params, {}):  # as SummaryWriter.add_hparams, without its sub-folder run
                    writer.file_writer.add_summary(summary, 0)
                writer.add_text("run_dir", run_dir, 0)
        except Exception as exc:  # noqa: BLE001 - raised to the training thread by its next call
            self.error = exc
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    break
                if self.error is None:
                    self._write(writer, Summary, *job)
            finally:
                self._jobs.task_done()
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001
                self.error = self.error or exc

    def _write(self, writer: Any, summary: Any, values: dict, step: int) -> None:
        try:
            writer.file_writer.add_summary(summary(value=[summary.Value(tag=k, simple_value=v)
                                                          for k, v in values.items()]), step)
            if self._jobs.unfinished_tasks == 1:  # this row is the last one queued: to the file now
                writer.flush()
        except Exception as exc:  # noqa: BLE001
            self.error, self.failed_step = exc, step


def _quiet_writer_threads() -> None:
    """No traceback from tensorboard's own writer thread: it keeps its error for the writer's next call (which
    raises it here, and the run says it in one line), then re-raises it, which ``threading.excepthook`` prints."""
    previous = threading.excepthook
    if getattr(previous, "torchrig", False):
        return

    def hook(args: Any) -> None:
        if not type(args.thread).__module__.startswith("tensorboard."):
            previous(args)

    hook.torchrig = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MLflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (no server): params, metrics with their step, the final
    metrics, the tag ``torchrig.run_dir``. Store: ``log.mlflow_uri``, by default an SQLite file
    ``mlruns/mlflow.db`` beside the run directory (``runs/<recipe>/mlruns``), shared by its sibling runs.

    A resumed run goes on in the same MLflow run. Steps between the checkpoint and where the stopped run got
    to are trained again; a point that run already logged at such a step (a metric at a step, as often as it
    was logged there) is not logged twice (MLflow keeps every point, and cannot delete one). Resume is exact,
    so the values kept are the ones the resumed run computes again, unless the configuration was changed."""

    name = "mlflow"
    package = "mlflow"

    def start(self, config: dict, run_dir: Path, resume_id: Optional[str]) -> Optional[str]:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        store = run_dir.resolve().parent / "mlruns"
        uri, self.uri_from = _setting(self._option("mlflow_uri"), "log.mlflow_uri", "MLFLOW_TRACKING_URI")
        if uri is None:
            make_dir(store)  # not a link: MLflow writes its database and artifacts where it leads
            uri, self.uri_from = f"sqlite:///{store / 'mlflow.db'}", ""
        self.uri, self.store = uri, store
        self.replayed: Counter = Counter()  # (metric, step) -> points the stopped run logged after the checkpoint
        try:
            self.client = client = MlflowClient(tracking_uri=uri)
            self.run_id = self._continue(resume_id) or self._given_run() or self._create(run_dir)
            got = client.get_run(self.run_id)
            params = [Param(k, str(v)[:6000]) for k, v in flat_keys(config).items() if k not in got.data.params]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(self.run_id, params=params[i:i + 100])
            self.where = self._where(got.info.experiment_id)
        except MlflowException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            named = f"{self.uri_from} {uri!r}" if self.uri_from else f"the MLflow store {uri!r}"
            raise TrackerError(f"{named}: MLflow refused the run: {first}; set log.mlflow_uri (or "
                               f"MLFLOW_TRACKING_URI) to a reachable store, e.g. sqlite:///mlflow.db") from None
        return self.run_id

    def _where(self, experiment_id: str) -> str:
        """``mlflow run ID in URI (experiment NAME)``, with where each setting came from when not from a key."""
        name = self.client.get_experiment(experiment_id).name
        source = f" (from {self.uri_from})" if self.uri_from.startswith("MLFLOW_") else ""
        where = f"mlflow run {self.run_id} in {self.uri}{source}, experiment {name!r}"
        if self.uri.startswith(("http://", "https://")):
            where += f": {self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}"
        return where

    def _given_run(self) -> Optional[str]:
        """``MLFLOW_RUN_ID``, as ``mlflow.start_run`` reads it: log into that run (made by a parent job)."""
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException:
            raise TrackerError(f"MLFLOW_RUN_ID {run_id!r}: the MLflow store {self.uri!r} has no such run; unset "
                               f"MLFLOW_RUN_ID or set it to a run of that store") from None
        return run_id

    def _continue(self, resume_id: Optional[str]) -> Optional[str]:
        if resume_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(resume_id, status="RUNNING")
        except MlflowException:
            return None  # the store no longer holds it: a new run
        try:  # the stopped run's points after the checkpoint: the resumed run computes them again
            self.replayed = Counter((key, m.step) for key in self.client.get_run(resume_id).data.metrics
                                    for m in self.client.get_metric_history(resume_id, key) if m.step > self.start_step)
        except MlflowException:
            pass  # unreadable history: the resumed run logs every point
        return resume_id

    def _create(self, run_dir: Path) -> str:
        """A new run in the experiment of ``log.project``, else ``MLFLOW_EXPERIMENT_NAME`` or
        ``MLFLOW_EXPERIMENT_ID`` (as MLflow's own client reads them), else ``torchrig``."""
        from mlflow.exceptions import MlflowException

        name, source = _setting(self._option("project"), "log.project", "MLFLOW_EXPERIMENT_NAME")
        given_id = os.environ.get("MLFLOW_EXPERIMENT_ID") if name is None else None
        if given_id:
            try:
                exp_id = self.client.get_experiment(given_id).experiment_id
            except MlflowException:
                raise TrackerError(f"MLFLOW_EXPERIMENT_ID {given_id!r}: the MLflow store {self.uri!r} has no such "
                                   f"experiment; unset it, or name one with log.project") from None
        else:
            name = name or "torchrig"
            exp = self.client.get_experiment_by_name(name)
            local = not self.uri.startswith(("http://", "https://", "databricks"))  # a server picks its own
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                name, artifact_location=(self.store / "artifacts").as_uri() if local else None)
        run = self.client.create_run(exp_id, run_name=self._option("run_name") or run_dir.name,
                                     tags={"torchrig.run_dir": str(run_dir.resolve())})
        return run.info.run_id

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        now, replayed, metrics = int(time.time() * 1000), self.replayed, []
        for k, v in _numbers(values).items():
            if replayed[(k, step)] > 0:  # MLflow holds this point already
                replayed[(k, step)] -= 1
            else:
                metrics.append(Metric(k, v, now, step))
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        self.last_step = step

    def finish(self, final_metrics: dict, status: str = "FINISHED") -> None:
        self.log(final_metrics, self.last_step)
        self.client.set_terminated(self.run_id, status)


class WandbTracker(Tracker):
    """A Weights & Biases run in ``RUN_DIR/wandb``. ``WANDB_MODE`` is honoured; without it, and without
    an API key (``WANDB_API_KEY`` or ``wandb login``), the run is offline: ``wandb sync`` uploads it later."""

    name = "wandb"
    package = "wandb"

    def start(self, config: dict, run_dir: Path, resume_id: Optional[str]) -> Optional[str]:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") or _has_wandb_key() else "offline"
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        env = os.environ.get
        # a torchrig key wins; else W&B's own variables (WANDB_PROJECT, WANDB_DIR, WANDB_NAME, and WANDB_ENTITY,
        # WANDB_RUN_GROUP, WANDB_JOB_TYPE, WANDB_TAGS, WANDB_NOTES, which torchrig never sets), read by wandb
        project = self._option("project") or (None if env("WANDB_PROJECT") else "torchrig")
        name = self._option("run_name") or (None if env("WANDB_NAME") else run_dir.name)
        if not env("WANDB_DIR"):
            make_dir(run_dir / "wandb", root=run_dir)  # not a link: W&B writes its run files where it leads
        self.run = wandb.init(project=project, name=name, dir=None if env("WANDB_DIR") else str(run_dir),
                              config={**config, "run_dir": str(run_dir)}, id=resume_id,
                              resume="allow" if resume_id else None, mode=mode, settings=settings)
        folder = Path(self.run.dir).parent
        run = self.run
        about = ", ".join(f"{what} {value!r}" for what, value in (
            ("entity", run.entity), ("project", run.project), ("group", run.group)) if value)
        self.where = f"wandb run {run.id} in {folder}" + (f" ({about})" if about else "") + (
            f"; offline: upload with wandb sync {folder}" if run.settings.mode == "offline" else
            (f": {run.url}" if getattr(run, "url", None) else ""))
        return self.run.id

    def log(self, values: dict, step: int) -> None:
        self.run.log(_numbers(values), step=step)
        self.last_step = step

    def finish(self, final_metrics: dict, status: str = "FINISHED") -> None:
        self.run.summary.update({**_numbers(final_metrics), "run_dir": str(self.run.dir)})
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def _setting(value: Any, key: str, variable: str) -> tuple[Any, str]:
    """(value, where it came from): the torchrig key when set, else the tracker's environment variable."""
    if value is not None:
        return value, key
    if os.environ.get(variable):
        return os.environ[variable], variable
    return None, ""


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


REGISTRY: dict[str, type[Tracker]] = {t.name: t for t in (CSVTracker, TensorBoardTracker, MLflowTracker, WandbTracker)}


def tracker_names(log: Any, tensorboard: Any = "auto") -> list[str]:
    """``log.trackers`` plus TensorBoard, which ``log.tensorboard`` (auto: when installed) turns on."""
    names = list(dict.fromkeys(getattr(log, "trackers", None) or []))  # each once, in the order given
    tensorboard = getattr(log, "tensorboard", tensorboard)
    if "tensorboard" not in names and (tensorboard is True or tensorboard == "true" or (
            tensorboard == "auto" and importlib.util.find_spec("tensorboard") is not None)):
        names.insert(0, "tensorboard")
    return names


def check_installed(names: list[str], listed: list) -> None:
    """Fail before training when a tracker's package is missing (every rank checks, so all stop).
    ``listed``: the names the user wrote in ``log.trackers`` (TensorBoard may come from ``log.tensorboard``)."""
    for name in names:
        package = REGISTRY[name].package
        if package and _missing(package):
            key = "log.trackers" if name in listed else "log.tensorboard"
            undo = f"remove {name} from log.trackers" if key == "log.trackers" else "set log.tensorboard=false"
            raise TrackerError(f"{key}: '{name}' needs the {package} package, which is not installed; "
                               f'pip install "torchrig[{name}]" or {undo}')


def _missing(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):  # a module entry of None, or one without a spec
        return True


class TrackerSet:
    """The trackers of one run, on the main process; an empty set elsewhere.

    A tracker that fails while logging (a store gone, a full disk) is dropped with one message on
    stderr: the training run, its checkpoints and ``metrics.jsonl`` go on.
    """

    _open: dict[str, "TrackerSet"] = {}  # run directory -> its open set: a second fit() ends the first

    def __init__(self, trackers: Optional[list[Tracker]] = None):
        self.items = list(trackers or [])
        self.finished = False

    @classmethod
    def open(cls, names: list[str], run_dir: Path, config: dict, options: Any = None,
             start_step: int = 0) -> "TrackerSet":
        """Start every tracker; after step 0 (a resume) the ids of ``trackers.json`` continue their runs."""
        check_installed(names, getattr(options, "trackers", []))
        earlier = cls._open.pop(str(run_dir.resolve()), None)
        if earlier is not None:
            earlier.finish()
        ids_path = run_dir / IDS_FILE
        ids = _read_ids(ids_path) if start_step > 0 else {}
        self = cls()
        for name in names:
            tracker = REGISTRY[name](options, start_step)
            try:
                run_id = tracker.start(config, run_dir, ids.get(name))
            except ImportError as exc:  # installed, but broken (a missing dependency of the package)
                raise TrackerError(f"log.trackers: '{name}' could not import {exc.name or tracker.package}: {exc}; "
                                   f'pip install "torchrig[{name}]" or remove {name} from log.trackers') from None
            except BaseException:
                self.finish({}, status="FAILED")  # the ones already started
                raise
            self.items.append(tracker)
            if run_id is not None:
                ids[name] = run_id
        if ids:
            _write_ids(ids_path, ids)
        if self.items:
            cls._open[str(run_dir.resolve())] = self
        return self

    def log(self, values: dict, step: int) -> None:
        for t in list(self.items):
            try:
                t.log(values, step)
            except Exception as exc:  # noqa: BLE001 - any tracker error: the run itself must go on
                self._drop(t, exc, step)

    def _drop(self, t: Tracker, exc: Exception, step: int) -> None:
        self.items.remove(t)
        step = t.failed_step if t.failed_step is not None else step  # a writer thread's row: the step it failed on
        print(f"torchrig: tracker '{t.name}' failed at step {step} ({type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); it is off for the rest "
              f"of this run, metrics.jsonl has every value", file=sys.stderr, flush=True)

    def where(self) -> list[str]:
        """Where each tracker's run is (TensorBoard's folder is said with the logs)."""
        return [t.where for t in self.items if t.where]

    def flush(self) -> None:
        for t in [] if self.finished else list(self.items):
            try:
                t.flush()
            except Exception as exc:  # noqa: BLE001 - as in log: the run goes on
                self._drop(t, exc, t.last_step)

    def finish(self, final_metrics: Optional[dict] = None, status: str = "FINISHED") -> None:
        """Final metrics (``test/accuracy`` …), then each tracker's end; once."""
        if self.finished:
            return
        self.finished = True
        for key in [k for k, v in TrackerSet._open.items() if v is self]:
            del TrackerSet._open[key]
        for t in self.items:
            t.finish(dict(final_metrics or {}), status)


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # MLflow's hex ids, W&B's ids; nothing a path can use


def _read_ids(path: Path) -> dict[str, str]:
    """The tracker run ids a resumed run continues. The file sits in a run directory that may come from
    someone else, so an id is used only if it looks like one (letters, digits, ``_ . -``, no ``..``); any
    other value starts a new run of that tracker, said in one line."""
    if not path.exists():
        return {}
    new_runs = "each tracker starts a new run"
    data, problem = None, f"tracker ids file '{path}' is not a JSON mapping of tracker names to run ids; {new_runs}"
    try:
        data = json.loads(files.read_regular(path, files.RECORD_LIMIT, "tracker ids file", new_runs, TrackerError))
    except TrackerError as exc:  # a FIFO, a device, a huge file: never read
        problem = str(exc)
    except OSError as exc:
        problem = f"tracker ids file '{path}' cannot be read ({describe_os_error(exc)}); {new_runs}"
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
        pass
    if not isinstance(data, dict):
        print(f"torchrig: {problem}", file=sys.stderr, flush=True)
        return {}
    ids = {}
    for k, v in data.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            continue
        if _RUN_ID.fullmatch(v) and ".." not in v:
            ids[k] = v
        else:
            print(f"torchrig: {path}: the {k!r} run id {v[:80]!r} is not a run id (letters, digits, _ . -); "
                  f"{k} starts a new run", file=sys.stderr, flush=True)
    return ids


def _write_ids(path: Path, ids: dict[str, str]) -> None:
    write_atomic(path, (json.dumps(ids, indent=1, sort_keys=True) + "\n").encode(), root=path.parent)
