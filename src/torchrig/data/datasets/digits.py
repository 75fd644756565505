"""The real 8x8 handwritten digits (1,797 images, 10 classes), shipped inside scikit-learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..common import DataError

SPLIT_SEED = 20240501  # fixed: the same train/test split on every machine
TEST_FRACTION = 0.2


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 in [0, 1] with shape (N, 8, 8) and int64 labels.

    Read from scikit-learn's own file (``sklearn/datasets/data/digits.csv.gz``, 64 pixels and the label a row) as
    its ``load_digits`` reads it, without importing scikit-learn: that import is 2-3 s of every start of the
    default job, a quarter of it. An installation without that file falls back to ``load_digits``."""
    found = _sklearn_file("datasets", "data", "digits.csv.gz")
    if found is not None:
        rows = np.loadtxt(found, delimiter=",")
        images, target = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise DataError("the embedded digits data set comes from scikit-learn; pip install scikit-learn") from None
        d = load_digits()
        images, target = d.images, d.target
    return (images / 16.0).astype(np.float32), target.astype(np.int64)


def _sklearn_file(*parts: str) -> Optional[Path]:
    """A data file inside the installed scikit-learn package, found without importing it (None: not there)."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    return None


def digits_split(val_fraction: float = 0.0) -> dict[str, TensorDataset]:
    """Fixed, stratified train/test split (80/20) and an optional validation split of the train part."""
    images, labels = digits_arrays()
    rng = np.random.default_rng(SPLIT_SEED)
    train_idx, test_idx, val_idx = [], [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(len(idx) * TEST_FRACTION))
        n_val = int(round((len(idx) - n_test) * val_fraction))
        test_idx += idx[:n_test].tolist()
        val_idx += idx[n_test:n_test + n_val].tolist()
        train_idx += idx[n_test + n_val:].tolist()

    def make(ix: list) -> TensorDataset:
        ix = np.sort(np.asarray(ix, dtype=np.int64))
        return TensorDataset(torch.from_numpy(images[ix]).unsqueeze(1), torch.from_numpy(labels[ix]))

    out = {"train": make(train_idx), "test": make(test_idx)}
    if val_idx:
        out["val"] = make(val_idx)
    return out
