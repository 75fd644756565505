"""What a recipe is: a config's model, data, trainer settings, and prediction I/O.

``run_train`` / ``run_evaluate`` / ``run_predict`` drive any recipe the same way, so the command
line has one code path and a recipe is only the parts that differ.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import config as C
from ..config.files import write_atomic
from ..errors import TorchrigError


class RecipeError(TorchrigError, ValueError):
    """Bad recipe input (data path, image, text file); the message names it and the fix."""


class Recipe:
    name = "base"
    description = ""
    defaults: dict = {}  # config values this recipe starts from (the user's config wins)
    # the --output file kinds write_predictions writes, chosen by extension; None: the recipe checks its own
    output_kinds: Optional[tuple] = (".csv", ".json")
    has_data = True  # False: no data of its own (``custom``): data.factory (or predict's --input) gives it
    reads_sources = False  # True: its build_data mixes data.sources by data.mixture (a torchrig.data.Mixture)

    def build_model(self, cfg: C.Config) -> nn.Module:
        raise NotImplementedError

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        """``{"train": ..., "val": ... (optional), "test": ... (optional)}``."""
        raise NotImplementedError

    def pack_refusal(self, cfg: C.Config) -> Optional[str]:
        """Why ``data.pack`` does not apply to this recipe's data, or None where it packs its documents."""
        return "its samples are not token documents"

    def trainer_kwargs(self, cfg: C.Config, data: dict) -> dict:
        """Extra ``Trainer`` arguments (step_fn, eval_fn, predict_fn, loss / metric objects)."""
        return {}

    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        """Prediction inputs from a file or folder, and a name for each sample."""
        raise NotImplementedError

    def write_predictions(self, cfg: C.Config, outputs: Any, names: list[str], out: Path, topk: int = 5) -> None:
        write_class_predictions(outputs, names, out, topk, class_names=self.class_names(cfg))

    def class_names(self, cfg: C.Config) -> Optional[list[str]]:
        return None

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        """Write what prediction needs beside the checkpoints (class map, tokenizer …)."""


def write_class_predictions(probs: torch.Tensor, names: list[str], out: Path, topk: int = 5,
                            class_names: Optional[list[str]] = None) -> None:
    """Top-k classes with probabilities as CSV or JSON (by the output file's extension)."""
    check_output_kind(out, (".csv", ".json"))
    k = min(topk, probs.shape[1])
    top = probs.topk(k, dim=1)
    label = (lambda i: class_names[i]) if class_names else (lambda i: int(i))
    rows = []
    for name, p, ix in zip(names, top.values.tolist(), top.indices.tolist()):
        rows.append({"input": name, "prediction": label(ix[0]), "probability": round(p[0], 6),
                     "top": [{"class": label(i), "probability": round(q, 6)} for i, q in zip(ix, p)]})
    if out.suffix.lower() == ".json":
        return write_output(out, (json.dumps(rows, indent=2) + "\n").encode())
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(["input", "prediction", "probability"] + [f"top{j + 1}" for j in range(k)]
               + [f"top{j + 1}_probability" for j in range(k)])
    for r in rows:
        w.writerow([r["input"], r["prediction"], r["probability"]] + [t["class"] for t in r["top"]]
                   + [t["probability"] for t in r["top"]])
    write_output(out, text.getvalue().encode())


def write_output(out: Path, data: bytes) -> None:
    """A file of ``predict --output`` (or beside it), written whole through ``files.write_atomic`` into the
    folder the user named (made if missing)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, data, root=out.parent)


def saved_bytes(save: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
    """What ``save(file, *args, **kwargs)`` writes (``np.save``, ``np.savez``), made in memory."""
    buffer = io.BytesIO()
    save(buffer, *args, **kwargs)
    return buffer.getvalue()


def check_output_kind(out: Path, kinds: tuple) -> None:
    """``predict --output``: the format is the file's extension; one it does not name is refused, not guessed."""
    if out.suffix.lower() not in kinds:
        raise RecipeError(f"predict --output '{out}': the format is chosen by the file's extension, and "
                          f"'{out.suffix or '(none)'}' is not one this task writes; end the name with "
                          f"{', '.join(kinds[:-1])} or {kinds[-1]} (e.g. predictions{kinds[0]})")


HEAD_PREFIXES = ("fc.", "classifier.", "head.", "heads.", "bert.classifier.")


def load_weights_partial(model: nn.Module, state: dict, source: str) -> None:
    """Load a local weights file (``model.weights``): every key must match, except the classifier
    head (``fc.`` / ``classifier.`` / ``head.``), which is left as initialised when its shape differs
    (fine-tuning an ImageNet-shaped checkpoint on another number of classes)."""
    from ..checkpoint import load_into

    own = model.state_dict()
    if "model." in next(iter(state), "") and not any(k in own for k in state):
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    skipped = [k for k in state if k in own and state[k].shape != own[k].shape and k.startswith(HEAD_PREFIXES)]
    missing_head = [k for k in own if k not in state and k.startswith(HEAD_PREFIXES)]
    if skipped or missing_head:
        state = {k: v for k, v in state.items() if k not in skipped}
        state.update({k: own[k] for k in skipped + missing_head})
        import sys

        print(f"torchrig: model.weights '{source}': kept the new classifier head for "
              f"{', '.join(skipped + missing_head)} (shape differs from the file)", file=sys.stderr)
    load_into(model, state, source=f"model.weights '{source}'")

