"""How a config key is declared: once, beside its dataclass field.

A key's field holds its type (the annotation), its default, and in ``key(...)`` the rule of the values
it accepts, its one-line help and the Trainer keywords that set it (its aliases)::

    lr: float = key(1e-3, POSITIVE, "learning rate of every parameter group", alias="lr")

Everything else is derived from these declarations: the checks of :func:`torchrig.config.validate`,
the Trainer's keyword table, ``torchrig config`` and the README's configuration reference.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, Callable, NamedTuple, Optional, Union

from ..errors import TorchrigError

SPEC = "torchrig"  # the key of a field's metadata that holds its KeySpec


class ConfigError(TorchrigError, ValueError):
    """A bad configuration key or value; the message names the key, the value and the fix."""


class Refused(TorchrigError, ValueError):
    """Raised by a rule's check to say in its own words why a value is refused: the message follows
    ``config key 'KEY': `` (e.g. ``must be at least 1, got 0``)."""


class Rule(NamedTuple):
    """What a key accepts: ``expect`` completes "expected ...", ``check`` returns the (normalised)
    value or raises ValueError / TypeError; a ValueError's argument is shown after the value."""

    expect: str
    check: Callable[[Any], Any]


class KeySpec(NamedTuple):
    rule: Rule
    help: str
    aliases: tuple[str, ...]


class Key(NamedTuple):
    """One declared key, as the listings and the checks see it."""

    name: str  # dotted: "optim.lr"
    type: Any
    default: Any  # dataclasses.MISSING for a field without a default
    rule: Optional[Rule]  # None only in a section whose fields are plain dataclass fields
    help: str
    aliases: tuple[str, ...]


def key(default: Any, rule: Rule, help: str, *, alias: Union[str, tuple[str, ...]] = ()) -> Any:
    """A dataclass field declaring a config key: its default, the rule of its values, its one-line
    help and the Trainer keywords (``alias``) that set it. A list or dict default is copied for
    every instance."""
    aliases = (alias,) if isinstance(alias, str) else tuple(alias)
    meta = {SPEC: KeySpec(rule, help, aliases)}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """The annotated types of the fields of ``cls`` (evaluated once: annotations are strings here)."""
    return typing.get_type_hints(cls)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def keys_of(cls: type, prefix: str = "") -> list[Key]:
    """The keys the dataclass ``cls`` declares, in declaration order, named ``prefix + name``; fields that
    are sections themselves (dataclasses) are not keys."""
    types = hints(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        if is_section(types[f.name]):
            continue
        spec = f.metadata.get(SPEC)
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append(Key(prefix + f.name, types[f.name], default, spec.rule if spec else None,
                       spec.help if spec else "", spec.aliases if spec else ()))
    return out


def rule_of(cls: type, name: str) -> Optional[Rule]:
    """The rule of the key ``name`` of the dataclass ``cls`` (None for a plain field)."""
    spec = next((f.metadata.get(SPEC) for f in dataclasses.fields(cls) if f.name == name), None)
    return spec.rule if spec else None


def refusal(name: str, rule: Rule, shown: Any, detail: str = "") -> ConfigError:
    return ConfigError(f"config key '{name}': expected {rule.expect}, got {shown!r}{detail}")


_AS_GIVEN = object()


def check_value(name: str, rule: Optional[Rule], value: Any, shown: Any = _AS_GIVEN) -> Any:
    """``value`` normalised by ``rule`` (unchanged without one), or a ConfigError naming the key
    ``name``, the value as the user wrote it (``shown``) and what is accepted."""
    if rule is None:
        return value
    try:
        return rule.check(value)
    except Refused as exc:
        raise ConfigError(f"config key '{name}': {exc}") from None
    except (ValueError, TypeError) as exc:
        detail = f" ({exc.args[0]})" if isinstance(exc, ValueError) and exc.args else ""
        raise refusal(name, rule, value if shown is _AS_GIVEN else shown, detail) from None
