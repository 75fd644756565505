"""Loaders with good defaults, the in-memory fast path, and moving batches to the device.

``prepare_train`` / ``prepare_eval`` turn a Dataset, a DataLoader or tensors into an object with
``set_epoch``, ``skip_batches``, ``__len__`` and ``__iter__``, using :class:`ResumableSampler` for
the order so that a run resumes at the exact sample where it stopped, on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset


from .common import WORKER_OPTIONS, DataError, as_dataset, is_iterable_source, torch_format
from .iterable import build_iterable
from .iterable_eval import build_iterable_eval
from .mixture import Mixture, MixtureSamples
from .sampler import ResumableSampler
from .workers import RngKept, SeededSamples, auto_workers, in_memory_tensors, most_workers


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move tensors nested in tuples, lists and dicts to ``device`` (asynchronously when pinned)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        # Tensors moved inline, without a recursive call each: this runs on every training step.
        moved = [v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)
                 else to_device(v, device, non_blocking) for v in batch]
        if type(batch) is list:
            return moved
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, Mapping):  # a dict, or a Hugging Face BatchEncoding (a UserDict): a plain dict from here on
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def prefetch_to_device(batches: Any, device: torch.device) -> Iterator:
    """Iterate ``batches`` already on ``device``: on CUDA the next batch's copy runs on a side stream while
    the current step computes (pinned batches make the copy asynchronous); elsewhere plain iteration."""
    if device.type != "cuda":
        return iter(batches)
    return _cuda_prefetch(iter(batches), device)


def _cuda_prefetch(it: Iterator, device: torch.device) -> Iterator:
    copy_stream = torch.cuda.Stream(device)

    def issue(batch: Any) -> Any:
        with torch.cuda.stream(copy_stream):
            return to_device(batch, device)

    def ready(batch: Any) -> None:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copy_stream)  # the step's kernels start after its batch arrived
        for t in _tensors(batch):
            t.record_stream(compute)  # the caching allocator must not reuse it while the step runs

    return lookahead(it, issue, ready)


def lookahead(it: Iterator, issue: Any, ready: Any) -> Iterator:
    """``it``'s batches, each ``issue``d one batch ahead (the next one's copy starts before the current one is
    handed out: it overlaps the current step) and made ``ready`` just before it is handed out. The source is
    therefore read one batch ahead of what the loop has trained, which its position must allow for (see
    ``IterableBatches.position``)."""
    pending = next(it, _END)
    pending = pending if pending is _END else issue(pending)
    while pending is not _END:
        current = pending
        ready(current)
        nxt = next(it, _END)
        pending = nxt if nxt is _END else issue(nxt)  # overlaps the step about to run
        yield current


def _tensors(batch: Any) -> list:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    return []


_END = object()


class TensorBatches:
    """In-memory fast path: one indexing operation per batch instead of per-sample fetch + collate.

    Yields exactly the batches a DataLoader over the same TensorDataset and sampler would.
    """

    def __init__(self, tensors: tuple, sampler: ResumableSampler, batch_size: int, drop_last: bool,
                 pin: bool = False):
        self.tensors = tensors
        # Batches are gathered straight into page-locked memory, so that to_device(non_blocking=True)
        # really is asynchronous (a slice of a pinned tensor is not pinned: index_select allocates).
        # Tensors already on an accelerator are indexed there: no copy at all.
        self.pin = pin and all(t.device.type == "cpu" for t in tensors)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list]:
        idx = self.sampler.indices()
        b = self.batch_size
        stop = (len(idx) // b) * b if self.drop_last else len(idx)
        # Tensors on an accelerator: the epoch's indices go there once, from page-locked memory (a copy from
        # pageable memory would wait for the GPU, once per batch)
        on_device = {t.device: (idx.pin_memory() if t.device.type == "cuda" else idx).to(t.device, non_blocking=True)
                     for t in self.tensors if t.device.type != "cpu"}
        for start in range(0, stop, b):
            sel = idx[start:start + b]
            yield [self._gather(t, on_device[t.device][start:start + b] if t.device in on_device else sel)
                   for t in self.tensors]  # a list, as default_collate gives

    def _gather(self, t: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.index_select(0, sel)
        if not self.pin:
            return t.index_select(0, sel)
        out = torch.empty((len(sel), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, sel, out=out)


class Batches:
    """What the loop iterates: a DataLoader or TensorBatches plus its resumable sampler. ``fresh``: each
    batch's tensors are new, made for it (gathered, or collated by ``default_collate``), so nothing writes
    them after the step; a user's collate function or stream may hand out buffers it fills again."""

    def __init__(self, source: Any, sampler: Optional[ResumableSampler], batch_size: int, fresh: bool = False,
                 mixture: Optional[MixtureSamples] = None):
        self.source, self.fresh, self.mixture = source, fresh, mixture
        self.sampler = sampler
        self.batch_size = batch_size
        self._skip_next = 0
        self._filler = sampler.filler_batch if sampler is not None else None  # fixed for the run: read once

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.skip = 0
            loader_generator = getattr(self.source, "generator", None)  # what the workers' seeds are drawn from
            if loader_generator is not None:  # from (seed, epoch), as a stream's: a resumed run's are the same
                loader_generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)
        else:
            inner = getattr(self.source, "sampler", None)
            if hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)

    def skip_batches(self, n: int) -> None:
        """Start the current epoch after ``n`` batches (resume); call after ``set_epoch``."""
        if n <= 0:
            return
        if self.sampler is None:
            self._skip_next = n
        else:
            self.sampler.skip = n * self.batch_size

    def weight(self, index: int) -> int:
        """0 for batch ``index`` of the epoch when it is this rank's filler (see ResumableSampler), else 1."""
        return 0 if index == self._filler else 1

    def global_samples(self, first: int, count: int) -> Optional[int]:
        """Samples in batches ``first … first + count - 1`` of the epoch over all ranks together, known on every
        rank from the sampler without any communication; None when torchrig does not sample (a user's loader)."""
        if self.sampler is None or not self.sampler.pad:
            return None
        return sum(self.sampler.global_batch_samples(i) for i in range(first, first + count))

    why_not_elsewhere = "a DataLoader with its own sampler keeps no position torchrig can re-split"

    def samples_before(self, batch: int) -> int:
        """Samples of the epoch's order consumed over all ranks once batches ``0 … batch - 1`` are done; -1 when
        torchrig does not sample (a user's loader, a stream)."""
        known = self.global_samples(0, batch)
        return -1 if known is None else known

    def batch_after(self, samples: int, accumulate: int = 1) -> Optional[int]:
        """The batch of the epoch that starts after ``samples`` samples of its order (over all ranks), at the start
        of an accumulation window of ``accumulate`` batches (or at the epoch's end); None when no batch starts there (another global
        batch cut the order elsewhere) or torchrig does not sample."""
        if self.sampler is None or not self.sampler.pad:
            return None
        done, batch = 0, 0
        while done < samples:
            size = self.sampler.global_batch_samples(batch)
            if size == 0:
                return None
            done, batch = done + size, batch + 1
        at_window = batch % accumulate == 0 or self.sampler.global_batch_samples(batch) == 0  # or the epoch's end
        return batch if done == samples and at_window else None

    def __len__(self) -> int:
        return len(self.source) - (self._skip_next if self.sampler is None else 0)

    def window_indices(self, first: int, count: int) -> list:
        """The data set indices of batches ``first … first + count - 1`` of the epoch over all ranks (one optimizer
        step's samples), known on every rank from the sampler; [] when torchrig does not sample."""
        if self.sampler is None or not self.sampler.pad:
            return []
        start = self.samples_before(first)
        return self.sampler.order()[start:start + self.global_samples(first, count)].tolist()

    def source_counts(self, epoch: int, first: int, count: int) -> dict:
        """Samples of each source of a Mixture in batches ``first … first + count - 1`` of ``epoch`` over all ranks,
        known on every rank from the sampler's positions without any communication; {} for other data."""
        if self.mixture is None or self.sampler is None:
            return {}
        start, n = self.samples_before(first), self.global_samples(first, count) or 0
        positions = (self.sampler.order()[start:start + n] if len(self.sampler.excluded)
                     else torch.arange(start, start + n))  # a mixture's order is its positions, less the excluded
        return self.mixture.counts(epoch, positions)

    def exclude(self, indices: list) -> None:
        """Leave ``indices`` out of every epoch from now on (see ``ResumableSampler.exclude``)."""
        if self.sampler is not None:
            self.sampler.exclude(indices)
            self._filler = self.sampler.filler_batch

    def state_dict(self) -> dict:
        # the position is the counters' (samples of the epoch's order) with the sampler's (seed, epoch) order
        excluded = self.sampler.excluded.tolist() if self.sampler is not None else []
        return {"excluded": excluded} if excluded else {}

    def load_state_dict(self, state: dict) -> None:
        if self.sampler is not None:
            self.sampler.excluded = torch.empty(0, dtype=torch.long)
            self.exclude(list((state or {}).get("excluded", [])))

    def __iter__(self):
        it = iter(self.source)
        if self.sampler is None and self._skip_next:
            for _ in range(self._skip_next):  # a user sampler we cannot fast-forward: consume
                next(it, None)
            self._skip_next = 0
        return _worker_errors(it, self.source) if getattr(self.source, "num_workers", 0) > 0 else it


def _worker_errors(it: Iterator, loader: Any) -> Iterator:
    """``it``, with an exception raised inside a DataLoader worker process told in one line: torch re-raises
    it as ``Caught ValueError in DataLoader worker process 0.`` with the data set's own message lines below."""
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            if not (lines and lines[0].startswith("Caught ") and "DataLoader worker process" in lines[0]):
                raise
            dataset = getattr(loader, "dataset", None)
            dataset = getattr(dataset, "dataset", dataset)  # under SeededSamples
            worker = lines[0].rpartition("process ")[2].rstrip(".")
            raise DataError(f"the data set {type(dataset).__name__} raised in DataLoader worker {worker}: {lines[-1]}; "
                            f"fix it (with data.num_workers=0 it runs in this process, where --debug shows the "
                            f"traceback)") from exc
        yield batch


def _build(data: Any, *, train: bool, batch_size: int, seed: int, rank: int, world_size: int,
           device: torch.device, num_workers: Any = "auto", pin_memory: Any = "auto",
           persistent_workers: bool = True, prefetch_factor: Optional[int] = None, shuffle: bool = True,
           drop_last: bool = False, fast_path: bool = True, local_world_size: int = 1,
           steps_per_epoch: Optional[int] = None, max_steps: Optional[int] = None, accumulate: int = 1) -> Any:
    if isinstance(data, Batches):
        return data
    workers = most_workers(local_world_size) if num_workers == "auto" else int(num_workers)  # for streams
    pin = (device.type == "cuda") if pin_memory == "auto" else bool(pin_memory)
    if not train and is_iterable_source(data):
        return build_iterable_eval(data, batch_size=batch_size, rank=rank, world_size=world_size, device=device,
                                   num_workers=workers, pin=pin, prefetch_factor=prefetch_factor)
    if train and is_iterable_source(data):
        return build_iterable(data, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                              device=device, num_workers=workers, pin=pin, drop_last=drop_last,
                              persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                              steps_per_epoch=steps_per_epoch, max_steps=max_steps, accumulate=accumulate)
    if isinstance(data, DataLoader):
        return _from_loader(data, train=train, seed=seed, rank=rank, world_size=world_size, fast_path=fast_path)
    dataset = as_dataset(torch_format(data))
    # auto: no worker process where a batch costs less to make here than to receive from one (workers.py);
    # samples are then seeded here as a worker seeds them, so the choice does not change what is drawn
    auto = num_workers == "auto"
    if auto:
        workers = auto_workers(dataset, batch_size, seed, local_world_size)
    options = dict(batch_size=batch_size, num_workers=workers, pin_memory=pin, drop_last=drop_last and train,
                   persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
    return _resumable(dataset, options, train=train, shuffle=shuffle and train, seed=seed, rank=rank,
                      world_size=world_size, fast_path=fast_path,
                      seed_here=auto and not in_memory_tensors(dataset))


def _from_loader(loader: DataLoader, *, train: bool, seed: int, rank: int, world_size: int,
                 fast_path: bool) -> Batches:
    """Rebuild a user's DataLoader around a ResumableSampler, keeping every other setting.

    Only plain samplers (random / sequential) are replaced; a custom sampler or batch sampler is
    kept as given (resume then re-reads the skipped batches, and sharding is the user's job).
    """
    plain = type(loader.sampler) in (RandomSampler, SequentialSampler) and loader.batch_size is not None
    if not plain:
        return Batches(loader, None, loader.batch_size or 1)
    default_collate = loader.collate_fn is torch.utils.data.default_collate  # by identity: a look-alike is the user's
    options = dict(batch_size=loader.batch_size, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                   drop_last=loader.drop_last and train, collate_fn=loader.collate_fn, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
                   prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    shuffle = isinstance(loader.sampler, RandomSampler) and train
    return _resumable(loader.dataset, options, train=train, shuffle=shuffle, seed=seed, rank=rank,
                      world_size=world_size, fast_path=fast_path and default_collate and loader.num_workers == 0)





def _resumable(dataset: Dataset, options: dict, *, train: bool, shuffle: bool, seed: int, rank: int,
               world_size: int, fast_path: bool, seed_here: bool = False) -> Batches:
    """The one way batches are made: a ResumableSampler over ``dataset``, then the in-memory fast
    path for a TensorDataset (when ``fast_path``), else a DataLoader with ``options`` (its keyword
    arguments) whose workers seed every sample from ``(seed, epoch, index)`` — as this process does
    without workers when ``seed_here``."""
    try:
        n = len(dataset)
    except TypeError:
        raise DataError(f"the data set {type(dataset).__name__} has no length; give a DataLoader instead") from None
    if n == 0:
        raise DataError(f"the {'training' if train else 'evaluation'} data set is empty (0 samples)")
    batch_size, drop_last = options["batch_size"], options["drop_last"]
    mixture = isinstance(dataset, Mixture)  # its positions are taken in order: shuffle is about its sources' walks
    sampler = ResumableSampler(n, shuffle=shuffle and not mixture, seed=seed, rank=rank, world_size=world_size,
                               drop_last=drop_last, pad=train, batch_size=batch_size)
    if fast_path and type(dataset) is TensorDataset:
        return Batches(TensorBatches(dataset.tensors, sampler, batch_size, drop_last, pin=options["pin_memory"]),
                       sampler, batch_size, fresh=True)
    workers = options["num_workers"] > 0
    if mixture:  # reads (position, epoch) from the sampler
        sampler.with_epoch = True
        dataset = MixtureSamples(dataset, seed, shuffle, seeded=workers or seed_here)
    elif workers or seed_here:
        sampler.with_epoch = True
        dataset = SeededSamples(dataset, seed)
    if not workers:
        options = {k: v for k, v in options.items() if k not in WORKER_OPTIONS}
    g = torch.Generator()
    g.manual_seed(seed)  # keeps DataLoader from drawing its base seed from the global RNG (reseeded per epoch)
    loader = DataLoader(dataset, sampler=sampler, generator=g, **options)
    fresh = options.get("collate_fn") in (None, torch.utils.data.default_collate)
    return Batches(RngKept(loader) if seed_here and not workers else loader, sampler, batch_size, fresh,
                   mixture=dataset if mixture else None)


def check_same_data(train: Batches, val_data: Any, device: torch.device) -> None:
    """Every rank must hold the same data sets: the sampler gives each its share by position, and ranks with
    different numbers of batches would wait for each other at a collective until it times out. One
    all-reduce (of the lengths and their negatives: a maximum and a minimum) finds out at once; every rank
    then raises the same error. Call it on every rank."""
    from .. import runtime

    sizes = [_size(train), _size(val_data) if val_data is not None else -1]
    extremes = runtime.agree_max([*sizes, *[-n for n in sizes]], device)
    for i, what in enumerate(("training", "validation")):
        most, least = int(extremes[i]), -int(extremes[i + 2])
        if most != least:
            raise DataError(f"the {what} data has {least} samples on one rank and {most} on another (this rank: "
                            f"{sizes[i]}); every rank must hold the same data set, which the sampler splits among "
                            f"them: build it the same way on every rank (the same files, data.path and data.factory)")


def _size(data: Any) -> int:
    """The number of samples of map-style data: training batches (their data set's), a data set, a DataLoader
    or (x, y) tensors; -1 for a stream, whose ranks agree on their length by themselves."""

    if isinstance(data, Batches):
        return data.sampler.n if data.sampler is not None else len(data)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return len(data[0])
    if is_iterable_source(data) or not (isinstance(data, DataLoader) or hasattr(data, "__getitem__")):
        return -1
    try:
        return len(data.dataset if isinstance(data, DataLoader) else data)
    except TypeError:
        return -1


def prepare_train(data: Any, **kwargs: Any) -> Batches:
    return _build(data, train=True, **kwargs)


def prepare_eval(data: Any, **kwargs: Any) -> Batches:
    kwargs = dict(kwargs, shuffle=False, drop_last=False)
    return _build(data, train=False, **kwargs)
