"""GPU figures: ResNet-18 on 224×224 synthetic images, bf16 autocast, channels_last.

Arms (fresh processes, alternated, medians over the runs):

- ``hand``            a hand-written loop: batches gathered from pinned host memory, copied with
                      ``non_blocking=True``, ``zero_grad(set_to_none=True)`` / forward under bf16
                      autocast / cross-entropy / backward / fused SGD step; ``loss.item()`` every 50 steps.
- ``trainer``         ``Trainer.fit`` on the same tensors, model, optimizer and precision.
- ``hand_compile`` /  the same two with ``torch.compile``.
  ``trainer_compile``
- ``trainer_fp16``    the Trainer with fp16 autocast and its GradScaler (reported for information).

Each arm reports images/s over the steps after a warm-up (CUDA-synchronised at both ends), the peak
GPU memory and, for the Trainer arms, the MFU it logs when ``log.flops`` is available. The targets:
torchrig / hand ≥ 0.98 with and without compile. Then the GPU-marked tests run (sync-free steps,
fp16 with GradScaler, automatic micro-batching on a real out-of-memory error).

Usage, on a machine with a CUDA GPU: ``python benchmarks/gpu.py [--runs 3] [--steps 60] [--batch 128]``.
Results go to ``benchmarks/results/gpu.json`` with the device name; without CUDA the script says so
and exits 0, so it can sit in ``run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "gpu"
TARGET = 0.98
WARMUP_STEPS = 15


def _setup(p: dict):
    import torch
    import torchvision

    torch.manual_seed(0)
    n = p["batch"] * (p["steps"] + WARMUP_STEPS)
    images = torch.randint(0, 256, (min(n, 4096), 3, 224, 224), dtype=torch.uint8)
    x = (images.float() / 255.0).pin_memory()
    y = torch.randint(0, 1000, (len(x),)).pin_memory()
    model = torchvision.models.resnet18(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    return torch, x, y, model, opt


def _arm_hand(p: dict) -> dict:
    torch, x, y, model, opt = _setup(p)
    step_fn = torch.compile(model) if p.get("compile") else model
    loss_fn = torch.nn.CrossEntropyLoss()
    b, total = p["batch"], p["steps"] + WARMUP_STEPS
    t0 = None
    for i in range(total):
        if i == WARMUP_STEPS:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        s = (i * b) % (len(x) - b + 1)
        xb = x[s:s + b].cuda(non_blocking=True).contiguous(memory_format=torch.channels_last)
        yb = y[s:s + b].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(step_fn(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 50 == 0:
            loss.item()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"images_s": p["steps"] * b / dt, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}


def _arm_trainer(p: dict) -> dict:
    import tempfile

    from torchrig import Trainer

    torch, x, y, model, opt = _setup(p)
    b = p["batch"]
    total = p["steps"] + WARMUP_STEPS
    n = min(len(x), total * b)
    marks: list = []

    def on_step_end(trainer, values):
        if trainer.global_step in (WARMUP_STEPS, total):
            torch.cuda.synchronize()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(model, opt, loss="cross_entropy", metrics=[], run_dir=run_dir, batch_size=b,
                          precision=p.get("precision", "bf16"), channels_last=True, compile=bool(p.get("compile")),
                          max_steps=total, epochs=10**6, shuffle=False, plot=False, checkpoint_every_epochs=0,
                          progress="none", callbacks=[_Hook(on_step_end)],
                          **{"log.flops": True}, **p.get("extra", {}))
        trainer.fit((x[:n], y[:n]))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    mfu = [r["mfu"] for r in rows if "mfu" in r]
    return {"images_s": p["steps"] * b / (marks[-1] - marks[0]),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "mfu": mfu[-1] if mfu else None}


class _Hook:
    """A callback object with one hook (the Trainer calls the hooks an object defines)."""

    def __init__(self, fn):
        self.on_step_end = fn


def _gpu_tests() -> dict:
    """The GPU-marked tests: sync-free steps, fp16 GradScaler, automatic micro-batching on a real OOM."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "tests"],
                          capture_output=True, text=True, cwd=str(c.HERE.parent))
    tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    return {"exit_code": proc.returncode, "summary": tail[0]}


def main() -> None:
    if c.child_main({"hand": _arm_hand, "hand_compile": lambda p: _arm_hand(dict(p, compile=True)),
                     "trainer": _arm_trainer, "trainer_compile": lambda p: _arm_trainer(dict(p, compile=True)),
                     "trainer_fp16": lambda p: _arm_trainer(dict(p, precision="fp16"))}):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile arms")
    args = ap.parse_args()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                            "if torch.cuda.is_available() else '')"], capture_output=True, text=True)
    device = probe.stdout.strip()
    if not device:
        print("no CUDA device: the GPU figures stay unmeasured (run this script on a GPU machine)")
        return
    params = {"batch": args.batch, "steps": args.steps}
    arms = ["hand", "trainer", "trainer_fp16"] + ([] if args.no_compile else ["hand_compile", "trainer_compile"])
    runs = c.alternate(Path(__file__), {a: params for a in arms}, args.runs, warmup=False, timeout=1200)
    med = {a: c.median([r["images_s"] for r in runs[a]]) for a in arms}
    ratios = {"trainer/hand": med["trainer"] / med["hand"]}
    if "hand_compile" in med:
        ratios["trainer_compile/hand_compile"] = med["trainer_compile"] / med["hand_compile"]
    rows = [[a, med[a], c.median([r["peak_mem_gb"] for r in runs[a]])] for a in arms]
    print(f"device: {device}\n" + c.table(["arm", "images/s", "peak GB"], rows))
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}× ({c.verdict(v, TARGET, lower_is_better=False)} ≥ {TARGET})")
    tests = _gpu_tests()
    print(f"GPU-marked tests: {tests['summary']}")
    path = c.write_result(NAME, {"device": device, "images_s": med, "ratios": ratios, "runs": runs,
                                 "gpu_tests": tests, "params": params})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
