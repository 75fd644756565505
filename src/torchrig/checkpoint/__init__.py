"""Atomic save / load / resume, keep-last-k and best-k, safe loading."""

from .background import finish_saves
from .io import (CheckpointError, CheckpointWriteError, CorruptCheckpointError, UnsafeCheckpointError, load_into,
                 load_weights_file, read_meta, safe_torch_load, save_weights, say_unverified)
from .manager import CheckpointManager, read_checkpoint, read_config, resolve
from .resume import find_checkpoint, load_weights_only


def load_weights(model, path, verify: bool = True) -> None:
    """Load a checkpoint's (or a weights file's) tensors into ``model``; never executes code. A checkpoint's
    files are checked against the checksums of its meta.json (a checkpoint without them is refused);
    ``verify=False`` loads them unchecked, and says so."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir() and not (p / "model.safetensors").exists():
        p = resolve(p) or p
    if not verify:
        say_unverified(p)
    load_into(model, load_weights_file(p, verify), source=f"checkpoint '{path}'")


__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriteError", "CorruptCheckpointError",
           "UnsafeCheckpointError",
           "find_checkpoint", "finish_saves", "load_weights_only", "load_into", "load_weights", "load_weights_file",
           "read_checkpoint", "read_config", "read_meta", "resolve", "safe_torch_load", "save_weights",
           "say_unverified"]
