"""Model tools used by the recipes: model.init, buffers through checkpoints and .to(device), lazy imports."""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn

from helpers import PYTHON, QUIET, subprocess_env


class WithBuffers(nn.Module):
    """BatchNorm running statistics, a persistent buffer and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu().mean(dim=(2, 3))
        self.scale.mul_(1.01)  # a buffer the forward pass changes, like running statistics
        return self.fc(h) * self.scale + self.cache


def test_init_forms_apply_to_conv_and_linear_only():
    from torchrig.models.init import InitError, apply_init

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.Flatten(), nn.Linear(64, 256), nn.Embedding(10, 4))
    emb = m[4].weight.clone()
    assert apply_init(m, "normal(0, 0.02); bias=constant(0.5)") == 2
    assert abs(m[3].weight.std().item() - 0.02) < 2e-3 and torch.all(m[3].bias == 0.5)
    assert torch.equal(m[4].weight, emb) and torch.all(m[1].weight == 1)  # untouched
    apply_init(m, "xavier_uniform")
    bound = (6 / (64 + 256)) ** 0.5
    assert m[3].weight.abs().max() <= bound and torch.all(m[3].bias == 0)
    apply_init(m, "kaiming_normal(mode=fan_out, nonlinearity=relu); bias=0.1")
    assert abs(m[3].weight.std().item() - (2 / 256) ** 0.5) < 0.01 and torch.allclose(m[0].bias, torch.tensor(0.1))
    for bad, msg in [("xavier_unifrom", "unknown method 'xavier_unifrom'; did you mean 'xavier_uniform'"),
                     ("normal(0, 1, 2)", "at most 2"),
                     ("kaiming_normal(mode=sideways)", "bad arguments"), ("normal; bias=abc", "not a number"),
                     ("xavier_uniform(alpha=1)", "no argument")]:
        with pytest.raises(InitError, match=msg.replace("(", r"\(")):
            apply_init(m, bad)


def test_model_init_from_config_in_a_recipe_run(tmp_path):
    from torchrig.recipes import get_recipe
    from torchrig.recipes.run import build_config, prepare_model

    cfg = build_config(None, ["model.init=constant(0.25); bias=0"], "digits")
    model = get_recipe("digits").build_model(cfg)
    prepare_model(model, cfg)
    linear = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert linear and all(torch.all(m.weight == 0.25) for m in linear)


def test_buffers_round_trip_through_checkpoints_and_devices(tmp_path):
    import torchrig
    from torchrig.checkpoint import load_weights_file, resolve

    torch.manual_seed(0)
    model = WithBuffers()
    x, y = torch.randn(16, 1, 6, 6), torch.randint(0, 3, (16,))
    trainer = torchrig.Trainer(model, run_dir=str(tmp_path / "run"), epochs=2, batch_size=8, optimizer="sgd",
                               lr=0.1, num_workers=0, **QUIET)
    trainer.fit((x, y))
    assert model.bn.num_batches_tracked.item() == 4 and model.scale.item() != 2.0
    state = load_weights_file(resolve(str(tmp_path / "run")))
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "scale"} <= set(state)
    assert "cache" not in state  # non-persistent buffers are not saved (they are rebuilt by __init__)
    fresh = WithBuffers()
    fresh.load_state_dict(state)
    for name, buf in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], buf), name
    model.eval()
    fresh.eval()
    probe = torch.randn(4, 1, 6, 6)
    with torch.no_grad():
        assert torch.allclose(fresh(probe), model(probe))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:  # .to(device) carries every buffer, persistent or not
        moved = WithBuffers().to(dev)
        moved.load_state_dict(state)
        assert all(b.device.type == dev for b in moved.buffers())
        back = moved.to("cpu")
        assert torch.equal(back.bn.running_var, model.bn.running_var) and back.cache.device.type == "cpu"
    meta = WithBuffers().to("meta")
    assert all(b.is_meta for b in meta.buffers())
    meta = meta.to_empty(device="cpu")
    meta.load_state_dict(state)
    assert torch.equal(meta.bn.running_mean, model.bn.running_mean)


def _recipe_model_data(name: str, g: torch.Generator) -> tuple:
    """8 training samples ``(*inputs, target)`` for a recipe model of ``RECIPE_MODELS``."""
    if name == "small_resnet":
        return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    if name == "unet_generator":
        return torch.randn(8, 1, 16, 16, generator=g), torch.randn(8, 1, 16, 16, generator=g)
    ids = torch.randint(5, 30, (8, 6), generator=g)
    return ids, torch.ones_like(ids), torch.zeros_like(ids), torch.randint(0, 2, (8,), generator=g)


RECIPE_MODELS = [  # the recipes' own buffer holders: BatchNorm (ResNet, U-Net) and BERT's position ids
    ("small_resnet", {"num_classes": 3, "in_channels": 1, "widths": (8, 16), "blocks": (1, 1)}, "cross_entropy"),
    ("unet_generator", {"in_channels": 1, "out_channels": 1, "ngf": 4, "num_downs": 4, "dropout": 0.0}, "mse"),
    ("bert", {"vocab_size": 30, "num_classes": 2, "hidden": 8, "heads": 2, "layers": 1}, "cross_entropy"),
]


@pytest.mark.parametrize("name,options,loss", RECIPE_MODELS, ids=[m[0] for m in RECIPE_MODELS])
def test_recipe_models_with_buffers_survive_checkpoints(tmp_path, name, options, loss):
    import torchrig
    from torchrig.checkpoint import load_weights_file, resolve
    from torchrig.models import build_model

    torch.manual_seed(0)
    model = build_model(name, **options)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = _recipe_model_data(name, torch.Generator().manual_seed(1))
    trainer = torchrig.Trainer(model, loss=loss, metrics=[], run_dir=str(tmp_path / "run"), epochs=1, batch_size=4,
                               optimizer="sgd", lr=0.1, num_workers=0, **QUIET)
    trainer.fit(data)
    saved = load_weights_file(resolve(str(tmp_path / "run")))
    trained = model.state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k]) for k in trained)  # the trained values, buffers included
    stats = [k for k in trained if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert (len(stats) > 0) is (name != "bert")
    assert all(not torch.equal(trained[k], initial[k]) for k in stats)  # training moved every statistic
    reloaded = build_model(name, **options)
    reloaded.load_state_dict(saved)
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(*data[:-1]), model(*data[:-1]))  # eval mode uses the reloaded statistics
    if name == "bert":  # non-persistent: not in the file, rebuilt by __init__
        assert "embeddings.position_ids" not in saved
        assert torch.equal(reloaded.embeddings.position_ids, torch.arange(512).unsqueeze(0))


def test_import_torchrig_and_recipes_does_not_import_torchvision():
    code = ("import sys, torchrig, torchrig.recipes, torchrig.models, torchrig.cli; "
            "import torchrig.recipes.image, torchrig.recipes.pix2pix, torchrig.recipes.text; "
            "bad = [m for m in ('torchvision', 'transformers', 'timm', 'PIL', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["image-classification", "image-classification-resnet18", "text-classification",
                                  "pix2pix", "language-model"])
def test_example_configs_load(name):
    from helpers import REPO
    from torchrig.recipes.run import build_config

    cfg = build_config(str(REPO / "examples" / f"{name}.yaml"))
    assert cfg.recipe == name.replace("-resnet18", "")
