"""Where the process runs: device choice and CPU thread settings."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import TorchrigError


class RuntimeSetupError(TorchrigError, RuntimeError):
    """The requested device, precision or thread setting cannot be honoured here."""


def select_device(name: str = "auto", local_rank: Optional[int] = None) -> torch.device:
    """Pick the device: ``auto`` prefers CUDA (the GPU of ``local_rank``), then MPS, then CPU."""
    name = (name or "auto").lower()
    if name == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda", (local_rank or 0) % max(1, torch.cuda.device_count()))
            use_device(dev)  # as for an explicit cuda:N: this rank's GPU, not cuda:0, is the current device
            return dev
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise RuntimeSetupError(f"device {name!r} is not a device name; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build; install a CUDA build of torch" if torch.version.cuda is None
                   else f"no usable GPU or driver (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
            raise RuntimeSetupError(
                f"device {name!r} asked for, but CUDA is not available on this machine "
                f"(torch {torch.__version__}: {why}); use device=cpu or device=auto")
        if dev.index is None:
            dev = torch.device("cuda", (local_rank or 0) % torch.cuda.device_count())
        elif dev.index >= torch.cuda.device_count():
            raise RuntimeSetupError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise RuntimeSetupError(f"device {name!r} asked for, but MPS is not available on this machine; use device=cpu")
    use_device(dev)
    return dev


def use_device(dev: torch.device) -> None:
    """Make ``dev`` the process's current CUDA device, whoever creates the process group.

    Collectives, ``torch.cuda`` calls without an index and NCCL barriers all use the current device; left
    at cuda:0, every rank of a machine would put its first allocations (and NCCL's) on GPU 0.
    """
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)


THREADS_PER_CORE = 4  # more threads than this per core only slow a run down, and enough of them crash it


def _check_thread_count(name: str, count: Optional[int]) -> None:
    """A thread count this machine can run: each thread reserves a stack, and torch creates its pool at once
    (threads=100000 fails inside an unrelated import, or crashes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if count is not None and count > THREADS_PER_CORE * cores:
        raise RuntimeSetupError(f"{name}={count}: more CPU threads than this machine can use ({cores} core(s) "
                                f"available to this process, at most {THREADS_PER_CORE} threads per core); set "
                                f"{name} to at most {cores}, or leave it unset")


def configure_threads(threads: Optional[int] = None, interop: Optional[int] = None) -> int:
    """Set intra-op (and inter-op) CPU threads; ``TORCH_THREAD_NUM`` is used when ``threads`` is None.

    Returns the intra-op thread count in force. Inter-op threads can only be set once per process,
    before any parallel work, so a failure there is ignored rather than fatal.
    """
    source = "threads"
    if threads is None:
        env = os.environ.get("TORCH_THREAD_NUM")
        if env:
            try:
                threads = int(env)
            except ValueError:
                raise RuntimeSetupError(f"TORCH_THREAD_NUM={env!r} is not an integer; set it to a thread count like 4") from None
            if threads < 1:
                raise RuntimeSetupError(f"TORCH_THREAD_NUM={env!r} must be at least 1")
            source = "TORCH_THREAD_NUM"
    for name, count in ((source, threads), ("interop_threads", interop)):
        _check_thread_count(name, count)
    if threads is not None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        interop = interop or threads
    if interop is not None and torch.get_num_interop_threads() != interop:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError:
            pass  # already started parallel work; intra-op threads still apply
    return torch.get_num_threads()

