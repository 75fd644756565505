"""Finding the checkpoint to resume from, and loading weights alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from torch import nn

from .. import runtime
from .io import CheckpointError, load_into, load_weights_file, say_unverified
from .manager import resolve


def find_checkpoint(spec: str, run_dir: Path) -> Optional[Path]:
    """The checkpoint directory ``spec`` names (a path, ``latest`` or ``best``), the same on every rank.

    None for ``latest`` when nothing was saved yet (a fresh start). Collective with several ranks:
    every rank reads the run directory, and they must agree, or every one of them raises.
    """
    try:
        path, problem = resolve(spec, run_dir), None
    except CheckpointError as exc:
        path, problem = None, exc
    if runtime.get_world_size() > 1:
        seen = runtime.gather(path.name if path is not None else None)
        if len(set(seen)) > 1:
            ranks = [r for r, name in enumerate(seen) if name != seen[0]]
            raise CheckpointError(
                f"resume={spec!r}: rank 0 found {seen[0] or 'no checkpoint'} but rank(s) "
                f"{', '.join(map(str, ranks))} found {seen[ranks[0]] or 'none'}; every rank reads the checkpoint, "
                f"so run_dir must be on a file system shared by all machines (or hold the same copy on each)")
    if problem is not None:
        raise problem
    if path is None and str(spec) == "best":
        raise CheckpointError(f"resume='best': {Path(run_dir) / 'checkpoints'} has no best checkpoint (one is "
                              f"kept when checkpoint.monitor names a validation value and keep_best >= 1); "
                              f"use resume=latest or a checkpoint directory")
    return path


def load_weights_only(model: nn.Module, path: Path, sharded: bool = False, verify: bool = True,
                      pipeline: Any = None, frozen_kept: bool = False) -> None:
    """The weights of checkpoint ``path`` into ``model`` (an FSDP2 model with ``sharded=True``; a stage of
    ``pipeline``, the group of this rank's pipeline, takes its own part); ``verify=False`` (``checkpoint.verify``):
    without checking them against meta.json's checksums, said in one line; ``frozen_kept``: the checkpoint holds what
    trains, and the model's frozen parameters keep their values."""
    if not verify:
        say_unverified(path)
    if sharded:
        from .sharded import load_full_weights

        load_full_weights(model, path, verify, pipeline, frozen_kept)  # the keys are checked there too
    else:
        load_into(model, load_weights_file(path, verify), source=f"checkpoint '{path}'", frozen_kept=frozen_kept)
