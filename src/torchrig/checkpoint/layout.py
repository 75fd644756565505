"""Names inside a run's ``checkpoints/`` folder, shared by the plain and the sharded (DCP) checkpoints."""

from __future__ import annotations

from typing import Any

PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    """The directory name of checkpoint ``step``: ``step-00000123``."""
    return f"{PREFIX}{step:08d}"


def weight_files(states: dict[str, Any]) -> dict[str, dict]:
    """``{file name: tensors}`` of the objects with a ``weights_file`` (collective under FSDP2: every rank)."""
    return {obj.weights_file: obj.weights() for obj in states.values() if hasattr(obj, "weights_file")}
