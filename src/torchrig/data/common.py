"""What the data layer's loaders share: its error, DataLoader options, and telling streams apart."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from ..errors import TorchrigError


class DataError(TorchrigError, ValueError):
    """Bad training or evaluation data; the message names what is wrong and how to fix it."""


WORKER_OPTIONS = ("persistent_workers", "prefetch_factor", "multiprocessing_context")
_LOADER_OPTIONS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                   "worker_init_fn", "multiprocessing_context", "prefetch_factor", "persistent_workers")


def is_hf(data: Any) -> bool:
    return type(data).__module__.split(".")[0] == "datasets"


def is_iterable_source(data: Any) -> bool:
    """True for an IterableDataset (torch or Hugging Face), or a DataLoader over one."""
    return isinstance(data.dataset if isinstance(data, DataLoader) else data, IterableDataset)


def torch_format(data: Any) -> Any:
    """A Hugging Face data set without a format, read as torch tensors (its rows are python lists
    otherwise, which ``default_collate`` would transpose); anything else unchanged."""
    if not is_hf(data) or not hasattr(data, "with_format"):
        return data
    fmt = getattr(data, "format", None)
    unset = fmt.get("type") is None if isinstance(fmt, dict) else getattr(data, "_formatting", None) is None
    return data.with_format("torch") if unset else data


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def shard_slot(rank: int, world_size: int) -> tuple[int, int]:
    """``(pairs, mine)``: the number of (rank, DataLoader worker) pairs and this one's number; sample ``i``
    of a stream belongs to the pair ``i % pairs`` (training and evaluation shard alike)."""
    info = get_worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    return world_size * workers, rank * workers + worker


def loader_options(data: Any, batch_size: int, num_workers: int, pin: bool, drop_last: bool,
                    persistent_workers: bool, prefetch_factor: Optional[int]) -> dict:
    if isinstance(data, DataLoader):
        opts = {k: getattr(data, k) for k in _LOADER_OPTIONS}
    else:
        opts = dict(batch_size=batch_size, num_workers=num_workers, pin_memory=pin, drop_last=drop_last,
                    persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
    if not opts["num_workers"]:
        opts = {k: v for k, v in opts.items() if k not in WORKER_OPTIONS}
    return opts


def as_dataset(data: Any) -> Dataset:
    """Map-style data from tensors (columns: inputs…, target), a Dataset, or anything with an index and a length."""
    if isinstance(data, torch.Tensor):
        return TensorDataset(data)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        shapes = {tuple(t.shape) for t in data}
        if isinstance(data, list) and len(data) > 3 and len(shapes) == 1:  # [sample, sample, …], not columns
            shape = shapes.pop()
            raise DataError(f"the data is a list of {len(data)} tensors of shape {shape}: torchrig reads a list or "
                            f"tuple of tensors as columns (inputs…, target), each holding every sample, and these "
                            f"look like one sample each; stack them (torch.stack(samples)) and give (inputs, "
                            f"targets), or give a list of (x, y) pairs")
        sizes = {len(t) if t.ndim else 0 for t in data}
        if len(sizes) != 1:
            raise DataError(f"tensors given as data have different lengths {sorted(sizes)}; they must match")
        return TensorDataset(*data)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return data
    raise DataError(f"data of type {type(data).__name__} is not a Dataset, DataLoader or tensors")
