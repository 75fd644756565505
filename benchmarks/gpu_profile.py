"""Where a torchrig step's time goes on a GPU, next to the hand loop of ``benchmarks/gpu.py``.

For each arm (``hand``, ``trainer``, ``trainer_quiet``: the Trainer without TensorBoard and without the
FLOP count; ``hand_compile``, ``trainer_compile``: the same with ``torch.compile``), in a fresh process: the same ResNet-18 workload as ``gpu.py``; a CUDA event recorded at
every step's end, so each step's time on the GPU's clock (its kernels plus any time the GPU waited
for the host) sits next to its time on the host's clock; and ``torch.profiler`` over the three steps
around the first log step, over four quiet steps (no log step among them) and over the three steps
around the second log step. Written to
``--out``: ``profile.json`` (per-step times, per-arm medians, each profiled window's kernel count,
GPU busy time and the top operators by device and by host time) and ``traces.tar.gz`` (the Chrome
traces, for https://ui.perfetto.dev).

Usage: ``python benchmarks/gpu_profile.py [--out DIR] [--steps 45] [--batch 128]``; ``--device cpu`` runs
a small smoke version of the same code without CUDA (no kernels, no figures worth keeping).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
from gpu import LOG_EVERY, _Hook, hand_step  # noqa: E402  (the benchmark's own hand loop and callback)

WARMUP = 15
FIRST_LOG = (19, 22)  # profiled steps [first, last): step 20 is the first log step
QUIET = (31, 35)  # between the log steps 20 and 40
AROUND_LOG = (39, 42)  # step 40 logs
WINDOWS = {"first_log": FIRST_LOG, "quiet": QUIET, "around_log": AROUND_LOG}


class _Clock:
    """Per-step host and device timestamps, and the profiler started and stopped at the given steps."""

    def __init__(self, torch, device: str, trace_dir: Path, arm: str):
        self.torch, self.cuda = torch, device == "cuda"
        self.host: list = []
        self.events: list = []
        self.windows: dict = {}
        self.trace_dir, self.arm, self.prof, self.window = trace_dir, arm, None, None

    def step_end(self, step: int) -> None:  # step: 1-based, just finished
        self.host.append(time.perf_counter())
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)
        for name, (first, last) in WINDOWS.items():
            if step == first - 1:
                self._start(name)
            elif step == last - 1 and self.window == name:
                self._stop()

    def _start(self, name: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof, self.window = profile(activities=acts, record_shapes=False), name
        self.prof.start()

    def _stop(self) -> None:
        prof, name = self.prof, self.window
        if self.cuda:
            self.torch.cuda.synchronize()
        prof.stop()
        self.prof = self.window = None
        trace = self.trace_dir / f"{self.arm}-{name}.json"
        prof.export_chrome_trace(str(trace))
        avg = prof.key_averages()
        dev_key = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
        kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        busy_us = sum(getattr(e, dev_key, 0) for e in avg if getattr(e, "key", "")) if self.cuda else 0.0

        def top(sort: str) -> str:
            try:
                return avg.table(sort_by=sort, row_limit=40, max_name_column_width=70)
            except Exception as e:  # noqa: BLE001 - a figure missing, not the run
                return f"(table by {sort} failed: {e})"

        self.windows[name] = {"steps": list(WINDOWS[name]), "device_events": len(kernels),
                              "device_self_us_total": busy_us,
                              "by_device": top(dev_key) if self.cuda else "", "by_host": top("self_cpu_time_total")}

    def figures(self) -> dict:
        if self.cuda:
            self.torch.cuda.synchronize()
            dev = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        else:
            dev = []
        host = [(b - a) * 1e3 for a, b in zip(self.host, self.host[1:])]
        steps = list(range(2, len(self.host) + 1))  # the step each interval ends with
        timed = [i for i, s in enumerate(steps) if s > WARMUP and not any(
            lo - 1 <= s <= hi for lo, hi in (QUIET, AROUND_LOG))]  # the first log step stays in  # profiler windows left out
        quiet = [i for i in timed if steps[i] % LOG_EVERY != 0 and (steps[i] - 1) % LOG_EVERY != 0]
        logs = [i for i in timed if steps[i] % LOG_EVERY == 0]

        def med(xs, idx):
            return statistics.median([xs[i] for i in idx]) if xs and idx else None

        return {"steps": steps, "device_ms": dev, "host_ms": host,
                "median_device_ms_quiet": med(dev, quiet), "median_host_ms_quiet": med(host, quiet),
                "device_ms_log_steps": [dev[i] for i in logs] if dev else [],
                "host_ms_log_steps": [host[i] for i in logs],
                "mean_device_ms_timed": statistics.fmean([dev[i] for i in timed]) if dev and timed else None,
                "windows": self.windows}


def _setup(p: dict):
    import torch
    import torchvision

    torch.manual_seed(0)
    dev, n = p["device"], p["batch"] * (p["steps"] + WARMUP)
    size = 224 if dev == "cuda" else 32
    x = torch.rand((n, 3, size, size), device=dev)
    y = torch.randint(0, 1000, (n,), device=dev)
    model = torchvision.models.resnet18(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=dev == "cuda")
    return torch, x, y, model, opt


def _arm_hand(p: dict) -> dict:
    torch, x, y, model, opt = _setup(p)
    dev, b, total = p["device"], p["batch"], p["steps"] + WARMUP
    if dev == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    order = torch.randperm(len(x), device=dev)
    with tempfile.TemporaryDirectory() as tmp:
        clock = _Clock(torch, dev, Path(p["trace_dir"]), "hand_compile" if p.get("compile") else "hand")
        model.train()
        step_fn = torch.compile(model) if p.get("compile") else model
        for i in range(total):
            hand_step(torch, step_fn, opt, x, y, order[i * b:(i + 1) * b], dev, log=(i + 1) % LOG_EVERY == 0)
            clock.step_end(i + 1)
        del tmp
    return clock.figures()


def _arm_trainer(p: dict, quiet: bool = False, arm: str = "trainer") -> dict:
    from torchrig import Trainer

    torch, x, y, model, opt = _setup(p)
    dev, b, total = p["device"], p["batch"], p["steps"] + WARMUP
    clock = _Clock(torch, dev, Path(p["trace_dir"]), arm)

    extra = {"log.tensorboard": False, "log.flops": False} if quiet else {"log.flops": not p.get("compile")}
    with tempfile.TemporaryDirectory() as run_dir:
        Trainer(model, opt, loss="cross_entropy", metrics=[], run_dir=run_dir, batch_size=b, precision="bf16",
                channels_last=True, compile=bool(p.get("compile")), max_steps=total, epochs=1, shuffle=True, plot=False, checkpoint_every_epochs=0,
                progress="none", num_workers=0, callbacks=[_Hook(lambda trainer, values: clock.step_end(trainer.global_step))], device=dev,
                **{"log.every_steps": LOG_EVERY, "log.summary": False}, **extra).fit((x, y))
    return clock.figures()


HANDLERS = {"hand": _arm_hand, "trainer": _arm_trainer,
            "trainer_quiet": lambda p: _arm_trainer(p, quiet=True, arm="trainer_quiet"),
            "hand_compile": lambda p: _arm_hand(dict(p, compile=True)),
            "trainer_compile": lambda p: _arm_trainer(dict(p, compile=True), arm="trainer_compile")}


def main() -> None:
    if c.child_main(HANDLERS):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=c.RESULTS)
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--arms", default=",".join(HANDLERS))
    ap.add_argument("--arm-timeout", type=float, default=240.0)
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing profiled (--device cpu runs the smoke version)")
            return
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"params": vars(args) | {"out": str(args.out)}, "arms": {}, "errors": {}}
    with tempfile.TemporaryDirectory() as traces:
        for arm in args.arms.split(","):
            p = {"device": args.device, "batch": args.batch if args.device == "cuda" else 8,
                 "steps": args.steps, "trace_dir": traces}
            try:
                result["arms"][arm] = c.run_child(Path(__file__), arm, p, args.arm_timeout)
            except Exception as e:  # noqa: BLE001 - one arm's failure is recorded, the others go on
                result["errors"][arm] = str(e)[-2000:]
            fig = result["arms"].get(arm, {})
            print(f"{arm}: quiet step {fig.get('median_device_ms_quiet')} ms on the device, "
                  f"{fig.get('median_host_ms_quiet')} ms on the host; log steps (device) "
                  f"{[round(v, 2) for v in fig.get('device_ms_log_steps', [])]}; timed mean "
                  f"{fig.get('mean_device_ms_timed')} ms", flush=True)
            (args.out / "profile.json").write_text(json.dumps(result, indent=1))
        with tarfile.open(args.out / "traces.tar.gz", "w:gz") as tar:
            for f in sorted(Path(traces).glob("*.json")):
                tar.add(f, arcname=f.name)
    for arm, fig in result["arms"].items():
        for name, w in fig["windows"].items():
            print(f"== {arm} · {name}: {w['device_events']} device events, "
                  f"{w['device_self_us_total'] / 1e3:.2f} ms of device self time")
    print(f"written to {args.out / 'profile.json'} and traces.tar.gz")


if __name__ == "__main__":
    main()
