"""Process group set-up and the collective helpers a custom step may need.

Ranks come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), from Slurm's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, first host of
``SLURM_JOB_NODELIST``), or from an explicit ``init_method`` (``tcp://host:port``, ``file:///path``).
All helpers work (as no-ops) when no process group exists, so single-process code calls them freely.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .device import RuntimeSetupError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    source: str = "single"  # single, torchrun, slurm, init_method

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[03-05,07],gpu1`` → ``node03``."""
    nodelist = nodelist.strip()
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def detect(init_method: Optional[str] = None, rank: Optional[int] = None,
           world_size: Optional[int] = None) -> DistInfo:
    """Work out rank and world size from explicit arguments, torchrun or Slurm, in that order."""
    env = os.environ
    if init_method is not None:
        if rank is None or world_size is None:
            raise RuntimeSetupError(
                f"dist.init_method={init_method!r} needs dist.rank and dist.world_size as well")
        local = int(env.get("LOCAL_RANK", rank))
        return DistInfo(rank, world_size, local, int(env.get("LOCAL_WORLD_SIZE", world_size)), "init_method")
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", 1)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        ntasks_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
        return DistInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                        int(ntasks_node) if ntasks_node.isdigit() else 1, "slurm")
    return DistInfo()


def default_backend(device: torch.device) -> str:
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_process_group(info: DistInfo, device: torch.device, backend: Optional[str] = None,
                       init_method: Optional[str] = None, timeout_s: float = 1800.0) -> bool:
    """Join the process group described by ``info``; returns True when this call created it."""
    if not info.is_distributed or dist.is_initialized():
        return False
    if not dist.is_available():
        raise RuntimeSetupError("this torch build has no torch.distributed support; install a standard torch wheel")
    backend = backend or default_backend(device)
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available()}
    if backend in available and not available[backend]:
        ok = [b for b, v in available.items() if v]
        raise RuntimeSetupError(f"dist.backend {backend!r} is not built into this torch; available: {', '.join(ok)}")
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeSetupError("dist.backend 'nccl' needs CUDA devices; use gloo on CPU")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=info.rank, world_size=info.world_size)
    elif info.source == "slurm":
        os.environ.setdefault("MASTER_ADDR", first_slurm_host(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        os.environ.setdefault("MASTER_PORT", "29500")
        kwargs.update(init_method="env://", rank=info.rank, world_size=info.world_size)
    else:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeSetupError(
                    f"{var} is not set but RANK/WORLD_SIZE are; start the job with torchrun or torchrig launch")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if backend == "nccl":
            kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return True


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (peer died) must not mask the original error
            pass


# ----------------------------------------------------------------------------- public helpers


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor; the input is left alone)."""
    out = t.detach().clone()
    if is_initialized() and get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    out = all_reduce_sum(t)
    return out / get_world_size() if out.is_floating_point() else out.double() / get_world_size()


def broadcast(obj: Any, src: int = 0) -> Any:
    """Broadcast a tensor (in place, returned) or any picklable object from ``src``."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    if isinstance(obj, torch.Tensor):
        dist.broadcast(obj, src)
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def gather(obj: Any) -> list:
    """Every rank's ``obj`` (tensor or picklable object), in rank order, on every rank."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out
