"""Tensor parallelism: the layers a plan names are split over the ``tp`` ranks with
``torch.distributed.tensor.parallel.parallelize_module``.

A plan maps module-name patterns (``fnmatch``: ``layers.*.mlp.up`` matches ``layers.0.mlp.up``) to a style:

=====================  ==========================================================================
``colwise``            ``ColwiseParallel()``: output features split, output stays sharded
``rowwise``            ``RowwiseParallel()``: input features split, output summed over the ranks
``colwise_rep``        ``ColwiseParallel(output_layouts=Replicate())``: the whole output on every rank
                       (Hugging Face's ``colwise_gather_output`` is the same)
``rowwise_rep``        ``RowwiseParallel()`` (Hugging Face's name)
``sequence_parallel``  ``SequenceParallel()``: a norm or dropout over a sequence split on dim 1
``embedding_rowwise``  ``RowwiseParallel(input_layouts=Replicate())``: an embedding's rows split
``embedding_colwise``  ``ColwiseParallel(output_layouts=Replicate())``: its columns split
=====================  ==========================================================================

``colwise_loss_parallel`` is ``ColwiseParallel(use_local_output=False)``: an output layer (an LM head) split by
class whose output stays a split DTensor, for the cross-entropy of ``parallel.loss_parallel`` (``parallel/loss.py``).

``auto`` takes the plan the model declares: a ``tp_plan`` attribute (torchrig's built-in models, or the
user's own), or a Hugging Face model's ``config.base_model_tp_plan`` (relative to its base model) with the
class's own ``_tp_plan`` (its head). The usual pairing is ``colwise`` into ``rowwise`` (an MLP's up and down
projections, attention's q/k/v and output projections): the activations between them stay split and one
all-reduce per pair joins them. An attention module must take its local head count from the shapes
(``view(b, n, -1, head_dim)``), as Hugging Face's do.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from typing import Any, Callable, Iterator

from torch import nn

from ..errors import suggest
from .errors import ParallelConfigError

KEY = "parallel.tp_plan"
# torch's DTensor, on a CPU (gloo) mesh, moving a split tensor from one dimension to another
CPU_ALLTOALL = "CPU process group does not support alltoall yet"


class _NotCpuAlltoall(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(CPU_ALLTOALL)


@contextlib.contextmanager
def quiet_cpu_alltoall(active: bool) -> Iterator[None]:
    """While torchrig runs a split model (``active``: tensor parallel on a CPU mesh), torch's warning that gloo has no
    all-to-all and an all-gather does its work is not shown: known and harmless (the same values), yet said by every
    rank. Only that message of only that logger: every other warning stays."""
    if not active:
        yield
        return
    logger, quiet = logging.getLogger("torch.distributed.tensor._collective_utils"), _NotCpuAlltoall()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel,
        "sequence_parallel": SequenceParallel,
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_loss_parallel": lambda: ColwiseParallel(use_local_output=False),
    }


STYLE_NAMES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "sequence_parallel",
               "embedding_rowwise", "embedding_colwise", "colwise_loss_parallel")


def model_plan(model: nn.Module) -> dict[str, str]:
    """The plan ``auto`` uses: ``model.tp_plan``, else a Hugging Face model's own; one line when there is none."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    plan: dict[str, str] = {}
    if base_plan:
        prefix = getattr(model, "base_model_prefix", "")
        under = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        plan.update({under + k: v for k, v in base_plan.items()})
        plan.update(getattr(type(model), "_tp_plan", None) or {})  # the head (lm_head) of a *ForCausalLM
    if not plan and any(type(m).__name__ == "Conv1D" for m in model.modules()):
        raise ParallelConfigError(
            f"config key '{KEY}': auto, but {type(model).__name__} declares no tensor-parallel plan, and its layers are "
            f"transformers Conv1D (GPT-2's), which PyTorch's tensor-parallel styles do not split; use parallel.pp or "
            f"dist.strategy=fsdp for this model")
    if not plan:
        raise ParallelConfigError(
            f"config key '{KEY}': auto, but {type(model).__name__} declares no tensor-parallel plan (no tp_plan "
            f"attribute, no Hugging Face base_model_tp_plan); give {KEY} as a mapping of module names to styles "
            f"({', '.join(STYLE_NAMES[:2])}, ...)")
    return plan


def resolve(model: nn.Module, plan: Any, tp: int) -> dict[str, str]:
    """``{module name: style}`` for every module the plan's patterns match, checked against ``tp``."""
    if plan == "auto":
        plan = model_plan(model)
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLE_NAMES:
            raise ParallelConfigError(f"config key '{KEY}': style {style!r} of {pattern!r} is not one of "
                                      f"{', '.join(STYLE_NAMES)}{suggest(style, STYLE_NAMES)}")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ParallelConfigError(
                f"config key '{KEY}': {pattern!r} matches no module of {type(model).__name__}"
                f"{suggest(pattern, names, n=3)} (module names such as {', '.join(names[:4])})")
        for name in matched:
            _check_divides(name, modules[name], style, tp)
            out[name] = style
    _check_heads(model, tp, out)
    return out


def _check_divides(name: str, module: nn.Module, style: str, tp: int) -> None:
    """A split dimension that ``tp`` does not divide: one line naming the module and the sizes."""
    dims: dict[str, tuple[str, int]] = {}
    if isinstance(module, nn.Linear):
        dims = {"colwise": ("output features", module.out_features), "rowwise": ("input features", module.in_features)}
    elif isinstance(module, nn.Embedding):
        dims = {"rowwise": ("rows (vocabulary)", module.num_embeddings),
                "colwise": ("columns (embedding size)", module.embedding_dim)}
    elif style != "sequence_parallel":
        raise ParallelConfigError(f"config key '{KEY}': module {name!r} is a {type(module).__name__}; the style "
                                  f"{style!r} splits nn.Linear and nn.Embedding layers only")
    kind = "rowwise" if "rowwise" in style else "colwise"
    if kind in dims and dims[kind][1] % tp:
        what, size = dims[kind]
        raise ParallelConfigError(f"config key '{KEY}': module {name!r} ({style}) has {size} {what}, which "
                                  f"parallel.tp={tp} does not divide; choose a tp that divides {size}, or a size of "
                                  f"the model that {tp} divides")


HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
               "n_kv_heads")


def _check_heads(model: nn.Module, tp: int, planned: dict[str, str]) -> None:
    """Attention heads that ``tp`` does not divide, each rank holding ``heads / tp`` of them: a Hugging Face
    config's counts, and a module of the plan's layers that says its own (``num_heads``, ``n_heads``, ... or a
    ``head_dim`` its column-split layers' output features, split ``tp`` ways, do not hold whole)."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ParallelConfigError(f"config key 'parallel.tp': {tp} does not divide the model's {heads} attention "
                                      f"heads ({attr}); choose a tp that divides {heads}")
    modules = dict(model.named_modules())
    for name, module in modules.items():
        split = [n for n, style in planned.items() if n.startswith(f"{name}.") and "colwise" in style
                 and isinstance(modules[n], nn.Linear)]
        if not split:
            continue
        for attr in HEAD_COUNTS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
                raise ParallelConfigError(
                    f"config key 'parallel.tp': {tp} does not divide the {heads} attention heads of module {name!r} "
                    f"({attr}), whose layers the plan splits by heads; choose a tp that divides {heads}")
        head_dim = getattr(module, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0:
            for n in split:
                features = modules[n].out_features
                if features % head_dim == 0 and (features // tp) % head_dim:
                    raise ParallelConfigError(
                        f"config key 'parallel.tp': {tp} does not divide the {features // head_dim} attention heads "
                        f"(of {head_dim} features) of module {name!r}: {n!r} has {features} output features; choose a "
                        f"tp that divides {features // head_dim}")


def apply(model: nn.Module, plan: Any, tp_mesh: Any, resolved: bool = False) -> dict[str, str]:
    """Split ``model`` in place by ``plan`` over ``tp_mesh``; returns the resolved ``{module: style}``. A plan
    already ``resolved`` (a pipeline stage's share of the whole model's, see :func:`resolve`) is applied as it is."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not resolved:
        plan = resolve(model, plan, tp_mesh.size())
    styles = _styles()
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in plan.items()})
    out_of_place(model)
    return plan


def out_of_place(model: nn.Module) -> None:
    """In-place activation modules (``nn.ReLU(inplace=True)``, ...) compute out of place: a split layer hands
    on a view of its DTensor's local piece, which autograd forbids changing in place. Same values, one
    activation-sized buffer more."""
    for module in model.modules():
        if isinstance(getattr(module, "inplace", None), bool) and module.inplace:
            module.inplace = False
