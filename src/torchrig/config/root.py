"""The whole configuration: the top-level keys, the built-in sections, and the sections recipes register.

Recipe sections (``cfg.image``, ``cfg.text`` …) are not fields of :class:`Config`: a recipe adds its
dataclass with :func:`register_section` when its module is imported, so this layer knows no recipe.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .rules import (AUTO_BOOL, BOOL, POSITIVE, TEXT, Rule, accept, choice, integer, is_int, list_of, number, optional,
                    pattern)
from .schema import ConfigError, Key, hints, is_section, key, keys_of
from .sections import (CheckpointConfig, DataConfig, DistConfig, LogConfig, ModelConfig, OptimConfig,
                       ParallelConfig, PeftConfig, ProfileConfig, QuantizeConfig, SchedulerConfig, SpikeConfig,
                       Float8Config)

LOSS_NORMALIZATIONS = ("auto", "samples", "tokens", "micro_batches")


def _run_dir(v: Any) -> str:
    """A folder path; ``~`` and ``~user`` expanded as a shell does (a YAML file or a Trainer keyword has no shell)."""
    accept(isinstance(v, str) and v.strip() != "", v)
    v = os.path.expanduser(v)
    return accept(not os.path.isfile(v), v, "an existing file")


def _output_key(v: Any) -> Any:
    """The prediction's index in a tuple output or its key in a dict output."""
    return accept((is_int(v) and v >= 0) or (isinstance(v, str) and v.strip() != ""), v)


def _class_dim(v: Any) -> Any:
    """Where the prediction's classes are: dimension 1, the last (-1), or auto."""
    return accept(v == "auto" or (is_int(v) and v in (1, -1)), v)


@dataclass
class Config:
    """The run, the device, the loss and the loop: the keys outside any section."""

    recipe: str = key("digits", TEXT, "the ready task torchrig train builds: digits, image-classification, "
                                      "text-classification, language-model, finetune, pix2pix or custom")
    seed: int = key(0, integer(0, 2**32 - 1), "seeds Python, NumPy and torch; the data order is a function of "
                                              "(seed, epoch)")
    epochs: int = key(10, integer(1), "passes over the training data")
    max_steps: Optional[int] = key(None, optional(integer(1)), "cap on optimizer steps")
    run_dir: Optional[str] = key(None, optional(Rule("a directory path", _run_dir)),
                                 "checkpoints, metrics.jsonl, TensorBoard, plots, one run at a time (locked); null: "
                                 "a new runs/<recipe>/N (Python API: runs/default/N)")
    resume: Optional[str] = key(None, optional(TEXT), "latest, best, a checkpoint or a run directory; a torchrun "
                                                      "restart or a Slurm requeue resumes latest by itself")
    resume_weights_only: bool = key(False, BOOL, "load only the weights of resume; optimizer, schedule and step "
                                                 "start fresh")
    resume_changes: str = key("refuse", choice("refuse", "allow"),
                              "refuse: a resume with settings that would make it inexact is refused naming them; "
                              "allow: resume anyway and say what is no longer exact")
    overwrite: bool = key(False, BOOL, "a new run may replace the run already in run_dir (its checkpoints and logs)")
    device: str = key("auto", pattern("auto, cpu, cuda, cuda:N, xpu, xpu:N or mps",
                                      r"auto|cpu|mps|(?:cuda|xpu)(?::\d+)?"),
                      "auto: cuda, else mps, else cpu")
    precision: str = key("fp32", choice("fp32", "bf16", "fp16"), "fp32, bf16 (autocast on CPU and CUDA) or fp16 "
                                                                 "(CUDA, with a GradScaler)")
    threads: Optional[int] = key(None, optional(integer(1)), "CPU threads; null: TORCH_THREAD_NUM, else torch's "
                                                             "default")
    interop_threads: Optional[int] = key(None, optional(integer(1)), "CPU inter-op threads; null: torch's default")
    deterministic: bool = key(False, BOOL, "repeatable CUDA runs: no cuDNN autotuning, no TF32 matmuls")
    cudnn_benchmark: Union[bool, str] = key("auto", AUTO_BOOL, "cuDNN autotuning; auto: on for CUDA runs unless "
                                                               "deterministic (such runs also get TF32 matmuls)")
    accumulate: int = key(1, integer(1), "loaded batches per optimizer step (gradient accumulation)")
    loss_normalization: str = key("auto", choice(*LOSS_NORMALIZATIONS),
                                  "a step's loss is the mean over the global batch's samples, valid tokens (labels "
                                  "!= -100) or micro_batches; auto: tokens for integer sequence labels, else samples")
    clip_grad_norm: Optional[float] = key(None, optional(POSITIVE), "clip the gradients' total norm to this")
    clip_norm_type: float = key(2.0, number(0, lo_open=True, finite=False), "the norm of clip_grad_norm (inf: the "
                                                                            "largest absolute value)")
    clip_grad_value: Optional[float] = key(None, optional(POSITIVE), "clip every gradient to [-value, value]")
    loss: str = key("auto", TEXT, "cross_entropy, nll, mse, l1, smooth_l1, bce_with_logits; auto: the model's own "
                                  "loss when its output has one, else cross_entropy")
    output_key: Union[int, str, None] = key(None, optional(Rule("an index >= 0 or a key name", _output_key)),
                                            "the prediction in a tuple output (an index; null: 0) or a dict output "
                                            "(a key; null: logits)")
    class_dim: Union[int, str] = key("auto", Rule("auto, 1 or -1", _class_dim),
                                     "the prediction's class dimension: 1 (PyTorch's (batch, classes, positions…)) "
                                     "or -1 (a token model's (batch, positions, classes)); auto: -1 for Hugging Face "
                                     "models, and for outputs (B, T, C) with integer targets (B, T) (in predict: "
                                     "input ids) when C != T, else 1")
    label_smoothing: float = key(0.0, number(0, 1), "label smoothing of cross_entropy")
    metrics: list = key(["accuracy"], list_of(TEXT, "a list of metric names"),
                        "accuracy, topK (top5), precision, recall, f1 (macro), *_weighted, mse, mae")
    on_nonfinite: str = key("error", choice("error", "skip"), "a non-finite loss or gradient: error stops naming "
                                                              "the step; skip skips the update, counts it and leaves its "
                                                              "loss out of train/loss")
    on_spike: str = key("off", choice("off", "rollback"), "a loss or gradient-norm spike (see spike.*) or a non-finite "
                                                          "value: rollback returns to the last snapshot, leaves the "
                                                          "step's samples out (RUN_DIR/skipped_samples.jsonl) and "
                                                          "replays")
    eval_every_epochs: int = key(1, integer(1), "validate every N epochs")
    early_stop_patience: Optional[int] = key(None, optional(integer(1)), "stop after this many epochs without "
                                                                         "improvement of checkpoint.monitor")
    ema_decay: Optional[float] = key(None, optional(number(0, 1, lo_open=True, hi_open=True)),
                                     "a float32 moving average of the weights with this decay (e.g. 0.999), used "
                                     "for evaluation and saved in checkpoints; null: off")
    ema_warmup: bool = key(False, BOOL, "EMA decay min(ema_decay, (1 + n) / (10 + n)) after n updates")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    float8: Float8Config = field(default_factory=Float8Config)

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
        return all(getattr(self, k) == getattr(other, k) for k in names(self))


# ----------------------------------------------------------------------------- recipe sections

_SECTIONS: dict[str, type] = {}


def register_section(name: str, cls: type) -> None:
    """Make the dataclass ``cls`` the top-level section ``name`` of every Config.

    Recipes call this when their module is imported, so that this layer knows no recipe. The YAML
    key ``name:``, ``--set name.key=value``, ``cfg.name.key``, ``to_dict`` / ``from_dict`` and a
    checkpoint's ``config.yaml`` then treat the section like a built-in one; its keys, declared with
    :func:`key`, are checked, listed and documented like the built-in ones, unknown keys in it get
    suggestions, and its ``validate()`` method, if it has one (for checks across its keys), runs
    within :func:`validate`.

    A config that names a section is loaded after the section is registered: the ``torchrig``
    command, ``torchrig.load_config`` and ``torchrig.Config`` import ``torchrig.recipes`` (every
    recipe) first; code that imports ``torchrig.config`` directly imports the recipe as well.
    """
    if not is_section(cls):
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


def names(obj: Any) -> list[str]:
    """The names under ``obj`` (a Config or a section): its fields, and for a Config the recipe sections."""
    fields = [f.name for f in dataclasses.fields(obj)]
    return fields + list(_SECTIONS) if isinstance(obj, Config) else fields


def get_key(cfg: Any, dotted: str) -> Any:
    """The value of the key ``dotted`` (``"optim.lr"``), or the section it names."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def groups() -> dict[str, type]:
    """Where keys are declared, in order: ``""`` (the top level) -> Config, the built-in sections, then
    the registered recipe sections by name (name -> dataclass)."""
    types = hints(Config)
    out: dict[str, type] = {"": Config}
    out.update({f.name: types[f.name] for f in dataclasses.fields(Config) if is_section(types[f.name])})
    out.update(sorted(_SECTIONS.items()))
    return out


def declared_keys() -> list[Key]:
    """Every key: the top-level ones, the built-in sections', then the registered recipe sections'."""
    return [k for name, cls in groups().items() for k in keys_of(cls, f"{name}." if name else "")]


def aliases() -> dict[str, str]:
    """Trainer keyword -> the dotted key it sets, for the keywords that are not top-level key names."""
    return {alias: k.name for k in declared_keys() for alias in k.aliases if alias != k.name}


# Names other tools give these keys (Lightning, Hugging Face, Keras, argparse habits): the dotted key meant.
SYNONYMS = {"learning_rate": "optim.lr", "lr_rate": "optim.lr", "optimiser": "optim.name",
            "num_epochs": "epochs", "n_epochs": "epochs", "max_epochs": "epochs", "lr_scheduler": "scheduler.name",
            "gradient_accumulation_steps": "accumulate", "accumulate_grad_batches": "accumulate",
            "gradient_clip_val": "clip_grad_norm", "max_grad_norm": "clip_grad_norm", "grad_clip": "clip_grad_norm",
            "per_device_train_batch_size": "data.batch_size", "train_batch_size": "data.batch_size",
            "output_dir": "run_dir", "logdir": "run_dir", "log_dir": "run_dir", "mixed_precision": "precision",
            "warmup": "scheduler.warmup_steps", "workers": "data.num_workers"}


def near_keys(name: str) -> list[str]:
    """The dotted keys a top-level name given without its section most likely means: the keys of that name in
    a section (``progress`` -> ``log.progress``; ``every_steps`` -> ``checkpoint.every_steps``,
    ``log.every_steps``), else the key another tool's name for it means (``learning_rate`` -> ``optim.lr``)."""
    found = sorted(k.name for k in declared_keys() if "." in k.name and k.name.rsplit(".", 1)[1] == name)
    if found:
        return found
    return [SYNONYMS[name]] if name in SYNONYMS else []
