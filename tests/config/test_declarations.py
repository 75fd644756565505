"""Each config key is declared once (type, default, rule, Trainer keyword, help), and everything derived
from the declarations agrees with them: the Trainer's keywords, ``torchrig config`` and the README."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchrig.recipes  # noqa: F401 - registers the recipes' sections, as the torchrig command does
from torchrig import config as C
from torchrig.config import reference, root
from torchrig.config.schema import check_value

README = Path(__file__).resolve().parents[2] / "README.md"

# The Trainer keywords that set a key of another name: public API, so listed here in full.
TRAINER_KEYWORDS = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "momentum": "optim.momentum",
    "nesterov": "optim.nesterov", "betas": "optim.betas", "group_lr": "optim.group_lr", "optimizer": "optim.name",
    "batch_size": "data.batch_size", "global_batch_size": "data.global_batch_size", "eval_batch_size": "data.eval_batch_size",
    "micro_batch_size": "data.micro_batch_size", "num_workers": "data.num_workers", "pin_memory": "data.pin_memory",
    "shuffle": "data.shuffle", "drop_last": "data.drop_last", "fast_path": "data.fast_path",
    "steps_per_epoch": "data.steps_per_epoch", "persistent_workers": "data.persistent_workers",
    "input_keys": "data.input_keys", "label_key": "data.label_key",
    "checkpoint_every": "checkpoint.every_steps", "checkpoint_every_epochs": "checkpoint.every_epochs",
    "keep_last": "checkpoint.keep_last", "keep_best": "checkpoint.keep_best", "monitor": "checkpoint.monitor",
    "monitor_mode": "checkpoint.mode", "log_every": "log.every_steps", "progress": "log.progress",
    "tensorboard": "log.tensorboard", "plot": "log.plot", "trackers": "log.trackers", "flops": "log.flops", "summary": "log.summary",
    "strategy": "dist.strategy", "dp_replicate": "parallel.dp_replicate", "dp_shard": "parallel.dp_shard",
    "cp": "parallel.cp", "tp": "parallel.tp", "tp_plan": "parallel.tp_plan", "loss_parallel": "parallel.loss_parallel",
    "pp": "parallel.pp", "pp_split": "parallel.pp_split",
    "pp_schedule": "parallel.pp_schedule", "pp_stages_per_rank": "parallel.pp_stages_per_rank",
    "sync_batchnorm": "dist.sync_batchnorm", "backend": "dist.backend",
    "init_method": "dist.init_method", "rank": "dist.rank", "world_size": "dist.world_size",
    "dist_timeout": "dist.timeout", "find_unused_parameters": "dist.find_unused_parameters",
    "static_graph": "dist.static_graph", "bucket_cap_mb": "dist.bucket_cap_mb", "fsdp_wrap": "dist.fsdp_wrap",
    "broadcast_buffers": "dist.broadcast_buffers", "warmup_steps": "scheduler.warmup_steps",
    "scheduler": "scheduler.name", "scheduler_interval": "scheduler.interval",
    "channels_last": "model.channels_last", "compile": "model.compile",
    "activation_checkpointing": "model.activation_checkpointing",
    "peft": "peft.method", "lora_r": "peft.r", "lora_alpha": "peft.alpha", "qat": "quantize.qat",
    "compile_mode": "model.compile_mode", "activation_offload": "model.activation_offload",
    "fused_head": "model.fused_head", "float8": "float8.recipe",
}


def incomplete(keys: list[C.Key]) -> list[str]:
    """What each key lacks of a whole declaration: a type, a default, a rule the default meets, one line of help."""
    problems = []
    for k in keys:
        if k.type in (None, typing.Any):
            problems.append(f"{k.name}: no type")
        if k.default is dataclasses.MISSING:
            problems.append(f"{k.name}: no default")
        if k.rule is None:
            problems.append(f"{k.name}: no rule (declare it with torchrig.config.key)")
        elif k.default is not dataclasses.MISSING:
            try:
                check_value(k.name, k.rule, k.default)
            except C.ConfigError as exc:
                problems.append(f"{k.name}: the default fails its own rule ({exc})")
        if not k.help.strip() or "\n" in k.help:
            problems.append(f"{k.name}: no one-line help")
    return problems


def test_every_key_has_a_type_default_rule_and_help():
    keys = C.declared_keys()
    assert len(keys) > 150 and {"image.size", "text.max_length", "pix2pix.samples"} <= {k.name for k in keys}
    assert incomplete(keys) == []
    assert len({k.name for k in keys}) == len(keys)


@dataclass
class GadgetConfig:
    size: int = C.key(2, C.Rule("an integer", int), "")  # no help
    colour: str = "red"  # not declared with key(): no rule, no help
    shape: str = dataclasses.field(default="round", metadata={})


def test_a_key_declared_without_help_or_rule_is_found(monkeypatch):
    monkeypatch.setitem(root._SECTIONS, "gadget", GadgetConfig)
    assert incomplete(C.declared_keys()) == [
        "gadget.size: no one-line help", "gadget.colour: no rule (declare it with torchrig.config.key)",
        "gadget.colour: no one-line help", "gadget.shape: no rule (declare it with torchrig.config.key)",
        "gadget.shape: no one-line help"]
    assert reference.with_table(README.read_text()) != README.read_text()  # the README test fails too


def test_aliases_are_unique_and_name_existing_keys():
    keys = C.declared_keys()
    names = {k.name for k in keys}
    top = {name for name in names if "." not in name}
    given = [a for k in keys for a in k.aliases]
    assert len(given) == len(set(given)), "a Trainer keyword is declared by two keys"
    assert not (set(C.aliases()) & top), "a Trainer keyword hides a top-level key"
    assert set(C.aliases().values()) <= names
    assert C.aliases() == TRAINER_KEYWORDS


def test_the_listing_names_every_key():
    text = reference.listing()
    lines = {line.split(" = ")[0].strip() for line in text.splitlines() if " = " in line and line.startswith("  ")}
    assert lines == {k.name for k in C.declared_keys()}
    assert "  optim.lr = 0.001  (Trainer: lr=)" in text.splitlines()
    assert all(len(line) <= 80 for line in text.splitlines() if line.startswith("    "))  # help and rule: wrapped


def test_the_listing_of_a_section_or_a_key():
    optim = reference.listing(["optim"]).splitlines()
    assert optim[0] == "optim: The optimizer of every parameter group."
    assert {line.split(" = ")[0].strip() for line in optim if " = " in line} == \
        {k.name for k in C.declared_keys() if k.name.startswith("optim.")}
    one = reference.listing(["data.micro_batch_size", "seed"]).splitlines()
    assert [line for line in one if " = " in line] == ["  seed = 0", "  data.micro_batch_size = null  (Trainer: "
                                                                     "micro_batch_size=)"]
    assert "    accepts an integer >= 1 or 'auto' or null" in one
    with pytest.raises(C.ConfigError, match="unknown config key or section 'optm'; did you mean 'optim'"):
        reference.listing(["optm"])


def test_torchrig_config_prints_the_listing(capsys):
    from torchrig.cli import main

    assert main(["config", "scheduler"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scheduler: The learning-rate schedule.\n") and "  scheduler.pct_start = 0.3\n" in out
    assert main(["config", "schedular"]) == 1
    assert "torchrig: error: unknown config key or section 'schedular'; did you mean 'scheduler'?" in \
        capsys.readouterr().err


def test_the_readme_reference_is_the_declarations():
    text = README.read_text()
    assert reference.BEGIN in text and reference.END in text
    assert reference.with_table(text) == text, "README.md is out of date: run python tools/config_reference.py"


def test_the_readme_table_changes_with_a_declaration(monkeypatch):
    text = README.read_text()
    field = next(f for f in dataclasses.fields(C.OptimConfig) if f.name == "lr")
    spec = field.metadata[C.schema.SPEC]
    monkeypatch.setattr(field, "metadata", {C.schema.SPEC: spec._replace(help="the step size")})
    assert "| `optim.lr` | `0.001` | a finite number > 0 | `lr` | the step size |" in reference.markdown()
    assert reference.with_table(text) != text
