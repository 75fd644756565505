"""A training step reads nothing back from the device between log steps.

On CPU the step reads the loss scalar on purpose (a memory load there), and the metrics logger sums the
logged scalars as Python floats. With ``step.host_checks`` and ``metrics_log.host`` off, a step runs
exactly as on a GPU, so counting host reads (``item``, ``__bool__``, ``tolist``,
``cpu`` …) made by torchrig's own code on CPU counts the reads that would synchronise a GPU. The
data layer's reads of its CPU index tensors are not device reads and are not counted. On a GPU the
same run is checked with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import QUIET, TinyNet, fp16_precision, make_classification
from helpers import step_configs as C
from helpers.host_reads import SRC, count_host_reads
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.metrics import get_metric
from torchrig.trainer import NonFiniteLossError
from torchrig.observe.metrics_logger import MetricsLogger
from torchrig.observe.run_logger import RunLogger
from torchrig.trainer.state import MetricStates
from torchrig.trainer.step import Step, default_step

class DeviceLikeSteps:
    """Turns the host checks off (as on a GPU) and records the reads made in each optimizer step."""

    def __init__(self, calls: list, every: int):
        self.calls, self.every = calls, every
        self.quiet_steps: list[list[str]] = []
        self.log_steps: list[list[str]] = []

    def on_fit_start(self, trainer):
        trainer.step.host_checks = trainer.metrics_log.host = False
        self.calls.clear()

    def on_step_end(self, trainer, values):
        (self.log_steps if trainer.global_step % self.every == 0 else self.quiet_steps).append(list(self.calls))
        self.calls.clear()

    def on_log(self, trainer, values, kind):
        self.calls.clear()


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, fused=True)


def _fit(run_dir, step_fn=None, **kw):
    x, y = make_classification()
    torch.manual_seed(0)
    model = TinyNet()
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=1, num_workers=0, metrics=["accuracy"],
                accumulate=2, checkpoint={"every_epochs": 0, "save_final": False}, log={"every_steps": 3})
    opts.update(kw)
    trainer = torchrig.Trainer(model, _fused_adamw, step_fn=step_fn, **opts)
    return trainer, TensorDataset(x, y)


def test_no_host_reads_between_log_steps(run_dir):
    with count_host_reads() as calls:
        watch = DeviceLikeSteps(calls, every=3)
        trainer, data = _fit(run_dir, callbacks=[watch], epochs=3)
        trainer.fit(data)
    assert len(watch.quiet_steps) >= 4 and len(watch.log_steps) >= 2
    assert all(reads == [] for reads in watch.quiet_steps), watch.quiet_steps
    # the counter sees reads where they are allowed: a log step reads the gradient norm
    assert any(reads for reads in watch.log_steps)


@pytest.mark.parametrize("name", list(C.CONFIGS))
def test_no_host_reads_between_log_steps_in_every_configuration(name, tmp_path, monkeypatch):
    """The configurations the CUDA sync census runs (precision, fused optimizers, metrics, accumulation, token
    normalisation, clipping, EMA, a skipped window, micro-batches), here with the host checks off: no step
    strictly between two log steps reads anything back. fp16 runs with ``GradScaler("cpu")``."""
    real = torchrig.runtime.make_precision
    monkeypatch.setattr(torchrig.runtime, "make_precision",
                        lambda p, device: fp16_precision() if p == "fp16" else real(p, device))
    with count_host_reads() as calls:
        watch = DeviceLikeSteps(calls, every=C.EVERY)
        opts, model, data = C.build(name, tmp_path / "run", "cpu", callbacks=[watch])
        trainer = torchrig.Trainer(model, **opts)
        trainer.fit(data)
    assert trainer.global_step == C.STEPS
    assert len(watch.quiet_steps) == C.STEPS - C.STEPS // C.EVERY
    assert all(reads == [] for reads in watch.quiet_steps), watch.quiet_steps
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_counter_sees_what_it_must():
    """Each kind of thing the counter looks for is counted when torchrig code does it, at any depth of the stack,
    and not otherwise (code compiled with a file name inside the package stands in for torchrig's)."""
    def as_torchrig(code: str, name: str = "trainer/x.py", **env):
        exec(compile(code, str(Path(SRC) / name), "exec"), {"torch": torch, **env})

    scaler = torch.amp.GradScaler("cpu")
    with count_host_reads() as calls:
        as_torchrig("float(torch.ones(()))")
        as_torchrig("torch.ones(3).tolist()")
        as_torchrig("torch.tensor(3, device='cpu'); torch.as_tensor([1.0, 2.0], device='cpu')")
        as_torchrig("scaler.get_scale()", scaler=scaler)
        as_torchrig("f()", f=lambda: torch.ones(()).item())  # a read inside a callee: torchrig is further up
    assert [c.split(" at ")[0] for c in calls] == ["__float__", "tolist", "torch.tensor(number, device=…)",
                                                  "torch.as_tensor(number, device=…)", "GradScaler.get_scale", "item"]
    with count_host_reads() as calls:
        torch.ones(()).item()                                    # not torchrig
        as_torchrig("torch.tensor(3)")                           # no device: a CPU tensor
        as_torchrig("torch.ones(3).tolist()", name="data/x.py")  # the data layer reading its own CPU tensor
        as_torchrig("t = torch.tensor([1], device='cpu'); t.tolist()", name="data/x.py")  # …but not one for the device
    assert [c.split(" at ")[0] for c in calls] == ["torch.tensor(number, device=…)", "tolist"]


def test_counter_sees_the_cpu_reads(run_dir):
    """With the CPU's host checks on, the same run reads the loss every micro-batch: the spy works."""
    with count_host_reads() as calls:
        trainer, data = _fit(run_dir)
        trainer.fit(data)
    assert sum(c.startswith("item") for c in calls) >= trainer.global_step


def _nan_at(bad_batch: int):
    def step_fn(step, batch):
        if step.batch_index == bad_batch:
            batch = [batch[0] * float("nan"), batch[1]]
        return default_step(step, batch)
    return step_fn


def test_device_decision_skips_without_reading(run_dir):
    """A NaN window is dropped by the fused kernel itself; the count arrives at the next log step."""
    states = []

    class Watch(DeviceLikeSteps):
        def on_step_end(self, trainer, values):
            states.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
            super().on_step_end(trainer, values)

    with count_host_reads() as calls:
        watch = Watch(calls, every=3)
        trainer, data = _fit(run_dir, step_fn=_nan_at(2), on_nonfinite="skip", callbacks=[watch])
        trainer.fit(data)
    assert all(reads == [] for reads in watch.quiet_steps)
    # window 2 (micro-batches 2, 3) held NaN: its update was not applied, and counted once settled
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[1][k], states[2][k]) for k in states[0])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.skipped_steps == 1


def test_device_decision_raises_at_the_next_log_step(run_dir):
    class Off:
        def on_fit_start(self, trainer):
            trainer.step.host_checks = False

    trainer, data = _fit(run_dir, step_fn=_nan_at(0), callbacks=[Off()])
    with pytest.raises(NonFiniteLossError, match="between step 1 and step 3"):
        trainer.fit(data)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_step_pieces_on_the_meta_device():
    """Forward, loss flag, backward, non-finite flag, metrics and logged sums on ``meta``: any host read fails."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("meta")
    metric = get_metric("accuracy")
    metric.device = torch.device("meta")
    step = Step(model, {"default": torch.optim.SGD(model.parameters(), lr=0.1)}, nn.CrossEntropyLoss(),
                torchrig.runtime.make_precision("fp32", torch.device("cpu")), torch.device("meta"), metrics=[metric])
    assert step.host_checks is False
    log = MetricsLogger(RunLogger(None, enabled=False), every_steps=10)
    x, y = torch.randn(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    step.begin_window(2)
    for _ in range(2):
        out = model(x)
        loss = step.loss_fn(out, y)
        step.backward(loss)
        step.update_metrics(out, y)
        log.record({"loss": loss.detach()}, 4)
    flag = step.guard.check.flag([p.grad for p in model.parameters()])
    assert flag.device.type == "meta" and step.guard.loss_flag.device.type == "meta"
    assert all(v.device.type == "meta" for v in metric.states.values())
    assert log.sums["loss"].device.type == "meta"
    # a checkpoint's states (loaded on the CPU) go to the metric's device
    states = MetricStates([metric])
    states.load_state_dict({"accuracy": {"correct": torch.tensor(3.0), "total": torch.tensor(4.0)}})
    assert all(v.device.type == "meta" and v.dtype == torch.float64 for v in metric.states.values())


@pytest.mark.gpu
def test_no_sync_in_steady_state_on_cuda(run_dir):
    """Between log steps a CUDA step issues no device→host synchronisation (8 steps, logs at 4 and 8)."""
    x, y = make_classification(64)
    torch.manual_seed(0)
    checked = []

    class Strict:
        """Sync debugging on for every step but the first, the log steps and the end of the epoch."""

        def on_step_end(self, trainer, values):
            k = trainer.global_step
            quiet_next = bool((k + 1) % 4 and k % 4)
            torch.cuda.set_sync_debug_mode("error" if quiet_next else 0)
            checked.extend([k + 1] if quiet_next else [])

        def on_log(self, trainer, values, kind):
            if kind == "interval" and trainer.global_step < 8:
                torch.cuda.set_sync_debug_mode("error")
                checked.append(trainer.global_step + 1)

    trainer = torchrig.Trainer(TinyNet(), "adamw", device="cuda", **QUIET, run_dir=str(run_dir), batch_size=8,
                               epochs=1, metrics=["accuracy"], num_workers=0, log={"every_steps": 4},
                               checkpoint={"every_epochs": 0, "save_final": False}, callbacks=[Strict()])
    try:
        trainer.fit(TensorDataset(x, y))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 8 and checked == [2, 3, 5, 6, 7]
    assert trainer.optimizers["default"].defaults["fused"]


@pytest.mark.slow
def test_no_host_reads_between_log_steps_under_ddp(tmp_path):
    """The same census in both ranks of a DDP run: the loss count, the micro-batch agreement and the stream
    flags travel without a read of device memory (flags the ranks agree on go through gloo, in host memory)."""
    import json

    from helpers import dist_procs
    from helpers.host_reads_worker import DDP_CONFIGS

    out = tmp_path / "out"
    results = dist_procs.pair("ddp", out, tmp_path / "store", timeout=240,
                              worker=dist_procs.HELPERS / "host_reads_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    for rank in (0, 1):
        report = json.loads((out / f"reads-{rank}.json").read_text())
        assert sorted(report) == sorted(DDP_CONFIGS)
        for name, r in report.items():
            assert r["steps"] == C.STEPS and r["finite"], name
            assert len(r["quiet"]) == C.STEPS - C.STEPS // C.EVERY
            assert all(reads == [] for reads in r["quiet"]), (rank, name, r["quiet"])
