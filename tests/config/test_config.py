"""Capability 11: typed configuration from dataclasses, YAML files and ``--set`` overrides."""

from __future__ import annotations

import pytest
import yaml

from torchrig.config import Config, ConfigError, from_dict, load_config, read_yaml, to_dict


# The defaults of the README's configuration reference, key by key.
README_DEFAULTS = {
    "recipe": "digits", "seed": 0, "epochs": 10, "max_steps": None, "run_dir": None, "resume": None,
    "device": "auto", "precision": "fp32", "threads": None, "interop_threads": None, "deterministic": False,
    "cudnn_benchmark": "auto", "accumulate": 1, "loss_normalization": "auto", "clip_grad_norm": None, "clip_norm_type": 2.0,
    "clip_grad_value": None, "loss": "auto", "label_smoothing": 0.0, "metrics": ["accuracy"],
    "on_nonfinite": "error", "eval_every_epochs": 1, "early_stop_patience": None, "data.batch_size": 64,
    "data.num_workers": "auto", "data.pin_memory": "auto", "data.persistent_workers": True, "data.fast_path": True,
    "optim.name": "adamw", "optim.lr": 1e-3, "optim.group_lr": {}, "scheduler.name": None, "scheduler.interval": None,
    "scheduler.step_size": 30, "scheduler.gamma": 0.1, "checkpoint.every_steps": 0, "checkpoint.every_epochs": 1,
    "checkpoint.keep_last": 2, "checkpoint.keep_best": 1, "checkpoint.monitor": None, "log.every_steps": 50,
    "log.progress": "auto", "log.tensorboard": "auto", "log.plot": True,
    "output_key": None, "data.input_keys": None, "data.label_key": None, "class_dim": "auto",
}


def test_defaults_are_the_documented_ones():
    from torchrig.config import get_key

    cfg = load_config()
    assert isinstance(cfg, Config)
    got = {key: get_key(cfg, key) for key in README_DEFAULTS}
    assert got == README_DEFAULTS


def test_yaml_file_then_overrides_win(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("epochs: 7\noptim:\n  name: sgd\n  lr: 0.1\ndata:\n  batch_size: 16\n")
    cfg = load_config(path, ["optim.lr=0.01", "data.batch_size=32"])
    assert cfg.epochs == 7
    assert cfg.optim.name == "sgd"
    assert cfg.optim.lr == 0.01
    assert cfg.data.batch_size == 32


@pytest.mark.parametrize("override,expected", [
    ("seed=3", ("seed", 3)),
    ("max_steps=100", ("max_steps", 100)),
    ("max_steps=null", ("max_steps", None)),
    ("optim.lr=3e-4", ("optim.lr", 3e-4)),  # YAML 1.1 would keep '3e-4' a string
    ("optim.lr=1", ("optim.lr", 1.0)),
    ("precision=bf16", ("precision", "bf16")),
    ("accumulate=4", ("accumulate", 4)),
    ("clip_grad_norm=1.0", ("clip_grad_norm", 1.0)),
    ("clip_norm_type=inf", ("clip_norm_type", float("inf"))),
    ("checkpoint.every_steps=5", ("checkpoint.every_steps", 5)),
    ("resume=latest", ("resume", "latest")),
    ("threads=2", ("threads", 2)),
    ("run_dir=runs/x", ("run_dir", "runs/x")),
    ("data.shuffle=false", ("data.shuffle", False)),
    ("data.num_workers=2", ("data.num_workers", 2)),
    ("data.num_workers=auto", ("data.num_workers", "auto")),
    ("metrics=accuracy,top5", ("metrics", ["accuracy", "top5"])),
    ("metrics=[accuracy, f1]", ("metrics", ["accuracy", "f1"])),
    ("optim.betas=[0.8, 0.9]", ("optim.betas", (0.8, 0.9))),
])
def test_overrides_are_typed(override, expected):
    from torchrig.config import get_key

    cfg = load_config(overrides=[override])
    key, value = expected
    got = get_key(cfg, key)
    assert got == value and type(got) is type(value)


def test_dict_sub_keys_for_group_lr():
    cfg = load_config(overrides=["optim.group_lr.backbone=1e-4", "optim.group_lr.head=1e-2"])
    assert cfg.optim.group_lr == {"backbone": 1e-4, "head": 1e-2}


def test_yaml_float_without_dot_is_a_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  group_lr: {backbone: 1e-4}\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 1e-3 and cfg.optim.group_lr == {"backbone": 1e-4}


@pytest.mark.parametrize("override,message", [
    ("epochs=abc", "config key 'epochs': expected an integer >= 1, got 'abc'"),
    ("epochs=2.5", "config key 'epochs': expected an integer >= 1, got 2.5"),
    ("optim.lr=fast", "config key 'optim.lr': expected a finite number > 0, got 'fast'"),
    ("data.shuffle=maybe", "config key 'data.shuffle': expected true or false, got 'maybe'"),
    ("max_steps=many", "config key 'max_steps': expected an integer >= 1 or null, got 'many'"),
    ("data.batch_size=[1,2]", "config key 'data.batch_size': expected an integer >= 1, got [1, 2]"),
    ("optim.group_lr=3", "config key 'optim.group_lr': expected a mapping of module-name prefix to lr > 0, got 3"),
])
def test_bad_types_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert message in str(err.value)


@pytest.mark.parametrize("override,message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("epoch=3", "unknown config key 'epoch'; did you mean 'epochs'?"),
    ("data.batchsize=3", "unknown config key 'data.batchsize'; did you mean 'data.batch_size'?"),
    ("optimm.lr=1", "unknown config section 'optimm'; did you mean 'optim'?"),
    ("checkpoint.evry_steps=1", "unknown config key 'checkpoint.evry_steps'; did you mean 'checkpoint.every_steps'?"),
    ("seed.x=1", "config key 'seed' has no sub-key 'x'"),
    ("zzzzzz=1", "unknown config key 'zzzzzz'; valid keys: accumulate, checkpoint, class_dim, clip_grad_norm, "),
])
def test_unknown_keys_suggest_the_closest(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert message in str(err.value)


@pytest.mark.parametrize("override,message", [
    ("precision=fp8", "config key 'precision': expected one of fp32, bf16, fp16, got 'fp8'"),
    ("on_nonfinite=ignore", "config key 'on_nonfinite': expected one of error, skip, got 'ignore'"),
    ("epochs=0", "config key 'epochs': expected an integer >= 1, got 0"),
    ("accumulate=0", "config key 'accumulate': expected an integer >= 1, got 0"),
    ("data.batch_size=0", "config key 'data.batch_size': expected an integer >= 1, got 0"),
    ("max_steps=0", "config key 'max_steps': expected an integer >= 1 or null, got 0"),
    ("optim.lr=-1", "config key 'optim.lr': expected a finite number > 0, got -1"),
    ("clip_grad_norm=0", "config key 'clip_grad_norm': expected a finite number > 0 or null, got 0"),
    ("clip_grad_value=-1", "config key 'clip_grad_value': expected a finite number > 0 or null, got -1"),
    ("checkpoint.mode=up", "config key 'checkpoint.mode': expected one of min, max or null, got 'up'"),
    ("threads=0", "config key 'threads': expected an integer >= 1 or null, got 0"),
    ("data.num_workers=many", "config key 'data.num_workers': expected an integer >= 0 or 'auto', got 'many'"),
    ("data.pin_memory=maybe", "config key 'data.pin_memory': expected true, false or 'auto', got 'maybe'"),
    ("log.tensorboard=maybe", "config key 'log.tensorboard': expected true, false or 'auto', got 'maybe'"),
    ("log.progress=fancy", "config key 'log.progress': expected one of auto, bar, lines, none, got 'fancy'"),
])
def test_bad_values_are_explained(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert message in str(err.value)


@pytest.mark.parametrize("item,message", [
    ("epochs", "override 'epochs' is not KEY=VALUE (for example --set optim.lr=0.01)"),
    ("=3", "override '=3' has an empty key"),
])
def test_malformed_overrides(item, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[item])
    assert message in str(err.value)


def test_yaml_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'; did you mean 'optim.lr'\?"):
        load_config(path)


def test_yaml_section_given_a_scalar(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: 3\n")
    with pytest.raises(ConfigError, match="config key 'optim': expected a mapping of sub-keys, got 3"):
        load_config(path)


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: 3\n  optim: [\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"config file '{path}' is not valid YAML at line 2" in str(err.value)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys, found list"):
        load_config(path)


def test_empty_yaml_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == Config()


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"config file '{path}' does not exist" in str(err.value)


def test_directory_given_as_config(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert f"config file '{tmp_path}' is a directory; pass a YAML file" in str(err.value)


def test_binary_file_given_as_config(tmp_path):
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01\x80")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert str(err.value).startswith(f"config file '{path}' is not a text file")


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(overrides=["optim.betas=[0.8,0.9]", "clip_norm_type=inf", "optim.group_lr.head=0.1",
                                 "metrics=accuracy,top5"])
    text = yaml.safe_dump(to_dict(cfg))
    again = from_dict(yaml.safe_load(text))
    assert again == cfg


def test_path_objects_are_accepted_for_strings(tmp_path):
    import torch

    import torchrig

    trainer = torchrig.Trainer(torch.nn.Linear(2, 2), run_dir=tmp_path / "r", resume=None, tensorboard=False)
    assert trainer.cfg.run_dir == str(tmp_path / "r")


def test_trainer_unknown_keyword_suggests(tmp_path):
    import torch

    import torchrig

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epoch'; did you mean 'epochs'\?"):
        torchrig.Trainer(torch.nn.Linear(2, 2), epoch=3, run_dir=str(tmp_path))


def test_trainer_data_keywords_reach_their_keys(tmp_path):
    import torch

    import torchrig

    trainer = torchrig.Trainer(torch.nn.Linear(2, 2), steps_per_epoch=7, persistent_workers=False,
                               run_dir=str(tmp_path))
    assert trainer.cfg.data.steps_per_epoch == 7 and trainer.cfg.data.persistent_workers is False


@pytest.mark.parametrize("fast_path", [True, False])
def test_steps_per_epoch_caps_the_epoch_of_a_data_set(tmp_path, fast_path):
    import torch

    import torchrig

    x, y = torch.randn(40, 2), torch.randint(0, 2, (40,))
    rows = []

    class Rows:
        def on_log(self, trainer, values, kind):
            rows.append((kind, trainer.global_step))

    trainer = torchrig.Trainer(torch.nn.Linear(2, 2), batch_size=8, epochs=3, steps_per_epoch=2, accumulate=1,
                               fast_path=fast_path, num_workers=0, callbacks=[Rows()], run_dir=str(tmp_path),
                               tensorboard=False, plot=False, progress="none")
    trainer.fit((x, y))  # 5 batches per epoch in the data; 2 taken
    assert trainer.global_step == 6 and [s for k, s in rows if k == "epoch"] == [2, 4, 6]


def test_trainer_bad_value_is_a_config_error(tmp_path):
    import torch

    import torchrig

    with pytest.raises(ConfigError, match="config key 'accumulate': expected an integer >= 1, got 0"):
        torchrig.Trainer(torch.nn.Linear(2, 2), accumulate=0, run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="config key 'optim.lr': expected a finite number > 0, got 'fast'"):
        torchrig.Trainer(torch.nn.Linear(2, 2), lr="fast", run_dir=str(tmp_path))


def test_trainer_takes_a_config_object(tmp_path):
    import torch

    import torchrig

    cfg = load_config(overrides=["epochs=2", "optim.name=sgd", f"run_dir={tmp_path}"])
    trainer = torchrig.Trainer(torch.nn.Linear(2, 2), config=cfg, lr=0.5)
    assert trainer.cfg.epochs == 2 and trainer.cfg.optim.lr == 0.5
    assert cfg.optim.lr != 0.5  # the caller's config is not modified
    assert isinstance(trainer.optimizers["default"], torch.optim.SGD)


def test_a_capped_epoch_resumes_exactly(tmp_path):
    import torch

    import torchrig

    x, y = torch.randn(40, 2), torch.randint(0, 2, (40,))

    def run(run_dir, **kw):
        torch.manual_seed(0)
        trainer = torchrig.Trainer(torch.nn.Linear(2, 2), optimizer="sgd", lr=0.1, batch_size=8, epochs=3,
                                   steps_per_epoch=2, fast_path=False, num_workers=0, run_dir=str(run_dir),
                                   tensorboard=False, plot=False, progress="none", seed=3, **kw)
        trainer.fit((x, y))
        return trainer

    whole = run(tmp_path / "whole")
    run(tmp_path / "parts", max_steps=3)  # stops in the middle of the second (capped) epoch
    resumed = run(tmp_path / "parts", resume="latest")
    assert resumed.global_step == whole.global_step == 6
    assert all(torch.equal(a, b) for a, b in zip(whole.model.state_dict().values(),
                                                 resumed.model.state_dict().values()))
