"""Small helpers the recipes share: messages from rank 0, fixed splits, input file listing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..runtime import is_main_process
from .base import RecipeError

SPLIT_SEED = 20240501  # validation splits do not depend on the training seed


def say(text: str) -> None:
    if is_main_process():
        print(text, file=sys.stderr, flush=True)


def stratified_split(labels: Sequence[int], fraction: float, seed: int = SPLIT_SEED) -> tuple[list[int], list[int]]:
    """(keep, held-out) indices: ``fraction`` of each class held out, the same on every machine."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    keep, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = int(round(len(idx) * fraction))
        if fraction > 0 and len(idx) > 1:
            n = max(1, min(n, len(idx) - 1))
        held += idx[:n].tolist()
        keep += idx[n:].tolist()
    return sorted(keep), sorted(held)


def input_files(path: Path, suffixes: Sequence[str], what: str = "input") -> list[Path]:
    """A file, or the files under a folder (recursively, sorted) with one of ``suffixes``."""
    if not path.exists():
        raise RecipeError(f"{what} '{path}' does not exist")
    if path.is_file():
        return [path]
    suffixes = tuple(s.lower() for s in suffixes)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise RecipeError(f"{what} folder '{path}' holds no files of type {', '.join(suffixes)}")
    return files


def display_name(file: Path, root: Path) -> str:
    return file.name if root.is_file() else str(file.relative_to(root))
