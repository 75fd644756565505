"""The rules of values a key may declare (see :func:`torchrig.config.key`), built from a few parts.

A rule's ``expect`` text completes "expected ..." in the error message and is what ``torchrig config``
and the README show; its ``check`` returns the normalised value. Values reach a rule already converted
to the key's annotated type where they could be (``"3"`` -> 3 for an int key).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from . import files
from .schema import ConfigError, Refused, Rule


def accept(ok: bool, value: Any, detail: str = "") -> Any:
    """``value`` when ``ok``, else a ValueError (whose ``detail`` the message shows in brackets)."""
    if not ok:
        raise ValueError(detail) if detail else ValueError
    return value


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, hi: Optional[int] = None) -> Rule:
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return Rule(text, lambda v: accept(is_int(v) and v >= lo and (hi is None or v <= hi), v))


def number(lo: float, hi: Optional[float] = None, *, lo_open: bool = False, hi_open: bool = False,
           finite: bool = True) -> Rule:
    """A float (ints accepted); NaN never, infinity only with ``finite=False``."""
    if hi is None:
        bound = f"{'>' if lo_open else '>='} {lo:g}"
        text = f"a finite number {bound}" if finite else f"a number {bound} or inf"
    else:
        text = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def check(v: Any) -> float:
        if isinstance(v, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError
        v = float(v)
        ok = not math.isnan(v) and (not finite or math.isfinite(v)) and (v > lo if lo_open else v >= lo)
        return accept(ok and (hi is None or (v < hi if hi_open else v <= hi)), v)

    return Rule(text, check)


def optional(rule: Rule) -> Rule:
    return Rule(f"{rule.expect} or null", lambda v: None if v is None else rule.check(v))


def or_auto(rule: Rule, text: Optional[str] = None) -> Rule:
    return Rule(text or f"{rule.expect} or 'auto'", lambda v: v if v == "auto" else rule.check(v))


def choice(*options: str) -> Rule:
    return Rule(f"one of {', '.join(options)}", lambda v: accept(v in options, v))


def pattern(text: str, regex: str) -> Rule:
    return Rule(text, lambda v: accept(isinstance(v, str) and re.fullmatch(regex, v) is not None, v))


def list_of(rule: Rule, text: str) -> Rule:
    return Rule(text, lambda v: [rule.check(x) for x in accept(isinstance(v, (list, tuple)), v)])


def pair(item: Rule, text: str) -> Rule:
    """Two values; strings such as ``0.9,0.99`` from the command line become numbers."""
    def check(v: Any) -> tuple:
        accept(isinstance(v, (list, tuple)) and len(v) == 2, v)
        return tuple(item.check(parse_scalar(x) if isinstance(x, str) else x) for x in v)

    return Rule(text, check)


def mapping_of(rule: Optional[Rule], text: str) -> Rule:
    def check(v: Any) -> dict:
        accept(isinstance(v, dict) and all(isinstance(k, str) and k for k in v), v)
        return {k: rule.check(x) for k, x in v.items()} if rule else v

    return Rule(text, check)


def kind(text: str, *types: type) -> Rule:
    """Any value of ``types`` (no range): for keys whose values the type says all about."""
    return Rule(text, lambda v: accept(isinstance(v, types), v))


def at_least(low: float, text: str = "an integer") -> Rule:
    """A number of at least ``low``, refused as ``must be at least LOW, got VALUE``."""
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError
        if v < low:
            raise Refused(f"must be at least {low}, got {v}")
        return v

    return Rule(f"{text} >= {low}", check)


def one_of(*options: Any) -> Rule:
    """One of ``options``, refused as ``VALUE is not one of A, B``."""
    listed = ", ".join(str(o) for o in options)

    def check(v: Any) -> Any:
        if v not in options or isinstance(v, bool):
            raise Refused(f"{v!r} is not one of {listed}")
        return v

    return Rule(f"one of {listed}", check)


BOOL = Rule("true or false", lambda v: accept(isinstance(v, bool), v))
TEXT = Rule("a non-empty string", lambda v: accept(isinstance(v, str) and v.strip() != "", v))
POSITIVE = number(0, lo_open=True)
MAPPING = mapping_of(None, "a mapping")
AUTO_BOOL = or_auto(BOOL, "true, false or 'auto'")


def parse_scalar(text: str) -> Any:
    """Parse a ``--set`` value the way YAML would (numbers, booleans, null, lists); empty text stays
    empty text (a key that accepts null says so: ``KEY=null``)."""
    import yaml

    if not text.strip():
        return text
    try:
        return files.parse_yaml(text, text if len(text) <= 60 else text[:57] + "...", "the value", ConfigError)
    except yaml.YAMLError:
        return text
