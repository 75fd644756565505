"""Every value of the core config sections is checked, and every error is one line naming the key,
the value as written and what the key accepts: through ``--set`` overrides, YAML, the Trainer's
keywords, a Config object and the real command line."""

from __future__ import annotations

import dataclasses
import math
import subprocess

import pytest
from helpers import PYTHON, subprocess_env

import torchrig.recipes  # noqa: F401 - registers the recipes' config sections, as the torchrig command does
from torchrig.config import RULES, Config, ConfigError, load_config, validate

# The examples of values that used to be accepted, or refused without naming the key.
EXAMPLES = [
    ("checkpoint.every_steps=-1", "config key 'checkpoint.every_steps': expected an integer >= 0, got -1"),
    ("log.every_steps=-1", "config key 'log.every_steps': expected an integer >= 0, got -1"),
    ("optim.betas=abc", "config key 'optim.betas': expected two numbers in [0, 1), got 'abc'"),
    ("optim.betas=[0.9]", "config key 'optim.betas': expected two numbers in [0, 1), got [0.9]"),
    ("optim.betas=0.9,1.5", "config key 'optim.betas': expected two numbers in [0, 1), got '0.9,1.5'"),
    ("optim.lr=nan", "config key 'optim.lr': expected a finite number > 0, got 'nan'"),
    ("optim.lr=.inf", "config key 'optim.lr': expected a finite number > 0, got inf"),
    ("data.val_fraction=1.5", "config key 'data.val_fraction': expected a number in [0, 1), got 1.5"),
    ("run_dir=''", "config key 'run_dir': expected a directory path or null, got ''"),
    ("foo.bar=1", "unknown config section 'foo'; valid sections: checkpoint, data, dist, finetune, float8, image, lm, log, model, "
                  "optim, parallel, peft, pix2pix, profile, quantize, scheduler, spike, text"),
]


@pytest.mark.parametrize("override,message", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_issue_examples_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message


def test_run_dir_that_is_a_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a run\n")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"run_dir={notes}"])
    assert str(err.value) == f"config key 'run_dir': expected a directory path or null, got '{notes}' (an existing file)"


# One bad value for every key of the core sections: (override, the message after "expected ").
BAD_VALUES = [
    ("recipe=''", "a non-empty string, got ''"),
    ('seed=-1', 'an integer in [0, 4294967295], got -1'),
    ('epochs=0', 'an integer >= 1, got 0'),
    ('max_steps=0', 'an integer >= 1 or null, got 0'),
    ("run_dir=''", "a directory path or null, got ''"),
    ("resume=''", "a non-empty string or null, got ''"),
    ('overwrite=maybe', "true or false, got 'maybe'"),
    ('resume_weights_only=2', "true or false, got 2"),
    ('resume_changes=maybe', "one of refuse, allow, got 'maybe'"),
    ('device=gpu', "auto, cpu, cuda, cuda:N, xpu, xpu:N or mps, got 'gpu'"),
    ('precision=fp8', "one of fp32, bf16, fp16, got 'fp8'"),
    ('threads=0', 'an integer >= 1 or null, got 0'),
    ('interop_threads=0', 'an integer >= 1 or null, got 0'),
    ('deterministic=2', 'true or false, got 2'),
    ('cudnn_benchmark=yes please', "true, false or 'auto', got 'yes please'"),
    ('accumulate=0', 'an integer >= 1, got 0'),
    ("loss_normalization=mean", "one of auto, samples, tokens, micro_batches, got 'mean'"),
    ('clip_grad_norm=-1', 'a finite number > 0 or null, got -1'),
    ('clip_norm_type=0', 'a number > 0 or inf, got 0'),
    ('clip_grad_value=inf', "a finite number > 0 or null, got 'inf'"),
    ("loss=''", "a non-empty string, got ''"),
    ('label_smoothing=1.5', 'a number in [0, 1], got 1.5'),
    ('metrics={a: 1}', "a list of metric names, got {'a': 1}"),
    ('on_nonfinite=ignore', "one of error, skip, got 'ignore'"),
    ('on_spike=restart', "one of off, rollback, got 'restart'"),
    ('data.global_batch_size=0', "an integer >= 1 or null, got 0"),
    ('spike.factor=1', "a finite number > 1, got 1"),
    ('spike.window=0', "an integer >= 1, got 0"),
    ('spike.warmup_steps=0', "an integer >= 1, got 0"),
    ('spike.snapshot_every=-1', "an integer >= 0, got -1"),
    ('spike.max_rollbacks=0', "an integer >= 1, got 0"),
    ('eval_every_epochs=0', 'an integer >= 1, got 0'),
    ('early_stop_patience=0', 'an integer >= 1 or null, got 0'),
    ('data.batch_size=-8', 'an integer >= 1, got -8'),
    ('data.eval_batch_size=0', 'an integer >= 1 or null, got 0'),
    ('data.micro_batch_size=0', "an integer >= 1 or 'auto' or null, got 0"),
    ('data.num_workers=-1', "an integer >= 0 or 'auto', got -1"),
    ('data.pin_memory=sometimes', "true, false or 'auto', got 'sometimes'"),
    ('data.persistent_workers=3', 'true or false, got 3'),
    ('data.prefetch_factor=0', 'an integer >= 1 or null, got 0'),
    ('data.shuffle=maybe', "true or false, got 'maybe'"),
    ('data.pack=maybe', "true or false, got 'maybe'"),
    ('data.drop_last=maybe', "true or false, got 'maybe'"),
    ('data.fast_path=maybe', "true or false, got 'maybe'"),
    ("data.path=''", "a non-empty string or null, got ''"),
    ("data.val_path=''", "a non-empty string or null, got ''"),
    ("data.sources={web: ''}", "a mapping {name: folder or file}, got {'web': ''}"),
    ("data.mixture={web: -1}", "a mapping {source name: weight > 0}, got {'web': -1}"),
    ("data.test_path=''", "a non-empty string or null, got ''"),
    ('data.val_fraction=1.5', 'a number in [0, 1), got 1.5'),
    ('data.skip_bad_samples=maybe', "true or false, got 'maybe'"),
    ("data.input_keys=[]", "a non-empty list of batch keys or null, got []"),
    ("data.label_key=''", "a non-empty string or null, got ''"),
    ("output_key=-1", "an index >= 0 or a key name or null, got -1"),
    ("class_dim=2", "auto, 1 or -1, got 2"),
    ('data.options=3', 'a mapping, got 3'),
    ('data.steps_per_epoch=0', 'an integer >= 1 or null, got 0'),
    ("model.name=''", "a non-empty string, got ''"),
    ('model.options=[1]', 'a mapping, got [1]'),
    ("model.weights=''", "a non-empty string or null, got ''"),
    ("model.init=''", "a non-empty string or null, got ''"),
    ('model.channels_last=maybe', "true, false or 'auto', got 'maybe'"),
    ('model.activation_checkpointing=[1]', "full, selective or a list of sub-module names, got [1]"),
    ('model.compile=maybe', "true or false, got 'maybe'"),
    ('model.compile_mode=fast', "one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, got "
                                "'fast'"),
    ('model.activation_offload=maybe', "true or false, got 'maybe'"),
    ("model.fused_head=''", "a non-empty string or null, got ''"),
    ('model.factory=mypkg.models', "a 'module:attribute' string such as mypkg.models:build_model or null, "
                                   "got 'mypkg.models'"),
    ('model.python_class=[1]', "a non-empty string or null, got [1]"),
    ('data.factory=my-pkg:build', "a 'module:attribute' string such as mypkg.models:build_model or null, "
                                  "got 'my-pkg:build'"),
    ("optim.name=''", "a non-empty string, got ''"),
    ('optim.lr=nan', "a finite number > 0, got 'nan'"),
    ('optim.weight_decay=-0.1', 'a finite number >= 0, got -0.1'),
    ('optim.momentum=1.0', 'a number in [0, 1), got 1.0'),
    ('optim.nesterov=maybe', "true or false, got 'maybe'"),
    ('optim.betas=abc', "two numbers in [0, 1), got 'abc'"),
    ('optim.eps=0', 'a finite number > 0, got 0'),
    ('optim.group_lr={fc: -1}', "a mapping of module-name prefix to lr > 0, got {'fc': -1}"),
    ('optim.options=x', "a mapping, got 'x'"),
    ("scheduler.name=''", "a non-empty string or null, got ''"),
    ('scheduler.interval=batch', "one of step, epoch or null, got 'batch'"),
    ('scheduler.step_size=0', 'an integer >= 1, got 0'),
    ('scheduler.gamma=0', 'a finite number > 0, got 0'),
    ('scheduler.milestones=[0, 10]', 'a list of integers >= 1, got [0, 10]'),
    ('scheduler.warmup_steps=-1', 'an integer >= 0, got -1'),
    ('scheduler.min_lr=-1e-5', 'a finite number >= 0, got -1e-05'),
    ('scheduler.max_lr=0', 'a finite number > 0 or null, got 0'),
    ('scheduler.pct_start=1', 'a number in (0, 1), got 1'),
    ('checkpoint.every_steps=-1', 'an integer >= 0, got -1'),
    ('checkpoint.every_epochs=-1', 'an integer >= 0, got -1'),
    ('checkpoint.keep_last=0', 'an integer >= 1, got 0'),
    ('checkpoint.keep_best=-1', 'an integer >= 0, got -1'),
    ("checkpoint.monitor=''", "a non-empty string or null, got ''"),
    ('checkpoint.mode=up', "one of min, max or null, got 'up'"),
    ('checkpoint.save_final=maybe', "true or false, got 'maybe'"),
    ('log.every_steps=-1', 'an integer >= 0, got -1'),
    ('log.progress=fancy', "one of auto, bar, lines, none, got 'fancy'"),
    ('log.tensorboard=maybe', "true, false or 'auto', got 'maybe'"),
    ('log.plot=maybe', "true, false or 'inline', got 'maybe'"),
    ('log.trackers=[mlfow]', "a list of csv, tensorboard, mlflow, wandb, got ['mlfow']"),
    ('log.mlflow_uri=""', "a non-empty string or null, got ''"),
    ('log.project=""', "a non-empty string or null, got ''"),
    ('log.run_name=""', "a non-empty string or null, got ''"),
    ('log.flops=maybe', "true or false, got 'maybe'"),
    ('log.summary=maybe', "true or false, got 'maybe'"),
    ('profile.steps=[5,2]', "[] or [first, last] with 1 <= first <= last, got [5, 2]"),
    ('profile.memory_snapshot=maybe', "true or false, got 'maybe'"),
    ('dist.strategy=horovod', "one of auto, none, ddp, dp, fsdp, got 'horovod'"),
    ('dist.backend=nccl2', "a backend (gloo, nccl, mpi, ucc, xccl; per device: cpu:gloo,cuda:nccl) or null, got 'nccl2'"),
    ('dist.init_method=localhost:29500', "a tcp://HOST:PORT, file:///PATH or env:// address or null, got 'localhost:29500'"),
    ('dist.rank=-1', 'an integer >= 0 or null, got -1'),
    ('dist.world_size=0', 'an integer >= 1 or null, got 0'),
    ('dist.timeout=inf', "a finite number > 0, got 'inf'"),
    ('dist.find_unused_parameters=maybe', "true or false, got 'maybe'"),
    ('dist.static_graph=maybe', "true or false, got 'maybe'"),
    ('dist.bucket_cap_mb=0', 'a finite number > 0 or null, got 0'),
    ('dist.gradient_as_bucket_view=maybe', "true or false, got 'maybe'"),
    ('dist.sync_batchnorm=maybe', "true or false, got 'maybe'"),
    ('dist.broadcast_buffers=maybe', "true, false or 'auto', got 'maybe'"),
    ('dist.hang_timeout=-1', 'a finite number >= 0, got -1'),
    ('dist.straggler_factor=0.5', 'a finite number > 1, got 0.5'),
    ('dist.straggler_steps=0', 'an integer >= 1, got 0'),
    ('dist.health_check=maybe', "true or false, got 'maybe'"),
    ('dist.fault_tolerance=torchelastic', "one of none, torchft, got 'torchelastic'"),
    ('dist.fsdp_wrap={a: 1}', "a list of module class names, got {'a': 1}"),
    ('dist.fsdp_min_params=-1', 'an integer >= 0, got -1'),
    ('dist.fsdp_cpu_offload=maybe', "true or false, got 'maybe'"),
    ('dist.fsdp_reshard_after_forward=maybe', "true or false, got 'maybe'"),
    ('dist.requeue=maybe', "true or false, got 'maybe'"),
    ('dist.stop_timeout=0', "a finite number > 0, got 0"),
    ('parallel.dp_replicate=0', "an integer >= 1, -1 (the rest) or 'auto', got 0"),
    ('parallel.dp_shard=half', "an integer >= 1, -1 (the rest) or 'auto', got 'half'"),
    ('parallel.tp=-2', "an integer >= 1, or -1 for the ranks the other degrees leave, got -2"),
    ('parallel.cp=0', "an integer >= 1, or -1 for the ranks the other degrees leave, got 0"),
    ('parallel.pp=1.5', "an integer >= 1, or -1 for the ranks the other degrees leave, got 1.5"),
    ('parallel.tp_plan=everything', "'auto' or a mapping of module-name patterns to styles or null, got 'everything'"),
    ('parallel.loss_parallel=maybe', "true, false or 'auto', got 'maybe'"),
    ('parallel.pp_split={a: 1}', "'auto' or a list of module names, got {'a': 1}"),
    ('parallel.pp_schedule=2f2b', "one of gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble, zbv_zero_bubble, "
                                  "got '2f2b'"),
    ('parallel.pp_stages_per_rank=0', "an integer >= 1, got 0"),
    ('ema_decay=1', 'a number in (0, 1) or null, got 1'),
    ('ema_warmup=maybe', "true or false, got 'maybe'"),
    ('checkpoint.async_save=maybe', "true or false, got 'maybe'"),
    ('checkpoint.verify=sometimes', "true or false, got 'sometimes'"),
    ('checkpoint.include_base=maybe', "true or false, got 'maybe'"),
    ("peft.method=dora", "one of lora or null, got 'dora'"),
    ('peft.r=0', 'an integer >= 1, got 0'),
    ('peft.alpha=0', 'a finite number > 0, got 0'),
    ('peft.dropout=1', 'a number in [0, 1), got 1'),
    ('peft.target_modules=[]', "'all-linear' or a non-empty list of module-name patterns, got []"),
    ("peft.modules_to_save=[1]", "a list of module-name patterns, got [1]"),
    ("peft.base_dtype=int8", "one of bf16, fp16, nf4, fp4 or null, got 'int8'"),
    ("quantize.qat=int2", "one of int8-dynamic-act-int4-weight, int4-weight-only or null, got 'int2'"),
    ('quantize.group_size=0', 'an integer >= 1, got 0'),
    ("float8.recipe=axiswise", "one of tensorwise, rowwise or null, got 'axiswise'"),
    ("float8.skip=[1]", "a list of module-name patterns, got [1]"),
    ("float8.fsdp_all_gather=maybe", "true or false, got 'maybe'"),
]


def test_every_core_key_has_a_rule_and_a_bad_value_here():
    """A key added to a core section without a check (or without a test of it) fails here."""
    core: set[str] = set()
    for f in dataclasses.fields(Config):
        value = getattr(Config(), f.name)
        if not dataclasses.is_dataclass(value):
            core.add(f.name)
        elif f.name in ("data", "model", "optim", "scheduler", "checkpoint", "log", "profile", "dist", "parallel",
                        "spike", "peft", "quantize", "float8"):
            core |= {f"{f.name}.{g.name}" for g in dataclasses.fields(value)}
    assert set(RULES) == core
    assert {o.split("=", 1)[0] for o, _ in BAD_VALUES} == core


@pytest.mark.parametrize("override,expected", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_one_bad_value_per_key(override, expected):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == f"config key '{key}': expected {expected}"


def test_bad_value_in_a_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  betas: abc\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == "config key 'optim.betas': expected two numbers in [0, 1), got 'abc'"


@pytest.mark.parametrize("override,value", [
    ("optim.betas=0.8,0.9", (0.8, 0.9)), ("optim.betas=[0, 0.5]", (0.0, 0.5)), ("clip_norm_type=inf", math.inf),
    ("data.num_workers=auto", "auto"), ("dist.backend=cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("dist.init_method=tcp://10.0.0.1:29500", "tcp://10.0.0.1:29500"), ("device=cuda:1", "cuda:1"),
    ("run_dir=null", None), ("seed=4294967295", 4294967295), ("label_smoothing=1", 1.0),
])
def test_good_values_pass_normalised(override, value):
    from torchrig.config import get_key

    got = get_key(load_config(overrides=[override]), override.split("=", 1)[0])
    assert got == value and type(got) is type(value)


def test_cross_key_checks():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["dist.rank=2", "dist.world_size=2"])
    assert str(err.value) == "config key 'dist.rank': expected an integer < dist.world_size (2), got 2"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["overwrite=true", "resume=latest"])
    assert str(err.value) == ("config key 'overwrite': true would remove the run that resume='latest' continues; "
                              "set one of them")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.micro_batch_size=4", "loss_normalization=micro_batches"])
    assert str(err.value) == ("config key 'data.micro_batch_size': 4 needs loss_normalization auto, samples or "
                              "tokens (micro_batches weighs every micro-batch alike, so cutting a batch would change "
                              "the loss); set one of them, or data.micro_batch_size=null")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.micro_batch_size=auto", "dist.strategy=fsdp"])
    assert str(err.value) == ("config key 'data.micro_batch_size': 'auto' is not supported with dist.strategy=fsdp "
                              "(FSDP2's sharded gradients); set data.micro_batch_size to an integer")
    with pytest.raises(ConfigError, match="log.trackers lists tensorboard"):
        load_config(overrides=["log.tensorboard=false", "log.trackers=[tensorboard]"])
    for fine in (["data.micro_batch_size=4", "dist.strategy=fsdp"], ["data.micro_batch_size=auto"],
                 ["loss_normalization=micro_batches"]):
        load_config(overrides=fine)


@pytest.mark.parametrize("kwargs,message", [
    ({"betas": "abc"}, "config key 'optim.betas': expected two numbers in [0, 1), got 'abc'"),
    ({"lr": float("nan")}, "config key 'optim.lr': expected a finite number > 0, got nan"),
    ({"checkpoint_every": -1}, "config key 'checkpoint.every_steps': expected an integer >= 0, got -1"),
    ({"log_every": -1}, "config key 'log.every_steps': expected an integer >= 0, got -1"),
    ({"run_dir": ""}, "config key 'run_dir': expected a directory path or null, got ''"),
    ({"num_workers": -2}, "config key 'data.num_workers': expected an integer >= 0 or 'auto', got -2"),
    ({"dist_timeout": float("inf")}, "config key 'dist.timeout': expected a finite number > 0, got inf"),
    ({"scheduler.pct_start": 0}, "config key 'scheduler.pct_start': expected a number in (0, 1), got 0"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_trainer_keywords_are_checked(kwargs, message):
    import torch

    import torchrig

    with pytest.raises(ConfigError) as err:
        torchrig.Trainer(torch.nn.Linear(2, 2), **kwargs)
    assert str(err.value) == message


def test_a_config_object_is_checked_too():
    import torch

    import torchrig

    cfg = Config()
    cfg.optim.lr = float("nan")
    with pytest.raises(ConfigError) as err:
        torchrig.Trainer(torch.nn.Linear(2, 2), config=cfg)
    assert str(err.value) == "config key 'optim.lr': expected a finite number > 0, got nan"
    cfg = Config()
    cfg.data.val_fraction = 1.5
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == "config key 'data.val_fraction': expected a number in [0, 1), got 1.5"


@pytest.mark.parametrize("args,line", [
    (["--set", "optim.betas=abc"], "torchrig: error: config key 'optim.betas': expected two numbers in [0, 1), got 'abc'"),
    (["--set", "checkpoint.every_steps=-1"],
     "torchrig: error: config key 'checkpoint.every_steps': expected an integer >= 0, got -1"),
])
def test_real_cli_prints_one_line_and_exits_1(tmp_path, args, line):
    r = subprocess.run([PYTHON, "-m", "torchrig", "train", *args], cwd=tmp_path, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_empty_override_is_not_null():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["run_dir="])
    assert str(err.value) == "config key 'run_dir': expected a directory path or null, got ''"
    assert load_config(overrides=["run_dir=null"]).run_dir is None
