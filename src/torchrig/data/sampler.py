"""A resumable, rank-aware sampler: the same order for a seed and epoch, whatever the resume point.

The order of an epoch depends only on ``(seed, epoch)`` through a private generator, never on the
global RNG, so resuming mid-epoch replays the same sequence and skips what was already consumed.

Training shards split each global batch (``world_size × batch_size`` consecutive samples of the
epoch's order) across the ranks, rank r taking the r-th slice, so the ranks' k-th batches together
are exactly the one-process batch k of size ``world_size × batch_size``, and no sample is repeated.
The last, short global batch is dealt out as evenly as it goes (sizes differ by at most one); a rank
left without a sample gets one *filler* batch (a real sample that the loop weighs 0: it keeps every
rank in the collectives and changes no gradient), so all ranks run the same number of batches.
With ``drop_last`` the short global batch is dropped on every rank. Evaluation shards deal the
samples out round-robin (rank r holds samples r, r+W, …), each exactly once.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, pad: bool = True, with_epoch: bool = False,
                 batch_size: int = 1):
        if num_samples < 1:
            raise ValueError("the data set is empty (0 samples); check the data path or split")
        self.n = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.pad = pad  # training shards: every rank gets the same number of batches (see the module's text)
        self.with_epoch = with_epoch  # yield (index, epoch) so workers can seed per sample
        self.batch_size = max(1, batch_size)
        self.epoch = 0
        self.skip = 0  # samples of this rank's shard already consumed (resume)
        self.excluded = torch.empty(0, dtype=torch.long)  # indices left out of every order (a rolled-back spike)

    @property
    def count(self) -> int:
        """Samples an epoch's order holds: the data set's, less the excluded ones."""
        return self.n - len(self.excluded)

    def exclude(self, indices: list) -> None:
        """Leave ``indices`` out of every epoch's order from now on: the order of the others is kept, so a position
        before the first of them means the same samples as before."""
        self.excluded = torch.tensor(sorted(set(self.excluded.tolist()) | {int(i) for i in indices}), dtype=torch.long)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _split(self) -> tuple[int, int, int]:
        """(full global batches, start of this rank's slice of the short one, its size) of a training shard."""
        per_step = self.world_size * self.batch_size
        full, rest = divmod(self.count, per_step)
        if rest == 0 or self.drop_last:
            return full, 0, 0
        q, extra = divmod(rest, self.world_size)
        return full, full * per_step + self.rank * q + min(self.rank, extra), q + (self.rank < extra)

    def global_batch_samples(self, index: int) -> int:
        """Samples of training batch ``index`` of the epoch over all ranks together (the one-process batch):
        ``world_size × batch_size``, or what is left for the last, short one (0 past the end)."""
        per_step = self.world_size * self.batch_size
        full, rest = divmod(self.count, per_step)
        if index < full:
            return per_step
        return rest if index == full and not self.drop_last else 0

    @property
    def filler_batch(self) -> Optional[int]:
        """Index (in the epoch) of this rank's zero-weight filler batch, or None when it has none."""
        if not self.pad:
            return None
        full, _, size = self._split()
        short = self.count % (self.world_size * self.batch_size) and not self.drop_last
        return full if short and size == 0 else None

    def _shard_size(self) -> int:
        if not self.pad:
            return len(range(self.rank, self.count, self.world_size))
        full, _, size = self._split()
        return full * self.batch_size + (max(size, 1) if self.count % (self.world_size * self.batch_size)
                                         and not self.drop_last else 0)

    def _positions(self) -> torch.Tensor:
        """Positions in the epoch's order that this rank's training shard takes."""
        full, start, size = self._split()
        b, per_step = self.batch_size, self.world_size * self.batch_size
        pos = (torch.arange(full)[:, None] * per_step + self.rank * b + torch.arange(b)[None, :]).reshape(-1)
        if self.filler_batch is not None:
            return torch.cat([pos, torch.tensor([full * per_step])])  # weighed 0 by the loop
        return torch.cat([pos, torch.arange(start, start + size)]) if size else pos

    def order(self) -> torch.Tensor:
        """The current epoch's order of every sample (over all ranks): from (seed, epoch) alone, less the excluded."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        return order[~torch.isin(order, self.excluded)] if len(self.excluded) else order

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, after the resume skip, as an int64 tensor."""
        order = self.order()
        shard = order[self._positions()] if self.pad else order[self.rank::self.world_size]
        return shard[self.skip:]

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

    most = runtime.all_reduce_max(torch.tensor([local_batches], device=device), name="batch counts")
    return int(most.item()) - local_batches


def unshard(parts: list, world_size: int) -> list:
    """Per-rank evaluation shards back in data order (rank r holds samples r, r+W, r+2W …)."""
    total = sum(len(p) for p in parts)
    order: list = [None] * total
    for r, part in enumerate(parts):
        for j, item in enumerate(part):
            order[r + j * world_size] = item
    return order
