"""Atomic, code-free checkpoint files.

Weights go to safetensors (no code can run on load); everything else (optimizer, scheduler,
counters, RNG states) is saved with ``torch.save`` and read back with ``weights_only=True``, which
refuses any pickled object that is not a tensor or a plain container. Every file is written to a
temporary name, flushed with fsync and renamed, so a process killed mid-save leaves the previous
checkpoint whole.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TorchrigError


class CheckpointError(TorchrigError, RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe or does not match the model."""


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    _write_atomic(Path(path), lambda fh: fh.write(data))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def _plain_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, with shared storage (tied weights) duplicated so safetensors accepts it."""
    out: dict[str, torch.Tensor] = {}
    seen: set = set()
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state_dict entry '{key}' is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather to a plain tensor
            t = t.full_tensor()
        t = t.to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a bigger storage
        out[key] = t
    return out


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save

    data = save(_plain_tensors(state), metadata={"format": "pt", "writer": "torchrig"})
    write_bytes_atomic(Path(path), data)


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.exists():
        raise CheckpointError(f"weights file '{path}' does not exist; point at a checkpoint directory or a .safetensors file")
    if path.suffix in (".pt", ".pth", ".bin"):
        obj = safe_torch_load(path)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"weights file '{path}' does not hold a state_dict of tensors")
        return obj
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"weights file '{path}' is corrupt or not a safetensors file ({exc}); "
                              f"use another checkpoint (RUN_DIR/checkpoints/) or retrain") from None


def check_keys(saved: set, expected: set, source: str) -> None:
    """Raise a CheckpointError listing missing and unexpected keys, if any."""
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        def show(keys: list) -> str:
            return ", ".join(keys[:8]) + (f" … ({len(keys)} in all)" if len(keys) > 8 else "") if keys else "none"
        raise CheckpointError(f"{source} does not match the model: missing keys: {show(missing)}; "
                              f"unexpected keys: {show(unexpected)}. Was it saved from a different model or config?")


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """``model.load_state_dict`` with a message that lists missing and unexpected keys."""
    got = set(state.keys())
    check_keys(got, set(model.state_dict().keys()), source)
    own = model.state_dict()
    bad = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in sorted(got)
           if state[k].shape != own[k].shape]
    if bad:
        raise CheckpointError(f"{source} does not match the model: shape mismatch for " + "; ".join(bad[:5]))
    model.load_state_dict(state)


def safe_torch_save(obj: Any, path: Path) -> None:
    _write_atomic(Path(path), lambda fh: torch.save(obj, fh))


def safe_torch_load(path: Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file '{path}' does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        first = str(exc).strip().splitlines()
        detail = f"found {found.group(1)}" if found else (first[0].strip()[:200] if first else "")
        raise CheckpointError(
            f"checkpoint file '{path}' contains pickled objects that are not plain tensors or containers "
            f"({detail}); torchrig refuses to load it because unpickling can execute code. "
            f"Re-save it as a plain state_dict or safetensors file") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"checkpoint file '{path}' is corrupt or truncated ({str(exc).splitlines()[0][:200]}); "
                              f"use another checkpoint") from None
