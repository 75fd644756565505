"""Typed configuration: dataclasses, YAML files and ``--set a.b=c`` overrides.

Every key a user can write lives in one of the dataclasses below, or in a section that a recipe
adds with :func:`register_section` (``image``, ``text``, ``pix2pix`` …: this layer knows no recipe),
so an unknown key is an error with the closest valid key suggested, and every value is checked
against its declared type. Only the standard library and PyYAML (imported lazily) are used here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import TorchrigError, suggest


class ConfigError(TorchrigError, ValueError):
    """A bad configuration key or value; the message names the key, the value and the fix."""


@dataclass
class DataConfig:
    batch_size: int = 64  # per process
    eval_batch_size: Optional[int] = None  # defaults to batch_size
    num_workers: Union[int, str] = "auto"  # "auto": 0 for in-memory tensors, else min(4, cores-1)
    pin_memory: Union[bool, str] = "auto"  # "auto": on when training on CUDA
    persistent_workers: bool = True
    prefetch_factor: Optional[int] = None
    shuffle: bool = True
    drop_last: bool = False
    fast_path: bool = True  # gather TensorDataset batches with one indexing op
    path: Optional[str] = None  # recipe data source (folder or file); None = embedded default
    val_path: Optional[str] = None
    test_path: Optional[str] = None
    val_fraction: float = 0.0  # carve a validation split out of the training data
    skip_bad_samples: bool = False
    options: dict = field(default_factory=dict)  # recipe-specific data options


@dataclass
class ModelConfig:
    name: str = "digits_cnn"
    options: dict = field(default_factory=dict)  # keyword arguments for the model builder
    weights: Optional[str] = None  # local weights file (safetensors or state_dict .pt)
    init: Optional[str] = None  # e.g. xavier_uniform, kaiming_normal, normal(0, 0.02)
    channels_last: bool = False
    compile: bool = False


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd / rmsprop
    nesterov: bool = False
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    group_lr: dict = field(default_factory=dict)  # module-name prefix -> lr, e.g. {"fc": 1e-2}
    options: dict = field(default_factory=dict)  # any other optimizer keyword arguments


@dataclass
class SchedulerConfig:
    name: Optional[str] = None  # step, multistep, cosine, onecycle, warmup_cosine, none
    interval: Optional[str] = None  # "step" (optimizer step) or "epoch"; default per scheduler
    step_size: int = 30  # step: in units of `interval`
    gamma: float = 0.1
    milestones: list = field(default_factory=list)
    warmup_steps: int = 0  # warmup_cosine: in optimizer steps
    min_lr: float = 0.0
    max_lr: Optional[float] = None  # onecycle; defaults to optim.lr
    pct_start: float = 0.3


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0 = off; counted in optimizer steps
    every_epochs: int = 1  # 0 = off
    keep_last: int = 2
    keep_best: int = 1
    monitor: Optional[str] = None  # e.g. "val/accuracy"; default: first val metric, else val/loss
    mode: Optional[str] = None  # "min" or "max"; default inferred from the metric name
    save_final: bool = True


@dataclass
class LogConfig:
    every_steps: int = 50  # progress lines / jsonl rows, in optimizer steps
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise), bar, lines, none
    tensorboard: Union[bool, str] = "auto"  # auto = when tensorboard is installed
    plot: bool = True  # write PNG curves at the end of fit


@dataclass
class DistConfig:
    strategy: str = "auto"  # auto, none, ddp, dp, fsdp
    backend: Optional[str] = None  # nccl / gloo / mpi; default by device
    init_method: Optional[str] = None  # tcp://host:port or file:///path
    rank: Optional[int] = None
    world_size: Optional[int] = None
    timeout: float = 1800.0  # seconds, for collectives
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: Optional[float] = None
    gradient_as_bucket_view: bool = True
    sync_batchnorm: bool = False
    fsdp_wrap: list = field(default_factory=list)  # module class names to shard per block
    fsdp_min_params: int = 0  # or shard every module with at least this many parameters
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    requeue: bool = False  # Slurm: `scontrol requeue` the job after a signal's checkpoint
    stop_timeout: float = 10.0  # seconds without progress after a stop signal before exiting uncheckpointed


@dataclass
class Config:
    recipe: str = "digits"
    seed: int = 0
    epochs: int = 10
    max_steps: Optional[int] = None  # cap on optimizer steps
    run_dir: str = "runs/default"
    resume: Optional[str] = None  # "latest", "best", a checkpoint directory, or None
    resume_weights_only: bool = False  # load only the weights of `resume`; fresh optimizer and schedule
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps
    precision: str = "fp32"  # fp32, bf16, fp16
    threads: Optional[int] = None  # CPU threads; env TORCH_THREAD_NUM also honoured
    interop_threads: Optional[int] = None
    deterministic: bool = False
    cudnn_benchmark: bool = False
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    clip_norm_type: float = 2.0
    clip_grad_value: Optional[float] = None
    loss: str = "cross_entropy"
    label_smoothing: float = 0.0
    metrics: list = field(default_factory=lambda: ["accuracy"])
    on_nonfinite: str = "error"  # error or skip
    eval_every_epochs: int = 1
    early_stop_patience: Optional[int] = None  # epochs without improvement of the monitor
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    # Recipe sections (``cfg.image``, ``cfg.text`` …) are not fields: see register_section.
    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            setattr(self, name, cls())

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a section registered after this Config was made.
        cls = _SECTIONS.get(name)
        if cls is None:
            raise AttributeError(f"'Config' object has no attribute '{name}'")
        value = cls()
        setattr(self, name, value)
        return value

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in _keys(self))


# ----------------------------------------------------------------------------- recipe sections

_SECTIONS: dict[str, type] = {}


def register_section(name: str, cls: type) -> None:
    """Make the dataclass ``cls`` the top-level section ``name`` of every Config.

    Recipes call this when their module is imported, so that this layer knows no recipe. The YAML
    key ``name:``, ``--set name.key=value``, ``cfg.name.key``, ``to_dict`` / ``from_dict`` and a
    checkpoint's ``config.yaml`` then treat the section like a built-in one; unknown keys in it get
    suggestions, and its ``validate()`` method, if it has one, runs within :func:`validate`.

    A config that names a section is loaded after the section is registered: the ``torchrig``
    command, ``torchrig.load_config`` and ``torchrig.Config`` import ``torchrig.recipes`` (every
    recipe) first; code that imports ``torchrig.config`` directly imports the recipe as well.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"config section '{name}': {cls!r} is not a dataclass")
    if name in {f.name for f in dataclasses.fields(Config)}:
        raise ConfigError(f"config section '{name}' would hide the config key '{name}'; choose another name")
    old = _SECTIONS.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ConfigError(f"config section '{name}' is already registered by {old.__module__}.{old.__qualname__}; "
                          f"choose another name")
    _SECTIONS[name] = cls


def sections() -> dict[str, type]:
    """The registered recipe sections, name -> dataclass."""
    return dict(_SECTIONS)


def _keys(obj: Any) -> list[str]:
    names = [f.name for f in dataclasses.fields(obj)]
    return names + list(_SECTIONS) if isinstance(obj, Config) else names


def _section_hint(obj: Any, mapping: bool) -> str:
    """An unknown top-level mapping is most likely the section of a recipe not imported yet."""
    if not (isinstance(obj, Config) and mapping):
        return ""
    return ("; a recipe's own section is known once the recipe is imported: import torchrig.recipes "
            "(the torchrig command and torchrig.load_config do)")


def _validate_sections(cfg: Config) -> None:
    for name in _SECTIONS:
        check = getattr(getattr(cfg, name), "validate", None)
        if check is not None:
            check()


# ----------------------------------------------------------------------------- type checking


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        # Try exact type matches first so "auto" stays a str and 4 stays an int.
        for arg in sorted(args, key=lambda a: 0 if isinstance(value, a if isinstance(a, type) else object) else 1):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if isinstance(value, os.PathLike):  # run_dir=Path(...) from Python code
        value = os.fspath(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"config key '{key}': expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
    if tp in (list, tuple):
        if isinstance(value, str):
            value = _parse_scalar(value) if value.strip().startswith("[") else [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        return tp(value)
    if tp is dict:
        if isinstance(value, str):
            value = _parse_scalar(value)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    return value


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _suggest(name: str, options: list[str]) -> str:
    return suggest(name, options, cutoff=0.5) or f"; valid keys: {', '.join(sorted(options))}"


def _apply_mapping(obj: Any, mapping: dict, prefix: str = "") -> None:
    hints = _hints(type(obj))
    names = _keys(obj)
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{full}'{_suggest(str(key), names)}{_section_hint(obj, isinstance(value, dict))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{full}': expected a mapping of sub-keys, got {value!r}")
            _apply_mapping(current, value, prefix=f"{full}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], full))


def _yaml_loader():
    """PyYAML's SafeLoader, plus YAML 1.2 floats: ``1e-4`` is a number, not the string '1e-4'."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def _parse_scalar(text: str) -> Any:
    """Parse a ``--set`` value the way YAML would (numbers, booleans, null, lists)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError:
        return text


def set_key(cfg: Any, dotted: str, value: Any) -> None:
    """Set the key ``dotted`` (``"optim.lr"``) of ``cfg`` to ``value``, checked like a YAML value.

    A string is parsed the way ``--set optim.lr=VALUE`` parses it (``"3"`` is 3, ``"[1, 2]"`` a
    list); an unknown key is a ConfigError naming the closest one. A key inside a mapping value
    (``optim.group_lr.head``) adds or replaces that entry. Call :func:`validate` afterwards for the
    checks that involve several keys.
    """
    parts = dotted.split(".")
    value = _parse_scalar(value) if isinstance(value, str) else value
    target = cfg
    for i, part in enumerate(parts[:-1]):
        names = _keys(target)
        if part not in names or not dataclasses.is_dataclass(getattr(target, part)):
            prefix = ".".join(parts[:i])
            shown = f"{prefix}.{part}" if prefix else part
            if part in names:  # a plain value, but the user addressed a sub-key
                if isinstance(getattr(target, part), dict):
                    getattr(target, part)[".".join(parts[i + 1:])] = value
                    return
                raise ConfigError(f"config key '{shown}' has no sub-key '{parts[i + 1]}'")
            raise ConfigError(f"unknown config section '{shown}'{_suggest(part, names)}"
                              f"{_section_hint(target, True)}")
        target = getattr(target, part)
    _apply_mapping(target, {parts[-1]: value}, prefix=".".join(parts[:-1]) + "." if len(parts) > 1 else "")


def validate(cfg: Config) -> Config:
    """Cross-field checks that a type alone cannot express."""
    choices = {
        "precision": ("fp32", "bf16", "fp16"),
        "on_nonfinite": ("error", "skip"),
        "dist.strategy": ("auto", "none", "ddp", "dp", "fsdp"),
        "log.progress": ("auto", "bar", "lines", "none"),
    }
    for key, allowed in choices.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(allowed)}")
    positive = {"epochs": cfg.epochs, "accumulate": cfg.accumulate, "data.batch_size": cfg.data.batch_size}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}': must be at least 1, got {value}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ConfigError(f"config key 'max_steps': must be at least 1, got {cfg.max_steps}")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"config key 'optim.lr': must be positive, got {cfg.optim.lr}")
    for key in ("clip_grad_norm", "clip_grad_value"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"config key '{key}': must be positive, got {value}")
    for key in ("data.pin_memory", "log.tensorboard"):
        value = get_key(cfg, key)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"config key '{key}': expected true, false or 'auto', got {value!r}")
    if cfg.checkpoint.mode not in (None, "min", "max"):
        raise ConfigError(f"config key 'checkpoint.mode': {cfg.checkpoint.mode!r} is not one of min, max")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"config key 'threads': must be at least 1, got {cfg.threads}")
    if isinstance(cfg.data.num_workers, str) and cfg.data.num_workers != "auto":
        raise ConfigError(f"config key 'data.num_workers': expected an integer or 'auto', got {cfg.data.num_workers!r}")
    _validate_sections(cfg)
    return cfg


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


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


def read_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing YAML file or none for the defaults")
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory; pass a YAML file")
    try:
        data = yaml.load(p.read_text(), Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file '{p}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{p}' is not a text file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys, found {type(data).__name__}")
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
    out.update({name: plain(dataclasses.asdict(getattr(cfg, name))) for name in _SECTIONS})
    return out


def from_dict(mapping: dict) -> Config:
    cfg = Config()
    _apply_mapping(cfg, mapping)
    return validate(cfg)


__all__ = [
    "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "SchedulerConfig", "CheckpointConfig",
    "LogConfig", "DistConfig", "load_config", "read_yaml", "to_dict", "from_dict", "validate", "get_key", "set_key",
    "register_section", "sections",
]
