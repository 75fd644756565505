"""Shared pieces of the benchmarks: the workload, child processes, medians, tables and JSON.

Every measurement runs in a fresh child process (``python benchmarks/NAME.py --child ARM ...``)
that prints one JSON object on its last stdout line. The parent alternates the arms (A B, then
B A, …) so that load from other processes on the shared cores hits every arm alike, and reports
medians and the ratio of medians.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# ----------------------------------------------------------------------------- the workload
# Digits-sized classification: 1,797 samples of 64 features, 10 classes, an MLP 64-256-256-10,
# batch 64, AdamW. Synthetic (a fixed random teacher) so that neither arm imports scikit-learn.
N_SAMPLES, N_FEATURES, N_CLASSES, HIDDEN, BATCH, LR = 1797, 64, 10, 256, 64, 1e-3
LOG_EVERY = 50  # the Trainer's default log.every_steps


def pin_threads() -> None:
    """One intra-op and one inter-op thread: less noise on shared cores, the same in every arm."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def make_data(n: int = N_SAMPLES, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return x, y


def make_model(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, N_CLASSES))


def make_loader(x, y, batch_size: int = BATCH, seed: int = 0):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def hand_loop(model, loader, optimizer, epochs: int, stream, *, on_epoch_end: Optional[Callable] = None,
              metrics: bool = True, cpu_times: Optional[list] = None) -> list:
    """What a PyTorch user writes (the PyTorch ImageNet example's ``train()``), kept lean.

    zero_grad(set_to_none=True), forward, loss, backward, step; loss and accuracy summed as
    tensors every step (the ImageNet example computes accuracy every step), ``.item()`` and a progress line
    every ``LOG_EVERY`` steps, an epoch line at the end of each epoch. Returns the epoch wall times
    (s); ``cpu_times``, if given, receives the epoch CPU times of this thread (s).
    """
    import torch.nn.functional as F

    device = next(model.parameters()).device
    step, times = 0, []
    for epoch in range(epochs):
        t_epoch, c_epoch = time.perf_counter(), time.thread_time()
        model.train()
        loss_sum = correct = None
        count = seen = 0
        t_log, last = time.perf_counter(), float("nan")
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            step += 1
            count += 1
            seen += len(y)
            d = loss.detach()
            loss_sum = d if loss_sum is None else loss_sum + d
            if metrics:
                c = (out.detach().argmax(dim=1) == y).sum()
                correct = c if correct is None else correct + c
            if step % LOG_EVERY == 0:
                now = time.perf_counter()
                last = loss_sum.item() / count
                acc = correct.item() / seen if metrics else float("nan")
                print(f"Epoch [{epoch + 1}/{epochs}][{i + 1}/{len(loader)}]  loss {last:.4f}  acc {acc:.4f}  "
                      f"lr {optimizer.param_groups[0]['lr']:.3e}  samples/s {seen / (now - t_log):.0f}",
                      file=stream, flush=True)
                loss_sum = correct = None
                count = seen = 0
                t_log = now
        print(f"epoch {epoch + 1}/{epochs} · step {step} · loss {last:.4f}", file=stream, flush=True)
        times.append(time.perf_counter() - t_epoch)
        if cpu_times is not None:
            cpu_times.append(time.thread_time() - c_epoch)
        if on_epoch_end is not None:
            on_epoch_end(epoch)
    return times


class AverageMeter:
    """The PyTorch ImageNet example's running average."""

    def __init__(self) -> None:
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def hand_loop_seeds(model, loader, optimizer, epochs: int, stream, *, cpu_times: Optional[list] = None) -> list:
    """The PyTorch ImageNet example's ``train()``: AverageMeters for batch time, data time,
    loss and top-1 accuracy updated every step (``loss.item()`` each step), a progress line every
    ``LOG_EVERY`` steps; ``zero_grad(set_to_none=True)``. Returns the epoch wall times (s)."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    times = []
    for epoch in range(epochs):
        t_epoch, c_epoch = time.perf_counter(), time.thread_time()
        batch_time, data_time, losses, top1 = AverageMeter(), AverageMeter(), AverageMeter(), AverageMeter()
        model.train()
        end = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            data_time.update(time.perf_counter() - end)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            n = x.size(0)
            losses.update(loss.item(), n)
            top1.update((out.detach().argmax(dim=1) == y).sum().item() * 100.0 / n, n)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            batch_time.update(time.perf_counter() - end)
            end = time.perf_counter()
            if (i + 1) % LOG_EVERY == 0:
                print(f"Epoch: [{epoch}][{i + 1}/{len(loader)}]\tTime {batch_time.val:.3f} ({batch_time.avg:.3f})\t"
                      f"Data {data_time.val:.3f} ({data_time.avg:.3f})\tLoss {losses.val:.4f} ({losses.avg:.4f})\t"
                      f"Prec@1 {top1.val:.3f} ({top1.avg:.3f})", file=stream, flush=True)
        print(f"epoch {epoch + 1}/{epochs} · loss {losses.avg:.4f} · Prec@1 {top1.avg:.3f}", file=stream, flush=True)
        times.append(time.perf_counter() - t_epoch)
        if cpu_times is not None:
            cpu_times.append(time.thread_time() - c_epoch)
    return times


def trainer_kwargs(run_dir: str, epochs: int, *, fast_path: bool, end_of_fit: bool = False) -> dict:
    """The Trainer arm: defaults except the run dir, one thread, and (unless ``end_of_fit``) no plot
    and no per-epoch checkpoints, so that fit times the training loop. Logging stays at its defaults
    (progress lines every 50 steps, metrics.jsonl, TensorBoard when installed)."""
    kw: dict[str, Any] = dict(loss="cross_entropy", epochs=epochs, run_dir=run_dir, threads=1, fast_path=fast_path,
                              batch_size=BATCH, seed=0)
    if not end_of_fit:
        kw.update(plot=False, checkpoint_every_epochs=0)
    return kw


def time_trainer_fit(trainer, data) -> dict:
    """Time ``fit`` and, inside it, the loop alone (the epochs and their end-of-epoch bookkeeping).

    The loop time is the sum of ``_run_epoch`` + ``_end_epoch``; what is left of ``fit`` is the
    set-up at its start (loaders, logger, TensorBoard writer) and the end (final checkpoint, plot).
    """
    wall, cpu = [0.0], [0.0]
    epoch_times: list = []
    epoch_cpu: list = []

    def timed(name: str):
        inner = getattr(trainer, name)

        def wrapper(*a, **k):
            t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                dt, dth = time.perf_counter() - t0, time.thread_time() - th0
                wall[0] += dt
                cpu[0] += time.process_time() - c0
                if name == "_run_epoch":
                    epoch_times.append(dt)
                    epoch_cpu.append(dth)
                else:
                    epoch_times[-1] += dt
                    epoch_cpu[-1] += dth
        setattr(trainer, name, wrapper)

    timed("_run_epoch")
    timed("_end_epoch")
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(data)
    total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"loop_s": wall[0], "loop_cpu_s": cpu[0], "fit_s": total, "fit_cpu_s": total_cpu,
            "outside_loop_s": total - wall[0], "epoch_s": epoch_times, "epoch_cpu_s": epoch_cpu,
            "steps": trainer.global_step}


# ----------------------------------------------------------------------------- processes and statistics
def child_main(handlers: dict[str, Callable[[dict], dict]]) -> bool:
    """If this process is a child (``--child ARM JSON``), run the arm, print its JSON and return True."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        arm, params = sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        result = handlers[arm](params)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        sys.stdout.flush()
        return True
    return False


def run_child(script: Path, arm: str, params: dict, timeout: float = 600.0,
              cmd: Optional[Sequence[str]] = None) -> dict:
    argv = list(cmd) if cmd is not None else [sys.executable, str(script), "--child", arm, json.dumps(params)]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, env=env,
                              cwd=str(HERE.parent))
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-3000:]
            raise RuntimeError(f"benchmark child {arm!r} failed (exit {proc.returncode}):\n{tail}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def compile_package() -> None:
    """Byte-compile torchrig, as ``pip install`` and a first import normally do: with
    ``PYTHONDONTWRITEBYTECODE`` set (as on some CI machines) every fresh process would otherwise compile
    torchrig's sources again (~55 ms), a cost no installed copy pays and the hand-written arms never see."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("torchrig")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            compileall.compile_dir(folder, quiet=1)


def alternate(script: Path, arms: dict[str, dict], runs: int, *, warmup: bool = True, progress: bool = True,
              timeout: float = 600.0) -> dict[str, list[dict]]:
    """Run each arm ``runs`` times in fresh processes, alternating the order every round.

    ``arms`` maps an arm name to its params. One untimed warm-up round (fills the page cache so the
    first timed arm does not pay for cold file reads) unless ``warmup`` is False.
    """
    names = list(arms)
    compile_package()
    if warmup:
        for name in names:
            run_child(script, name, dict(arms[name], warmup=True), timeout)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(runs):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            _note_load()
            out[name].append(run_child(script, name, arms[name], timeout))
        if progress:
            print(f"  round {r + 1}/{runs} done", file=sys.stderr, flush=True)
    return out


_LOADS: list = []  # 1-minute load average seen before each timed run: how busy the shared cores were


def _note_load() -> None:
    try:
        _LOADS.append(os.getloadavg()[0])
    except OSError:
        pass


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how noisy a set of runs was."""
    m = median(values)
    return (max(values) - min(values)) / m if m else 0.0


def _torch_version(default: str) -> str:
    """torch.__version__ (with its local tag, e.g. +cu130) read from torch/version.py, not imported."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "version.py"
        if path.exists():
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", path.read_text())
            if m:
                return m.group(1)
    return default


def environment() -> dict:
    from importlib import metadata  # not `import torch`: the parent process stays light

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"torch": _torch_version(metadata.version("torch")), "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_cores": cores, "loadavg_1m": round(load[0], 2), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "threads_per_process": 1,
            "loadavg_during_runs": {"min": round(min(_LOADS), 2), "median": round(median(_LOADS), 2),
                                    "max": round(max(_LOADS), 2)} if _LOADS else None}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_result(name: str, payload: dict, quick: bool = False) -> Path:
    """Write ``results/NAME.json`` (``results/quick/NAME.json`` for ``--quick`` runs, so a smoke test
    never overwrites the published numbers)."""
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = dict(payload, benchmark=name, quick=quick, environment=environment())
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def verdict(value: float, target: float, lower_is_better: bool = True) -> str:
    ok = value <= target if lower_is_better else value >= target
    return "meets target" if ok else "MISSES target"
