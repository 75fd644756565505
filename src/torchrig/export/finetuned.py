"""Exporting a fine-tuned checkpoint: adapters merged, the adapter folder alone, or a QAT model converted.

- ``--merge``: peft's ``merge_and_unload`` folds the LoRA adapters into the base's weights (and puts the trained
  copies of ``peft.modules_to_save`` in place of the originals): the model of the base's class, which every format
  exports. It is checked against the model with its adapters, within the export's tolerance, before anything is
  written; then the written export is checked against it as every export is.
- ``--format adapter``: peft's ``save_pretrained`` of the adapters (``adapter_config.json``,
  ``adapter_model.safetensors``): the folder ``peft.PeftModel.from_pretrained(base, folder)`` loads. It is checked
  by loading it onto a base built again as the run built it.
- ``--quantize``: torchao's ``convert`` step turns the fake-quantised Linear layers of a ``quantize.qat`` run into
  quantised ones, checked against the fake-quantised model (torchao holds its schemes to identical outputs);
  ``torch.export`` writes its tensors (the other formats cannot hold them).

A base kept in bf16 / fp16 for training (``peft.base_dtype``) is widened to fp32 first: the export computes in fp32.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import TorchrigError


class FineTuneExportError(TorchrigError, RuntimeError):
    """``--merge``, ``--quantize`` or ``--format adapter`` asked of a checkpoint that cannot give it."""


def check_flags(got: Any, format: str, merge: bool, quantize: bool) -> None:
    """One line for a flag the checkpoint cannot serve, before anything is computed."""
    where, adapted = f"checkpoint '{got.path}'", got.adapted is not None
    if (merge or format == "adapter") and not adapted:
        flag = "--merge" if merge else "--format adapter"
        raise FineTuneExportError(f"{flag}: {where} holds no peft adapters (its run set no peft.method); export it "
                                  f"without {flag}")
    if merge and format == "adapter":
        raise FineTuneExportError("--merge folds the adapters into the base, --format adapter writes them alone; "
                                  "choose one")
    if adapted and not merge and format == "hf":
        raise FineTuneExportError(f"--format hf: {where} holds peft adapters; add --merge for the whole model with "
                                  f"them folded in, or use --format adapter for the folder peft loads onto its base")
    if quantize and got.cfg.quantize.qat is None:
        raise FineTuneExportError(f"--quantize: {where} was not trained with quantize.qat, so there is nothing to "
                                  f"convert; export it without --quantize")
    if quantize and format != "torch-export":
        raise FineTuneExportError(f"--quantize --format {format}: torchao's quantised tensors are written by "
                                  f"torch.export only; use --format torch-export")


def widened(got: Any, model: nn.Module) -> nn.Module:
    """The model in fp32 when its frozen base was kept in half precision for training."""
    if got.adapted is not None and got.adapted.base_dtype in ("bf16", "fp16"):
        return model.float()
    return model


def fold(got: Any, model: nn.Module, args: tuple, kwargs: dict, merge: bool, quantize: bool, atol: float,
         difference: Callable[[Any, Any], float]) -> tuple[nn.Module, str]:
    """``(model to export, note)``: the adapters merged (``merge``) or the QAT layers converted (``quantize``),
    checked within ``atol`` against the model before; the model as it is otherwise."""
    if not (merge or quantize):
        return model, ""
    with torch.inference_mode():
        before = model(*args, **kwargs)
    with torch.no_grad():
        if merge:
            model, what, than = got.adapted.wrapper.merge_and_unload(), "merged", "the model with its adapters"
        else:
            from ..optim import qat

            qat.convert(model, got.cfg.quantize)
            what, than = "quantised", f"the fake-quantised model (torchao {got.cfg.quantize.qat})"
    model.eval()
    with torch.inference_mode():
        diff = difference(before, model(*args, **kwargs))
    if not diff <= atol:  # NaN too
        raise FineTuneExportError(f"the {what} model of '{got.path}' does not reproduce {than}: max |difference| "
                                  f"{diff:.3g} > {atol:g}; nothing was written")
    return model, f"; {what}: max |difference| {diff:.2e} from {than}"


def adapter_format(got: Any, difference: Callable[[Any, Any], float]) -> tuple[Callable, Callable]:
    """(write, check) of ``--format adapter``, as the exporter's formats take them."""

    def write(model, args, kwargs, out: Path, cfg, batch_only: bool = False) -> None:
        got.adapted.wrapper.save_pretrained(str(out), safe_serialization=True)

    def check(model, args, kwargs, out: Path, expected) -> float:
        from peft import PeftModel

        from ..recipes.run import base_model

        base = base_model(got.recipe, got.cfg, got.meta).to("cpu")  # a new base, built as the run built it
        with warnings.catch_warnings():  # transformers' deprecations, met inside peft
            warnings.filterwarnings("ignore", category=FutureWarning)
            loaded = PeftModel.from_pretrained(base, str(out)).eval()
        with torch.inference_mode():
            return difference(expected, loaded(*args, **kwargs))

    return write, check
