"""Iterable and streaming data for ``evaluate`` and ``predict``: every sample once, in stream order.

The stream is sharded as for training: every (rank, worker) pair reads the whole stream and keeps
sample ``i`` (its position, 0-based, in the order the data set yields it) when ``i mod k`` is the
pair's number, with ``k = processes × workers`` and pair number ``rank × workers + worker``. So rank
``r``'s worker ``w`` holds samples ``p, p + k, p + 2k, …`` with ``p = r × workers + w``. Each batch
travels with the positions of its samples (beside it: the model sees the batch as the stream made
it), which lets ``predict`` put every output back at its sample's position, undoing both the
interleaving over ranks and the order in which a DataLoader hands out its workers' batches.

Nothing is dropped or repeated: the last batch of each (rank, worker) pair may be short. Ranks may
hold different numbers of batches; with ``lockstep`` (needed under FSDP, where each forward is a
collective) the ranks agree before each batch whether any of them still has one, and a rank that ran
out receives ``None`` for the others' extra batches (one all-reduce of one number per batch).

A Hugging Face ``IterableDataset`` is read in each process itself (no loader workers): inside a
loader worker it yields only that worker's share of its shards, which would hide samples from the
count of positions.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from .. import runtime
from .common import is_hf, loader_options, shard_slot, torch_format

_WORKER_ONLY = ("persistent_workers", "prefetch_factor", "multiprocessing_context", "worker_init_fn", "timeout")


class PositionedShard(IterableDataset):
    """``(position, sample)`` for the samples of ``dataset`` that belong to this (rank, worker) pair."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        k, me = shard_slot(self.rank, self.world_size)
        for i, sample in enumerate(self.dataset):
            if i % k == me:
                yield i, sample


class PositionCollate:
    """Collate the samples with the loader's own ``collate_fn``; their positions as an int64 tensor."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, items: list) -> tuple[torch.Tensor, Any]:
        return torch.tensor([i for i, _ in items], dtype=torch.int64), self.collate([s for _, s in items])


class IterableEvalBatches:
    """What ``evaluate`` / ``predict`` iterate for an iterable source: this rank's batches, as the user's
    collate made them; ``positions`` holds the stream positions of the samples yielded so far (one
    tensor per batch)."""

    def __init__(self, loader: DataLoader, world_size: int, device: torch.device, lockstep: bool = False):
        self.loader, self.world_size, self.device, self.lockstep = loader, world_size, device, lockstep
        self.positions: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[Optional[Any]]:
        self.positions = []
        end = object()
        it = iter(self.loader)
        while True:
            item = next(it, end)
            if self.lockstep and self.world_size > 1:
                left = runtime.all_reduce_max(torch.tensor([float(item is not end)], device=self.device))
                if not left.item():
                    return
                if item is end:
                    yield None  # another rank still has a batch: this one makes a discarded forward
                    continue
            elif item is end:
                return
            positions, batch = item
            self.positions.append(positions)
            yield batch

    def stream_positions(self) -> torch.Tensor:
        """Positions of every sample this rank yielded, in the order yielded."""
        return torch.cat(self.positions) if self.positions else torch.zeros(0, dtype=torch.int64)


def build_iterable_eval(data: Any, *, batch_size: int, rank: int, world_size: int, device: torch.device,
                        num_workers: int, pin: bool, prefetch_factor: Optional[int]) -> IterableEvalBatches:
    """Shard an iterable source over ranks and workers for evaluation (see the module's docstring)."""
    source = data.dataset if isinstance(data, DataLoader) else torch_format(data)
    opts = loader_options(data, batch_size, num_workers, pin, False, False, prefetch_factor)
    if is_hf(source) and opts["num_workers"]:
        opts = {k: v for k, v in opts.items() if k not in _WORKER_ONLY}
        opts["num_workers"] = 0
    opts["drop_last"] = False  # every sample once
    if opts["num_workers"]:
        opts["persistent_workers"] = False  # a new loader each call: nothing to keep the workers for
    opts["collate_fn"] = PositionCollate(opts.get("collate_fn") or default_collate)
    opts["batch_size"] = opts.get("batch_size") or 1  # a loader without automatic batching: one sample a batch
    g = torch.Generator()
    g.manual_seed(0)
    return IterableEvalBatches(DataLoader(PositionedShard(source, rank, world_size), generator=g, **opts),
                               world_size, device)
