"""Typed configuration: dataclasses, YAML files and ``--set a.b=c`` overrides.

Every key a user can write lives in one of the dataclasses below, so an unknown key is an error
with the closest valid key suggested, and every value is checked against its declared type.
Only the standard library and PyYAML (imported lazily) are used here.
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
class ImageConfig:
    """Recipe ``image-classification``: image folder reading and transforms (sizes in pixels)."""

    size: Optional[int] = None  # final square side; None = as stored (all images must then share one size)
    resize: Optional[int] = None  # resize the shorter side to this before cropping; default: size
    random_resized_crop: bool = False  # train: random area/aspect crop resized to `size`
    crop_scale: tuple = (0.08, 1.0)  # random_resized_crop area range (fractions of the image)
    random_crop_padding: int = 0  # train: pad by this many pixels, then random-crop back to size
    hflip: bool = False  # train: random horizontal flip
    normalize: bool = True
    mean: Optional[list] = None  # per channel in [0, 1]; None = computed from the training images
    std: Optional[list] = None
    channels: Optional[int] = None  # 1 or 3; None = from the images (3 for torchvision / timm models)
    class_map: dict = field(default_factory=dict)  # class folder -> index; default: sorted folder names
    classes: list = field(default_factory=list)  # index -> class name; filled in by training
    cache: Union[bool, str] = "auto"  # decode every image into memory once ("auto": small data sets)
    extensions: list = field(default_factory=lambda: [".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif",
                                                      ".tiff", ".webp", ".ppm", ".pgm"])


@dataclass
class TextConfig:
    """Recipe ``text-classification``: CSV / JSONL columns, tokenizer and sequence length (tokens)."""

    text_column: str = "text"
    text_pair_column: Optional[str] = None  # a second segment (token_type 1), e.g. for sentence pairs
    label_column: str = "label"
    max_length: int = 128  # tokens per sample including [CLS] / [SEP]; longer texts are truncated
    vocab_size: int = 8000  # tokenizer vocabulary budget, trained on the training texts
    min_frequency: int = 2  # a word or piece must occur this often to enter the vocabulary
    lowercase: bool = True
    labels: list = field(default_factory=list)  # index -> label; filled in by training (or fixes the order)
    tokenizer: Optional[str] = None  # a saved tokenizer.json to reuse; None = train one (saved in the run dir)


@dataclass
class Pix2PixConfig:
    """Recipe ``pix2pix``: paired images, the U-Net / PatchGAN sizes and the loss weights."""

    layout: str = "auto"  # auto, side_by_side (A|B in one file), folders (DIR/A and DIR/B, matching names)
    direction: str = "AtoB"  # AtoB or BtoA
    image_size: Optional[int] = None  # square side fed to the networks; None = 256 (embedded digits: 32)
    load_size: Optional[int] = None  # train: resize to this, then random-crop image_size (jitter)
    flip: bool = False  # train: random horizontal flip of both images together
    channels_a: Optional[int] = None  # 1 or 3; None = from the images
    channels_b: Optional[int] = None
    lambda_l1: float = 100.0  # weight of the L1 term in the generator loss
    gan_mode: str = "vanilla"  # vanilla (BCE with logits) or lsgan (MSE)
    ngf: Optional[int] = None  # generator filters in the first layer; None = 64 (embedded digits: 32)
    ndf: Optional[int] = None  # discriminator filters in the first layer; None = 64 (embedded digits: 32)
    num_downs: Optional[int] = None  # U-Net depth; None = log2(image_size) (a 1x1 bottleneck)
    d_layers: Optional[int] = None  # PatchGAN strided layers; None = 3, the 70x70 PatchGAN (digits: 2)
    dropout: float = 0.5  # in the three decoder blocks after the bottleneck
    samples: int = 8  # pairs shown in the PNG grid written each epoch


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
    image: ImageConfig = field(default_factory=ImageConfig)
    text: TextConfig = field(default_factory=TextConfig)
    pix2pix: Pix2PixConfig = field(default_factory=Pix2PixConfig)


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
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{full}'{_suggest(str(key), names)}")
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


def _set_path(obj: Any, dotted: str, raw: Any) -> None:
    parts = dotted.split(".")
    target = obj
    for i, part in enumerate(parts[:-1]):
        names = [f.name for f in dataclasses.fields(target)]
        if part not in names or not dataclasses.is_dataclass(getattr(target, part)):
            sections = [n for n in names if dataclasses.is_dataclass(getattr(target, n))]
            prefix = ".".join(parts[:i])
            shown = f"{prefix}.{part}" if prefix else part
            if part in names:  # a plain value, but the user addressed a sub-key
                name = parts[i + 1]
                if isinstance(getattr(target, part), dict):
                    getattr(target, part)[".".join(parts[i + 1 :])] = _parse_scalar(raw) if isinstance(raw, str) else raw
                    return
                raise ConfigError(f"config key '{shown}' has no sub-key '{name}'")
            raise ConfigError(f"unknown config section '{shown}'{_suggest(part, sections + names)}")
        target = getattr(target, part)
    _apply_mapping(target, {parts[-1]: _parse_scalar(raw) if isinstance(raw, str) else raw},
                   prefix=".".join(parts[:-1]) + "." if len(parts) > 1 else "")


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
        _set_path(cfg, key, raw)
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

    return plain(dataclasses.asdict(cfg))


def from_dict(mapping: dict) -> Config:
    cfg = Config()
    _apply_mapping(cfg, mapping)
    return validate(cfg)


__all__ = [
    "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "SchedulerConfig",
    "CheckpointConfig", "LogConfig", "DistConfig", "ImageConfig", "TextConfig", "Pix2PixConfig", "load_config", "read_yaml", "to_dict",
    "from_dict", "validate", "get_key",
]
