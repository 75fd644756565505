"""What torchrig takes from a checkpoint's ``meta.json``, field by field, each by its rule.

``meta.json`` comes with the checkpoint, so it is a stranger's file like the rest of it: a layout of
``dp_replicate: 10**18`` or ``pp: 0`` would be printed and compared as if it were a job's. Each field that
a load uses is checked here when the file is read (:func:`check_fields`); a field that breaks its rule
raises a ``ValueError`` whose text names the field, the value and the rule (the reader adds the file and
what to do). Fields no load uses (``epoch``, ``precision``, ``saved_at`` …) are not looked at. The
``checksums`` record is checked by the reader of each file (``io.recorded_checksum``), which alone knows
whether checking is on (``checkpoint.verify``).
"""

from __future__ import annotations

import re
from typing import Any

MAX_PROCESSES = 1 << 20  # a degree or a world size: no job has more processes
MAX_STEP = 1 << 53  # a step count (exact as a float, as JSON readers elsewhere hold it)
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")  # a layout's degrees (parallel.mesh.DEGREES, which writes them)
STRATEGIES = ("none", "ddp", "fsdp", "dp")  # the data-parallel wrapper a checkpoint was saved under
CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")  # one file's record in ``checksums``
_HEX = re.compile(r"[0-9a-f]{64}")
WEIGHTS = ("all", "trainable")  # what model.safetensors holds: every tensor, or an adapted model's trainable ones


def shown(value: Any, width: int = 80) -> str:
    """``value`` as JSON would show it, cut to ``width`` characters (a stranger's value may be megabytes long)."""
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    return text if len(text) <= width else text[:width] + "…"


def _bad(field: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"field '{field}' is {shown(value)}, {rule}")


def _count(field: str, value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, value, f"not {what} (an integer from {low} to {high})")
    return value


def check_fields(meta: dict) -> None:
    """Raise ``ValueError`` naming the first used field of ``meta`` that breaks its rule."""
    if "step" in meta:
        _count("step", meta["step"], 0, MAX_STEP, "a step count")
    if "world_size" in meta:
        _count("world_size", meta["world_size"], 1, MAX_PROCESSES, "a number of processes")
    if "layout" in meta:
        _check_layout(meta["layout"], meta.get("world_size"))
    if "strategy" in meta and meta["strategy"] not in STRATEGIES:
        raise _bad("strategy", meta["strategy"], f"not one of {', '.join(STRATEGIES)}")
    if "optimizer_keys" in meta and meta["optimizer_keys"] != "by_name":
        raise _bad("optimizer_keys", meta["optimizer_keys"], "not 'by_name' (the one way torchrig keys them)")
    if "factories" in meta:
        _check_factories(meta["factories"])
    if "weights" in meta and meta["weights"] not in WEIGHTS:
        raise _bad("weights", meta["weights"], f"not one of {', '.join(WEIGHTS)}")
    if "base" in meta:
        _check_base(meta["base"])


def _check_base(base: Any) -> None:
    """``{"class": "module:qualname", "sha256": hex, "parameters": count, "config": mapping or null}``: the identity
    of the base model an adapted checkpoint's adapters belong to."""
    if not isinstance(base, dict):
        raise _bad("base", base, "not a mapping of class, config, sha256 and parameters")
    if not isinstance(base.get("sha256"), str) or not _HEX.fullmatch(base["sha256"]):
        raise _bad("base.sha256", base.get("sha256"), "not a sha256 (64 hexadecimal digits)")
    if not isinstance(base.get("class"), str):
        raise _bad("base.class", base.get("class"), "not a string")
    _count("base.parameters", base.get("parameters"), 0, MAX_STEP, "a parameter count")
    if base.get("config") is not None and not isinstance(base["config"], dict):
        raise _bad("base.config", base["config"], "not a mapping (a Hugging Face config) or null")


def _check_layout(layout: Any, world_size: Any) -> None:
    """Degrees that are process counts whose product is the layout's (and the checkpoint's) world size; a key of
    a later version is left alone (no load uses it)."""
    if not isinstance(layout, dict):
        raise _bad("layout", layout, "not a mapping of degrees (dp_replicate, dp_shard, cp, tp, pp, world_size)")
    product = 1
    for key in DEGREES:
        if key in layout:
            product *= _count(f"layout.{key}", layout[key], 1, MAX_PROCESSES, "a number of processes")
    if "world_size" in layout:
        own = _count("layout.world_size", layout["world_size"], 1, MAX_PROCESSES, "a number of processes")
        if isinstance(world_size, int) and own != world_size:
            raise _bad("layout.world_size", own, f"not the checkpoint's world_size {world_size}")
        world_size = own
    if isinstance(world_size, int) and product != world_size:
        degrees = " × ".join(f"{k}={layout[k]}" for k in DEGREES if k in layout) or "none"
        raise _bad("layout", {k: layout[k] for k in (*DEGREES, "world_size") if k in layout},
                   f"whose degrees ({degrees}) make {product} processes, not its world size {world_size}")


def _check_factories(factories: Any) -> None:
    """``{config key: {"module": name, "file": path, "sha256": hex}}``: what a factory named by the checkpoint
    is compared with before it is imported."""
    if not isinstance(factories, dict):
        raise _bad("factories", factories, "not a mapping of config keys to the files of their modules")
    for key, record in factories.items():
        if not isinstance(record, dict):
            raise _bad(f"factories.{key}", record, "not a mapping of module, file and sha256")
        for name in ("module", "file", "sha256"):
            if name in record and not isinstance(record[name], str):
                raise _bad(f"factories.{key}.{name}", record[name], "not a string")
        if isinstance(record.get("sha256"), str) and not _HEX.fullmatch(record["sha256"]):
            raise _bad(f"factories.{key}.sha256", record["sha256"], "not a sha256 (64 hexadecimal digits)")


def check_checksums(checksums: Any) -> dict[str, str]:
    """``checksums`` as torchrig writes it: ``{file name in the checkpoint: "sha256:HEX"}``."""
    if not isinstance(checksums, dict):
        raise _bad("checksums", checksums, "not a mapping of the checkpoint's files to their sha256")
    for name, record in checksums.items():
        if not isinstance(record, str) or not CHECKSUM.fullmatch(record):
            raise _bad(f"checksums.{name}", record, "not a checksum ('sha256:' and 64 hexadecimal digits)")
    return checksums
