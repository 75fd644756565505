"""Trainer keywords: the objects it takes as they are, and the config keys they set."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import config as C
from ..errors import suggest


def _apply_kwargs(cfg: C.Config, kwargs: dict) -> None:
    top = {f.name for f in dataclasses.fields(cfg)}
    aliases = C.aliases()  # Trainer keyword -> config key, as the keys declare them
    for key, value in kwargs.items():
        dotted = aliases.get(key, key)
        if dotted not in top and dotted == key:
            keyword = {v: k for k, v in aliases.items()}  # a dotted key -> its Trainer keyword, when it has one
            near = [keyword.get(n, n) for n in C.near_keys(key)]
            hint = (f"; did you mean {' or '.join(_python(n) for n in near)}?" if near
                    else suggest(key, sorted(top | set(aliases))))
            raise TypeError(f"Trainer got an unexpected keyword argument '{key}'{hint}")
        C.set_key(cfg, dotted, value)


def _python(name: str) -> str:
    """How a Trainer call names a key: ``lr``, or ``**{"log.every_steps": ...}`` for a dotted key."""
    return f"**{{{name!r}: ...}}" if "." in name else repr(name)


def resolve_options(config: Optional[C.Config], given: dict[str, Any], kwargs: dict) -> tuple[C.Config, dict]:
    """The run's config, and the objects given as such (an optimizer instance, a loss callable …).

    ``given`` holds the ``optimizer``, ``loss``, ``scheduler`` and ``metrics`` arguments: a name
    becomes a config value, anything else is kept as the object to use.
    """
    import copy

    cfg = copy.deepcopy(config) if config is not None else C.Config()
    objects: dict[str, Any] = {}
    kwargs = dict(kwargs)
    for key, value in given.items():
        if value is None:
            continue
        if key != "metrics" and isinstance(value, str):  # optimizer / scheduler: aliases of optim / scheduler.name
            kwargs[key] = value
        elif key == "metrics" and isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value):
            kwargs["metrics"] = list(value)
        else:
            objects[key] = value
    dotted = {k: kwargs.pop(k) for k in list(kwargs) if "." in k}
    _apply_kwargs(cfg, kwargs)
    for k, v in dotted.items():
        C.set_key(cfg, k, v)
    return C.validate(cfg), objects
