"""``torchrig export``: a checkpoint's model as a file another runtime loads, checked before it is kept.

Four formats, each through the library that owns it:

- ``torch-export``: ``torch.export.export`` → ``torch.export.save`` (a ``.pt2`` program, loaded back with
  ``torch.export.load(path).module()``), with a dynamic batch dimension;
- ``onnx``: ``torch.onnx.export(..., dynamo=True)`` (the same ``torch.export`` graph translated by
  onnxscript), checked by running it in ``onnxruntime``;
- ``safetensors``: the weights alone, ``safetensors.torch.save_model`` (shared tensors written once), for
  ``safetensors.torch.load_model`` into the same ``nn.Module``;
- ``hf``: ``save_pretrained`` of the Hugging Face model inside (the model itself, or its one
  ``transformers.PreTrainedModel`` sub-module), with the run's tokenizer when it has one, for
  ``AutoModel*.from_pretrained(folder)``;
- ``adapter``: a fine-tuned checkpoint's peft adapters alone, for ``PeftModel.from_pretrained(base, folder)``.

A fine-tuned checkpoint's adapters are merged into its base first with ``--merge``, a QAT model's layers
converted with ``--quantize`` (``finetuned.py``), each checked before the format's own check.

The checkpoint is read as ``evaluate`` and ``predict`` read it (safetensors weights, a safe YAML config:
no code from the checkpoint). The example inputs are the first samples of the recipe's data (``test``,
else ``val``, else ``train``), or the files of ``--input`` read as ``predict`` reads them. Every export
is loaded back and run on those inputs; its outputs must match the model's within ``atol`` (1e-5), or
the command fails, naming the largest difference, and nothing is written. The export is written and
checked in a new temporary folder beside the output and renamed into place once checked: a link at
the output (``--overwrite``) is replaced, never written through, and ``RUN_DIR/export`` must be a
folder of the run's own, not a link to one elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..config.files import make_dir, staged
from ..errors import TorchrigError, suggest
from ..models.hub import no_progress_bars
from . import finetuned

FORMATS = {"torch-export": ".pt2", "onnx": ".onnx", "safetensors": ".safetensors", "hf": "", "adapter": ""}
EXAMPLES = 3  # samples in the example batch: more than 1, so the batch dimension is not specialised to 1
ATOL = 1e-5


class ExportError(TorchrigError, RuntimeError):
    """The model, its inputs or the output path cannot be exported; the message names the blocker."""


@dataclass
class Exported:
    """What :func:`export_checkpoint` wrote and how closely the reloaded export matched the model."""

    path: Path
    format: str
    max_abs_diff: float
    samples: int
    note: str = ""  # what the export had to give up, e.g. a dynamic dimension

    def line(self) -> str:
        sizes = " and at smaller sizes of its dynamic dimensions" if self.format in ("torch-export", "onnx") else ""
        return (f"exported {self.format} to {self.path} (loaded back and run on {self.samples} samples{sizes}: "
                f"max |difference| {self.max_abs_diff:.2e} <= {ATOL:g}{self.note})")


def export_checkpoint(checkpoint: str, format: str, output: Optional[str] = None, *, inputs: Optional[str] = None,
                      overrides: Optional[list[str]] = None, overwrite: bool = False, atol: float = ATOL,
                      merge: bool = False, quantize: bool = False) -> Exported:
    """Export the model of ``checkpoint`` (a checkpoint, run directory or ``.../latest``) as ``format``.

    ``output`` defaults to ``RUN_DIR/export/<checkpoint name><suffix>`` (a folder for ``hf`` and ``adapter``). An
    existing output is refused unless ``overwrite``. ``merge``: peft adapters folded into the base first;
    ``quantize``: a QAT model's fake-quantised layers converted first (see ``export/finetuned.py``). Returns the
    path and the checked difference."""
    from ..recipes.run import load_checkpoint_model

    if format not in FORMATS:
        raise ExportError(f"--format {format!r} is not an export format{suggest(format, FORMATS)}; choose one of "
                          f"{', '.join(FORMATS)}")
    got = load_checkpoint_model(checkpoint, overrides)
    finetuned.check_flags(got, format, merge, quantize)
    recipe, cfg, path = got.recipe, got.cfg, got.path
    model = finetuned.widened(got, got.model.to("cpu")).eval()
    default = f"{path.name}{FORMATS[format]}" if FORMATS[format] else f"{path.name}-{format}"
    out = Path(output).expanduser() if output else Path(cfg.run_dir) / "export" / default
    _check_output(out, format, overwrite)
    root = _given_folder(out, Path(cfg.run_dir))
    make_dir(out.parent, root)  # RUN_DIR/export a link (to a folder elsewhere) is refused here
    args, kwargs = example_inputs(recipe, cfg, model, inputs)
    model, folded = finetuned.fold(got, model, args, kwargs, merge, quantize, atol, max_difference)
    with torch.inference_mode():
        expected = model(*args, **kwargs)
    write, check = finetuned.adapter_format(got, max_difference) if format == "adapter" else _FORMATS[format]
    if quantize:  # the tracer cannot see through torchao's tensors which sizes a layer fixes: the batch alone varies
        write = functools.partial(write, batch_only=True)
    # written and checked in a new temporary folder beside the output; renamed into place (over a link there,
    # never through it) only when it reproduces the model
    with staged(out, root) as new:
        program = write(model, args, kwargs, new, cfg)
        diff = check(model, args, kwargs, new, expected)
        note = ""
        if program is not None and diff <= atol:
            other, note = _check_other_sizes(model, args, kwargs, new, cfg, program, format, atol)
            diff = max(diff, other)
        if not diff <= atol:  # NaN too
            raise ExportError(f"the {format} export of '{path}' does not reproduce the model: max |difference| "
                              f"{diff:.3g} > {atol:g} on {_count(args, kwargs)} samples; nothing was written to "
                              f"{out}")
    return Exported(out, format, diff, _count(args, kwargs), folded + note)


def _given_folder(out: Path, run_dir: Path) -> Path:
    """The folder the user named for ``out``: the run directory when ``out`` lies in it (then no folder below it
    may be a link), else ``out``'s own folder."""
    try:
        out.absolute().relative_to(run_dir.absolute())
        return run_dir
    except ValueError:
        return out.parent


def _check_other_sizes(model, args, kwargs, out: Path, cfg, program, format: str,
                       atol: float) -> tuple[float, str]:
    """Run the export again on the example inputs cut by one along every dimension the traced program
    left dynamic, so a graph that is right only at the example's size is caught. ONNX's translation of
    some operators (adaptive pooling) keeps the example's size inside a graph whose inputs are dynamic:
    such an export is written again with only the batch dimension dynamic."""
    smaller = _shrunk(args, kwargs, _dynamic_dims(program))
    if smaller is None:
        return 0.0, ""
    sargs, skwargs = smaller
    with torch.inference_mode():
        expected = model(*sargs, **skwargs)
    write, check = _FORMATS[format]
    try:
        diff = check(model, sargs, skwargs, out, expected)
    except Exception as exc:  # e.g. onnxruntime refusing a shape inside the graph
        if format != "onnx":
            raise ExportError(f"the {format} export runs at the example's sizes only: {blocker(exc)}") from exc
        diff = float("inf")
    if diff <= atol or format != "onnx":
        return diff, ""
    write(model, args, kwargs, out, cfg, batch_only=True)
    with torch.inference_mode():
        diff = check(model, args, kwargs, out, model(*args, **kwargs))
    fewer = _shrunk(args, kwargs, [{0}] * len(_tensors(args, kwargs)))
    if fewer is not None:
        with torch.inference_mode():
            diff = max(diff, check(model, *fewer, out, model(*fewer[0], **fewer[1])))
    return diff, ("; only the batch dimension is dynamic: the ONNX graph was wrong at other sizes of "
                  "the dimensions torch.export left dynamic")


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]


def _dynamic_dims(program) -> list[set[int]]:
    """For each tensor input of a ``torch.export`` program (in order), the dimensions it left dynamic."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    user = set(program.graph_signature.user_inputs)
    dims = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in user and isinstance(node.meta.get("val"), torch.Tensor):
            # a dimension torch.export fixed (a feature size) may still be a SymInt holding a number
            dims.append({d for d, n in enumerate(node.meta["val"].shape)
                         if isinstance(n, torch.SymInt) and not is_concrete_int(n)})
    return dims


def _shrunk(args: tuple, kwargs: dict, dims: list[set[int]]) -> Optional[tuple[tuple, dict]]:
    """The inputs cut by one along each dynamic dimension longer than 2, or None when nothing can be cut."""
    cut = False
    it = iter(dims)

    def shrink(t):
        nonlocal cut
        if not isinstance(t, torch.Tensor):
            return t
        for d in sorted(next(it, set())):
            if t.shape[d] > 2:
                t, cut = t.narrow(d, 0, t.shape[d] - 1), True
        return t

    sargs = tuple(shrink(a) for a in args)
    skwargs = {k: shrink(v) for k, v in kwargs.items()}
    return (sargs, skwargs) if cut else None


def _check_output(out: Path, format: str, overwrite: bool) -> None:
    if FORMATS[format] and out.suffix.lower() != FORMATS[format]:
        raise ExportError(f"--output {out}: a {format} export is a {FORMATS[format]} file; name it "
                          f"{out.with_suffix(FORMATS[format]).name}")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ExportError(f"--output {out} already exists; choose another path or add --overwrite")
        if out.is_dir() and not out.is_symlink() and FORMATS[format]:
            raise ExportError(f"--output {out} is a folder; a {format} export is a file")


# ----------------------------------------------------------------------------- example inputs


def example_inputs(recipe, cfg, model: nn.Module, inputs: Optional[str] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model`` from the first samples of the recipe's data, or from ``inputs``."""
    from ..data.batches import forward_arguments, predict_inputs
    from ..recipes import factory

    if inputs is not None:
        x, _ = recipe.load_inputs(cfg, Path(inputs))
        batch = _first(x, EXAMPLES, f"--input {inputs}")
    else:
        data = factory.build_data(recipe, cfg, missing=f"recipe '{recipe.name}' has no data to take example inputs "
                                                       f"from; pass --input FILE_OR_FOLDER or --set "
                                                       f"data.factory=MODULE:FN")
        split = next((s for s in ("test", "val", "train") if data.get(s) is not None), None)
        if split is None:
            raise ExportError(f"recipe '{recipe.name}' gives no data to take example inputs from; pass --input "
                              f"FILE_OR_FOLDER (read as predict reads it)")
        batch = _first(data[split], EXAMPLES, f"the {split} split")
        batch = predict_inputs(model, batch, cfg.data.label_key)
    if isinstance(batch, dict):
        args, kwargs = forward_arguments(model, batch, tuple(cfg.data.input_keys) if cfg.data.input_keys else None)
        return tuple(args), dict(kwargs)
    return (tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)), {}


def _first(data: Any, n: int, where: str) -> Any:
    """The first ``n`` samples of ``data`` as one batch (a tensor, a tuple or a dict of tensors)."""
    from torch.utils.data import DataLoader, IterableDataset, default_collate

    if isinstance(data, torch.Tensor):
        return data[:n]
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return tuple(t[:n] for t in data)
    if isinstance(data, DataLoader):
        return _slice(next(iter(data)), n)
    if isinstance(data, IterableDataset):
        samples = [s for _, s in zip(range(n), data)]
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        samples = [data[i] for i in range(min(n, len(data)))]
    else:
        raise ExportError(f"cannot take example inputs from {where} ({type(data).__name__}); pass --input")
    if not samples:
        raise ExportError(f"{where} holds no sample to take example inputs from; pass --input")
    return default_collate(samples)


def _slice(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, dict):
        return {k: _slice(v, n) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, n) for v in batch)
    return batch


def _count(args: tuple, kwargs: dict) -> int:
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.ndim), None)
    return int(first.shape[0]) if first is not None else 1


# ----------------------------------------------------------------------------- comparing outputs


def _leaves(output: Any) -> list[torch.Tensor]:
    """The tensors of an output (a tensor, a tuple, a dict, a ``ModelOutput``), in a fixed order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict) or hasattr(output, "to_tuple"):
        items = output.items() if isinstance(output, dict) else zip(output.keys(), output.to_tuple())
        return [t for _, v in sorted(items, key=lambda kv: str(kv[0])) for t in _leaves(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in _leaves(v)]
    return []


def max_difference(expected: Any, got: Any) -> float:
    """The largest absolute difference between two outputs of the same structure (inf when they differ)."""
    a, b = _leaves(expected), [torch.as_tensor(t) for t in _leaves(got)]
    if len(a) != len(b) or any(x.shape != tuple(y.shape) for x, y in zip(a, b)):
        raise ExportError(f"the export returns {[tuple(t.shape) for t in b]}, the model "
                          f"{[tuple(t.shape) for t in a]}")
    return max((float((x.detach().double() - y.detach().double()).abs().max()) if x.numel() else 0.0)
               for x, y in zip(a, b)) if a else 0.0


# ----------------------------------------------------------------------------- torch.export


def _dynamic_shapes(args: tuple, kwargs: dict, batch_only: bool = False) -> list:
    """The first dimension of every tensor input is the batch (one dimension shared by all); every other
    dimension is ``Dim.AUTO``: dynamic where the model allows it (a text model's sequence length, a
    convolutional net's image size), fixed to the example's size where it does not (a flatten into a
    ``Linear``). Listed in the order of the inputs (positional, then keywords)."""
    batch = torch.export.Dim("batch", min=1)

    def spec(v):
        if isinstance(v, torch.Tensor) and v.ndim:
            return {0: batch, **({} if batch_only else {d: torch.export.Dim.AUTO for d in range(1, v.ndim)})}
        if isinstance(v, (tuple, list)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    return [spec(a) for a in args] + [spec(v) for v in kwargs.values()]


def export_program(model: nn.Module, args: tuple, kwargs: dict, what: str = "torch.export", batch_only: bool = False):
    """``torch.export.export`` of ``model`` with a dynamic batch; a failure is one line naming its cause."""
    try:
        with _quiet_tracer():
            return torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(args, kwargs, batch_only),
                                       strict=False)
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"{what} cannot trace {type(model).__name__}: {blocker(exc)}") from exc


@contextlib.contextmanager
def _quiet_tracer():
    """The tracers log pages (graphs, guards) on the way to an error that :func:`blocker` sums up in a line."""
    names = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export", "torch._dynamo",
             "torch.onnx", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:  # non-strict tracing also prints the partial graph when it meets a data-dependent branch
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def blocker(exc: BaseException) -> str:
    """One line for an export failure: what blocked it (the operator, the input or the guard) and where in
    the user's code, rather than the tracer's pages of explanation."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    for marker in ("Could not guard on data-dependent expression", "Could not extract specialized integer",
                   "Dynamic control flow is not supported", "Unsupported", "not supported", "No decomposition",
                   "Constraints violated", "DispatchError", "is not supported"):
        hit = next((ln for ln in lines if marker in ln), None)
        if hit:
            head = hit
            break
    head = head if len(head) <= 300 else head[:297] + "..."
    where = _user_frame(exc)
    return f"{head}{f' (at {where})' if where else ''}"


def _user_frame(exc: BaseException) -> Optional[str]:
    """The last traceback frame outside torch, transformers' internals and torchrig's export code."""
    seen: list = []
    e: Optional[BaseException] = exc
    while e is not None and len(seen) < 4:
        seen.append(e)
        e = e.__cause__ or e.__context__
    skip = ("/torch/", "/onnxscript/", "/onnx/", "/site-packages/torch", "torchrig/export/exporter.py",
            "<frozen", "/contextlib.py", "/functools.py")
    for e in seen:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not any(s in f.filename for s in skip)]
        if frames:
            f = frames[-1]
            return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
    return None


def _write_torch_export(model, args, kwargs, out: Path, cfg, batch_only: bool = False):
    program = export_program(model, args, kwargs, batch_only=batch_only)
    torch.export.save(program, str(out))
    return program


def _check_torch_export(model, args, kwargs, out: Path, expected) -> float:
    program = torch.export.load(str(out))
    with torch.inference_mode():
        return max_difference(expected, program.module()(*args, **kwargs))


# ----------------------------------------------------------------------------- ONNX


def _need(module: str, fmt: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"--format {fmt} needs the {module} package; pip install {extra}") from None


def _write_onnx(model, args, kwargs, out: Path, cfg, batch_only: bool = False):
    _need("onnxscript", "onnx", "onnx onnxscript onnxruntime")
    program = export_program(model, args, kwargs, what="torch.onnx.export (through torch.export)",
                             batch_only=batch_only)
    try:  # the graph's inputs keep the names of forward's parameters (x, input_ids, attention_mask, ...)
        with _quiet_tracer():
            onnx_program = torch.onnx.export(program, args, kwargs=kwargs, dynamo=True, verbose=False,
                                             optimize=True)
    except Exception as exc:
        raise ExportError(f"torch.onnx.export cannot translate {type(model).__name__}: {blocker(exc)}") from exc
    onnx_program.save(str(out))
    return program


def _named_inputs(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The tensor inputs by the name of the ``forward`` parameter they fill."""
    import inspect

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"input_{i}": a for i, a in enumerate(args)}, **kwargs}
    return {k: v for k, v in bound.items() if isinstance(v, torch.Tensor)}


def _check_onnx(model, args, kwargs, out: Path, expected) -> float:
    ort = _need("onnxruntime", "onnx", "onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a refused shape is raised (and reported by the caller), not also logged
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    named = _named_inputs(model, args, kwargs)
    wanted = [i.name for i in session.get_inputs()]
    if any(n not in named for n in wanted):  # an input the tracer renamed: fall back to their order
        feeds = dict(zip(wanted, named.values()))
    else:  # an input forward ignores is left out of the graph by the exporter
        feeds = {n: named[n] for n in wanted}
    return max_difference(expected, [torch.from_numpy(o) for o in
                                     session.run(None, {n: t.numpy() for n, t in feeds.items()})])


# ----------------------------------------------------------------------------- safetensors


def _write_safetensors(model, args, kwargs, out: Path, cfg) -> None:
    from safetensors.torch import save_model

    save_model(model, str(out), metadata={"format": "pt", "torchrig.recipe": str(cfg.recipe),
                                          "torchrig.model": type(model).__name__})


def _check_safetensors(model, args, kwargs, out: Path, expected) -> float:
    import copy

    from safetensors.torch import load_model

    fresh = copy.deepcopy(model)
    for p in fresh.parameters():  # nothing of the original survives into the check but the file's weights
        p.data.fill_(float("nan"))
    load_model(fresh, str(out))
    with torch.inference_mode():
        return max_difference(expected, fresh(*args, **kwargs))


# ----------------------------------------------------------------------------- Hugging Face


def hf_model(model: nn.Module) -> nn.Module:
    """The ``transformers.PreTrainedModel`` that is ``model`` or its only such sub-module."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        raise ExportError("--format hf needs the transformers package; pip install 'torchrig[hf]'") from None
    if isinstance(model, PreTrainedModel):
        return model
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel)]
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if len(outer) == 1:
        return outer[0][1]
    if not outer:
        raise ExportError(f"--format hf: {type(model).__name__} is not a Hugging Face model (no "
                          f"transformers.PreTrainedModel in it); use --format safetensors, torch-export or onnx")
    raise ExportError(f"--format hf: {type(model).__name__} holds {len(outer)} Hugging Face models "
                      f"({', '.join(n for n, _ in outer)}); export one of them from Python with save_pretrained")


def _write_hf(model, args, kwargs, out: Path, cfg) -> None:
    with no_progress_bars():
        hf_model(model).save_pretrained(str(out), safe_serialization=True)
    tokenizer = Path(cfg.run_dir) / "tokenizer.json"
    if tokenizer.is_file() and not tokenizer.is_symlink():
        from transformers import PreTrainedTokenizerFast

        # the run's word-piece vocabulary, with BERT's special tokens, so AutoTokenizer loads the folder
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), unk_token="[UNK]", pad_token="[PAD]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                      model_input_names=["input_ids", "token_type_ids", "attention_mask"])
        tok.save_pretrained(str(out))


def _check_hf(model, args, kwargs, out: Path, expected) -> float:
    from ..trainer.outputs import unpack

    inner = hf_model(model)
    with no_progress_bars():
        loaded = type(inner).from_pretrained(str(out)).eval()
    with torch.inference_mode():
        got = loaded(*args, **kwargs) if inner is model else unpack(loaded(*args, **kwargs))[0]
    if inner is not model:
        expected = unpack(expected)[0]
    return max_difference(expected, got)


_FORMATS: dict[str, tuple[Callable, Callable]] = {
    "torch-export": (_write_torch_export, _check_torch_export),
    "onnx": (_write_onnx, _check_onnx),
    "safetensors": (_write_safetensors, _check_safetensors),
    "hf": (_write_hf, _check_hf),
}
