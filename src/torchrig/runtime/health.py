"""A health check before a long run: a slow or broken device, or a slow link, named before it costs the run.

One GPU of 1,024 that runs at half its clock (thermal throttling, a bad power cap), one with a fraction of its
memory free (another process on it), or one host whose network is degraded makes every step of every rank as slow
as itself, and says nothing. Per device, the check times a square matrix product in the run's dtype (bf16 / fp16
under autocast, fp32 otherwise) and compares it with the dtype's peak where the GPU is known, allocates as much
memory as it is asked to; per rank, it times a ring exchange with the next rank (each rank sends to ``rank + 1``
and receives from ``rank - 1`` at once: one link each) and one all-reduce of the whole group (its bus bandwidth).
Every rank's figures are gathered (one small all-gather) and a rank far below the median of the others
(:data:`FAR_BELOW`: under half of it) is named with its host and device, on every rank alike, so every rank stops
before training with the same line. ``torchrig doctor --gpus`` runs the same probes on the devices of one
machine (and, under ``torchrig launch``, over the ranks).

Timings wait for the device (``torch.cuda.synchronize``): the check runs once, before training.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .dist import all_gather_numbers, enter_collective, get_rank, get_world_size, leave_collective

FAR_BELOW = 0.5  # a figure under this share of the other ranks' median names the rank


@dataclasses.dataclass
class Probe:
    """One device's figures: matrix-product FLOP/s in ``dtype``, bytes allocated, link bytes/s (ring, bus)."""

    device: str
    dtype: str
    flops: float
    memory: float
    ring: Optional[float] = None
    bus: Optional[float] = None

    def numbers(self) -> list:
        return [self.flops, self.memory, self.ring or 0.0, self.bus or 0.0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 0, seconds: float = 0.2) -> float:
    """FLOP/s of ``n × n`` matrix products in ``dtype`` on ``device`` (n: 8192 on a GPU, 256 on the CPU), repeated
    for about ``seconds`` after one warm-up."""
    n = n or (8192 if device.type == "cuda" else 256)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    _matmul(a, b)
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while True:
        _matmul(a, b)
        reps += 1
        if reps % 4 == 0 or device.type != "cuda":
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return 2.0 * n ** 3 * reps / elapsed


def allocatable(device: torch.device, share: float = 0.9, chunk: int = 256 << 20, cpu_bytes: int = 64 << 20) -> float:
    """Bytes that could be allocated on ``device``: on a GPU ``share`` of its free memory, in chunks (each touched);
    on the CPU a stand-in of ``cpu_bytes``. Freed before returning."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        want = int(free * share)
    else:
        want = cpu_bytes
    held, got = [], 0
    try:
        while got < want:
            size = min(chunk, want - got)
            held.append(torch.empty(size, dtype=torch.uint8, device=device).fill_(1))
            got += size
    except torch.OutOfMemoryError:
        pass
    finally:
        held.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return float(got)


def ring_bytes_per_s(device: torch.device, nbytes: int = 0, reps: int = 3) -> float:
    """This rank's link: bytes/s of sending ``nbytes`` to the next rank while receiving as much from the previous
    one (every rank at once). Collective."""
    nbytes = nbytes or ((256 << 20) if device.type == "cuda" else (8 << 20))
    world, rank = get_world_size(), get_rank()
    out = torch.ones(nbytes // 4, device=device)
    into = torch.empty_like(out)
    n = enter_collective("send/recv", "health check")
    t0 = time.perf_counter()
    for _ in range(reps):
        ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, into, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    _sync(device)
    leave_collective(n)
    return reps * nbytes / (time.perf_counter() - t0)


def bus_bytes_per_s(device: torch.device, nbytes: int = 0, reps: int = 3) -> float:
    """The group's all-reduce bus bandwidth (bytes × 2(n-1)/n per second, NCCL-tests' ``busbw``). Collective."""
    nbytes = nbytes or ((256 << 20) if device.type == "cuda" else (8 << 20))
    world = get_world_size()
    t = torch.ones(nbytes // 4, device=device)
    n = enter_collective("all_reduce", "health check")
    dist.all_reduce(t)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(t)
    _sync(device)
    leave_collective(n)
    return reps * nbytes * 2 * (world - 1) / world / (time.perf_counter() - t0)


def probe(device: torch.device, dtype: torch.dtype, links: bool) -> Probe:
    """This device's figures; with ``links`` (several ranks) its ring link and the group's bus bandwidth too."""
    flops = matmul_flops(device, dtype)
    memory = allocatable(device)
    ring = ring_bytes_per_s(device) if links else None
    bus = bus_bytes_per_s(device) if links else None
    return Probe(str(device), str(dtype).replace("torch.", ""), flops, memory, ring, bus)


# ----------------------------------------------------------------------------- judging


FIGURES = (("matmul", "FLOP/s", 1e12, "TFLOP/s"), ("memory", "allocatable", 2 ** 30, "GiB"),
           ("ring link", "bytes/s", 2 ** 30, "GiB/s"))


def far_below(figures: list, names: list, what: str = "rank") -> list:
    """One line per rank (or device) whose matmul, memory or ring link is under :data:`FAR_BELOW` of the median of
    the others'. ``figures``: per rank, :meth:`Probe.numbers`; ``names``: per rank, (host, device)."""
    lines = []
    for i, mine in enumerate(figures):
        for k, (label, _, scale, unit) in enumerate(FIGURES):
            others = [f[k] for j, f in enumerate(figures) if j != i and f[k] > 0]
            if not others or mine[k] <= 0 and k == 2:
                continue
            median = statistics.median(others)
            if mine[k] < FAR_BELOW * median:
                host, device = names[i] if i < len(names) else ("?", "?")
                lines.append(f"{what} {i} (host {host}, {device}): {label} {mine[k] / scale:.3g} {unit}, "
                             f"{mine[k] / median:.2f}× the other {what}s' median {median / scale:.3g} {unit}")
    return lines


def describe(p: Probe, peak: Optional[float] = None) -> str:
    """One line of a device's figures; ``peak``: its dtype's peak FLOP/s where the GPU is known."""
    share = f" ({p.flops / peak:.0%} of its {p.dtype} peak {peak / 1e12:.0f} TFLOP/s)" if peak else ""
    text = f"{p.device}: matmul {p.dtype} {p.flops / 1e12:.3g} TFLOP/s{share} · {p.memory / 2 ** 30:.3g} GiB allocatable"
    if p.ring is not None:
        text += f" · ring link {p.ring / 2 ** 30:.3g} GiB/s · all-reduce bus {p.bus / 2 ** 30:.3g} GiB/s"
    return text


def check_ranks(device: torch.device, dtype: torch.dtype, names: list,
                say: Callable[[str], None], peak: Optional[float] = None) -> list:
    """Every rank's probe, gathered; the lines naming ranks far below their peers (the same on every rank). Rank 0
    says each rank's figures. Collective."""
    mine = probe(device, dtype, links=get_world_size() > 1)
    figures = all_gather_numbers(mine.numbers(), name="health figures")
    if get_rank() == 0:
        for r, f in enumerate(figures):
            p = Probe(names[r][1] if r < len(names) else "?", mine.dtype, *f[:2], f[2] or None, f[3] or None)
            say(f"torchrig: health check, rank {r} (host {names[r][0] if r < len(names) else '?'}) {describe(p, peak)}")
    return far_below(figures, names)


def check_devices(devices: list, dtype_of: Callable[[torch.device], torch.dtype],
                  peak_of: Callable[[torch.device, torch.dtype], Optional[float]]) -> tuple[list, list]:
    """``torchrig doctor --gpus`` in one process: (a line per device, the lines naming devices far below the
    others). Each device is probed alone, one after the other."""
    probes = [probe(d, dtype_of(d), links=False) for d in devices]
    lines = [describe(p, peak_of(d, dtype_of(d))) for p, d in zip(probes, devices)]
    return lines, far_below([p.numbers() for p in probes], [("this machine", p.device) for p in probes], "device")


__all__ = ["FAR_BELOW", "Probe", "allocatable", "bus_bytes_per_s", "check_devices", "check_ranks", "describe",
           "far_below", "matmul_flops", "probe", "ring_bytes_per_s"]
