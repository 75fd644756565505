"""Reading ``torch.distributed.checkpoint`` (DCP) folders without running code from them.

DCP's own ``FileSystemReader`` reads the ``.metadata`` index with a plain ``pickle.load``, and its
default load planner reads every non-tensor value (an optimizer's ``lr``, ``betas``, ...) from the
``.distcp`` shard files with ``torch.load(weights_only=False)``: a crafted file runs any code it
likes on load. Here ``.metadata`` is read by an unpickler that builds only DCP's metadata classes
and the few torch and builtin types they hold, shard files may only be named inside the folder, and
every value, tensor or not, is read with ``torch.load(weights_only=True)``. Anything else is refused
with an ``UnsafeCheckpointError`` naming the file.
"""

from __future__ import annotations

import io
import itertools
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .io import CheckpointError, UnsafeCheckpointError, open_checked, refused, weights_only_refusal

_DCP = "torch.distributed.checkpoint"
# What DCP pickles into .metadata (torch 2.4 - 2.14): its dataclasses, torch.Size, dtypes and layouts by
# name, and the checkpoint's path. Each builds plain data; none runs code.
_ALLOWED = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh: Any, path: Path) -> None:
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise refused(self.path, f"pickles '{module}.{name}'")


def read_metadata_file(path: Path, verify: bool = True) -> Metadata:
    """A DCP ``.metadata`` file (checked against its recorded checksum), unpickled with only DCP's
    metadata classes allowed, whose tensors' pieces each cover their tensor exactly (see :func:`check_coverage`)."""
    with open_checked(path, verify) as fh:
        try:
            metadata = _MetadataUnpickler(fh, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # truncated or garbage bytes: not a code risk, just unreadable
            raise ValueError(f"'{path}' is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise refused(path, f"holds a {type(metadata).__name__} instead of DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", "")
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise refused(path, f"names the shard file {name!r} outside its folder")
    check_coverage(metadata, path)
    return metadata


MAX_CELLS = 1 << 22  # pieces a tensor's check may count (a grid of shards: ranks × ranks at most)


def check_coverage(metadata: Metadata, path: Path) -> None:
    """Every saved tensor's pieces (``chunks``: offsets and sizes) lie inside its declared size and cover it
    exactly, no element twice and none left out; else one line naming the tensor. A forged piece outside the
    tensor would leave part of a parameter as it was before the load, silently. Counted on the grid the pieces'
    edges cut the tensor into, never by allocating it."""
    for fqn, item in (metadata.state_dict_metadata or {}).items():
        if isinstance(item, TensorStorageMetadata):
            problem = _coverage_problem(item)
            if problem:
                raise CheckpointError(f"sharded checkpoint file '{path}' does not describe '{fqn}' whole: {problem}; "
                                      f"use another checkpoint, or its model.safetensors for the weights alone")


def _dims(value: Any) -> Optional[tuple[int, ...]]:
    """A shape, an offset: a tuple of integers >= 0 (None for anything else)."""
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    return None


def _coverage_problem(item: TensorStorageMetadata) -> str:
    """What is wrong with the pieces of one tensor ("" when they tile it exactly)."""
    size = _dims(getattr(item, "size", None))
    if size is None:
        return f"its size {getattr(item, 'size', None)!r} is not a shape"
    boxes = []
    for chunk in getattr(item, "chunks", None) or []:
        start, extent = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
        if start is None or extent is None or len(start) != len(size) or len(extent) != len(size):
            return f"a piece {getattr(chunk, 'offsets', None)!r} / {getattr(chunk, 'sizes', None)!r} is not " \
                   f"offsets and sizes of a {len(size)}-dimensional tensor"
        if any(o + n > s for o, n, s in zip(start, extent, size)):
            return f"a piece at offsets {tuple(start)} of sizes {tuple(extent)} lies outside its size {tuple(size)}"
        if all(extent):  # a piece of no elements holds nothing
            boxes.append((start, extent))
    return _tiling_problem(size, boxes)


def _tiling_problem(size: tuple[int, ...], boxes: list) -> str:
    if not all(size):
        return ""  # a tensor of no elements: nothing to cover
    cuts = [sorted({0, s} | {b[0][d] for b in boxes} | {b[0][d] + b[1][d] for b in boxes}) for d, s in enumerate(size)]
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells > MAX_CELLS:
        return f"its {len(boxes)} pieces cut it into more than {MAX_CELLS} parts, more than a checkpoint's shards do"
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    strides = [1] * len(size)
    for d in range(len(size) - 2, -1, -1):
        strides[d] = strides[d + 1] * (len(cuts[d + 1]) - 1)
    seen = bytearray(cells)
    for start, extent in boxes:
        ranges = [range(at[d][start[d]], at[d][start[d] + extent[d]]) for d in range(len(size))]
        for cell in itertools.product(*ranges):
            flat = sum(i * k for i, k in zip(cell, strides))
            if seen[flat]:
                return f"two pieces overlap (one at offsets {tuple(start)})"
            seen[flat] = 1
    if not all(seen):
        return "part of it is in no piece"
    return ""


class _Reader(FileSystemReader):
    """DCP's reader with a safe ``read_metadata``, and shard files checked (regular files, recorded
    checksums) before DCP opens them; remembers a refusal, which DCP would otherwise wrap."""

    def __init__(self, folder: Path, verify: bool = True) -> None:
        super().__init__(str(folder))
        self.folder, self.verify = Path(folder), verify
        self.reading = ""
        self.refusal: Optional[CheckpointError] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            rank = kwargs.get("rank")  # DCP asks for a rank's own index when the global one is missing
            metadata = read_metadata_file(self.folder / (".metadata" if rank is None else f"__{rank}.metadata"),
                                          self.verify)
        except CheckpointError as exc:  # unsafe or corrupt
            self.refusal = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.reading = sinfo.relative_path  # the shard file the next value comes from
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                open_checked(self.folder / name, self.verify).close()  # the whole file, before DCP reads slices
        except CheckpointError as exc:
            self.refusal = exc
            raise
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as exc:  # from torch.load(weights_only=True), tensors and other values
            self.refusal = weights_only_refusal(self.folder / self.reading, exc)
            raise self.refusal from None


class _Planner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict, folder: Path, no_dist: bool, verify: bool = True) -> None:
    """``dcp.load(state, folder)`` in place, through the safe reader and planner.

    A refused file raises its UnsafeCheckpointError or CorruptCheckpointError (on every rank, when any
    rank refused one); any
    other failure raises the first rank's own exception instead of DCP's multi-rank wrapper.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _Reader(folder, verify)
    try:
        dcp.load(state, storage_reader=reader, planner=_Planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:
        if reader.refusal is not None:
            raise reader.refusal from None
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
        for failure in failures:
            if isinstance(failure, CheckpointError):  # refused as unsafe or corrupt, by another rank
                raise failure from None
        if failures and isinstance(failures[0], Exception):
            raise failures[0] from None
        raise
