"""TensorBoard event files written by ``torch.utils.tensorboard.SummaryWriter`` from the tracker's own
thread, read back with TensorBoard's readers (``EventAccumulator`` checks every record's CRC-32C).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import TensorDataset

import torchrig
from helpers import TRACKED_FINAL, TinyNet, make_classification, tracked_fit
from torchrig.config import to_dict
from torchrig.runtime import RunStopped
from torchrig.config import flat_keys
from torchrig.observe.trackers import TensorBoardTracker, TrackerError

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader  # noqa: E402
from tensorboard.compat.proto.event_pb2 import Event  # noqa: E402
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData  # noqa: E402

HPARAMS_TAGS = ("_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info")

FINAL = TRACKED_FINAL


def records(folder: Path) -> list[Event]:
    """Every event of every file in ``folder``, as written (TensorBoard's reader checks the checksums)."""
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        out += [Event.FromString(raw) for raw in RawEventFileLoader(str(path)).Load()]
    return out


def fit(run_dir: Path, **kw) -> torchrig.Trainer:
    return tracked_fit(run_dir, **dict(dict(tensorboard=True), **kw))


def jsonl_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k not in ("step", "epoch", "kind") and isinstance(v, (int, float)) and np.isfinite(v):
                out.setdefault(k, []).append((row["step"], float(v)))
    return out


def accumulator(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_a_run_reads_back_with_tensorboard(tmp_path):
    run = tmp_path / "run"
    trainer = fit(run)
    acc = accumulator(run)
    points = jsonl_points(run)
    assert {"train/loss", "lr", "samples_per_s", "val/accuracy"} <= set(points)
    for name, expected in points.items():  # every value of metrics.jsonl, as a float32
        assert [(e.step, e.value) for e in acc.Scalars(name)] == [(s, float(np.float32(v))) for s, v in expected]
    assert [(e.step, e.value) for e in acc.Scalars("test/accuracy")] == [(8, 0.625)]  # the final metrics

    content = acc.PluginTagToContent("hparams")
    assert set(content) == set(HPARAMS_TAGS)
    from torch.utils.tensorboard.summary import hparams

    params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat_keys(to_dict(trainer.cfg)).items()}
    expected = {s.value[0].tag: HParamsPluginData.FromString(s.value[0].metadata.plugin_data.content)
                for s in hparams(params, {})}
    assert {tag: HParamsPluginData.FromString(c) for tag, c in content.items()} == expected
    start = expected["_hparams_/session_start_info"].session_start_info.hparams
    assert start["optim.lr"].number_value == 0.001 and start["data.batch_size"].number_value == 8

    assert list(acc.PluginTagToContent("text")) == ["run_dir/text_summary"]
    (text,) = acc.Tensors("run_dir/text_summary")
    assert text.step == 0 and text.tensor_proto.string_val == [str(run).encode()]


def test_the_text_plugin_serves_run_dir(tmp_path):
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.text import text_plugin

    run = tmp_path / "run"
    fit(run, epochs=1)
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(run))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(run))
    plugin = text_plugin.TextPlugin(base_plugin.TBContext(data_provider=provider, logdir=str(run),
                                                         multiplexer=multiplexer))
    ctx = context.RequestContext()
    assert plugin.index_impl(ctx, experiment="") == {"tensorboard": ["run_dir/text_summary"]}  # as torch tags it
    (row,) = plugin.text_impl(ctx, "tensorboard", "run_dir/text_summary", experiment="", enable_markdown=False)
    assert row["step"] == 0 and str(run) in row["text"]


def test_a_resumed_run_hides_what_the_stopped_run_logged_after_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    fit(run, max_steps=6, checkpoint_every=2, log_every=1)  # then "stopped": final metrics logged at step 6
    fit(run, resume=str(run / "checkpoints" / "step-00000004"), log_every=1)
    events = records(run / "tensorboard")
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [1, 5]  # each file: START at its first step, so TensorBoard drops what came after
    acc = accumulator(run)
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps.count(5) == steps.count(6) == 1  # logged by both runs, shown once
    points = jsonl_points(run)  # metrics.jsonl was cut back to step 4 by the resumed run
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, float(np.float32(v))) for s, v in points["train/loss"]]
    # logged by the first run at step 6 and never again at an earlier step: only the START hides it
    assert [(e.step, e.value) for e in acc.Scalars("test/accuracy")] == [(8, 0.625)]


SPY = """
import importlib.abc, json, sys, threading, time
import torch, torchrig
from helpers import TinyNet, make_classification
before = sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'google.protobuf') if m in sys.modules)
seen = {}

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        # submodules: a finder sees them only when they are imported (find_spec('tensorboard') is a look-up)
        if name in ('tensorboard.summary', 'torch.utils.tensorboard', 'google.protobuf') and name not in seen:
            seen[name] = threading.current_thread().name
            if name == 'torch.utils.tensorboard':
                time.sleep(1.0)  # a slow import: the rows logged meanwhile wait in the queue
        return None

sys.meta_path.insert(0, Spy())
x, y = make_classification(64)
t = torchrig.Trainer(TinyNet(), run_dir=sys.argv[1], batch_size=8, epochs=1, log_every=1, plot=False,
                     progress='none')
t0 = time.perf_counter()
t.fit(torch.utils.data.TensorDataset(x, y))
fit_s = time.perf_counter() - t0
t.close()
print(json.dumps({'before': before, 'seen': seen, 'fit_s': fit_s}))
"""


def test_tensorboard_is_imported_by_the_trackers_thread_not_by_import_torchrig_or_the_training_thread(tmp_path):
    tests = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(torchrig.__file__).parent.parent), str(tests)]))
    out = subprocess.run([sys.executable, "-c", SPY, str(tmp_path / "run")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] == []
    assert result["seen"] == {name: "torchrig-tensorboard" for name in
                              ("tensorboard.summary", "torch.utils.tensorboard", "google.protobuf")}
    # on by log.tensorboard=auto, and every row logged while the import was slow is in the file
    assert [e.step for e in accumulator(tmp_path / "run").Scalars("train/loss")] == \
        [s for s, _ in jsonl_points(tmp_path / "run")["train/loss"]] == [1, 2, 3, 4, 5, 6, 7, 8, 8]


def test_values_that_are_not_finite_are_left_out_and_a_row_of_none_writes_no_event(tmp_path):
    tracker = TensorBoardTracker(None, start_step=4)
    tracker.start({"lr": 0.1}, tmp_path, None)
    tracker.log({"a": 1.5, "b": float("nan"), "c": float("inf"), "d": 2, "flag": True, "name": "x"}, 5)
    tracker.log({"b": float("nan")}, 6)
    tracker.finish({"test/accuracy": 0.5})
    events = records(tmp_path / "tensorboard")
    starts = [e.step for e in events if e.HasField("session_log")]
    scalars = [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in events if e.HasField("summary")]
    assert starts == [5]  # purge_step: the resumed run's first step
    # no hparams after step 0; the final metrics at the last step logged
    assert scalars == [(5, [("a", 1.5), ("d", 2.0)]), (6, [("test/accuracy", 0.5)])]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_a_run_stopped_by_a_signal_has_every_row_in_the_event_file(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    class SlowWriter(torch.utils.tensorboard.SummaryWriter):
        def __init__(self, *a, **kw):
            time.sleep(1.0)  # as a slow import would: the rows wait in the queue when the run stops
            super().__init__(*a, **kw)

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", SlowWriter)

    class Stop:
        def on_step_end(self, trainer, values):
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "run"
    x, y = make_classification(64)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(run), batch_size=8, epochs=2, log_every=1, plot=False,
                               progress="none", tensorboard=True, callbacks=[Stop()])
    with pytest.raises(RunStopped):
        trainer.fit(TensorDataset(x, y))
    # flushed when fit ended, before the tracker run is closed
    assert [e.step for e in accumulator(run).Scalars("train/loss")] == [1, 2, 3, 4, 5]
    trainer.close()


@pytest.mark.parametrize("asked", ["log.tensorboard", "log.trackers"])
def test_a_log_folder_that_is_a_file_stops_the_run_with_one_line(tmp_path, asked):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a folder")
    x, y = make_classification(16)
    how = dict(tensorboard=True) if asked == "log.tensorboard" else dict(trackers=["tensorboard"])
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(run), batch_size=8, epochs=1, plot=False, progress="none", **how)
    with pytest.raises(TrackerError) as err:
        trainer.fit(TensorDataset(x, y))
    undo = "set log.tensorboard=false" if asked == "log.tensorboard" else "remove tensorboard from log.trackers"
    assert str(err.value) == (f"{asked}: cannot write event files in '{run / 'tensorboard'}' (file exists (errno 17 "
                              f"EEXIST)); make it a writable folder or {undo}")
    assert trainer.global_step == 0 and (run / "tensorboard").read_text() == "not a folder"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_mid_run_switches_tensorboard_off_with_one_line(tmp_path, capsys, monkeypatch):
    class FillDisk:
        """From step 3 on, the event file's path leads to /dev/full: every write fails with ENOSPC."""

        def on_step_end(self, trainer, step):
            if trainer.global_step == 3:
                (tracker,) = [t for t in trainer.logger.trackers.items if t.name == "tensorboard"]
                tracker.flush()  # step 2's row is in the file
                (path,) = (run / "tensorboard").glob("events.out.tfevents.*")
                path.rename(path.with_name(path.name + ".kept"))
                path.symlink_to("/dev/full")
                links.append(path)

    run, links, thread_errors = tmp_path / "run", [], []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)  # what would print a thread's traceback
    trainer = fit(run, callbacks=[FillDisk()])
    assert trainer.global_step == 8
    err = capsys.readouterr().err
    assert ("torchrig: tracker 'tensorboard' failed at step 4 (OSError: [Errno 28] No space left on device); it is "
            "off for the rest of this run, metrics.jsonl has every value") in err
    assert thread_errors == []  # no traceback from tensorboard's own writer thread either
    links[0].unlink()
    assert [e.step for e in accumulator(run).Scalars("train/loss")] == [2]
    assert max(s for s, _ in jsonl_points(run)["train/loss"]) == 8
