"""Iterable and streaming training data: sharding, equal steps on every rank, resumable position.

A ``torch.utils.data.IterableDataset`` (given as is or inside a DataLoader) or a Hugging Face
``datasets.IterableDataset`` has no index a sampler could shard or fast-forward, so it takes this path
instead of :class:`ResumableSampler`:

* **sharding** – every (rank, worker) pair reads the whole stream and keeps every k-th sample
  (k = processes × workers), so each sample is used once per epoch in all. A Hugging Face
  ``IterableDataset`` is split with ``datasets.distributed.split_dataset_by_node``, which also
  spreads its shards over the DataLoader workers.
* **equal steps** – ranks agree before each accumulation window that every rank still has a whole
  one (one tiny all-reduce per window); when any rank runs out, the epoch ends on all of them, so DDP
  never waits for a rank that has nothing left. With uneven shards the other ranks' last batches are
  not used that epoch, nor is a partial window at the end of a stream.
* **position** – when the data set can report its position (``state_dict`` / ``load_state_dict``,
  as a Hugging Face ``IterableDataset`` does) and torchdata is installed, batches come from torchdata's
  ``StatefulDataLoader``, whose state (every worker's position) is saved in each checkpoint; a
  mid-epoch resume goes on from the next sample. Otherwise a resume re-reads the batches already used
  in that epoch and says so once.
* **epoch length** – ``data.steps_per_epoch`` when set, else from ``__len__`` (samples); without
  either, an epoch ends when the stream runs out (on any rank: every rank agrees, as for uneven shards),
  its length unknown until then. What needs the run's length in steps beforehand (a schedule over the
  total steps) asks for ``data.steps_per_epoch`` or ``max_steps``.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from .. import runtime
from .common import is_hf, is_stateful, loader_options, shard_slot, torch_format

try:  # an optional extra: without it a resume re-reads the epoch's consumed batches
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - depends on the installation
    StatefulDataLoader = None


_END = object()



class ShardedIterable(IterableDataset):
    """Sample ``i`` of ``dataset`` goes to the (rank, worker) pair number ``i % (world_size × workers)``."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self._seen = 0   # samples of the whole stream read so far in this pass (all pairs' included)
        self._start = 0  # where a restored pass goes on

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        k, me = shard_slot(self.rank, self.world_size)
        self._seen, self._start = self._start, 0
        for sample in self.dataset:
            i = self._seen
            self._seen += 1
            if i % k == me:
                yield sample

    def __len__(self) -> int:
        return len(self.dataset)


class StatefulShardedIterable(ShardedIterable):
    """The same, for a data set with ``state_dict`` / ``load_state_dict``: its position plus ours."""

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "seen": self._seen}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self._start = int(state["seen"])


def shard(dataset: Any, rank: int, world_size: int) -> Any:
    """``dataset`` restricted to this rank (and, when read by workers, to each worker)."""
    if is_hf(dataset) and hasattr(dataset, "n_shards"):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size) if world_size > 1 else dataset
    cls = StatefulShardedIterable if is_stateful(dataset) else ShardedIterable
    return cls(dataset, rank, world_size)


def batches_per_rank(n: int, batch_size: Optional[int], drop_last: bool, workers: int, world_size: int) -> int:
    """Micro-batches every rank can take from ``n`` samples sharded as ShardedIterable does: the
    fewest over ranks, each worker batching its own samples."""
    k = world_size * max(1, workers)
    per_rank = []
    for r in range(world_size):
        total = 0
        for w in range(max(1, workers)):
            c = n // k + (1 if n % k > r * max(1, workers) + w else 0)
            b = batch_size or 1
            total += c // b if drop_last else -(-c // b)
        per_rank.append(total)
    return min(per_rank)


def epoch_length(dataset: Any, loader: DataLoader, world_size: int, steps_per_epoch: Optional[int],
                 accumulate: int) -> Optional[int]:
    """Micro-batches per epoch on each rank: ``steps_per_epoch``, else from ``__len__``; None: unknown, the
    epoch ends when the stream runs out."""
    if steps_per_epoch:
        return steps_per_epoch * accumulate
    try:
        n = len(dataset)
    except TypeError:
        n = None
    if n is not None and not is_hf(dataset):
        return batches_per_rank(n, loader.batch_size, loader.drop_last, loader.num_workers, world_size)
    return None


def _rank0_print(text: str) -> None:
    if runtime.get_rank() == 0:
        print(text, flush=True)


class IterableBatches:
    """What the loop iterates for an iterable source (the counterpart of ``Batches``).

    ``state_dict`` (a collective: it gathers every rank's loader position) is saved in each
    checkpoint as ``data``; ``load_state_dict`` keeps this rank's part until the resumed epoch starts.
    """

    def __init__(self, loader: DataLoader, length: Optional[int], stateful: bool, *, rank: int, world_size: int,
                 device: torch.device, seed: int, accumulate: int = 1):
        self.loader, self.length, self.stateful, self.accumulate = loader, length, stateful, max(1, accumulate)
        self.rank, self.world_size, self.device, self.seed = rank, world_size, device, seed
        self.batch_size = loader.batch_size or 1
        self.say: Callable[[str], None] = _rank0_print
        # How many batches of the epoch the loop has trained, set by the loop: a prefetcher reads the stream
        # ahead of it (CUDA copies the next batch while the current one trains), so ``consumed`` (read from
        # the stream) can be ahead of what a checkpoint must record. None: nothing reads ahead.
        self.position: Optional[Callable[[], int]] = None
        self.epoch, self.consumed = 0, 0
        self._skip, self._pending = 0, None
        self._said: set = set()
        self._marks: dict[int, Any] = {}  # consumed -> the loader's state there, at the last window boundaries

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._skip = epoch, 0
        if hasattr(self.loader.dataset, "set_epoch"):
            self.loader.dataset.set_epoch(epoch)  # e.g. a Hugging Face shuffle buffer's order
        if self.loader.generator is not None:  # worker seeds from (seed, epoch), not from the resume point
            self.loader.generator.manual_seed(self.seed * 1_000_003 + epoch)

    def skip_batches(self, n: int) -> None:
        """Start the current epoch after ``n`` batches (resume); call after ``set_epoch``."""
        self._skip = max(0, n)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(f"the training data {type(self._source()).__name__} is a stream without a length")
        return self.length

    def global_samples(self, first: int, count: int) -> Optional[int]:
        return None  # not known without reading: the step counts its micro-batches' own

    def weight(self, index: int) -> int:
        """Every streamed batch is real: ranks stop together instead of running filler batches."""
        return 1

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        saved, self._pending = self._pending, None
        exact = (skip and self.stateful and saved is not None and saved.get("loader") is not None
                 and saved.get("epoch") == self.epoch and saved.get("batches") == skip)
        if exact:
            self.loader.load_state_dict(saved["loader"])
        it = iter(self.loader)
        self._marks = {}
        if skip and not exact:
            source = self._source()
            if not is_stateful(source):
                why = (f"the training data {type(source).__name__} cannot report its position (give it "
                       f"state_dict/load_state_dict to resume without this)")
            elif StatefulDataLoader is None:
                why = "torchdata is not installed (pip install torchdata)"
            else:
                why = ("the checkpoint holds no stream position for this point (it was saved by another "
                       "torchrig version, or on another number of processes)")
            self._note("replay", f"torchrig: resuming in epoch {self.epoch + 1} re-reads the {skip} batches already "
                                 f"used: {why}")
            for _ in range(skip):
                next(it, None)
        self.consumed = skip
        return self._agreed(it)

    def _source(self) -> Any:
        ds = self.loader.dataset
        return ds.dataset if isinstance(ds, ShardedIterable) else ds

    def _agreed(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it``'s batches, one accumulation window at a time, while every rank still has a whole window
        (one all-reduce of two numbers per window); a partial window at the end of the stream is not used."""
        A = self.accumulate
        while self.length is None or self.consumed < self.length:
            want = A - self.consumed % A if self.length is None else min(A - self.consumed % A,
                                                                         self.length - self.consumed)
            if self.stateful:  # the stream's position before this window: what a checkpoint after it resumes
                self._marks = {k: v for k, v in self._marks.items() if k >= self.consumed - 2 * A}
                self._marks[self.consumed] = self.loader.state_dict()
            window = list(itertools.islice(it, want))
            full = float(len(window) == want)
            lacking, having = 1.0 - full, full
            if self.world_size > 1:  # agreed in host memory when the group takes CPU tensors: no GPU round trip
                lacking, having = runtime.agree_max([lacking, having], self.device)
            if lacking and having:
                self._note("uneven", f"torchrig: epoch {self.epoch + 1} ended after {self.consumed} batches on "
                                     f"every process because one process's share of the training data ran out; "
                                     f"the others' remaining samples were not used (uneven shards)")
            elif lacking and window:
                self._note("tail", f"torchrig: epoch {self.epoch + 1} ended with {len(window)} batch(es) left, "
                                   f"fewer than one accumulation window (accumulate={A}); they were not used")
            elif lacking and self.length is not None:  # without a length, running out is how an epoch ends
                self._note("short", f"torchrig: the training data ran out after {self.consumed} of the "
                                    f"{self.length} batches of epoch {self.epoch + 1}; the epoch ends there")
            if lacking:
                return
            for batch in window:
                self.consumed += 1
                yield batch

    def _note(self, kind: str, text: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            self.say(text)

    def state_dict(self) -> dict:
        trained = self.position() if self.position is not None else self.consumed
        loader = None
        if self.stateful:  # the stream where the loop stands, not where a prefetcher read ahead to
            loader = self.loader.state_dict() if trained == self.consumed else self._marks.get(trained)
        mine = {"epoch": self.epoch, "batches": trained, "loader": loader}
        return {"ranks": runtime.gather(mine)}

    def load_state_dict(self, state: dict) -> None:
        ranks = state.get("ranks") or []
        self._pending = ranks[self.rank] if self.rank < len(ranks) and len(ranks) == self.world_size else None


def build_iterable(data: Any, *, batch_size: int, seed: int, rank: int, world_size: int, device: torch.device,
                   num_workers: int, pin: bool, drop_last: bool, persistent_workers: bool,
                   prefetch_factor: Optional[int], steps_per_epoch: Optional[int] = None,
                   max_steps: Optional[int] = None, accumulate: int = 1) -> IterableBatches:
    """Shard an iterable source over ranks and workers and batch it (see the module's docstring)."""
    source = data.dataset if isinstance(data, DataLoader) else torch_format(data)
    opts = loader_options(data, batch_size, num_workers, pin, drop_last, persistent_workers, prefetch_factor)
    if opts.get("persistent_workers") and hasattr(source, "set_epoch") and not is_hf(source):
        opts["persistent_workers"] = False  # a long-lived worker's copy would never see set_epoch
    stateful = StatefulDataLoader is not None and is_stateful(source)
    cls = StatefulDataLoader if stateful else DataLoader
    g = torch.Generator()
    g.manual_seed(seed)
    with warnings.catch_warnings():  # torchdata's constructor calls torch.set_vital, deprecated in torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = cls(shard(source, rank, world_size), generator=g, **opts)
    length = epoch_length(source, loader, world_size, steps_per_epoch, accumulate)
    return IterableBatches(loader, length, stateful, rank=rank, world_size=world_size, device=device, seed=seed,
                           accumulate=accumulate)
