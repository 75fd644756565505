"""Recipe config sections: registered by the recipes, loaded, overridden, checked and saved like core keys."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest
import yaml

import torchrig
import torchrig.recipes  # noqa: F401  (registers the image, text and pix2pix sections)
from torchrig import config as C
from torchrig.config import root
from torchrig.config import ConfigError, from_dict, load_config, register_section, set_key, to_dict

from helpers import PYTHON, QUIET, make_classification, subprocess_env


def test_yaml_and_overrides_fill_recipe_sections(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("recipe: image-classification\nimage:\n  size: 24\n  crop_scale: [0.5, 1.0]\n"
                    "pix2pix:\n  samples: 2\n")
    cfg = torchrig.load_config(path, ["image.hflip=true", "text.max_length=32"])
    assert (cfg.image.size, cfg.image.crop_scale, cfg.image.hflip) == (24, (0.5, 1.0), True)
    assert (cfg.pix2pix.samples, cfg.text.max_length) == (2, 32)
    saved = to_dict(cfg)
    assert saved["image"]["crop_scale"] == [0.5, 1.0] and saved["pix2pix"]["samples"] == 2
    again = from_dict(yaml.safe_load(yaml.safe_dump(saved)))
    assert again == cfg and again.image.size == 24
    again.image.size = 25
    assert again != cfg  # equality looks at the sections too


def test_python_api_knows_recipe_sections_in_a_fresh_interpreter(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("image:\n  size: 12\ntext:\n  max_length: 16\n")
    code = f"import torchrig; cfg = torchrig.load_config({str(path)!r}); print(cfg.image.size, cfg.text.max_length)"
    out = subprocess.run([PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["12", "16"]


def test_checkpoint_config_holds_the_sections(tmp_path):
    x, y = make_classification(n=16)
    cfg = torchrig.load_config(overrides=["image.size=12", "pix2pix.samples=3", "epochs=1", "data.batch_size=8"])
    trainer = torchrig.Trainer(torch_linear(), config=cfg, run_dir=str(tmp_path / "run"), **QUIET)
    trainer.fit((x, y))
    trainer.close()
    saved = yaml.safe_load((tmp_path / "run" / "checkpoints" / "latest" / "config.yaml").read_text())
    assert saved["image"]["size"] == 12 and saved["pix2pix"]["samples"] == 3
    assert from_dict(saved).image.size == 12


def torch_linear():
    import torch

    return torch.nn.Linear(8, 4)


@pytest.mark.parametrize("override,message", [
    ("image.sise=3", "unknown config key 'image.sise'; did you mean 'image.size'?"),
    ("pix2pix.sampels=3", "unknown config key 'pix2pix.sampels'; did you mean 'pix2pix.samples'?"),
    ("text.max_lenght=3", "unknown config key 'text.max_lenght'; did you mean 'text.max_length'?"),
    ("imag.size=3", "unknown config section 'imag'; did you mean 'image'?"),
])
def test_unknown_keys_in_sections_suggest(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("overrides,message", [
    (["image.size=0"], "config key 'image.size': must be at least 1, got 0"),
    (["image.resize=-4"], "config key 'image.resize': must be at least 1, got -4"),
    (["image.random_crop_padding=-1"], "config key 'image.random_crop_padding': must be at least 0, got -1"),
    (["image.crop_scale=[0.5]"], "config key 'image.crop_scale': expected two fractions of the image area "
                                 "0 < low <= high <= 1, got [0.5]"),
    (["image.crop_scale=[0, 1]"], "got [0, 1]"),
    (["image.crop_scale=[0.5, 1.5]"], "got [0.5, 1.5]"),
    (["image.crop_scale=[0.9, 0.5]"], "got [0.9, 0.5]"),
    (["image.crop_scale=[a, b]"], "got ['a', 'b']"),
    (["image.random_resized_crop=true"], "config key 'image.random_resized_crop': needs image.size"),
    (["image.channels=2"], "config key 'image.channels': 2 is not one of 1, 3"),
    (["image.cache=maybe"], "config key 'image.cache': expected true, false or 'auto', got 'maybe'"),
    (["image.std=[0.5, 0]"], "config key 'image.std': expected one number per channel (each above 0), got [0.5, 0]"),
    (["text.max_length=2"], "config key 'text.max_length': must be at least 3, got 2"),
    (["text.text_pair_column=b", "text.max_length=3"], "config key 'text.max_length': must be at least 4, got 3"),
    (["text.vocab_size=0"], "config key 'text.vocab_size': must be at least 1, got 0"),
    (["text.min_frequency=0"], "config key 'text.min_frequency': must be at least 1, got 0"),
    (["text.label_column=''"], "config key 'text.label_column': must name a column"),
    (["pix2pix.samples=-1"], "config key 'pix2pix.samples': must be at least 0, got -1"),
    (["pix2pix.dropout=1"], "config key 'pix2pix.dropout': must be in [0, 1), got 1.0"),
    (["pix2pix.direction=up"], "config key 'pix2pix.direction': 'up' is not one of AtoB, BtoA"),
    (["pix2pix.layout=grid"], "config key 'pix2pix.layout': 'grid' is not one of auto, side_by_side, folders"),
    (["pix2pix.gan_mode=wgan"], "config key 'pix2pix.gan_mode': 'wgan' is not one of vanilla, lsgan"),
    (["pix2pix.image_size=24"], "config key 'pix2pix.image_size': must be a power of two >= 8, got 24"),
    (["pix2pix.num_downs=1"], "config key 'pix2pix.num_downs': must be at least 2, got 1"),
    (["pix2pix.lambda_l1=-1"], "config key 'pix2pix.lambda_l1': must be at least 0, got -1.0"),
    (["pix2pix.channels_b=4"], "config key 'pix2pix.channels_b': 4 is not one of 1, 3"),
])
def test_section_values_are_checked(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_section_edge_values_are_accepted():
    cfg = load_config(overrides=["image.size=1", "image.crop_scale=[1, 1]", "image.random_crop_padding=0",
                                 "image.channels=1", "image.cache=false", "text.max_length=3", "text.min_frequency=1",
                                 "pix2pix.samples=0", "pix2pix.dropout=0", "pix2pix.image_size=8",
                                 "pix2pix.lambda_l1=0"])
    assert cfg.image.crop_scale == (1, 1) and cfg.pix2pix.samples == 0 and cfg.text.max_length == 3


@dataclass
class WidgetConfig:
    size: int = 2

    def validate(self) -> None:
        if self.size > 9:
            raise ConfigError(f"config key 'widget.size': must be at most 9, got {self.size}")


def test_a_registered_section_behaves_like_a_core_one(monkeypatch):
    before = C.Config()  # made before the section existed: it gets the defaults on first use
    monkeypatch.setitem(root._SECTIONS, "widget", WidgetConfig)
    assert before.widget == WidgetConfig()
    cfg = load_config(overrides=["widget.size=5"], base={"widget": {"size": 3}})
    assert cfg.widget.size == 5 and to_dict(cfg)["widget"] == {"size": 5}
    set_key(cfg, "widget.size", "7")
    assert cfg.widget.size == 7
    with pytest.raises(ConfigError, match=r"config key 'widget.size': must be at most 9, got 12"):
        load_config(overrides=["widget.size=12"])
    with pytest.raises(ConfigError, match=r"config key 'widget.size': expected an integer, got 'big'"):
        load_config(overrides=["widget.size=big"])


def test_register_section_refuses_clashes(monkeypatch):
    monkeypatch.setattr(root, "_SECTIONS", dict(root._SECTIONS))
    with pytest.raises(ConfigError, match="config section 'optim' would hide the config key 'optim'"):
        register_section("optim", WidgetConfig)
    with pytest.raises(ConfigError, match="config section 'image' is already registered by "
                                          "torchrig.recipes.image.ImageConfig; choose another name"):
        register_section("image", WidgetConfig)
    with pytest.raises(TypeError, match="config section 'gadget': .* is not a dataclass"):
        register_section("gadget", dict)
    register_section("widget", WidgetConfig)
    register_section("widget", WidgetConfig)  # importing the same module again is fine
    assert C.sections()["widget"] is WidgetConfig


def test_a_section_whose_recipe_is_not_imported_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torchrig.recipes", raising=False)  # as in a process that never imported it
    hint = "a recipe's own section is known once the recipe is imported: import torchrig.recipes"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["gizmo.size=3"])
    assert str(err.value).startswith("unknown config section 'gizmo'") and hint in str(err.value)
    path = tmp_path / "exp.yaml"
    path.write_text("gizmo:\n  size: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith("unknown config key 'gizmo'") and hint in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["gizmo=3"])  # a plain value is a mistyped key, not a section
    assert hint not in str(err.value)
    monkeypatch.undo()
    with pytest.raises(ConfigError) as err:  # the built-in recipes are known: the section is simply unknown
        load_config(overrides=["gizmo.size=3"])
    assert hint not in str(err.value)


def test_set_key_parses_like_an_override():
    cfg = C.Config()
    set_key(cfg, "optim.lr", "0.5")
    set_key(cfg, "optim.group_lr.head", "1e-2")
    set_key(cfg, "image.size", 16)
    assert cfg.optim.lr == 0.5 and cfg.optim.group_lr == {"head": 1e-2} and cfg.image.size == 16
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'; did you mean 'optim.lr'"):
        set_key(cfg, "optim.lrr", 1)
    with pytest.raises(ConfigError, match="config key 'epochs' has no sub-key 'max'"):
        set_key(cfg, "epochs.max", 1)
