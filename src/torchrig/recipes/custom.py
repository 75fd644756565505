"""The recipe of ``torchrig train --model pkg:build_model --data pkg:build_data``: no model or data of
its own, only yours (see :mod:`torchrig.recipes.factory`); loss, metrics and optimizer come from the
config as for any run.

``predict`` reads arrays as they are: ``.npy``, ``.pt`` (a tensor) or ``.csv`` files (or a folder of
them), first dimension = samples, and writes the top-k classes (``.csv`` / ``.json``) or the raw
outputs (``.npy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import config as C
from .base import Recipe, RecipeError, saved_bytes, write_class_predictions, write_output

ARRAY_SUFFIXES = (".npy", ".pt", ".csv")


class CustomRecipe(Recipe):
    name = "custom"
    description = "your own model and data: torchrig train --model pkg.module:build_model --data pkg.module:build_data"
    has_data = False

    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        raise RecipeError("recipe 'custom' has no model of its own; give --model pkg.module:build_model "
                          "(config key model.factory)")

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        raise RecipeError("recipe 'custom' has no data of its own; give --data pkg.module:build_data "
                          "(config key data.factory)")

    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        if not path.exists():
            raise RecipeError(f"input '{path}' does not exist")
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in ARRAY_SUFFIXES and not p.name.startswith(".")) \
            if path.is_dir() else [path]
        if not files:
            raise RecipeError(f"input folder '{path}' holds no {', '.join(ARRAY_SUFFIXES)} file")
        arrays, names = [], []
        for f in files:
            a = _read_array(f)
            name = f.relative_to(path).as_posix() if path.is_dir() else f.name
            names += [f"{name}[{i}]" for i in range(len(a))] if len(a) > 1 else [name]
            arrays.append(a)
        if len({a.shape[1:] for a in arrays}) > 1:
            raise RecipeError(f"inputs under '{path}' have different sample shapes "
                              f"{sorted({tuple(a.shape[1:]) for a in arrays})}; give one shape")
        return torch.cat(arrays), names

    output_kinds = (".csv", ".json", ".npy")

    def write_predictions(self, cfg: C.Config, outputs: Any, names: list[str], out: Path, topk: int = 5) -> None:
        if out.suffix.lower() == ".npy":
            write_output(out, saved_bytes(np.save, outputs.float().numpy()))
            return
        if not (isinstance(outputs, torch.Tensor) and outputs.ndim == 2):
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise RecipeError(f"--output '{out}': the model's outputs {shape} are not (samples, classes) "
                              f"scores; write them raw with --output FILE.npy")
        write_class_predictions(outputs, names, out, topk)


def _read_array(f: Path) -> torch.Tensor:
    suffix = f.suffix.lower()
    try:
        if suffix == ".npy":
            a = torch.from_numpy(np.load(f, allow_pickle=False))
        elif suffix == ".pt":
            a = torch.load(f, map_location="cpu", weights_only=True)
        elif suffix == ".csv":
            a = torch.from_numpy(np.loadtxt(f, delimiter=",", ndmin=2))
        else:
            raise RecipeError(f"input '{f}' has an unsupported type '{suffix}'; give .npy, .pt or .csv files")
    except RecipeError:
        raise
    except Exception as exc:
        raise RecipeError(f"input '{f}' is not a readable {suffix} array ({exc})") from None
    if not isinstance(a, torch.Tensor) or a.ndim == 0:
        raise RecipeError(f"input '{f}' holds no array of samples (first dimension = samples)")
    return a.float() if a.is_floating_point() else a
