"""Seeding and capture / restore of every random number generator, for exact resume.

Each process of a run has generators of its own: the ranks draw different amounts (a short last batch
on one rank, a filler batch on another), so their streams part after the first epoch. A checkpoint
therefore holds every rank's states, gathered by :func:`rng_states_of_ranks` as plain bytes in a
tensor (nothing exchanged between ranks is unpickled), and each rank restores its own.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .dist import host_collectives


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """All generator states as plain tensors / ints, so they load with ``weights_only=True``."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def rng_states_of_ranks() -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, in rank order (collective: every rank calls it)."""
    mine = rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    # host memory over gloo (the default beside NCCL); an NCCL-only group moves device tensors
    device = torch.device("cpu") if host_collectives() else torch.device("cuda", torch.cuda.current_device())
    data = _pack(mine).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device))  # CUDA states may differ in number
    padded = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(every, padded)
    return [_unpack(d.cpu()) for d in every]


def _pack(state: dict[str, Any]) -> torch.Tensor:
    """``state`` (of :func:`rng_state`) as bytes: a header of counts, then the generators' words."""
    py, n, cuda = state["python"], state["numpy"], state.get("cuda", [])
    head = torch.tensor([py["version"], py["state"].numel(), n["keys"].numel(), state["torch"].numel(), len(cuda),
                         cuda[0].numel() if cuda else 0, n["pos"], n["has_gauss"]], dtype=torch.int64)
    gauss = torch.tensor([math.nan if py["gauss"] is None else py["gauss"], n["gauss"]], dtype=torch.float64)
    parts = [head, gauss, py["state"], n["keys"], state["torch"], *cuda]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def _unpack(data: torch.Tensor) -> dict[str, Any]:
    """The state :func:`_pack` packed (trailing padding ignored)."""
    at = 0

    def take(count: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal at
        size = count * torch.empty((), dtype=dtype).element_size()
        part, at = data[at:at + size].clone().view(dtype), at + size
        return part

    version, py_len, np_len, torch_len, n_cuda, cuda_len, np_pos, np_has_gauss = take(8, torch.int64).tolist()
    py_gauss, np_gauss = take(2, torch.float64).tolist()
    state = {
        "python": {"version": version, "state": take(py_len, torch.int64),
                   "gauss": None if math.isnan(py_gauss) else py_gauss},
        "numpy": {"name": "MT19937", "keys": take(np_len, torch.int64), "pos": np_pos, "has_gauss": np_has_gauss,
                  "gauss": np_gauss},
        "torch": take(torch_len, torch.uint8),
    }
    if n_cuda:
        state["cuda"] = [take(cuda_len, torch.uint8) for _ in range(n_cuda)]
    return state
