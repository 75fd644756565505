"""TensorBoard event files written by torchrig itself, read back with the tensorboard package.

The encoder is checked byte for byte (or message for message, where protobuf orders a map freely)
against the protobuf classes TensorBoard and ``torch.utils.tensorboard`` use; whole runs are read
with TensorBoard's ``EventAccumulator``, which checks every record's CRC-32C.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import TensorDataset

import torchrig
from helpers import TRACKED_FINAL, TinyNet, make_classification, tracked_fit
from torchrig.config import to_dict
from torchrig.trainer import tbevents
from torchrig.trainer.trackers import TrackerError, flatten

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader  # noqa: E402
from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # noqa: E402
from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: E402
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData  # noqa: E402

FINAL = TRACKED_FINAL


def test_crc32c_of_the_known_vector_and_as_tensorboard_masks_it():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    assert tbevents.crc32c(b"123456789") == 0xE3069283
    assert tbevents.crc32c(b"") == 0
    rng = np.random.default_rng(0)
    for n in [*range(0, 19), 64, 357, 1001]:  # every tail length of the four-byte loop, and longer data
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tbevents.masked_crc32c(data) == masked_crc32c(data), n


def test_events_are_the_bytes_protobuf_writes():
    values = {"train/loss": 0.5, "lr": 0.0, "grad_norm": -3.25, "big": 1e39, "tiny": 1e-50, "ünï/cödé": 7.0}
    ours = b"".join(tbevents._message(1, tbevents._text(1, k) + b"\x15" + tbevents._float32(v)) for k, v in values.items())
    theirs = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
    assert tbevents.event(1.7e9 + 0.25, 123456789012, summary=ours) == \
        Event(wall_time=1.7e9 + 0.25, step=123456789012, summary=theirs).SerializeToString()
    assert tbevents.event(12.5, 0, file_version="brain.Event:2") == \
        Event(wall_time=12.5, file_version="brain.Event:2").SerializeToString()
    assert tbevents.event(12.5, 41, session_log=tbevents.SESSION_START) == \
        Event(wall_time=12.5, step=41, session_log=SessionLog(status=SessionLog.START)).SerializeToString()
    assert tbevents.event(0.0, -2) == Event(step=-2).SerializeToString()  # a negative int64: ten bytes


def test_text_and_hparams_are_what_torch_writes():
    from torch.utils.tensorboard.summary import hparams, text

    assert tbevents.text_summary("run_dir", "runs/ünï 1") == text("run_dir", "runs/ünï 1").SerializeToString()
    params = {"optim.lr": 0.001, "epochs": 3, "amp": True, "off": False, "name": "digits", "empty": "",
              "none": None, "zero": 0.0, "big": 2**40}
    theirs = hparams(params, {})
    ours = [Summary.FromString(s) for s in tbevents.hparams_summaries(params)]
    assert [s.value[0].tag for s in ours] == list(tbevents.HPARAMS_TAGS) == [s.value[0].tag for s in theirs]
    for mine, torch_s in zip(ours, theirs):
        assert mine.value[0].metadata.plugin_data.plugin_name == "hparams"
        # a map's entries may come in any order, so the plugin data are compared as messages
        assert HParamsPluginData.FromString(mine.value[0].metadata.plugin_data.content) == \
            HParamsPluginData.FromString(torch_s.value[0].metadata.plugin_data.content)
    with pytest.raises(ValueError, match=r"^hyperparameter 'layers': list \[1, 2\] is not a number or a string$"):
        tbevents.hparams_summaries({"layers": [1, 2]})


def records(folder: Path) -> list[Event]:
    """Every event of every file in ``folder``, as written (TensorBoard's reader checks the checksums)."""
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        out += [Event.FromString(raw) for raw in RawEventFileLoader(str(path)).Load()]
    return out


def test_the_writer_names_its_file_as_tensorboard_does_and_skips_values_that_are_not_finite(tmp_path):
    writer = tbevents.EventWriter(tmp_path / "tb", purge_step=5)
    writer.scalars({"a": 1.5, "b": float("nan"), "c": float("inf"), "d": 2}, step=5)
    writer.scalars({"b": float("nan")}, step=6)  # nothing finite: no event
    writer.text("note", "hello", 5)
    writer.close()
    writer.flush()  # after close: nothing to do
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[^.]+.*\.%d\.\d+" % os.getpid(), writer.path.name)
    events = records(tmp_path / "tb")
    assert events[0].file_version == "brain.Event:2" and events[0].step == 0
    assert events[1].session_log.status == SessionLog.START and events[1].step == 5
    assert [(v.tag, v.simple_value) for v in events[2].summary.value] == [("a", 1.5), ("d", 2.0)]
    assert events[2].step == 5 and events[2].wall_time >= events[0].wall_time
    assert events[3].summary.value[0].tensor.string_val == [b"hello"] and len(events) == 4
    second = tbevents.EventWriter(tmp_path / "tb")  # the same second, the same process: another file
    second.close()
    assert second.path != writer.path and len(list((tmp_path / "tb").iterdir())) == 2


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
    assert set(content) == set(tbevents.HPARAMS_TAGS)
    from torch.utils.tensorboard.summary import hparams

    params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(to_dict(trainer.cfg)).items()}
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


def test_torchrig_and_a_run_with_tensorboard_import_neither_tensorboard_nor_protobuf(tmp_path):
    code = ("import sys, torch, torchrig\n"
            "from helpers import QUIET, TinyNet, make_classification\n"
            "x, y = make_classification(16)\n"
            "t = torchrig.Trainer(TinyNet(), run_dir=sys.argv[1], batch_size=8, epochs=1, plot=False, progress='none')\n"
            "t.fit(torch.utils.data.TensorDataset(x, y)); t.close()\n"
            "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'google.protobuf') if m in sys.modules))")
    tests = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(torchrig.__file__).parent.parent), str(tests)]))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert "train/loss" in accumulator(tmp_path / "run").Tags()["scalars"]  # it was on (log.tensorboard=auto)


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
def test_a_full_disk_mid_run_switches_tensorboard_off_with_one_line(tmp_path, capsys):
    class FillDisk:
        """From step 3 on, the event file writes to /dev/full: every flush fails with ENOSPC."""

        def on_step_end(self, trainer, step):
            if trainer.global_step == 3:
                (tracker,) = [t for t in trainer.logger.trackers.items if t.name == "tensorboard"]
                tracker._writer._fh.close()
                tracker._writer._fh = open("/dev/full", "wb")

    run = tmp_path / "run"
    trainer = fit(run, callbacks=[FillDisk()])
    assert trainer.global_step == 8
    assert ("torchrig: tracker 'tensorboard' failed at step 4 (OSError: [Errno 28] No space left on device); it is "
            "off for the rest of this run, metrics.jsonl has every value") in capsys.readouterr().err
    assert [e.step for e in accumulator(run).Scalars("train/loss")] == [2]
    assert max(s for s, _ in jsonl_points(run)["train/loss"]) == 8
