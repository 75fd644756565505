"""The profiler callback: a Chrome trace and a top-20 operator table in the run directory, on CPU."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch.utils.data import TensorDataset

import torchrig
from helpers import QUIET, TinyNet, make_classification


def fit(run_dir, steps, memory_snapshot=False, **kw):
    x, y = make_classification(32)
    torch.manual_seed(0)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(run_dir), batch_size=8, epochs=1, num_workers=0,
                               profile={"steps": steps, "memory_snapshot": memory_snapshot}, **QUIET, **kw)
    trainer.fit(TensorDataset(x, y))
    return trainer


def test_profiled_steps_write_a_chrome_trace_and_an_operator_table(tmp_path, capsys):
    fit(tmp_path, [2, 3])
    out = tmp_path / "profile"
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names  # the Linear layers' forward ran inside the window
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "aten::addmm") == 2 * 2  # 2 layers × 2 steps
    table = (out / "ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    rows = [line for line in table.splitlines() if line.strip().startswith(("aten::", "Optimizer", "autograd"))]
    assert 0 < len(rows) <= 20
    err = capsys.readouterr().err
    assert f"torchrig: profiled steps 2-3: Chrome trace {out / 'trace.json'}" in err
    assert f"top 20 operators {out / 'ops.txt'}" in err


def test_memory_snapshot_is_skipped_on_cpu_with_a_message(tmp_path, capsys):
    fit(tmp_path, [1, 1], memory_snapshot=True)
    assert "torchrig: profile.memory_snapshot skipped: the run is on cpu" in capsys.readouterr().err
    assert (tmp_path / "profile" / "trace.json").exists()
    assert not (tmp_path / "profile" / "memory_snapshot.pickle").exists()


def test_a_window_after_the_last_step_says_so(tmp_path, capsys):
    fit(tmp_path, [10, 15])  # 4 steps in all
    assert ("profile.steps [10, 15]: the run ended at step 4 before step 10; nothing was profiled"
            in capsys.readouterr().err)
    assert not (tmp_path / "profile").exists()


def test_the_command_line_flag_sets_the_default_window():
    from torchrig.cli import build_parser

    assert build_parser().parse_args(["train", "--profile"]).profile is True
    assert build_parser().parse_args(["train"]).profile is False


class PlainData(pickle.Unpickler):
    """Reads a pickle of plain data only (dicts, lists, strings, numbers): any class or function it names is refused,
    so reading it can run nothing."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the pickle names {module}.{name}: not plain data")


@pytest.mark.gpu  # the snapshot records the CUDA allocator: no CPU stand-in
def test_memory_snapshot_on_gpu(tmp_path):
    """The snapshot is plain data (read without running anything) and holds the allocator's records of the profiled
    steps: allocations whose Python stack runs through torchrig's training step into TinyNet's forward."""
    fit(tmp_path, [1, 2], memory_snapshot=True, device="cuda")
    with open(tmp_path / "profile" / "memory_snapshot.pickle", "rb") as f:
        snap = PlainData(f).load()
    assert {"segments", "device_traces"} <= set(snap)
    allocs = [e for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]
    assert allocs and all(e["size"] > 0 for e in allocs)
    stacks = [[fr["filename"].replace(os.sep, "/") for fr in e.get("frames", [])] for e in allocs]
    model = TinyNet.forward.__code__.co_filename.replace(os.sep, "/")
    package = os.path.dirname(torchrig.__file__).replace(os.sep, "/") + "/"
    ours = [s for s in stacks if model in s and any(f.startswith(package) for f in s)]
    assert ours, f"no allocation made in TinyNet.forward under the training step among {len(allocs)}"
    assert any(b["allocated_size"] > 0 for b in snap["segments"])  # the run's memory, still held at the dump
