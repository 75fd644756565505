"""The search space: plain YAML keyed by the config keys of ``--set``, checked by the keys' own rules.

::

    optim.lr: {log_uniform: [1e-5, 1e-1]}
    optim.weight_decay: {uniform: [0.0, 1e-3]}
    data.batch_size: {choice: [32, 64, 128]}
    model.options.width: {int: [16, 64], step: 16}

Kinds: ``uniform`` / ``log_uniform`` (floats), ``int`` / ``log_int`` (integers, ``step`` optional for
``uniform`` and ``int``) and ``choice`` (any values; lists such as ``optim.betas`` too). Nested mappings
(``optim: {lr: {log_uniform: [...]}}``) read as the dotted keys. Each bound and each choice is set on a
copy of the config as ``--set`` would set it, so a key that does not exist or a value outside its rule
is refused in one line naming the key, before any trial runs.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from .. import config as C
from ..config.rules import parse_scalar
from ..errors import TorchrigError, suggest

KINDS = ("uniform", "log_uniform", "int", "log_int", "choice")
# Keys torchrig tune sets itself for every trial, or that name the trial's process rather than its training.
NOT_SEARCHED = ("recipe", "run_dir", "resume", "resume_weights_only", "resume_changes", "overwrite",
                "checkpoint.monitor", "checkpoint.mode", "model.factory", "data.factory", "model.python_class")
GRID_LIMIT = 10_000  # grid points of a whole space


class TuneError(TorchrigError, ValueError):
    """A search space, a study or a tuning request that cannot work as given; the message names it."""


@dataclass(frozen=True)
class Param:
    """One searched key: ``kind`` of ``KINDS``, ``low`` / ``high`` (and ``step``) or ``choices``."""

    key: str
    kind: str
    low: Any = None
    high: Any = None
    step: Any = None
    choices: tuple = ()

    def distribution(self) -> Any:
        """The Optuna distribution (choices that are not plain scalars travel as JSON text)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind in ("uniform", "log_uniform"):
            return FloatDistribution(self.low, self.high, log=self.kind == "log_uniform", step=self.step)
        if self.kind in ("int", "log_int"):
            return IntDistribution(self.low, self.high, log=self.kind == "log_int", step=self.step or 1)
        return CategoricalDistribution([_encode(c) for c in self.choices])

    def count(self) -> int:
        """How many values this key takes on a grid, counted without listing them; a continuous range without a
        step has none."""
        if self.kind == "choice":
            return len(self.choices)
        if self.kind in ("int", "log_int"):
            return (self.high - self.low) // (self.step or 1) + 1
        if self.step is not None:
            return int(round((self.high - self.low) / self.step)) + 1
        raise TuneError(f"search space key '{self.key}': the grid sampler needs a finite set of values, and "
                        f"{self.kind} [{self.low}, {self.high}] has none; use {{choice: [...]}}, a step "
                        f"({{uniform: [lo, hi], step: S}}) or --sampler tpe / random")

    def grid(self) -> list:
        """Every value this key takes on a grid (``count`` of them)."""
        if self.kind == "choice":
            return [_encode(c) for c in self.choices]
        if self.kind in ("int", "log_int"):
            return list(range(self.low, self.high + 1, self.step or 1))
        return [self.low + i * self.step for i in range(self.count())]

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (as Optuna stores it) is one this key can take: a choice, or a number in range."""
        if self.kind == "choice":
            return any(type(value) is type(c) and value == c for c in map(_encode, self.choices))
        number = int if self.kind in ("int", "log_int") else (int, float)
        return (isinstance(value, number) and not isinstance(value, bool) and math.isfinite(value)
                and self.low <= value <= self.high)

    def describe(self) -> str:
        if self.kind == "choice":
            return f"choice of {', '.join(map(str, self.choices))}"
        return f"{self.kind} [{self.low}, {self.high}]" + (f" step {self.step}" if self.step is not None else "")


def value_of(raw: Any) -> Any:
    """A sampled value as the config takes it (choices stored as JSON text come back as lists)."""
    if isinstance(raw, str) and raw[:1] in "[{":
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _encode(choice: Any) -> Any:
    if choice is None or isinstance(choice, (bool, int, float, str)):
        return choice
    return json.dumps(choice)


class Space:
    """The searched keys in file order; ``apply`` sets a trial's values on a config."""

    def __init__(self, params: list[Param], source: str = "search space"):
        self.params, self.source = params, source

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def distributions(self) -> dict[str, Any]:
        return {p.key: p.distribution() for p in self.params}

    def grid_size(self) -> int:
        """The points of the grid, counted before any is listed: more than ``GRID_LIMIT`` is refused."""
        total = 1
        for p in self.params:
            total *= p.count()
        if total > GRID_LIMIT:
            raise TuneError(f"{self.source}: the grid has {total} points (more than {GRID_LIMIT}); narrow it or use "
                            f"--sampler tpe / random")
        return total

    def grid(self) -> dict[str, list]:
        self.grid_size()
        return {p.key: p.grid() for p in self.params}

    def check_values(self, values: dict[str, Any], where: str) -> None:
        """Refuse a trial's ``values`` (read back from a study's storage; ``where`` names the trial) unless they
        set exactly this space's keys, each to a value the space can give it."""
        params = {p.key: p for p in self.params}
        for key, value in values.items():
            if key not in params:
                why = ("a key torchrig tune sets itself, never searched" if key in NOT_SEARCHED
                       else "a key the study's search space does not hold")
                raise TuneError(f"{where} sets '{key}' to {value!r}, {why}; torchrig runs only the values of the "
                                f"study's search space: start a new study with another --study-dir")
            if not params[key].holds(value):
                raise TuneError(f"{where} sets '{key}' to {value!r}, outside the study's search space "
                                f"({params[key].describe()}); start a new study with another --study-dir")
        missing = [k for k in params if k not in values]
        if missing:
            raise TuneError(f"{where} has no value for '{missing[0]}' of the study's search space; start a new study "
                            f"with another --study-dir")

    def apply(self, cfg: C.Config, values: dict[str, Any]) -> C.Config:
        """A copy of ``cfg`` with ``values`` (key -> sampled value) set as ``--set`` sets them, then validated."""
        out = copy.deepcopy(cfg)
        for key, raw in values.items():
            C.set_key(out, key, value_of(raw))
        return C.validate(out)

    def to_dict(self) -> dict:
        """The space as it was read, in plain data (recorded in the study's manifest)."""
        out = {}
        for p in self.params:
            spec: dict[str, Any] = {p.kind: list(p.choices) if p.kind == "choice" else [p.low, p.high]}
            if p.step is not None:
                spec["step"] = p.step
            out[p.key] = spec
        return out


def load_space(space: Union[str, Path, dict], cfg: C.Config, source: Optional[str] = None) -> Space:
    """Read and check a search space (a YAML file or a mapping) against ``cfg``, the study's base config."""
    if isinstance(space, (str, Path)):
        source = source or str(space)
        try:
            mapping = C.read_yaml(space, "search space file", "write the keys to search in it, e.g. 'optim.lr: "
                                  "{log_uniform: [1e-4, 3e-2]}' (docs/tuning.md shows every kind)")
        except C.ConfigError as exc:
            raise TuneError(str(exc)) from None
    elif isinstance(space, dict):
        mapping, source = space, source or "search space"
    else:
        raise TuneError(f"the search space must be a YAML file or a mapping of config keys, got {type(space).__name__}")
    flat = _flatten(mapping, source)
    if not flat:
        raise TuneError(f"{source}: no key to search; give config keys such as 'optim.lr: {{log_uniform: [1e-5, 1e-1]}}'")
    params = [_param(key, spec, source) for key, spec in flat.items()]
    for p in params:
        _check_against(cfg, p, source)
    return Space(params, source)


def _flatten(mapping: dict, source: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, spec in mapping.items():
        full = f"{prefix}{key}"
        # a section of keys (optim: {lr: {...}}) holds mappings only; a key's spec holds a list or a number
        if isinstance(spec, dict) and spec and all(isinstance(v, dict) for v in spec.values()):
            out.update(_flatten(spec, source, f"{full}."))
        else:
            out[full] = spec
    return out


def _number(value: Any, key: str, source: str, integer: bool) -> Any:
    if isinstance(value, str):
        value = parse_scalar(value)  # YAML reads 1e-5 (no dot) as text
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok:
        raise TuneError(f"{source}: key '{key}': expected {'an integer' if integer else 'a number'}, got {value!r}")
    return value if integer else float(value)


def _param(key: str, spec: Any, source: str) -> Param:
    if key in NOT_SEARCHED:
        raise TuneError(f"{source}: key '{key}' is set by torchrig tune for each trial (or names its process); "
                        f"it cannot be searched")
    if not isinstance(spec, dict) or len([k for k in spec if k != "step"]) != 1:
        raise TuneError(f"{source}: key '{key}': expected one of {', '.join(KINDS)} as a mapping, e.g. "
                        f"'{key}: {{choice: [a, b]}}', got {spec!r}")
    kind = next(k for k in spec if k != "step")
    if kind not in KINDS:
        raise TuneError(f"{source}: key '{key}': unknown kind '{kind}'{suggest(str(kind), KINDS)}; "
                        f"kinds are {', '.join(KINDS)}")
    args = spec[kind]
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise TuneError(f"{source}: key '{key}': choice needs a non-empty list of values, got {args!r}")
        if "step" in spec:
            raise TuneError(f"{source}: key '{key}': choice takes no step")
        choices = tuple(parse_scalar(a) if isinstance(a, str) else a for a in args)
        named = next((c for c in choices for v in (c if isinstance(c, list) else [c])
                      if isinstance(v, str) and ":" in v), None) if key in ("loss", "metrics") else None
        if named is not None:  # code to import: the command line names it, a space (read back too) never
            raise TuneError(f"{source}: key '{key}': the choice {named!r} names code of yours (MODULE:NAME), which "
                            f"torchrig imports only when the command line names it; give it with --set {key}=..., "
                            f"and search names only")
        return Param(key, kind, choices=choices)
    integer = kind in ("int", "log_int")
    if not isinstance(args, list) or len(args) != 2:
        raise TuneError(f"{source}: key '{key}': {kind} needs [low, high], got {args!r}")
    low, high = (_number(a, key, source, integer) for a in args)
    if not low < high:
        raise TuneError(f"{source}: key '{key}': {kind} [{low}, {high}] needs low < high")
    if kind.startswith("log_") and low <= 0:
        raise TuneError(f"{source}: key '{key}': {kind} needs low > 0, got {low}")
    step = spec.get("step")
    if step is not None:
        if kind.startswith("log_"):
            raise TuneError(f"{source}: key '{key}': {kind} takes no step")
        step = _number(step, key, source, integer)
        if step <= 0 or step > high - low:
            raise TuneError(f"{source}: key '{key}': step {step} must be > 0 and at most high - low ({high - low})")
    return Param(key, kind, low, high, step)


def _check_against(cfg: C.Config, p: Param, source: str) -> None:
    """Each bound / choice set on a copy of ``cfg``: an unknown key or a value its rule refuses is one line."""
    values = list(p.choices) if p.kind == "choice" else [p.low, p.high]
    for value in values:
        probe = copy.deepcopy(cfg)
        try:
            C.set_key(probe, p.key, value)
        except C.ConfigError as exc:
            raise TuneError(f"{source}: {exc}") from None
