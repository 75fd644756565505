"""``torchrig doctor``: what this machine offers for training, and known version problems explained."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys
from pathlib import Path
from typing import Any

from ..errors import TorchrigError

REQUIRED = ("numpy", "pyyaml", "safetensors", "tqdm", "scikit-learn", "matplotlib")
# package -> the extra that installs it, when torchrig's own metadata cannot say (a source checkout on PYTHONPATH)
EXTRAS = {"torchvision": "vision", "pillow": "vision", "tensorboard": "tensorboard", "tokenizers": "text",
          "transformers": "text", "timm": "timm", "datasets": "hf", "torchdata": "torchdata", "mlflow": "mlflow",
          "wandb": "wandb", "optuna": "tune", "onnx": "export", "onnxscript": "export", "onnxruntime": "export",
          "torchmetrics": "metrics", "ipywidgets": "notebook", "ray": "ray",
          "peft": "finetune", "torchao": "finetune", "liger-kernel": "speed",
          "torchft": "ft"}


def extras() -> dict[str, str]:
    """Optional package -> the torchrig extra that installs it (``pip install "torchrig[EXTRA]"``), from the
    installed torchrig's metadata (its ``Requires-Dist``), else :data:`EXTRAS`. Only what an extra installs is
    listed, so doctor never calls missing a package no extra would bring."""
    import re

    try:
        requires = md.requires("torchrig") or []
    except md.PackageNotFoundError:
        requires = []
    found: dict[str, str] = {}
    for line in requires:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^]]*])?[^;]*;\s*extra\s*==\s*[\"']([^\"']+)[\"']", line)
        if m and m.group(2) not in ("all", "test") and m.group(1).lower() not in found:
            found[m.group(1).lower()] = m.group(2)
    return found or dict(EXTRAS)

# torch minor -> the torchvision minor built against it
TORCHVISION_FOR_TORCH = {(2, 4): 19, (2, 5): 20, (2, 6): 21, (2, 7): 22, (2, 8): 23, (2, 9): 24, (2, 10): 25,
                         (2, 11): 26, (2, 12): 27, (2, 13): 28, (2, 14): 29}


def _version(pkg: str):
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _minor(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def problems() -> list[str]:
    import torch

    found = []
    tv = _version("torchvision")
    if tv:
        want = TORCHVISION_FOR_TORCH.get(_minor(torch.__version__))
        if want is not None and _minor(tv)[1] != want:
            found.append(f"torchvision {tv} does not match torch {torch.__version__} (expects 0.{want}.x): "
                         f"importing torchvision may fail with 'operator torchvision::nms does not exist'; "
                         f"install the matching pair, e.g. pip install torchvision==0.{want}.*")
    np_v = _version("numpy")
    if np_v and _minor(np_v)[0] >= 2 and _minor(torch.__version__) < (2, 3):
        found.append(f"numpy {np_v} with torch {torch.__version__}: torch before 2.3 was built against numpy 1.x; "
                     f"pip install 'numpy<2' or upgrade torch")
    if os.environ.get("CUDA_VISIBLE_DEVICES") and not torch.cuda.is_available():
        reason = "this torch is a CPU-only build" if torch.version.cuda is None else "no driver or device is usable"
        found.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} is set but CUDA is unavailable: {reason}")
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        name = os.environ.get(var)
        if name and not os.path.exists(f"/sys/class/net/{name.split(',')[0].lstrip('^=')}"):
            found.append(f"{var}={name} names no network interface on this machine; multi-machine runs will "
                         f"fail to connect (list interfaces with `ip -br addr`)")
    env_threads = os.environ.get("TORCH_THREAD_NUM")
    if env_threads and not env_threads.isdigit():
        found.append(f"TORCH_THREAD_NUM={env_threads!r} is not an integer")
    return found


def report() -> str:
    import torch
    import torch.distributed as dist

    lines = [f"python       {sys.version.split()[0]} ({platform.platform()})",
             f"torch        {torch.__version__}"]
    lines.append(f"cuda         {torch.version.cuda or 'not built'}; available: {torch.cuda.is_available()}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"cudnn        {cudnn or 'not available'}")
    built = dist.is_available() and dist.is_nccl_available()
    nccl = "not built into this torch"
    if built:
        try:
            nccl = "built, version " + ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = "built"
        nccl += "; usable" if torch.cuda.is_available() else "; not usable here (no CUDA device)"
    lines.append(f"nccl         {nccl}")
    if dist.is_available():
        lines.append(f"distributed  backends built: gloo {dist.is_gloo_available()}, nccl {built}, "
                     f"mpi {dist.is_mpi_available()}")
    else:
        lines.append("distributed  not built into this torch")
    devices = ["cpu"]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        devices.append(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB bf16={torch.cuda.is_bf16_supported()}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    lines.append(f"devices      {'; '.join(devices)}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append(f"threads      intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}, "
                 f"cores {cores}, TORCH_THREAD_NUM={os.environ.get('TORCH_THREAD_NUM', 'unset')}, "
                 f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    lines.append(f"packages     {', '.join(f'{p} {_version(p)}' for p in REQUIRED if _version(p))}")
    optional = extras()
    present = [f"{p} {_version(p)}" for p in optional if _version(p)]
    missing = [f'{p} (pip install "torchrig[{extra}]")' for p, extra in optional.items() if not _version(p)]
    if present:
        lines.append(f"optional     {', '.join(present)}")
    if missing:
        lines.append(f"missing      {', '.join(missing)}")
    found = problems()
    lines.append("problems     " + ("none found" if not found else f"{len(found)}:"))
    lines += [f"  - {p}" for p in found]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- torchrig doctor --hang RUN_DIR


class DoctorError(TorchrigError, ValueError):
    """A run folder doctor cannot read as asked; the message names it."""


MAX_RANKS = 1 << 17  # dump files read from one folder
FRAMES = 4           # innermost frames shown of each rank's main thread


def _printable(text: str, limit: int = 300) -> str:
    """``text`` as one line of at most ``limit`` printable characters (a stranger's file may hold anything)."""
    clean = "".join(c if c.isprintable() else "?" for c in str(text))
    return clean if len(clean) <= limit else clean[:limit - 1] + "…"


def _json(path: Path, limit: int, what: str) -> Any:
    import json

    from ..config.files import read_regular

    data = read_regular(path, limit, what, "it is not one torchrig wrote; remove it", DoctorError)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise DoctorError(f"{what} '{path}' is not JSON ({exc}); it is not one torchrig wrote") from None


def hang_records(folder: Path) -> tuple[dict, list[str]]:
    """(rank -> record, one line per file that is not a record) of RUN_DIR/hang."""
    from ..runtime import hang

    records, bad = {}, []
    names = sorted(e.name for e in os.scandir(folder) if e.name.startswith("rank-") and e.name.endswith(".json")
                   and not e.name.endswith(".nccl.json"))
    for name in names[:MAX_RANKS]:
        try:
            rec = _json(folder / name, hang.RECORD_LIMIT, "hang record")
        except (DoctorError, OSError) as exc:
            bad.append(_printable(str(exc)))
            continue
        if not hang.valid(rec) or name != hang.dump_name(rec["rank"], "json"):
            bad.append(f"{name}: not a hang record of its rank (a field is missing or of the wrong type)")
            continue
        records[rec["rank"]] = rec
    return records, bad


def main_thread(path: Path) -> list[str]:
    """The innermost frames of the main thread in a rank's stacks file (faulthandler's text), read within bounds."""
    from ..config.files import read_lines
    from ..runtime import hang

    threads, current = [], []
    for _, line in read_lines(path, hang.STACK_LIMIT, "hang stacks", "remove it", DoctorError):
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = []
            threads.append(current)
        elif line.startswith("  File ") and len(threads):
            current.append(line.strip())
    main = next((t for t in threads if t and t[-1].endswith("in <module>")), threads[-1] if threads else [])
    return [_printable(f, 200) for f in main[:FRAMES]]


def nccl_line(path: Path) -> str:
    """The Flight Recorder's last collective started and last completed of one rank, from its JSON trace."""
    from ..runtime import hang

    trace = _json(path, hang.TRACE_LIMIT, "NCCL Flight Recorder trace")
    entries = trace.get("entries") if isinstance(trace, dict) else None
    if not isinstance(entries, list):
        return "NCCL trace: no collective entries"
    seen = [e for e in entries if isinstance(e, dict) and isinstance(e.get("collective_seq_id"), int)]
    done = [e for e in seen if e.get("state") == "completed"]
    open_ = [e for e in seen if e.get("state") != "completed"]
    parts = []
    if open_:
        e = open_[-1]
        parts.append(f"{_printable(e.get('profiling_name', '?'), 60)} seq {e['collective_seq_id']} "
                     f"{_printable(e.get('state', '?'), 20)}, not completed")
    if done:
        parts.append(f"last completed seq {done[-1]['collective_seq_id']}")
    return "NCCL trace: " + ("; ".join(parts) or "empty")


def hang_report(run_dir: str) -> str:
    """What ``torchrig doctor --hang RUN_DIR`` prints: the summary and, per rank, where it was and its frames."""
    from ..runtime import hang

    folder = Path(run_dir) / hang.FOLDER
    if not folder.is_dir():
        raise DoctorError(f"'{folder}' does not exist: the run in '{run_dir}' wrote no hang dump (dist.hang_timeout "
                          f"writes one per rank when a step, a collective or a data load makes no progress)")
    records, bad = hang_records(folder)
    lines = [f"hang dumps in {folder}: {len(records)} rank(s)"]
    if (folder / hang.SUMMARY).is_file():
        kept = _json(folder / hang.SUMMARY, hang.RECORD_LIMIT, "hang summary")
        text = kept.get("summary") if isinstance(kept, dict) else None
        lines.append("summary: " + (_printable(text, 4000) if isinstance(text, str) else "(unreadable)"))
    elif records:
        world = max(records) + 1
        lines.append(f"summary (rank 0 wrote none; from the {len(records)} records): "
                     + _printable(hang.summarize(records, world), 4000))
    for rank, rec in sorted(records.items()):
        state = (f"waits in {hang.collective_text(rec)}" if rec["entered"] > rec["completed"]
                 else f"{hang.elsewhere_text(rec)}")
        lines.append(_printable(f"rank {rank} ({rec['host']}, {rec['device']}): step {rec['step']}, {state}; last "
                                f"collective completed #{rec['completed']}; no progress for {rec['stalled']:g}s", 400))
        stacks = folder / hang.dump_name(rank, "txt")
        if stacks.is_file():
            lines += [f"    {f}" for f in main_thread(stacks)]
        trace = folder / hang.dump_name(rank, "nccl.json")
        if trace.is_file():
            lines.append(f"    {nccl_line(trace)}")
    return "\n".join(lines + [f"skipped: {b}" for b in bad])


# ----------------------------------------------------------------------------- torchrig doctor --gpus


def _dtype_of(device: Any) -> Any:
    import torch

    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def _peak_of(device: Any, dtype: Any) -> Any:
    import torch

    from ..observe.throughput import peak_flops

    return peak_flops(device, "bf16" if dtype == torch.bfloat16 else "fp32")


def gpus_report() -> tuple[str, bool]:
    """(what ``torchrig doctor --gpus`` prints, whether a device or rank is far below the others): every local GPU
    (the CPU without one) probed in turn; under ``torchrig launch`` / torchrun, every rank's device and links."""
    import socket

    import torch

    from .. import runtime
    from ..runtime import health

    info = runtime.detect()
    if info.is_distributed:
        device = runtime.select_device("auto", info.local_rank)
        runtime.init_process_group(info, device)
        try:
            names = runtime.gather((socket.gethostname(), str(device)), name="rank names")
            lines: list = []
            problems = health.check_ranks(device, _dtype_of(device), names, lines.append, _peak_of(device, _dtype_of(device)))
        finally:
            runtime.destroy_process_group()
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
        lines, problems = health.check_devices(devices, _dtype_of, _peak_of)
    verdict = [f"health: far below the others: {p}" for p in problems] or ["health: no device far below the others"]
    return "\n".join(lines + verdict), bool(problems)
