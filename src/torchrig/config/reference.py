"""The configuration reference, written from the key declarations: ``torchrig config`` and the README's
table (between :data:`BEGIN` and :data:`END`; ``python tools/config_reference.py`` rewrites it)."""

from __future__ import annotations

import textwrap
from typing import Any, Iterable

from ..errors import suggest
from .root import groups
from .schema import ConfigError, Key, keys_of

BEGIN = "<!-- configuration reference: written by tools/config_reference.py from the key declarations -->"
END = "<!-- end of configuration reference -->"


def shown(value: Any) -> str:
    """A default as one would write it in YAML: null, true, [a, b], {} …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return repr(value) if value == "" else str(value)


def _sections(names: Iterable[str]) -> list[tuple[str, str, list[Key]]]:
    """(section, its one-line description, its keys) of every group of keys, or of those ``names``
    (sections or keys) select; an unknown name is a ConfigError naming the closest."""
    out = [(name, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
            keys_of(cls, f"{name}." if name else "")) for name, cls in groups().items()]
    names = list(names)
    every = [k.name for _, _, keys in out for k in keys]
    for name in names:
        if name not in every and not any(k.startswith(f"{name}.") for k in every):
            options = [s for s, _, _ in out if s] + every
            raise ConfigError(f"unknown config key or section '{name}'{suggest(name, options)}")
    if not names:
        return out
    picked = [(s, doc, [k for k in keys if any(k.name == n or k.name.startswith(f"{n}.") for n in names)])
              for s, doc, keys in out]
    return [group for group in picked if group[2]]


def listing(names: Iterable[str] = (), width: int = 80) -> str:
    """The keys of every section, or of the sections and keys ``names``: per key its default and
    Trainer keyword, its help and the values it accepts, wrapped at ``width`` columns."""
    lines: list[str] = []
    indent = " " * 4
    for section, doc, keys in _sections(names):
        lines += [""] if lines else []
        lines.append(f"{section or 'top level'}: {doc.replace('``', '')}")
        for k in keys:
            alias = f"  (Trainer: {', '.join(k.aliases)}=)" if k.aliases else ""
            lines.append(f"  {k.name} = {shown(k.default)}{alias}")
            lines += textwrap.wrap(k.help, width, initial_indent=indent, subsequent_indent=indent)
            lines += textwrap.wrap(f"accepts {k.rule.expect if k.rule else 'any value of its type'}", width,
                                   initial_indent=indent, subsequent_indent=indent + "  ")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """``text`` as it reads in a Markdown table cell (no pipe, tag or emphasis)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def markdown() -> str:
    """The README's reference: one table per section, a row per key."""
    out: list[str] = []
    for section, doc, keys in _sections(()):
        out += [f"**{section or 'Top level'}**: {doc.replace('``', '`')}", "",
                "| key | default | accepts | Trainer keyword | meaning |", "| --- | --- | --- | --- | --- |"]
        for k in keys:
            alias = ", ".join(f"`{a}`" for a in k.aliases)
            rule = k.rule.expect if k.rule else ""
            default = shown(k.default).replace("|", "\\|")  # a code span: only the pipe is escaped
            out.append(f"| `{k.name}` | `{default}` | {_cell(rule)} | {alias} | {_cell(k.help)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def with_table(text: str) -> str:
    """``text`` (the README) with the reference between its markers replaced by :func:`markdown`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no '{BEGIN}' ... '{END}' markers")
    return text[:start + len(BEGIN)] + "\n" + markdown() + text[end:]
