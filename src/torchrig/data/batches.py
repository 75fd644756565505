"""What a batch holds and how it reaches a model's ``forward``.

A tuple ``(x, y)`` / ``(x1, …, xn, y)`` is inputs then target; a dict's target is
``batch[data.label_key]`` (default: the first of ``labels``, ``label``, ``target``, ``targets``, ``y``
present). The other keys of a dict reach ``forward`` through :func:`forward_arguments`, chosen once per
(forward, batch keys) from ``forward``'s signature or ``data.input_keys``. The rules in full, with the
model outputs they go with, are in ``trainer/outputs.py``'s docstring.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..errors import TorchrigError
from ..runtime.modules import unwrap

LABEL_KEYS = ("labels", "label", "target", "targets", "y")


class BatchError(TorchrigError, TypeError):
    """A batch that does not fit the model or the loss (its keys, the inputs' shape or dtype, the targets);
    the message names both sides and what to change."""


def describe(value: Any) -> str:
    """``float64 (64, 5)`` for a tensor; the same per element of a tuple or per key of a dict."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__



def batch_size_of(batch: Any) -> int:
    if isinstance(batch, (list, tuple)) and batch:  # the usual (inputs, target): the inputs' length
        batch = batch[0]
        if isinstance(batch, torch.Tensor) and batch.ndim:
            return batch.shape[0]
        return batch_size_of(batch)
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


@dataclass(frozen=True)
class Signature:
    """What ``forward`` accepts, read once per forward function."""

    text: str  # "forward(x, mask=None)"
    positional: tuple  # names that may be given by position, in order
    required: int  # positional parameters without a default
    keywords: frozenset  # names that may be given by keyword
    var_positional: bool
    var_keyword: bool

    def accepts(self, name: str) -> bool:
        return self.var_keyword or name in self.keywords


_SIGNATURES: dict = {}
_PLANS: dict = {}


def signature(model: Callable) -> Signature:
    """The signature of the user's ``forward`` (under DDP / DataParallel / ``torch.compile`` wrappers)."""
    module = unwrap(model) if isinstance(model, nn.Module) else model
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper
    forward = module.forward if isinstance(module, nn.Module) else module
    fn = getattr(forward, "__func__", forward)
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = _describe(forward)
    return sig


def _describe(forward: Callable) -> Signature:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: accept anything
        return Signature("forward(*args, **kwargs)", (), 0, frozenset(), True, True)
    P = inspect.Parameter
    positional = tuple(p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD))
    required = sum(1 for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
                   and p.default is P.empty)
    keywords = frozenset(p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY))
    shown = ", ".join(str(p.replace(annotation=P.empty)) for p in params)
    return Signature(f"forward({shown})", positional, required, keywords,
                     any(p.kind is P.VAR_POSITIONAL for p in params), any(p.kind is P.VAR_KEYWORD for p in params))


def split_batch(batch: Any, label_key: Optional[str] = None) -> tuple[Any, Any]:
    """``(inputs, target)`` of a training batch: ``(x, y)``, ``(x1, …, xn, y)``, a dict, or ``x`` alone."""
    if isinstance(batch, (list, tuple)):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
        return tuple(batch[:-1]), batch[-1]
    if isinstance(batch, dict):
        key = label_of(batch, label_key)
        if key is None:
            return batch, None
        return {k: v for k, v in batch.items() if k != key}, batch[key]
    return batch, None


def label_of(batch: dict, label_key: Optional[str] = None) -> Optional[str]:
    """The target's key in a dict batch: ``label_key`` if present, else the first of LABEL_KEYS present."""
    if label_key is not None:
        return label_key if label_key in batch else None
    for key in LABEL_KEYS:
        if key in batch:
            return key
    return None


def label_keyword(model: Callable, label_key: Optional[str] = None) -> Optional[str]:
    """The keyword under which ``forward`` takes the target, or None: ``data.label_key`` when
    ``forward`` accepts it (``**kwargs`` too), else the first of LABEL_KEYS that is a parameter of
    ``forward`` (``labels`` for Hugging Face models, whatever the batch calls its target)."""
    sig = signature(model)
    if label_key is not None:
        return label_key if sig.accepts(label_key) else None
    return next((k for k in LABEL_KEYS if k in sig.keywords), None)


def forward_arguments(model: Callable, inputs: dict, input_keys: Optional[tuple] = None,
                      labels: Optional[tuple] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``forward`` from a dict batch without its target (see the module docstring).

    ``labels`` is ``(keyword, target)`` to pass as well (see :func:`label_keyword`). The choice is
    made once per (forward, batch keys) and cached: a step pays one dict lookup.
    """
    sig = signature(model)
    names = tuple(inputs)
    label_name = labels[0] if labels is not None else None
    cache_key = (id(sig), names, input_keys, label_name)  # signatures live as long as _SIGNATURES
    plan = _PLANS.get(cache_key)
    if plan is None:
        plan = _PLANS[cache_key] = _plan(sig, names, input_keys, label_name)
    by_position, keys = plan
    if by_position:
        return tuple(inputs[k] for k in keys), {}
    kwargs = {k: inputs[k] for k in keys}
    if label_name is not None:
        kwargs[label_name] = labels[1]
    return (), kwargs


def _plan(sig: Signature, names: tuple, input_keys: Optional[tuple], label_name: Optional[str]) -> tuple[bool, tuple]:
    """(by position?, keys): how a dict batch with keys ``names`` reaches ``forward``; checked against it."""
    if input_keys is not None:
        missing = [k for k in input_keys if k not in names]
        if missing:
            raise BatchError(f"data.input_keys={list(input_keys)}: the batch has no key {missing[0]!r} "
                             f"(batch keys: {list(names)}); set data.input_keys to keys of the batch")
        keys = tuple(input_keys)
        by_position = not all(sig.accepts(k) for k in keys)
    else:
        accepted = tuple(k for k in names if sig.accepts(k))
        by_position = not accepted and len(names) == 1
        keys = names if by_position else accepted
    given = set() if by_position else set(keys) | ({label_name} if label_name else set())
    count = len(keys) if by_position else 0
    positional_ok = sig.var_positional or count <= len(sig.positional)
    missing_required = [p for p in sig.positional[count:sig.required] if p not in given]
    if not keys or not positional_ok or missing_required:
        why = f": no value for {missing_required[0]!r}" if missing_required and keys else ""
        raise BatchError(f"dict batch with keys {list(names)} (besides the label) does not fit {sig.text}{why}; "
                         f"set data.input_keys to the batch keys forward takes, in order, and data.label_key "
                         f"to the target's key")
    return by_position, keys


def predict_inputs(model: Callable, batch: Any, label_key: Optional[str] = None) -> Any:
    """The inputs of a prediction batch: every element of a tuple ``forward`` needs, no target."""
    if isinstance(batch, (list, tuple)):
        if len(batch) == 1:
            return batch[0]
        if signature(model).required >= len(batch):
            return tuple(batch)
        return batch[0] if len(batch) == 2 else tuple(batch[:-1])
    if isinstance(batch, dict):
        key = label_of(batch, label_key)
        return {k: v for k, v in batch.items() if k != key} if key is not None else batch
    return batch
