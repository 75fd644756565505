"""A Config from defaults, mappings, YAML files and ``--set KEY=VALUE`` overrides, and back to a mapping.

Every value is converted to its key's type and checked by its rule as it is set, so an error names
the key and the value as the user wrote it; :func:`load_config` and :func:`from_dict` end with
:func:`validate`, which adds the checks across keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from ..errors import suggest
from . import files
from .checks import validate
from .coerce import coerce
from .root import Config, names, near_keys, sections
from .rules import parse_scalar
from .schema import ConfigError, check_value, hints, refusal, rule_of


def _suggest(name: str, options: list[str], what: str = "keys", prefix: str = "") -> str:
    """``; did you mean 'optim.lr'?`` (``name`` matched among the bare ``options`` of section ``prefix``), else the
    list of them."""
    return suggest(name, options, cutoff=0.5, prefix=prefix) or f"; valid {what}: {', '.join(sorted(set(options)))}"


def _section_hint(obj: Any, mapping: bool) -> str:
    """An unknown top-level mapping is most likely the section of a recipe not imported yet."""
    import sys

    if not (isinstance(obj, Config) and mapping) or "torchrig.recipes" in sys.modules:
        return ""  # the built-in recipes are registered: the section is just unknown
    return ("; a recipe's own section is known once the recipe is imported: import torchrig.recipes "
            "(the torchrig command and torchrig.load_config do)")


def _apply_mapping(obj: Any, mapping: dict, prefix: str = "") -> None:
    types = hints(type(obj))
    known = names(obj)
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if key not in known:
            near = near_keys(str(key)) if isinstance(obj, Config) else []
            hint = (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near  # a key without its section
                    else _suggest(str(key), known, prefix=prefix))
            raise ConfigError(f"unknown config key '{full}'{hint}{_section_hint(obj, isinstance(value, dict))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{full}': expected a mapping of sub-keys, got {value!r}")
            _apply_mapping(current, value, prefix=f"{full}.")
            continue
        rule = rule_of(type(obj), key)
        try:
            typed = coerce(value, types[key], full)
        except ConfigError:
            if rule is None:
                raise
            raise refusal(full, rule, value) from None  # what the key accepts, not just its type
        setattr(obj, key, check_value(full, rule, typed, shown=value))


def set_key(cfg: Any, dotted: str, value: Any) -> None:
    """Set the key ``dotted`` (``"optim.lr"``) of ``cfg`` to ``value``, checked like a YAML value.

    A string is parsed the way ``--set optim.lr=VALUE`` parses it (``"3"`` is 3, ``"[1, 2]"`` a
    list); an unknown key is a ConfigError naming the closest one. A key inside a mapping value
    (``optim.group_lr.head``) adds or replaces that entry. Call :func:`validate` afterwards for the
    checks that involve several keys.
    """
    parts = dotted.split(".")
    value = parse_scalar(value) if isinstance(value, str) else value
    target = cfg
    for i, part in enumerate(parts[:-1]):
        known = names(target)
        if part not in known or not dataclasses.is_dataclass(getattr(target, part)):
            prefix = ".".join(parts[:i])
            shown = f"{prefix}.{part}" if prefix else part
            if part in known:  # a plain value, but the user addressed a sub-key
                if isinstance(getattr(target, part), dict):
                    getattr(target, part)[".".join(parts[i + 1:])] = value
                    return
                raise ConfigError(f"config key '{shown}' has no sub-key '{parts[i + 1]}'")
            groups = [n for n in known if dataclasses.is_dataclass(getattr(target, n, None))]
            raise ConfigError(f"unknown config section '{shown}'"
                              f"{_suggest(part, groups, 'sections', prefix=shown[:len(shown) - len(part)])}"
                              f"{_section_hint(target, True)}")
        target = getattr(target, part)
    _apply_mapping(target, {parts[-1]: value}, prefix=".".join(parts[:-1]) + "." if len(parts) > 1 else "")


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                base: Optional[dict] = None) -> Config:
    """Build a Config from defaults, an optional mapping, a YAML file and ``KEY=VALUE`` overrides.

    Later sources win: defaults < ``base`` < file < overrides.
    """
    cfg = Config()
    if base:
        _apply_mapping(cfg, base)
    if path is not None:
        _apply_mapping(cfg, read_yaml(path))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example --set optim.lr=0.01)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        set_key(cfg, key, raw)
    return validate(cfg)


def read_yaml(path: str | Path, what: str = "config file",
              missing: str = "pass an existing YAML file or none for the defaults") -> dict:
    """The mapping of a YAML file (``what``: "config file", "search space file" …): a regular file of at most 1 MiB
    whose aliases expand little (see ``files``), or a ConfigError naming the file; ``missing`` says what to do
    when there is none."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} '{p}' does not exist; {missing}")
    if p.is_dir():
        raise ConfigError(f"{what} '{p}' is a directory; pass a YAML file")
    try:
        raw = files.read_regular(p, files.YAML_LIMIT, what, f"pass a YAML {what}", ConfigError)
        data = files.parse_yaml(raw.decode("utf-8"), str(p), what, ConfigError)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what} '{p}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} '{p}' is not a text file (UTF-8 YAML); pass a YAML {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{p}' must hold a mapping of keys, found {type(data).__name__}")
    return data


def to_dict(cfg: Config) -> dict:
    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    out = plain(dataclasses.asdict(cfg))
    out.update({name: plain(dataclasses.asdict(getattr(cfg, name))) for name in sections()})
    return out


def flat_keys(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``: a config mapping by dotted key (as ``--set`` names
    them); lists, empty mappings and other values are kept as they are."""
    out: dict[str, Any] = {}
    for k, v in mapping.items():
        if isinstance(v, dict) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_dict(mapping: dict) -> Config:
    cfg = Config()
    _apply_mapping(cfg, mapping)
    return validate(cfg)
