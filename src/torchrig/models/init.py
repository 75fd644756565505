"""``model.init``: re-initialise Conv / ConvTranspose / Linear layers with ``Module.apply``.

Spec strings (case-insensitive)::

    xavier_uniform              xavier_normal            kaiming_normal         kaiming_uniform
    normal(0, 0.02)             uniform(-0.1, 0.1)       orthogonal             trunc_normal(0, 0.02)
    kaiming_normal(mode=fan_out, nonlinearity=relu)      xavier_uniform(gain=1.4)

followed by an optional ``; bias=VALUE`` (``constant(VALUE)`` works too) for the biases, which are
otherwise set to 0. Only weights of Conv*d, ConvTranspose*d and Linear layers are touched:
normalisation layers and embeddings keep their own initialisation.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import nn

from ..errors import TorchrigError, suggest


class InitError(TorchrigError, ValueError):
    """A ``model.init`` string that cannot be parsed; the message shows the accepted forms."""


LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)

# name -> (init function, positional parameter names)
_METHODS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "xavier_uniform": (nn.init.xavier_uniform_, ("gain",)),
    "xavier_normal": (nn.init.xavier_normal_, ("gain",)),
    "kaiming_uniform": (nn.init.kaiming_uniform_, ("a", "mode", "nonlinearity")),
    "kaiming_normal": (nn.init.kaiming_normal_, ("a", "mode", "nonlinearity")),
    "normal": (nn.init.normal_, ("mean", "std")),
    "uniform": (nn.init.uniform_, ("a", "b")),
    "trunc_normal": (nn.init.trunc_normal_, ("mean", "std", "a", "b")),
    "orthogonal": (nn.init.orthogonal_, ("gain",)),
    "constant": (nn.init.constant_, ("val",)),
    "zeros": (nn.init.zeros_, ()),
}

_FORMS = "e.g. 'xavier_uniform', 'kaiming_normal(mode=fan_out)', 'normal(0, 0.02)' or 'xavier_uniform; bias=0.01'"


def _value(text: str) -> Any:
    text = text.strip().strip("'\"")
    try:
        return float(text) if any(c in text for c in ".eE") or not text.lstrip("-").isdigit() else int(text)
    except ValueError:
        return text


def _parse_call(text: str, spec: str) -> tuple[str, dict]:
    m = re.fullmatch(r"\s*([a-zA-Z_]+)\s*(?:\((.*)\))?\s*", text)
    if not m:
        raise InitError(f"model.init {spec!r} is not understood; {_FORMS}")
    name, args = m.group(1).lower().rstrip("_"), m.group(2)
    if name not in _METHODS:
        listing = f"Valid methods: {', '.join(_METHODS)}"
        raise InitError(f"model.init: unknown method '{name}'{suggest(name, _METHODS, listing=listing)}")
    fn, positional = _METHODS[name]
    kwargs: dict = {}
    if args and args.strip():
        for i, part in enumerate(a for a in args.split(",") if a.strip()):
            if "=" in part:
                k, v = part.split("=", 1)
                kwargs[k.strip()] = _value(v)
            elif i < len(positional):
                kwargs[positional[i]] = _value(part)
            else:
                raise InitError(f"model.init {spec!r}: '{name}' takes at most {len(positional)} positional "
                                f"argument(s) ({', '.join(positional) or 'none'})")
    unknown = set(kwargs) - set(positional)
    if unknown:
        raise InitError(f"model.init {spec!r}: '{name}' has no argument(s) {sorted(unknown)}; "
                        f"valid: {', '.join(positional) or 'none'}")
    try:  # validate the arguments once, on a scratch tensor
        fn(torch.empty(4, 4), **kwargs)
    except (TypeError, ValueError) as exc:
        raise InitError(f"model.init {spec!r}: bad arguments for '{name}' ({exc})") from None
    return name, kwargs


def parse_init(spec: str) -> tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], Any]]:
    """(weight initialiser, bias initialiser) for a spec string."""
    weight_part, _, bias_part = spec.partition(";")
    name, kwargs = _parse_call(weight_part, spec)
    fn = _METHODS[name][0]
    bias_value = 0.0
    if bias_part.strip():
        m = re.fullmatch(r"\s*bias\s*=\s*(?:constant\s*\(\s*([^)]*)\)|([^\s]+))\s*", bias_part)
        if not m:
            raise InitError(f"model.init {spec!r}: the part after ';' must be bias=VALUE or bias=constant(VALUE)")
        raw = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            bias_value = float(raw)
        except ValueError:
            raise InitError(f"model.init {spec!r}: bias value {raw!r} is not a number") from None
    return (lambda w: fn(w, **kwargs)), (lambda b: nn.init.constant_(b, bias_value))


def apply_init(model: nn.Module, spec: str) -> int:
    """Initialise every Conv / ConvTranspose / Linear of ``model``; returns how many layers."""
    weight_init, bias_init = parse_init(spec)
    count = 0

    def visit(m: nn.Module) -> None:
        nonlocal count
        if isinstance(m, LAYERS):
            with torch.no_grad():
                weight_init(m.weight)
                if m.bias is not None:
                    bias_init(m.bias)
            count += 1

    model.apply(visit)
    return count


def normal_init_(model: nn.Module, std: float = 0.02) -> None:
    """The DCGAN / pix2pix initialisation: conv weights N(0, std), norm weights N(1, std), biases 0."""

    def visit(m: nn.Module) -> None:
        if isinstance(m, LAYERS):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and m.affine:
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.zeros_(m.bias)

    with torch.no_grad():
        model.apply(visit)


__all__ = ["InitError", "apply_init", "parse_init", "normal_init_"]
