"""Typed configuration: dataclasses, YAML files and ``--set a.b=c`` overrides.

Every key a user can write lives in one of the dataclasses below, or in a section that a recipe
adds with :func:`register_section` (``image``, ``text``, ``pix2pix`` …: this layer knows no recipe),
so an unknown key is an error with the closest valid key suggested, and every value is checked
against its declared type. Only the standard library and PyYAML (imported lazily) are used here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..errors import TorchrigError, suggest
from . import files


class ConfigError(TorchrigError, ValueError):
    """A bad configuration key or value; the message names the key, the value and the fix."""


@dataclass
class DataConfig:
    batch_size: int = 64  # per process
    micro_batch_size: Union[int, str, None] = None  # rows per forward/backward; None: the loaded batch; "auto": halve on OOM
    eval_batch_size: Optional[int] = None  # defaults to batch_size
    # "auto": 0 for in-memory tensors or samples cheaper to make here than to receive from a worker process
    # (timed on a few), else min(16, cores per local rank - 1); samples are seeded alike either way
    num_workers: Union[int, str] = "auto"
    pin_memory: Union[bool, str] = "auto"  # "auto": on when training on CUDA
    persistent_workers: bool = True  # loader workers live for the whole fit: training's, and a validation Dataset's
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
    input_keys: Optional[list] = None  # dict batch keys passed to forward; None: those forward's signature accepts
    label_key: Optional[str] = None  # the target's key in dict batches; None: labels, label, target, targets or y
    factory: Optional[str] = None  # "module:attr": build_data(cfg) -> train | (train, val[, test]) | dict
    # optimizer steps per epoch: needed for iterable data without a length; caps the epoch of other data
    steps_per_epoch: Optional[int] = None


@dataclass
class ModelConfig:
    name: str = "digits_cnn"
    options: dict = field(default_factory=dict)  # keyword arguments for the model builder
    weights: Optional[str] = None  # local weights file (safetensors or state_dict .pt)
    init: Optional[str] = None  # e.g. xavier_uniform, kaiming_normal, normal(0, 0.02)
    channels_last: Union[bool, str] = "auto"  # "auto": on for convolutional models on CUDA
    compile: bool = False
    activation_checkpointing: list = field(default_factory=list)  # sub-module names recomputed in backward
    factory: Optional[str] = None  # "module:attr": build_model(cfg) -> nn.Module (torchrig train --model)
    python_class: Optional[str] = None  # "module:qualname" of a model given to Trainer in Python (not rebuildable)


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
    async_save: bool = True  # write in a background thread; training waits only for the copy to host memory


@dataclass
class LogConfig:
    every_steps: int = 50  # progress lines / jsonl rows, in optimizer steps
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise), bar, lines, none
    tensorboard: Union[bool, str] = "auto"  # auto = when tensorboard is installed
    plot: bool = True  # PNG curves (RUN_DIR/plots/curves.png), drawn before fit returns; false: none
    trackers: list = field(default_factory=list)  # csv, tensorboard, mlflow, wandb (rank 0 only)
    mlflow_uri: Optional[str] = None  # None: sqlite:///<run dir's parent>/mlruns/mlflow.db
    project: Optional[str] = None  # MLflow experiment / W&B project; None: "torchrig"
    run_name: Optional[str] = None  # tracker run name; None: the run directory's name
    flops: bool = False  # count FLOPs per sample once and log flops_per_s (and mfu on known GPUs)


@dataclass
class ProfileConfig:
    steps: list = field(default_factory=list)  # [first, last] optimizer steps to record; [] = off
    memory_snapshot: bool = False  # also write a CUDA memory snapshot of those steps (GPU only)


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
    broadcast_buffers: Union[bool, str] = "auto"  # DDP buffer broadcast; "auto": off with SyncBatchNorm
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
    run_dir: Optional[str] = None  # None: a new numbered directory, runs/<recipe>/N (Python API: runs/default/N)
    resume: Optional[str] = None  # "latest", "best", a checkpoint directory, or None
    resume_weights_only: bool = False  # load only the weights of `resume`; fresh optimizer and schedule
    resume_changes: str = "refuse"  # "allow": resume although settings that make it inexact changed (it says which)
    overwrite: bool = False  # a new run may replace the run already in run_dir (its checkpoints and logs)
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps
    precision: str = "fp32"  # fp32, bf16, fp16
    threads: Optional[int] = None  # CPU threads; env TORCH_THREAD_NUM also honoured
    interop_threads: Optional[int] = None
    deterministic: bool = False
    cudnn_benchmark: Union[bool, str] = "auto"  # "auto": on for CUDA runs unless deterministic
    accumulate: int = 1
    loss_normalization: str = "auto"  # a step's loss is the mean over: samples, tokens, micro_batches; auto
    clip_grad_norm: Optional[float] = None
    clip_norm_type: float = 2.0
    clip_grad_value: Optional[float] = None
    loss: str = "auto"  # a loss name; auto: the model's own loss when its output has one, else cross_entropy
    output_key: Union[int, str, None] = None  # the prediction in a tuple (index) or dict output; None: 0 / "logits"
    label_smoothing: float = 0.0
    metrics: list = field(default_factory=lambda: ["accuracy"])
    on_nonfinite: str = "error"  # error or skip
    eval_every_epochs: int = 1
    early_stop_patience: Optional[int] = None  # epochs without improvement of the monitor
    ema_decay: Optional[float] = None  # EMA of the weights (e.g. 0.999), used for evaluation; None = off
    ema_warmup: bool = False  # decay min(ema_decay, (1 + n) / (10 + n)) after n updates
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
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
    import sys

    if not (isinstance(obj, Config) and mapping) or "torchrig.recipes" in sys.modules:
        return ""  # the built-in recipes are registered: the section is just unknown
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
        value = _parse_scalar(value) if value.strip().startswith("[") else \
            [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError("a list")
    return tp(value)


def _to_dict(value: Any) -> dict:
    if isinstance(value, str):
        value = _parse_scalar(value)
    if not isinstance(value, dict):
        raise ValueError("a mapping")
    return dict(value)


_CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    bool: _to_bool, int: lambda v: _to_number(v, int), float: lambda v: _to_number(v, float), str: _to_str,
    list: lambda v: _to_sequence(v, list), tuple: lambda v: _to_sequence(v, tuple), dict: _to_dict,
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        # Try exact type matches first so "auto" stays a str and 4 stays an int.
        for arg in sorted(args, key=lambda a: 0 if isinstance(value, a if isinstance(a, type) else object) else 1):
            if arg is not type(None):
                try:
                    return _coerce(value, arg, key)
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


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _suggest(name: str, options: list[str], what: str = "keys") -> str:
    return suggest(name, options, cutoff=0.5) or f"; valid {what}: {', '.join(sorted(set(options)))}"


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
            try:
                typed = _coerce(value, hints[key], full)
            except ConfigError:
                if full not in RULES:
                    raise
                typed = object()  # fails every rule, so the message says what the key accepts
            setattr(obj, key, check_value(full, typed, shown=value))


def _parse_scalar(text: str) -> Any:
    """Parse a ``--set`` value the way YAML would (numbers, booleans, null, lists); empty text stays
    empty text (a key that accepts null says so: ``KEY=null``)."""
    import yaml

    if not text.strip():
        return text
    try:
        return files.parse_yaml(text, text if len(text) <= 60 else text[:57] + "...", "the value", ConfigError)
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
            sections = [n for n in names if dataclasses.is_dataclass(getattr(target, n, None))]
            raise ConfigError(f"unknown config section '{shown}'{_suggest(part, sections, 'sections')}"
                              f"{_section_hint(target, True)}")
        target = getattr(target, part)
    _apply_mapping(target, {parts[-1]: value}, prefix=".".join(parts[:-1]) + "." if len(parts) > 1 else "")


# ----------------------------------------------------------------------------- value checks


class _Rule(typing.NamedTuple):
    """What a key accepts: ``expect`` completes "expected ...", ``check`` returns the (normalised)
    value or raises ValueError / TypeError; a ValueError's argument is shown after the value."""

    expect: str
    check: Callable[[Any], Any]


def _accept(ok: bool, value: Any, detail: str = "") -> Any:
    if not ok:
        raise ValueError(detail) if detail else ValueError
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(lo: int, hi: Optional[int] = None) -> _Rule:
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return _Rule(text, lambda v: _accept(_is_int(v) and v >= lo and (hi is None or v <= hi), v))


def _num(lo: float, hi: Optional[float] = None, *, lo_open: bool = False, hi_open: bool = False,
         finite: bool = True) -> _Rule:
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
        return _accept(ok and (hi is None or (v < hi if hi_open else v <= hi)), v)

    return _Rule(text, check)


def _optional(rule: _Rule) -> _Rule:
    return _Rule(f"{rule.expect} or null", lambda v: None if v is None else rule.check(v))


def _or_auto(rule: _Rule, text: Optional[str] = None) -> _Rule:
    return _Rule(text or f"{rule.expect} or 'auto'", lambda v: v if v == "auto" else rule.check(v))


def _choice(*options: str) -> _Rule:
    return _Rule(f"one of {', '.join(options)}", lambda v: _accept(v in options, v))


def _pattern(text: str, regex: str) -> _Rule:
    return _Rule(text, lambda v: _accept(isinstance(v, str) and re.fullmatch(regex, v) is not None, v))


def _list_of(rule: _Rule, text: str) -> _Rule:
    return _Rule(text, lambda v: [rule.check(x) for x in _accept(isinstance(v, (list, tuple)), v)])


def _pair(item: _Rule, text: str) -> _Rule:
    """Two values; strings such as ``0.9,0.99`` from the command line become numbers."""
    def check(v: Any) -> tuple:
        _accept(isinstance(v, (list, tuple)) and len(v) == 2, v)
        return tuple(item.check(_parse_scalar(x) if isinstance(x, str) else x) for x in v)

    return _Rule(text, check)


def _mapping_of(rule: Optional[_Rule], text: str) -> _Rule:
    def check(v: Any) -> dict:
        _accept(isinstance(v, dict) and all(isinstance(k, str) and k for k in v), v)
        return {k: rule.check(x) for k, x in v.items()} if rule else v

    return _Rule(text, check)


def _run_dir(v: Any) -> str:
    _accept(isinstance(v, str) and v.strip() != "", v)
    return _accept(not os.path.isfile(v), v, "an existing file")


def _output_key(v: Any) -> Any:
    """The prediction's index in a tuple output or its key in a dict output."""
    return _accept((_is_int(v) and v >= 0) or (isinstance(v, str) and v.strip() != ""), v)


def _input_keys(v: Any) -> list:
    _accept(isinstance(v, (list, tuple)) and len(v) > 0, v)
    return [_accept(isinstance(k, str) and k.strip() != "", k) for k in v]


def _steps(v: Any) -> list:
    """[] (off) or two optimizer steps [first, last], first >= 1, last >= first."""
    _accept(isinstance(v, (list, tuple)) and len(v) in (0, 2) and all(_is_int(x) for x in v), v)
    return _accept(not v or 1 <= v[0] <= v[1], list(v))


TRACKERS = ("csv", "tensorboard", "mlflow", "wandb")
_BOOL = _Rule("true or false", lambda v: _accept(isinstance(v, bool), v))
_TEXT = _Rule("a non-empty string", lambda v: _accept(isinstance(v, str) and v.strip() != "", v))
_POSITIVE = _num(0, lo_open=True)
_SPEC = _pattern("a 'module:attribute' string such as mypkg.models:build_model",
                 r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_BACKEND = r"(?:(?:cpu|cuda|xpu):)?(?:gloo|nccl|mpi|ucc|xccl)"

# Every key of the core sections, with the values it accepts. (Recipe sections bring their own checks.)
RULES: dict[str, _Rule] = {
    "recipe": _TEXT, "seed": _int(0, 2**32 - 1), "epochs": _int(1), "max_steps": _optional(_int(1)),
    "run_dir": _optional(_Rule("a directory path", _run_dir)), "resume": _optional(_TEXT), "overwrite": _BOOL,
    "resume_weights_only": _BOOL, "resume_changes": _choice("refuse", "allow"),
    "device": _pattern("auto, cpu, cuda, cuda:N, xpu, xpu:N or mps", r"auto|cpu|mps|(?:cuda|xpu)(?::\d+)?"),
    "precision": _choice("fp32", "bf16", "fp16"), "threads": _optional(_int(1)),
    "interop_threads": _optional(_int(1)), "deterministic": _BOOL,
    "cudnn_benchmark": _or_auto(_BOOL, "true, false or 'auto'"), "accumulate": _int(1),
    "loss_normalization": _choice("auto", "samples", "tokens", "micro_batches"),
    "clip_grad_norm": _optional(_POSITIVE), "clip_norm_type": _num(0, lo_open=True, finite=False),
    "clip_grad_value": _optional(_POSITIVE), "loss": _TEXT, "label_smoothing": _num(0, 1),
    "metrics": _list_of(_TEXT, "a list of metric names"), "on_nonfinite": _choice("error", "skip"),
    "eval_every_epochs": _int(1), "early_stop_patience": _optional(_int(1)),
    "output_key": _optional(_Rule("an index >= 0 or a key name", _output_key)),
    "data.input_keys": _optional(_Rule("a non-empty list of batch keys", _input_keys)),
    "data.label_key": _optional(_TEXT),
    "ema_decay": _optional(_num(0, 1, lo_open=True, hi_open=True)), "ema_warmup": _BOOL,
    "data.batch_size": _int(1), "data.micro_batch_size": _optional(_or_auto(_int(1), "an integer >= 1 or 'auto'")),
    "data.eval_batch_size": _optional(_int(1)), "data.num_workers": _or_auto(_int(0)),
    "data.pin_memory": _or_auto(_BOOL, "true, false or 'auto'"), "data.persistent_workers": _BOOL,
    "data.prefetch_factor": _optional(_int(1)), "data.shuffle": _BOOL, "data.drop_last": _BOOL,
    "data.fast_path": _BOOL, "data.path": _optional(_TEXT), "data.val_path": _optional(_TEXT),
    "data.test_path": _optional(_TEXT), "data.val_fraction": _num(0, 1, hi_open=True),
    "data.skip_bad_samples": _BOOL, "data.options": _mapping_of(None, "a mapping"),
    "data.factory": _optional(_SPEC), "model.factory": _optional(_SPEC), "model.python_class": _optional(_TEXT),
    "data.steps_per_epoch": _optional(_int(1)),
    "model.name": _TEXT, "model.options": _mapping_of(None, "a mapping"), "model.weights": _optional(_TEXT),
    "model.init": _optional(_TEXT), "model.compile": _BOOL,
    "model.channels_last": _or_auto(_BOOL, "true, false or 'auto'"),
    "model.activation_checkpointing": _list_of(_TEXT, "a list of sub-module names"),
    "optim.name": _TEXT, "optim.lr": _POSITIVE, "optim.weight_decay": _num(0),
    "optim.momentum": _num(0, 1, hi_open=True),
    "optim.nesterov": _BOOL, "optim.betas": _pair(_num(0, 1, hi_open=True), "two numbers in [0, 1)"),
    "optim.eps": _POSITIVE, "optim.group_lr": _mapping_of(_POSITIVE, "a mapping of module-name prefix to lr > 0"),
    "optim.options": _mapping_of(None, "a mapping"),
    "scheduler.name": _optional(_TEXT), "scheduler.interval": _optional(_choice("step", "epoch")),
    "scheduler.step_size": _int(1), "scheduler.gamma": _POSITIVE,
    "scheduler.milestones": _list_of(_int(1), "a list of integers >= 1"), "scheduler.warmup_steps": _int(0),
    "scheduler.min_lr": _num(0), "scheduler.max_lr": _optional(_POSITIVE),
    "scheduler.pct_start": _num(0, 1, lo_open=True, hi_open=True),
    "checkpoint.every_steps": _int(0), "checkpoint.every_epochs": _int(0), "checkpoint.keep_last": _int(1),
    "checkpoint.keep_best": _int(0), "checkpoint.monitor": _optional(_TEXT),
    "checkpoint.mode": _optional(_choice("min", "max")), "checkpoint.save_final": _BOOL,
    "checkpoint.async_save": _BOOL,
    "log.every_steps": _int(0), "log.progress": _choice("auto", "bar", "lines", "none"),
    "log.tensorboard": _or_auto(_BOOL, "true, false or 'auto'"),
    "log.plot": _BOOL,
    "log.trackers": _list_of(_choice(*TRACKERS), f"a list of {', '.join(TRACKERS)}"),
    "log.mlflow_uri": _optional(_TEXT), "log.project": _optional(_TEXT), "log.run_name": _optional(_TEXT),
    "log.flops": _BOOL, "profile.steps": _Rule("[] or [first, last] with 1 <= first <= last", _steps),
    "profile.memory_snapshot": _BOOL,
    "dist.strategy": _choice("auto", "none", "ddp", "dp", "fsdp"),
    "dist.backend": _optional(_pattern("a backend (gloo, nccl, mpi, ucc, xccl; per device: cpu:gloo,cuda:nccl)",
                                       rf"{_BACKEND}(?:,{_BACKEND})*")),
    "dist.init_method": _optional(_pattern("a tcp://HOST:PORT, file:///PATH or env:// address",
                                           r"(?:tcp://\S+:\d+|file:///\S+|env://\S*)")),
    "dist.rank": _optional(_int(0)), "dist.world_size": _optional(_int(1)), "dist.timeout": _POSITIVE,
    "dist.find_unused_parameters": _BOOL, "dist.static_graph": _BOOL, "dist.bucket_cap_mb": _optional(_POSITIVE),
    "dist.gradient_as_bucket_view": _BOOL, "dist.sync_batchnorm": _BOOL,
    "dist.broadcast_buffers": _or_auto(_BOOL, "true, false or 'auto'"),
    "dist.fsdp_wrap": _list_of(_TEXT, "a list of module class names"), "dist.fsdp_min_params": _int(0),
    "dist.fsdp_cpu_offload": _BOOL, "dist.fsdp_reshard_after_forward": _BOOL, "dist.requeue": _BOOL,
    "dist.stop_timeout": _POSITIVE,
}


_AS_GIVEN = object()


def check_value(key: str, value: Any, shown: Any = _AS_GIVEN) -> Any:
    """``value`` normalised by the rule of ``key`` (unchanged for keys without one), or a ConfigError
    naming the key, the value as the user wrote it (``shown``) and what is accepted."""
    rule = RULES.get(key)
    if rule is None:
        return value
    try:
        return rule.check(value)
    except (ValueError, TypeError) as exc:
        detail = f" ({exc.args[0]})" if isinstance(exc, ValueError) and exc.args else ""
        shown = value if shown is _AS_GIVEN else shown
        raise ConfigError(f"config key '{key}': expected {rule.expect}, got {shown!r}{detail}") from None


def validate(cfg: Config) -> Config:
    """Check every core key against its rule (see ``RULES``), then what no single key can express."""
    for key in RULES:
        section, _, name = key.rpartition(".")
        owner = get_key(cfg, section) if section else cfg
        setattr(owner, name, check_value(key, getattr(owner, name)))
    d = cfg.dist
    if d.rank is not None and d.world_size is not None and d.rank >= d.world_size:
        raise ConfigError(f"config key 'dist.rank': expected an integer < dist.world_size ({d.world_size}), "
                          f"got {d.rank}")
    for key, value, other in (("rank", d.rank, "world_size"), ("world_size", d.world_size, "rank")):
        if value is not None and (getattr(d, other) is None or d.init_method is None):
            missing = [f"dist.{k}" for k in (other, "init_method") if getattr(d, k) is None]
            raise ConfigError(f"config key 'dist.{key}': {value} is used only with dist.{other} and dist.init_method "
                              f"(tcp://HOST:PORT or file:///PATH), and {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not set; set them too, or start the job with "
                              f"torchrun (torchrig launch), which gives every process its rank")
    if cfg.overwrite and cfg.resume in ("latest", "best"):
        raise ConfigError(f"config key 'overwrite': true would remove the run that resume={cfg.resume!r} continues; "
                          f"set one of them")
    if cfg.log.tensorboard is False and "tensorboard" in cfg.log.trackers:
        raise ConfigError("config key 'log.tensorboard': false, but log.trackers lists tensorboard; remove one of them")
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
    """The mapping of a YAML config file: a regular file of at most 1 MiB whose aliases expand little
    (see ``files``), or a ConfigError naming the file."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing YAML file or none for the defaults")
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory; pass a YAML file")
    try:
        raw = files.read_regular(p, files.YAML_LIMIT, "config file", "pass a YAML config file", ConfigError)
        data = files.parse_yaml(raw.decode("utf-8"), str(p), "config file", ConfigError)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file '{p}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{p}' is not a text file (UTF-8 YAML); pass a YAML config file") from None
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
    "LogConfig", "ProfileConfig", "DistConfig", "load_config", "read_yaml", "to_dict", "from_dict", "validate",
    "get_key", "set_key", "register_section", "sections",
]
