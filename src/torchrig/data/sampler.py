"""A resumable, rank-aware sampler: the same order for a seed and epoch, whatever the resume point.

The order of an epoch depends only on ``(seed, epoch)`` through a private generator, never on the
global RNG, so resuming mid-epoch replays the same sequence and skips what was already consumed.
Training shards pad the permutation (like ``DistributedSampler``) so every rank has the same number
of batches; evaluation shards do not pad, so every sample is seen exactly once.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, pad: bool = True, with_epoch: bool = False):
        if num_samples < 1:
            raise ValueError("the data set is empty (0 samples); check the data path or split")
        self.n = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.pad = pad
        self.with_epoch = with_epoch  # yield (index, epoch) so workers can seed per sample
        self.epoch = 0
        self.skip = 0  # samples of this rank's shard already consumed (resume)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shard_size(self) -> int:
        if not self.pad:
            return len(range(self.rank, self.n, self.world_size))
        if self.drop_last and self.n % self.world_size:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, after the resume skip, as an int64 tensor."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        if self.pad and self.world_size > 1:
            total = self._shard_size() * self.world_size
            if total > self.n:
                reps = math.ceil((total - self.n) / self.n)
                order = torch.cat([order] + [order] * reps)[:total]
            else:
                order = order[:total]
        return order[self.rank::self.world_size][self.skip:]

    def __iter__(self) -> Iterator:
        idx = self.indices().tolist()
        if self.with_epoch:
            return iter([(i, self.epoch) for i in idx])
        return iter(idx)

    def __len__(self) -> int:
        return max(0, self._shard_size() - self.skip)


def padding_batches(local_batches: int, device: torch.device) -> int:
    """Extra forward passes this rank must make so that every rank makes as many as the busiest one.

    Evaluation shards hold every sample once, so they differ by up to one batch between ranks. That
    is harmless for DDP (evaluation calls the bare module), but every FSDP forward all-gathers the
    parameters, and a rank with one batch less would leave the others waiting forever. Collective.
    """
    from .. import runtime

    most = runtime.all_reduce_max(torch.tensor([local_batches], device=device))
    return int(most.item()) - local_batches


def unshard(parts: list, world_size: int) -> list:
    """Per-rank evaluation shards back in data order (rank r holds samples r, r+W, r+2W …)."""
    total = sum(len(p) for p in parts)
    order: list = [None] * total
    for r, part in enumerate(parts):
        for j, item in enumerate(part):
            order[r + j * world_size] = item
    return order
