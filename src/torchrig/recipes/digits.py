"""The embedded default job: a small CNN on the real 8x8 handwritten digits (no download)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import config as C
from ..data.datasets import digits_split
from ..models import build_model
from .base import Recipe, RecipeError


# 20 % of the training images (287) held out: each one is 0.35 % of val/accuracy, so the epochs of a good run
# are ranked by more than one or two images (ties still go to the lower val/loss, see checkpoint.monitor)
VAL_FRACTION = 0.2


class DigitsRecipe(Recipe):
    name = "digits"
    description = "small CNN on the 8x8 handwritten digits shipped with scikit-learn (the default job)"
    @property
    def defaults(self) -> dict:  # type: ignore[override]
        d = {"epochs": 15, "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
             "scheduler": {"name": "cosine"}, "metrics": ["accuracy", "top5", "f1"],
             "data": {"batch_size": 32, "val_fraction": VAL_FRACTION}}
        if not os.environ.get("TORCH_THREAD_NUM"):
            # 8x8 images: the convolutions are too small to gain from a second thread, and on a busy machine
            # the threads wait for each other (measured: 9 s on one thread, 31 s on two, 2 shared cores)
            d["threads"] = 1
        return d

    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        name = cfg.model.name if cfg.model.name != "digits_cnn" else "digits_cnn"
        return build_model(name, **cfg.model.options)

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        if cfg.data.path is not None:
            raise RecipeError("recipe 'digits' uses the embedded data set; for your own images use "
                              "--recipe image-classification with data.path=FOLDER")
        parts = digits_split(cfg.data.val_fraction)
        return {"train": parts["train"], "val": parts.get("val", parts["test"]), "test": parts["test"]}

    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        """``.npy`` / ``.pt`` arrays of (N, 8, 8) or (N, 64) in [0, 1], ``.csv`` rows of 64 values, or images."""
        if not path.exists():
            raise RecipeError(f"input '{path}' does not exist")
        # a folder is read recursively (the class folders of `torchrig data export-digits` too); hidden files skipped
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) \
            if path.is_dir() else [path]
        if not files:
            raise RecipeError(f"input folder '{path}' holds no file; give .npy, .csv or image files")
        arrays, names = [], []
        for f in files:
            suffix = f.suffix.lower()
            if suffix == ".npy":
                try:
                    a = np.load(f, allow_pickle=False)
                except Exception as exc:
                    raise RecipeError(f"input '{f}' is not a readable .npy array ({exc})") from None
            elif suffix == ".csv":
                try:
                    a = np.loadtxt(f, delimiter=",", ndmin=2)
                except ValueError as exc:
                    raise RecipeError(f"input '{f}' is not a CSV of numbers ({exc})") from None
            elif suffix in (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"):
                a = _image_as_digit(f)[None]
            else:
                raise RecipeError(f"input '{f}' has an unsupported type '{suffix}'; give .npy, .csv or image files")
            a = np.asarray(a, dtype=np.float32)
            if a.ndim == 2 and a.shape[1] == 64:
                a = a.reshape(-1, 8, 8)
            if a.ndim == 2 and a.shape == (8, 8):
                a = a[None]
            if a.ndim != 3 or a.shape[1:] != (8, 8):
                raise RecipeError(f"input '{f}' has shape {a.shape}; expected (N, 8, 8) or (N, 64) values in [0, 1]")
            low, high = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
            if low < -1e-3 or high > 1 + 1e-3:  # the model learnt [0, 1]: other values give confident nonsense
                hint = "; scikit-learn's load_digits gives 0-16: divide by 16" if 1 < high <= 16 and low >= 0 else ""
                raise RecipeError(f"input '{f}' holds values in [{low:g}, {high:g}]; the digits model takes values "
                                  f"in [0, 1]{hint}")
            arrays.append(a)
            name = f.relative_to(path).as_posix() if path.is_dir() else f.name  # "3/test_0004.png" in a tree
            names += [name] if len(a) == 1 else [f"{name}[{i}]" for i in range(len(a))]
        x = torch.from_numpy(np.concatenate(arrays)).unsqueeze(1)
        return x, names


def _image_as_digit(path: Path) -> np.ndarray:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise RecipeError("reading images needs Pillow; pip install 'torchrig[vision]'") from None
    try:
        with Image.open(path) as im:
            im = im.convert("L").resize((8, 8))
            return np.asarray(im, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise RecipeError(f"image '{path}' is unreadable or corrupt ({exc})") from None
