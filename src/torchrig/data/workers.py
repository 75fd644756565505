"""Loader worker processes: how many ``data.num_workers=auto`` gives, and seeding that makes results
independent of that number.

A worker process pays off when making a batch costs more than receiving it: every batch a worker
sends costs the training process a socket round trip and a memory map per tensor (about 2.4 ms per
batch of two tensors on a 2-core VM; about a millisecond on a larger machine), while a batch of
in-memory tensors takes some 0.15 ms to fetch and collate in place. So ``auto`` gives:

- no worker for in-memory tensors (a ``TensorDataset``, or a ``Subset`` / ``ConcatDataset`` of them):
  their samples are a slice each, with nothing to do in parallel;
- no worker when a batch's samples are fetched in less than :data:`CHEAP_BATCH_S`, timed on a few
  samples in a forked child process (a file that ``__getitem__`` opens lazily, a generator it draws
  from, stay untouched in the training process);
- else one worker per core this rank owns but one, up to 16.

Each sample is drawn with the random generators seeded from ``(seed, epoch, index)``
(:class:`SeededSamples`), in a worker or, under ``auto``, in this process (:class:`RngKept` then puts
the training process's generators back after each batch). Random augmentation therefore gives the
same samples whatever ``auto`` chose and whatever the machine's core count.
"""

from __future__ import annotations

import os
import random
import select
import signal
import sys
import time
import warnings
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

# A batch that takes less than this to fetch in the training process costs less there than sent by a worker.
CHEAP_BATCH_S = 1.5e-3
PROBE_SAMPLES = 8  # samples timed to decide (fewer when the first two are already slow)
PROBE_TIMEOUT_S = 2.0  # a probe still running by then has found slow samples


def most_workers(local_world_size: int = 1) -> int:
    """Every core this rank owns but one (the training process's own), up to 16: beyond that a worker
    adds memory (a data set copy each) more than speed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(16, cores // max(1, local_world_size) - 1))


def in_memory_tensors(dataset: Any) -> bool:
    """A TensorDataset, or a Subset / ConcatDataset of them: slices of tensors, no work per sample."""
    if type(dataset) is TensorDataset:
        return True
    if type(dataset) is Subset:
        return in_memory_tensors(dataset.dataset)
    if type(dataset) is ConcatDataset:
        return all(in_memory_tensors(d) for d in dataset.datasets)
    return False


def auto_workers(dataset: Dataset, batch_size: int, seed: int, local_world_size: int = 1) -> int:
    """``data.num_workers=auto`` for a map-style data set (see the module's docstring)."""
    most = most_workers(local_world_size)
    if most == 0 or in_memory_tensors(dataset):
        return 0
    fetch = batch_fetch_s(dataset, batch_size, seed)
    return 0 if fetch is not None and fetch < CHEAP_BATCH_S else most


def batch_fetch_s(dataset: Dataset, batch_size: int, seed: int) -> Optional[float]:
    """Seconds to fetch ``batch_size`` samples here, from the median of a few, timed in a forked child
    process: a file a sample opens, a generator it draws from or a cache it fills stays in the child.
    None when that cannot tell (no ``fork``, an empty data set, a sample that raises: the loader
    then reports it as usual); ``inf`` when the child takes longer than :data:`PROBE_TIMEOUT_S`."""
    try:
        n = len(dataset)
    except Exception:
        return None
    if n == 0 or not sys.platform.startswith("linux"):  # fork is what Linux DataLoader workers use too
        return None
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a process with threads, as DataLoader workers
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: time the samples, write the answer, leave without running any exit handler
        try:
            os.close(read)
            torch.set_num_threads(1)  # as a DataLoader worker does: an OpenMP pool does not survive a fork
            samples = SeededSamples(dataset, seed)
            _time_samples(samples, n, batch_size)  # once untimed: the fork's copy-on-write faults, first calls
            os.write(write, repr(_time_samples(samples, n, batch_size)).encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = "inf"
    try:
        if select.select([read], [], [], PROBE_TIMEOUT_S)[0]:
            answer = os.read(read, 64).decode()
    finally:
        os.close(read)
        if answer == "inf":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        return float(answer)
    except ValueError:  # nothing written: a sample raised
        return None


def _time_samples(samples: SeededSamples, n: int, batch_size: int) -> float:
    k = min(n, PROBE_SAMPLES)
    limit = CHEAP_BATCH_S / batch_size
    times: list[float] = []
    for j in range(k):
        t0 = time.perf_counter()
        samples[(j * n // k, 0)]
        times.append(time.perf_counter() - t0)
        if len(times) == 2 and min(times) > limit:
            break  # clearly slow: no need to look further
    rest = sorted(times[1:] or times)  # the first sample may pay one-off costs (opening a file …)
    return rest[len(rest) // 2] * batch_size


class kept_rng:
    """Puts Python's, NumPy's and torch's CPU random generators back as they were on entry."""

    def __enter__(self) -> None:
        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    def __exit__(self, *exc: Any) -> None:
        py, np_state, pt = self.states
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(pt)


def seed_sample(seed: int, epoch: int, index: int) -> None:
    s = (seed * 1_000_003 + epoch * 7_919 + index) % (2**63 - 1)
    # The CPU generator is the one a worker's transforms draw from (workers never use CUDA):
    # seeding it alone costs 1 µs, torch.manual_seed (every device type) about 90 µs per sample.
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s % (2**32))


class SeededSamples(Dataset):
    """Seeds the RNGs from ``(seed, epoch, index)`` before each sample (the sampler yields
    ``(index, epoch)``), so random augmentation depends on neither the worker count nor the resume point."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        index, epoch = item
        seed_sample(self.seed, epoch, index)
        return self.dataset[index]


class RngKept:
    """A DataLoader without workers over :class:`SeededSamples`: the training process's random generators
    are put back after each batch, so training draws what it would with worker processes."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size … of the DataLoader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        while True:
            with kept_rng():
                try:
                    batch = next(it)
                except StopIteration:
                    return
            yield batch
