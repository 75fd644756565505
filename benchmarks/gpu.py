"""GPU figures: ResNet-18 on 224×224 synthetic images, bf16 autocast, channels_last weights.

Both sides do the same work, the way a performance engineer writes it:

- the images (``batch × (warmup + steps)`` of them, float32) and labels live on the GPU, and every
  epoch is a fresh ``randperm`` gathered there with ``index_select`` (the Trainer indexes tensors that
  are already on the device the same way): no host copy in either arm;
- ``cudnn.benchmark`` on and TF32 allowed in both (the Trainer's defaults on CUDA), inputs in the
  default layout (cuDNN converts them for the channels_last weights in both);
- fused SGD with momentum 0.9, ``zero_grad(set_to_none=True)``, cross-entropy, ``loss.item()`` at the log
  steps only (every 20);
- the timed window is steps ``warmup + 1 … warmup + steps`` of one epoch (26–105 by default, four log
  steps inside), CUDA-synchronised at both ends: no epoch boundary, no compilation, no cuDNN
  autotuning and no first log step inside it. The first log step does things once (CUDA loads the
  kernels of the gradient norm and the row's reductions on their first launch, files are opened):
  about 40 ms on an H100 (``benchmarks/gpu_profile.py``), which a 40-step window starting before it
  counted as an 8 % slower step rate.

Arms (fresh processes, alternated): ``hand``, ``trainer``; ``hand_compile``, ``trainer_compile`` (the
same with ``torch.compile``); ``trainer_fp16`` (fp16 autocast with GradScaler, for information);
``trainer_host`` (the images in pinned host memory, gathered and copied by the Trainer's prefetcher:
the cost of feeding a GPU from the host, for information). Each reports images/s, peak GPU memory, and
for the Trainer the MFU it logged next to the MFU computed from its FLOPs per image and the images/s
measured here. The target: trainer / hand ≥ 0.98 with and without compile.

Then the GPU-marked tests run, with the sync census of ``tests/trainer/test_gpu_syncs.py`` written
beside the figures.

Usage, on a machine with a CUDA GPU: ``python benchmarks/gpu.py [--runs 2] [--steps 80] [--batch 128]
[--out DIR] [--arms hand,trainer] [--no-tests]``. Every arm's figures are written to ``gpu.json`` (in
``--out``, else ``benchmarks/results``) as soon as they exist, so a run cut short keeps what it measured;
an arm that fails or runs past ``--arm-timeout`` is recorded with its error and the rest go on. Without
CUDA the script says so and exits 0, so it can sit in ``run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "gpu"
TARGET = 0.98
WARMUP_STEPS = 25  # includes the first log step (20): its one-time costs are no part of the steady rate
LOG_EVERY = 20
ARMS = ("hand", "trainer", "trainer_fp16", "trainer_host", "hand_compile", "trainer_compile")


def _setup(p: dict, on_gpu: bool = True):
    import torch
    import torchvision

    torch.manual_seed(0)
    n = p["batch"] * (p["steps"] + WARMUP_STEPS)
    x = torch.empty((n, 3, 224, 224), pin_memory=not on_gpu, device="cuda" if on_gpu else "cpu")
    for s in range(0, n, 512):  # drawn on the GPU: seconds instead of a minute of host RNG
        chunk = torch.rand((min(512, n - s), 3, 224, 224), device="cuda")
        x[s:s + len(chunk)].copy_(chunk)
    y = torch.randint(0, 1000, (n,), device=x.device)
    torch.cuda.synchronize()
    model = torchvision.models.resnet18(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    torch.cuda.reset_peak_memory_stats()
    return torch, x, y, model, opt


def _flops_per_image(torch, model, x, y) -> float:
    """Forward + backward FLOPs of one image, counted by PyTorch's FlopCounterMode (as the Trainer's log.flops)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 8


def hand_step(torch, step_fn, opt, x, y, sel, device_type: str, log: bool) -> None:
    """One step of the hand loop (``benchmarks/gpu_profile.py`` profiles the same function)."""
    xb, yb = x.index_select(0, sel), y.index_select(0, sel)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(step_fn(xb), yb)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if log:
        loss.item()


def _arm_hand(p: dict) -> dict:
    torch, x, y, model, opt = _setup(p)
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    flops = _flops_per_image(torch, model, x, y)
    step_fn = torch.compile(model) if p.get("compile") else model
    b, total = p["batch"], p["steps"] + WARMUP_STEPS
    order = torch.randperm(len(x), device="cuda")
    model.train()
    t0 = None
    for i in range(total):
        if i == WARMUP_STEPS:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        hand_step(torch, step_fn, opt, x, y, order[i * b:(i + 1) * b], "cuda", log=(i + 1) % LOG_EVERY == 0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    images_s = p["steps"] * b / dt
    return {"images_s": images_s, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
            "flops_per_image": flops, "mfu_by_hand": _mfu(torch, flops * images_s, "bf16")}


def _mfu(torch, flops_per_s: float, precision: str):
    from torchrig.observe.throughput import peak_flops

    peak = peak_flops(torch.device("cuda"), precision)
    return flops_per_s / peak if peak else None


def _arm_trainer(p: dict) -> dict:
    import tempfile

    from torchrig import Trainer

    torch, x, y, model, opt = _setup(p, on_gpu=not p.get("host"))
    b = p["batch"]
    total = p["steps"] + WARMUP_STEPS
    marks: list = []

    def on_step_end(trainer, values):
        if trainer.global_step in (WARMUP_STEPS, total):
            torch.cuda.synchronize()
            marks.append(time.perf_counter())

    precision = p.get("precision", "bf16")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(model, opt, loss="cross_entropy", metrics=[], run_dir=run_dir, batch_size=b,
                          precision=precision, channels_last=True, compile=bool(p.get("compile")),
                          max_steps=total, epochs=1, shuffle=True, plot=False, checkpoint_every_epochs=0,
                          progress="none", num_workers=0, callbacks=[_Hook(on_step_end)],
                          **{"log.flops": not p.get("compile"), "log.every_steps": LOG_EVERY})
        trainer.fit((x, y))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        flops = trainer.metrics_log.flops_per_sample
    images_s = p["steps"] * b / (marks[-1] - marks[0])
    timed = [r for r in rows if r.get("kind") == "interval" and r["step"] > WARMUP_STEPS + LOG_EVERY - 1]
    row = timed[-1] if timed else {}
    return {"images_s": images_s, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
            "flops_per_image": flops, "logged_images_s": row.get("samples_per_s"), "mfu_logged": row.get("mfu"),
            "mfu_by_hand": _mfu(torch, flops * images_s, precision) if flops else None,
            "skipped_steps": trainer.skipped_steps,
            "finite": all(bool(torch.isfinite(q).all()) for q in model.parameters())}


class _Hook:
    """A callback object with one hook (the Trainer calls the hooks an object defines)."""

    def __init__(self, fn):
        self.on_step_end = fn


HANDLERS = {"hand": _arm_hand, "hand_compile": lambda p: _arm_hand(dict(p, compile=True)),
            "trainer": _arm_trainer, "trainer_compile": lambda p: _arm_trainer(dict(p, compile=True)),
            "trainer_fp16": lambda p: _arm_trainer(dict(p, precision="fp16")),
            "trainer_host": lambda p: _arm_trainer(dict(p, host=True))}


def _gpu_tests(out: Path, timeout: float) -> dict:
    """The GPU-marked tests, the sync census written to ``out/syncs.jsonl``; the log to ``out/gpu-tests.log``."""
    census = out / "syncs.jsonl"
    census.unlink(missing_ok=True)
    env = dict(os.environ, TORCHRIG_SYNC_REPORT=str(census))
    log = out / "gpu-tests.log"
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                               "tests"], capture_output=True, text=True, cwd=str(c.HERE.parent), env=env,
                              timeout=timeout)
        log.write_text(proc.stdout + proc.stderr)
        tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        return {"exit_code": proc.returncode, "summary": tail[0]}
    except subprocess.TimeoutExpired as e:
        log.write_text(str(e.stdout or "") + str(e.stderr or ""))
        return {"exit_code": None, "summary": f"timed out after {timeout:.0f} s"}


def main() -> None:
    if c.child_main(HANDLERS):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    ap.add_argument("--arm-timeout", type=float, default=300.0, help="seconds before one arm's process is stopped")
    ap.add_argument("--tests-timeout", type=float, default=300.0)
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU-marked tests")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu.json and the test logs")
    args = ap.parse_args()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                            "if torch.cuda.is_available() else '')"], capture_output=True, text=True)
    device = probe.stdout.strip()
    if not device:
        print("no CUDA device: the GPU figures stay unmeasured (run this script on a GPU machine)")
        return
    import torch

    out = args.out or c.RESULTS
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    params = {"batch": args.batch, "steps": args.steps}
    result: dict = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "date": time.strftime("%Y-%m-%d"), "params": params, "runs": {a: [] for a in arms}, "errors": {}}
    path = out / "gpu.json"
    c.compile_package()
    for r in range(args.runs):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            t0 = time.perf_counter()
            try:
                res = c.run_child(Path(__file__), arm, params, args.arm_timeout)
                res["wall_s"] = time.perf_counter() - t0
                result["runs"][arm].append(res)
            except Exception as e:  # noqa: BLE001 - a failed arm is a figure too; the others go on
                result["errors"].setdefault(arm, []).append(str(e)[-2000:])
            print(f"  {arm}: {result['runs'][arm][-1] if result['runs'][arm] else result['errors'][arm][-1][:400]}",
                  file=sys.stderr, flush=True)
            _summarise(result)
            path.write_text(json.dumps(result, indent=1))
    _print(result)
    if not args.no_tests:
        result["gpu_tests"] = _gpu_tests(out, args.tests_timeout)
        print(f"GPU-marked tests: {result['gpu_tests']['summary']}")
        path.write_text(json.dumps(result, indent=1))
    print(f"written to {path}")


def _summarise(result: dict) -> None:
    runs = result["runs"]
    med = {a: c.median([r["images_s"] for r in rs]) for a, rs in runs.items() if rs}
    result["images_s"] = med
    ratios = {}
    for mine, theirs in (("trainer", "hand"), ("trainer_compile", "hand_compile")):
        if mine in med and theirs in med:
            ratios[f"{mine}/{theirs}"] = med[mine] / med[theirs]
    result["ratios"] = ratios


def _print(result: dict) -> None:
    rows = [[a, result["images_s"][a], c.median([r["peak_mem_gb"] for r in rs]),
             rs[-1].get("mfu_logged") or float("nan"), rs[-1].get("mfu_by_hand") or float("nan")]
            for a, rs in result["runs"].items() if rs]
    print(f"device: {result['device']} · torch {result['torch']} · CUDA {result['cuda']}\n"
          + c.table(["arm", "images/s", "peak GB", "MFU logged", "MFU by hand"], rows))
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.3f}× ({c.verdict(v, TARGET, lower_is_better=False)} ≥ {TARGET})")
    for arm, errs in result["errors"].items():
        print(f"{arm}: FAILED: {errs[-1].splitlines()[-1] if errs[-1] else ''}")


if __name__ == "__main__":
    main()
