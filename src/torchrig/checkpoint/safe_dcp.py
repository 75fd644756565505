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
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


def read_metadata_file(path: Path) -> Metadata:
    """A DCP ``.metadata`` file (checked against its recorded checksum), unpickled with only DCP's
    metadata classes allowed."""
    with open_checked(path) as fh:
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
    return metadata


class _Reader(FileSystemReader):
    """DCP's reader with a safe ``read_metadata``, and shard files checked (regular files, recorded
    checksums) before DCP opens them; remembers a refusal, which DCP would otherwise wrap."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.folder = Path(folder)
        self.reading = ""
        self.refusal: Optional[CheckpointError] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            rank = kwargs.get("rank")  # DCP asks for a rank's own index when the global one is missing
            metadata = read_metadata_file(self.folder / (".metadata" if rank is None else f"__{rank}.metadata"))
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
                open_checked(self.folder / name).close()  # the whole file once, before DCP reads slices of it
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


def load(state: dict, folder: Path, no_dist: bool) -> None:
    """``dcp.load(state, folder)`` in place, through the safe reader and planner.

    A refused file raises its UnsafeCheckpointError or CorruptCheckpointError (on every rank, when any
    rank refused one); any
    other failure raises the first rank's own exception instead of DCP's multi-rank wrapper.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _Reader(folder)
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
