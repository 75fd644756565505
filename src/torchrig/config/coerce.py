"""A value converted to the type a key is annotated with: ``"3"`` to 3 for an int, ``"a,b"`` to a list,
``"auto"`` kept as a string where the key also takes one. Its rule checks the range afterwards."""

from __future__ import annotations

import os
import types
import typing
from typing import Any, Callable, Union

from .rules import parse_scalar
from .schema import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return value.lower() in ("true", "yes", "on", "1")
    raise ValueError("true or false")


def _to_number(value: Any, tp: type) -> Any:
    """An int (whole floats and numeric strings too) or a float; never a bool."""
    what = "an integer" if tp is int else "a number"
    if isinstance(value, bool):
        raise ValueError(what)
    if isinstance(value, int if tp is int else (int, float)):
        return tp(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    raise ValueError(what)


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError("a string")


def _to_sequence(value: Any, tp: type) -> Any:
    if isinstance(value, str):
        value = parse_scalar(value) if value.strip().startswith("[") else \
            [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError("a list")
    return tp(value)


def _to_dict(value: Any) -> dict:
    if isinstance(value, str):
        value = parse_scalar(value)
    if not isinstance(value, dict):
        raise ValueError("a mapping")
    return dict(value)


_CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    bool: _to_bool, int: lambda v: _to_number(v, int), float: lambda v: _to_number(v, float), str: _to_str,
    list: lambda v: _to_sequence(v, list), tuple: lambda v: _to_sequence(v, tuple), dict: _to_dict,
}


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        # Try exact type matches first so "auto" stays a str and 4 stays an int.
        for arg in sorted(args, key=lambda a: 0 if isinstance(value, a if isinstance(a, type) else object) else 1):
            if arg is not type(None):
                try:
                    return coerce(value, arg, key)
                except ConfigError:
                    pass
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")
    if isinstance(value, os.PathLike):  # run_dir=Path(...) from Python code
        value = os.fspath(value)
    convert = _CONVERTERS.get(tp)
    if convert is None:  # Any, or a type without a converter
        return value
    try:
        return convert(value)
    except ValueError as exc:
        raise ConfigError(f"config key '{key}': expected {exc}, got {value!r}") from None
