"""Recipe ``pix2pix``: paired data layouts, the GAN step, sample grids, predict, DDP."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import read_jsonl
from helpers.recipe_helpers import (assert_same_params, cli, ddp_train, make_pairs, max_param_diff, sets, whole_split,
                            write_png)

TINY_GAN = ["pix2pix.ngf=4", "pix2pix.ndf=4", "pix2pix.d_layers=1"]


pytestmark = pytest.mark.usefixtures("restore_threads")


def test_networks_shapes_and_init():
    from torchrig.models.pix2pix import build_pix2pix

    torch.manual_seed(0)
    m = build_pix2pix(in_channels=1, out_channels=3, image_size=32, ngf=8, ndf=8, d_layers=2)
    x = torch.randn(2, 1, 32, 32)
    y = m["G"](x)
    assert y.shape == (2, 3, 32, 32) and y.abs().max() <= 1  # tanh output
    assert m["D"](torch.cat([x, y], 1)).shape == (2, 1, 6, 6)  # one logit per patch
    big = build_pix2pix(3, 3, 64, ngf=16, ndf=16)
    convs = [mod.weight for mod in big.modules() if isinstance(mod, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
    w = torch.cat([c.flatten() for c in convs])
    assert abs(w.mean().item()) < 1e-3 and abs(w.std().item() - 0.02) < 1e-3  # N(0, 0.02)
    assert sum(isinstance(mod, torch.nn.Dropout) for mod in big["G"].modules()) == 3
    with pytest.raises(ValueError) as err:
        build_pix2pix(1, 1, 16, d_layers=3)
    assert str(err.value) == "pix2pix.d_layers 3 is too deep for image_size 16; lower it"


def test_digits_pairs():
    from torchrig.data.datasets.paired import digits_pairs

    parts = digits_pairs(32, 0.1)
    a, b = parts["train"]
    assert a.shape == b.shape and a.shape[1:] == (1, 32, 32) and set(parts) == {"train", "val", "test"}
    assert a.min() >= -1 and a.max() <= 1 and b.min() >= -1 and b.max() <= 1
    assert len(parts["test"][0]) == 359


@pytest.mark.parametrize("layout", ["side_by_side", "folders"])
def test_end_to_end_train_evaluate_predict(tmp_path, capsys, layout):
    data = make_pairs(tmp_path / "pairs", n=8, size=16, layout=layout)
    run = tmp_path / "run"
    extra = ["pix2pix.flip=true", "pix2pix.load_size=20"] if layout == "folders" else []
    rc, out, err = cli(["train", "--recipe", "pix2pix"]
                       + sets(f"data.path={data}", f"run_dir={run}", "epochs=2", "data.batch_size=2",
                              "data.val_fraction=0.25", "pix2pix.image_size=16", "log.every_steps=1", *TINY_GAN,
                              *extra), capsys)
    assert rc == 0, err
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["epoch-001.png", "epoch-002.png"]
    rows = read_jsonl(run / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss_d" in r]
    assert train_rows and {"train/loss_g_gan", "train/l1", "train/loss_g"} <= set(train_rows[0])
    assert [r["val/l1"] for r in rows if "val/l1" in r]  # held-out L1 each epoch
    rc, out, err = cli(["evaluate", "--checkpoint", run, "--split", "val", "--json"], capsys)
    assert rc == 0, err
    model, (a, b) = whole_split(run, "val")  # held-out L1: mean |G(A) - B| over the val pairs, by hand
    with torch.no_grad():
        l1 = float((model["G"](a) - b).abs().mean())
    assert json.loads(out.strip().splitlines()[-1]) == pytest.approx({"l1": l1}, rel=1e-5)
    inputs = data if layout == "side_by_side" else data / "A"
    preds = tmp_path / "out"
    rc, out, err = cli(["predict", "--checkpoint", run, "--input", inputs, "--output", preds,
                        "--features", "G.down.1"], capsys)
    assert rc == 0, err
    from PIL import Image

    files = sorted(p.name for p in preds.glob("*.png"))
    assert files == [f"pair_{i}.png" for i in range(8)]
    with Image.open(preds / "pair_0.png") as im:
        assert im.size == (16, 16) and im.mode == "L"
    assert np.load(preds / "features.G.down.1.npy").shape == (8, 8, 4, 4)


def test_bad_inputs_have_clear_messages(tmp_path, capsys):
    run = ["train", "--recipe", "pix2pix"]
    missing = tmp_path / "nope"
    rc, _, err = cli(run + sets(f"data.path={missing}", f"run_dir={tmp_path / 'r'}"), capsys)
    assert rc == 1 and f"data.path '{missing}' does not exist" in err

    data = make_pairs(tmp_path / "folders", n=3, size=16, layout="folders")
    (data / "B" / "pair_2.png").rename(data / "B" / "other.png")
    rc, _, err = cli(run + sets(f"data.path={data}", f"run_dir={tmp_path / 'r'}"), capsys)
    assert rc == 1 and f"data.path '{data}': A and B file names must match; only in A: ['pair_2'], only in B: " \
        f"['other']" in err

    sbs = make_pairs(tmp_path / "sbs", n=4, size=16)
    (sbs / "pair_3.png").write_bytes(b"not a png at all")
    rc, _, err = cli(run + sets(f"data.path={sbs}", f"run_dir={tmp_path / 'r'}", "pix2pix.image_size=16"), capsys)
    assert rc == 1 and f"image '{sbs / 'pair_3.png'}' is unreadable or corrupt (UnidentifiedImageError: " in err
    assert "fix or remove it, or set data.skip_bad_samples=true to skip such files" in err
    rc, _, err = cli(run + sets(f"data.path={sbs}", f"run_dir={tmp_path / 'r2'}", "pix2pix.image_size=16",
                                "data.skip_bad_samples=true", "max_steps=1", "data.val_fraction=0", *TINY_GAN), capsys)
    assert rc == 0, err
    assert "pair_3.png" in (tmp_path / "r2" / "bad_samples.txt").read_text()

    write_png(tmp_path / "odd" / "x.png", np.zeros((16, 31)))
    rc, _, err = cli(run + sets(f"data.path={tmp_path / 'odd'}", f"run_dir={tmp_path / 'r'}"), capsys)
    assert rc == 1 and f"image '{tmp_path / 'odd' / 'x.png'}' is unreadable or corrupt (width 31 is odd; a " \
        f"side-by-side pair needs A and B of equal width)" in err
    rc, _, err = cli(run + sets("pix2pix.image_size=24", f"run_dir={tmp_path / 'r'}"), capsys)
    assert rc == 1 and "torchrig: error: config key 'pix2pix.image_size': must be a power of two >= 8, got 24" in err
    rc, _, err = cli(run + sets("pix2pix.gan_mode=wgan", f"run_dir={tmp_path / 'r'}"), capsys)
    assert rc == 1 and "torchrig: error: config key 'pix2pix.gan_mode': 'wgan' is not one of vanilla, lsgan" in err


def _two_ranks_by_hand(cfg, world: int = 2) -> tuple[dict, dict]:
    """The recipe's GAN step for ``world`` ranks written out in one process: each rank's half of the batch
    through G and D (BatchNorm on that half only, as under DDP), gradients averaged over the ranks, D
    stepped before G's loss looks at it. Returns (initial, final) parameters."""
    import torch.nn.functional as F
    from torch.utils.data import default_collate

    from torchrig.recipes.pix2pix import Pix2PixRecipe, gan_loss
    from torchrig.recipes.run import prepare_model
    from torchrig.runtime import seed_everything

    recipe = Pix2PixRecipe()  # its own instance: nothing cached from other runs of this process
    seed_everything(cfg.seed)  # as the training command does before building the model
    model = recipe.build_model(cfg)
    prepare_model(model, cfg)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    pairs, batch = recipe.build_data(cfg)["train"], cfg.data.batch_size
    G, D = model["G"], model["D"]
    opt = {k: torch.optim.SGD(m.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum) for k, m in model.items()}
    gan = gan_loss(cfg.pix2pix.gan_mode)
    for step in range(cfg.max_steps):  # data.shuffle=false: rank r takes the r-th slice of each global batch
        first = step * world * batch
        shards = [default_collate([pairs[first + r * batch + j] for j in range(batch)]) for r in range(world)]
        fakes = [G(a) for a, _ in shards]
        for (a, b), fake in zip(shards, fakes):
            loss_d = 0.5 * (gan(D(torch.cat([a, fake.detach()], 1)), False) + gan(D(torch.cat([a, b], 1)), True))
            (loss_d / world).backward()
        opt["D"].step()
        opt["D"].zero_grad()
        D.requires_grad_(False)
        for (a, b), fake in zip(shards, fakes):
            loss_g = gan(D(torch.cat([a, fake], 1)), True) + cfg.pix2pix.lambda_l1 * F.l1_loss(fake, b)
            (loss_g / world).backward()
        D.requires_grad_(True)
        opt["G"].step()
        opt["G"].zero_grad()
    return start, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.slow
def test_two_rank_ddp_matches_the_gan_step_written_out_for_two_ranks(tmp_path):
    """Under DDP, G and D are each wrapped and all-reduced on their own. BatchNorm normalises each rank's
    batch alone, so one process with twice the batch is not the reference: the recipe's step written out
    per rank is. SGD, not Adam: Adam's update hardly depends on the gradients' scale."""
    from torchrig.recipes.run import build_config

    data = make_pairs(tmp_path / "pairs", n=8, size=16)
    items = [f"data.path={data}", "data.val_fraction=0", "data.shuffle=false", "data.batch_size=2", "max_steps=2",
             "pix2pix.image_size=16", "pix2pix.dropout=0", "optim.name=sgd", "optim.lr=0.05", *TINY_GAN]
    p0, p1 = ddp_train(tmp_path, ["train", "--recipe", "pix2pix"] + sets(*items, f"run_dir={tmp_path / 'run'}"))
    assert_same_params(p0, p1)
    assert any(k.startswith("D.") for k in p0) and any(k.startswith("G.") for k in p0)
    start, by_hand = _two_ranks_by_hand(build_config(None, items, "pix2pix"))
    assert max_param_diff(p0, by_hand) < 1e-6
    assert max_param_diff(p0, start) > 1e-3  # the two steps moved the weights far more than the tolerance
