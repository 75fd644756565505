"""The model summary printed at the start of a run (``log.summary``) and by ``torchrig summary CONFIG``.

One table, 80 columns wide: each top-level module (``named_children``), its type, its parameters, how many
of them train and how many are frozen (``requires_grad=False``), and its size (parameters and buffers) in
MB; then the totals and an estimate of the memory one process holds for the weights, their gradients and
the optimizer's state. A parameter shared by two modules (tied weights) is counted once, where first seen.

The estimate counts what the optimizer keeps per trainable parameter, read from the optimizer built for
the run (Adam / AdamW: two moments, three with ``amsgrad``; SGD: a momentum buffer when momentum > 0;
RMSprop: the square average, plus momentum and the mean gradient when set; Adagrad: the sum; Adadelta,
Adamax, NAdam, RAdam: two), in the parameters' dtype. Under ``precision`` bf16 / fp16 autocast runs the
forward in half precision but the weights, gradients and optimizer state stay float32, so the estimate
is the same; activations (which depend on the batch) are not counted. Under FSDP2 each process holds
its shard: the estimate is divided by the number of processes.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

from .. import runtime

MB = 1024 ** 2
MAX_ROWS = 12  # top-level modules listed one per row; the rest share one row

# optimizer class name -> (state tensors per parameter, as a function of its param group)
_STATES = {
    "adam": lambda g: 3 if g.get("amsgrad") else 2,
    "adamw": lambda g: 3 if g.get("amsgrad") else 2,
    "sgd": lambda g: 1 if g.get("momentum", 0) else 0,
    "rmsprop": lambda g: 1 + bool(g.get("momentum", 0)) + bool(g.get("centered")),
    "adagrad": lambda g: 1,
    "adadelta": lambda g: 2,
    "adamax": lambda g: 2,
    "nadam": lambda g: 2,
    "radam": lambda g: 2,
}


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held(tensors: Iterable[Any]) -> int:
    """The bytes this process holds of ``tensors``: a DTensor's local piece (FSDP2 shards, tensor-parallel halves)."""
    return _nbytes(runtime.local_tensor(t) for t in tensors)


def _count(n: int) -> str:
    return f"{n:,}"


def size(nbytes: float) -> str:
    """``512 B``, ``120.7 KB``, ``1.18 MB``, ``12.3 MB``, ``1.52 GB`` (powers of 1024)."""
    if nbytes >= 1024 * MB:
        return f"{nbytes / (1024 * MB):.2f} GB"
    if nbytes >= MB:
        return f"{nbytes / MB:.2f} MB" if nbytes < 10 * MB else f"{nbytes / MB:.1f} MB"
    return f"{nbytes / 1024:.1f} KB" if nbytes >= 1024 else f"{int(nbytes)} B"


def _rows(model: nn.Module) -> list[list]:
    """[name, type, params, trainable, frozen, bytes] per top-level module, each parameter counted once."""
    seen: set[int] = set()

    def tally(name: str, kind: str, params: Iterable[nn.Parameter], buffers: Iterable[Any]) -> list:
        own = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in own)
        trainable = sum(p.numel() for p in own if p.requires_grad)
        total = sum(p.numel() for p in own)
        return [name, kind, total, trainable, total - trainable, _nbytes(own) + _nbytes(buffers)]

    children = list(model.named_children())
    if not children:
        return [tally("(whole model)", type(model).__name__, model.parameters(), model.buffers())]
    rows = [tally(name, getattr(child, "summary_kind", type(child).__name__), child.parameters(), child.buffers())
            for name, child in children]  # summary_kind: a pipeline's stand-in for a module another stage holds
    direct = list(model.parameters(recurse=False))
    if direct:
        rows.append(tally("(own parameters)", "Parameter", direct, model.buffers(recurse=False)))
    return rows


def optimizer_state(optimizers: Any, model: nn.Module) -> tuple[Optional[int], str]:
    """(bytes of optimizer state, the optimizers' names); None when an optimizer's state is not known."""
    if optimizers is None:
        return None, "no optimizer"
    items = optimizers.values() if isinstance(optimizers, dict) else [optimizers]
    total, names = 0, []
    for opt in items:
        name = type(opt).__name__
        names.append(name.lower())
        states = _STATES.get(name.lower())
        if states is None:
            return None, name
        for group in opt.param_groups:
            total += states(group) * _held(p for p in group["params"] if p.requires_grad)
    return total, "+".join(dict.fromkeys(names))


def model_summary(model: nn.Module, optimizers: Any = None, precision: str = "fp32", shards: int = 1,
                  ema: bool = False, layout: str = "", whole: Optional[int] = None) -> str:
    """The summary table (fits 80 columns) and the memory estimate of one process: ``1/shards`` of plain tensors
    (FSDP2 about to shard them), the local pieces of DTensors, and ``layout`` (``tp=2 × pp=2``) named when the model
    is split. ``whole``: the parameters of the whole model when ``model`` holds only this process's pipeline stages
    (the header gives both; the table is this process's)."""
    rows = _rows(model)
    if len(rows) > MAX_ROWS:
        rest = rows[MAX_ROWS - 1:]
        rows = rows[:MAX_ROWS - 1] + [[f"… {len(rest)} more", "", *(sum(r[i] for r in rest) for i in range(2, 6))]]
    staged = whole is not None and whole != sum(r[2] for r in rows)
    total = ["this process" if staged else "total", "", *(sum(r[i] for r in rows) for i in range(2, 6))]
    params = [p for p in model.parameters()]
    trainable = total[3]
    head = f"torchrig: model {type(model).__name__} · " + (
        f"{_count(whole)} parameters; this process's stages hold {_count(total[2])}" if staged
        else f"{_count(total[2])} parameters")
    head += ", all trainable" if total[4] == 0 else f" ({_count(trainable)} trainable, {_count(total[4])} frozen)"
    lines = _wrap(head + f" · {size(total[5])}", 80)
    table = [["module", "type", "params", "trainable", "frozen", "size"]]
    for r in rows + [total]:
        table.append([_cut(r[0], 22), _cut(r[1], 16), _count(r[2]), _count(r[3]), _count(r[4]), size(r[5])])
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    for row in table:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(("  " + "  ".join(cells)).rstrip())
    lines += _memory(model, params, optimizers, precision, shards, ema, layout)
    return "\n".join(lines)


def memory_figures(model: nn.Module, optimizers: Any = None, ema: bool = False) -> dict:
    """The bytes this process holds for ``model``: ``weights``, ``gradients`` (of the trainable parameters),
    ``optimizer`` (None when not known; ``optimizer_name`` says which), ``ema`` (0 without one) and ``total``; the
    local pieces of DTensors (FSDP2 shards, tensor-parallel halves), a pipeline rank's own stages."""
    params = list(model.parameters())
    state, names = optimizer_state(optimizers, model)
    out = {"weights": _held(params), "gradients": _held(p for p in params if p.requires_grad), "optimizer": state,
           "optimizer_name": names,
           "ema": _held(params) + _held(b for b in model.buffers() if b.is_floating_point()) if ema else 0}
    out["total"] = out["weights"] + out["gradients"] + (state or 0) + out["ema"]
    return out


def _memory(model: nn.Module, params: list, optimizers: Any, precision: str, shards: int, ema: bool,
            layout: str) -> list[str]:
    if any(hasattr(p, "to_local") for p in params):  # sharded or split already: count what this process holds
        shards, where = 1, f"per process ({layout or 'FSDP2'}: this process's part)"
    else:
        where = "per process" + (f" (FSDP2: 1/{shards} each)" if shards > 1 else f" ({layout}: this process's part)"
                                 if layout else "")
    held = memory_figures(model, optimizers, ema)
    state, names, total = held["optimizer"], held["optimizer_name"], held["total"]
    parts = [f"weights {size(held['weights'] / shards)}", f"gradients {size(held['gradients'] / shards)}"]
    if state is not None:
        parts.append(f"{names} state {size(state / shards)}")
    if ema:
        parts.append(f"EMA {size(held['ema'] / shards)}")
    first = f"memory {where}: " + " + ".join(parts) + f" = {size(total / shards)}"
    base = _low_precision_base(params, shards)
    kept = "what trains, its gradients and optimizer state stay fp32; " if base else \
        f"{precision} autocast keeps weights, gradients and optimizer state fp32; "
    note = base + (f"{names} state not estimated; " if state is None else "") + (kept if precision != "fp32" else "")
    return _wrap(first + "; " + note + "activations not counted", 80)


def _low_precision_base(params: list, shards: int) -> str:
    """``frozen weights in bf16: 12.3 MB (fp32 would take 24.6 MB; 12.3 MB saved); ``: a frozen base kept in half
    precision (``peft.base_dtype``) while what trains stays fp32; "" otherwise."""
    low = [p for p in params if not p.requires_grad and p.is_floating_point() and p.element_size() < 4]
    if not low:
        return ""
    held = _held(low)
    full = sum(runtime.local_tensor(p).numel() * 4 for p in low)
    kinds = "/".join(sorted({str(p.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
                             for p in low}))
    return (f"frozen weights in {kinds}: {size(held / shards)} (fp32 would take {size(full / shards)}; "
            f"{size((full - held) / shards)} saved); ")


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, never between a number and its unit (``74.8 KB``)."""
    import re
    import textwrap

    kept = re.sub(r"(\d) (B|KB|MB|GB)\b", "\\1\x00\\2", text)
    return [line.replace("\x00", " ") for line in
            textwrap.wrap(kept, width=width, subsequent_indent="  ", break_on_hyphens=False)]
