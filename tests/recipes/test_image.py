"""Recipe ``image-classification``: image folders, transforms, bad images, predict, DDP."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from helpers.recipe_helpers import (assert_same_params, cli, ddp_train, make_image_folder, max_param_diff,
                            one_process_train, read_json, sets, whole_split, write_png)

TINY_MODEL = ["model.options={widths: [8, 16], blocks: [1, 1]}"]


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHRIG_CACHE", str(tmp_path / "cache"))
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_export_digits_writes_class_folders(tmp_path, capsys):
    out = tmp_path / "digits"
    rc, stdout, _ = cli(["data", "export-digits", out], capsys)
    assert rc == 0 and "1797 PNG images" in stdout
    train = sorted(p.name for p in (out / "train").iterdir())
    assert train == [str(d) for d in range(10)]
    n_train = sum(1 for _ in (out / "train").rglob("*.png"))
    n_test = sum(1 for _ in (out / "test").rglob("*.png"))
    assert (n_train, n_test) == (1438, 359)
    from PIL import Image

    with Image.open(next((out / "test" / "7").iterdir())) as im:
        assert im.size == (8, 8) and im.mode == "L"
    rc, _, err = cli(["data", "export-digits", out], capsys)  # not empty: refuses, names the folder
    assert rc == 1 and str(out) in err and "not empty" in err


def test_end_to_end_train_evaluate_predict(tmp_path, capsys):
    root = tmp_path / "shapes"
    for split, n in (("train", 8), ("val", 3), ("test", 3)):
        make_image_folder(root / split, per_class=n, seed=len(split))
    run = tmp_path / "run"
    rc, out, err = cli(["train", "--recipe", "image-classification"]
                       + sets(f"data.path={root}", f"run_dir={run}", "epochs=3", "data.batch_size=8",
                              "image.size=12", "image.hflip=true", *TINY_MODEL), capsys)
    assert rc == 0, err
    assert "test: loss" in out and "top5" not in out  # 3 classes: all in the top 5, so the default leaves it out
    info = read_json(run / "classes.json")
    assert info["classes"] == ["circle", "cross", "square"] and info["channels"] == 1
    assert len(info["mean"]) == 1 and 0 < info["std"][0] < 1  # computed from the training images
    assert (run / "checkpoints" / "best").exists()  # best by val/accuracy
    index = read_json(run / "checkpoints" / "index.json")
    assert index["best"] and "val/accuracy" in json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])

    # top2, not the default top5: with 3 classes every sample is in the top 5
    rc, out, err = cli(["evaluate", "--checkpoint", run, "--split", "test", "--json", "--set", "metrics=[accuracy,top2]"],
                       capsys)
    assert rc == 0, err
    metrics = json.loads(out.strip().splitlines()[-1])
    assert metrics == pytest.approx(_by_hand(run, "test"), rel=1e-5)

    preds = tmp_path / "preds.csv"
    rc, out, err = cli(["predict", "--checkpoint", run, "--input", root / "test", "--output", preds, "--topk", "2",
                        "--features", "layers.1", "--set", "threads=1"], capsys)
    assert rc == 0, err
    rows = list(csv.DictReader(preds.open()))
    assert len(rows) == 9 and rows[0]["input"] == "circle/circle_0.png"
    assert rows[0]["prediction"] in info["classes"] and "top2_probability" in rows[0]
    feats = np.load(tmp_path / "preds.features.layers.1.npy")
    assert feats.shape == (9, 16, 6, 6)
    js = tmp_path / "one.json"  # a single file, JSON output
    rc, _, err = cli(["predict", "--checkpoint", run, "--input", root / "test" / "cross" / "cross_0.png",
                      "--output", js], capsys)
    assert rc == 0, err
    (row,) = read_json(js)
    assert row["input"] == "cross_0.png" and abs(sum(t["probability"] for t in row["top"]) - 1) < 1e-3


def _by_hand(run, split: str) -> dict:
    """Loss, accuracy and top-2 accuracy of the run's checkpoint on ``split``, from the model's outputs."""
    model, (x, y) = whole_split(run, split)
    with torch.no_grad():
        out = model(x)
    return {"loss": float(torch.nn.functional.cross_entropy(out, y)),
            "accuracy": float((out.argmax(1) == y).float().mean()),
            "top2": float((out.topk(2, dim=1).indices == y[:, None]).any(1).float().mean())}


def test_val_fraction_split_and_torchvision_model(tmp_path):
    """No val folder: a fixed stratified split; a torchvision model gets 3 channels and num_classes."""
    from torchrig.recipes import get_recipe
    from torchrig.recipes.run import build_config

    root = make_image_folder(tmp_path / "shapes", per_class=10)
    cfg = build_config(None, [f"data.path={root}", "data.val_fraction=0.2", "model.name=resnet18", "image.size=32"],
                       "image-classification")
    recipe = get_recipe("image-classification")
    model = recipe.build_model(cfg)
    data = recipe.build_data(cfg)
    assert cfg.image.channels == 3 and model.fc.out_features == 3
    assert len(data["train"]) == 24 and len(data["val"]) == 6 and "test" not in data
    assert sorted(data["val"].tensors[1].tolist()) == [0, 0, 1, 1, 2, 2]
    x = data["val"].tensors[0]
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.uint8  # normalised on the device, in the steps
    model.eval()
    assert model(recipe.model_inputs(cfg, x)).shape == (6, 3)


def test_class_map_and_local_weights(tmp_path, capsys):
    from torchrig.recipes import get_recipe
    from torchrig.recipes.run import build_config, prepare_model

    root = make_image_folder(tmp_path / "shapes", per_class=2)
    cfg = build_config(None, [f"data.path={root}", "image.class_map={square: 0, circle: 1, cross: 2}",
                              "data.val_fraction=0", "image.cache=false"] + TINY_MODEL, "image-classification")
    recipe = get_recipe("image-classification")
    model = recipe.build_model(cfg)
    assert cfg.image.classes == ["square", "circle", "cross"]
    data = recipe.build_data(cfg)["train"]
    # image.cache=false: files decoded on access, so each sample still names its file and class folder
    assert sorted((path.parent.name, label) for path, label in zip(data.items, data.labels)) == \
        [("circle", 1), ("circle", 1), ("cross", 2), ("cross", 2), ("square", 0), ("square", 0)]
    # model.weights: a file from a 5-class model loads everything but the classifier head
    from torchrig.models.vision import SmallResNet

    donor = SmallResNet(num_classes=5, in_channels=1, widths=(8, 16), blocks=(1, 1))
    torch.save(donor.state_dict(), tmp_path / "donor.pt")
    cfg.model.weights = str(tmp_path / "donor.pt")
    prepare_model(model, cfg)
    assert torch.equal(model.stem[0].weight, donor.stem[0].weight)
    assert model.fc.out_features == 3
    assert "kept the new classifier head" in capsys.readouterr().err
    torch.save({"other.weight": torch.zeros(2)}, tmp_path / "bad.pt")
    cfg.model.weights = str(tmp_path / "bad.pt")
    from torchrig.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as err:
        prepare_model(model, cfg)
    assert str(err.value).startswith(f"model.weights '{tmp_path / 'bad.pt'}' does not match the model: missing keys: "
                                     f"layers.0.0.bn1.bias, layers.0.0.bn1.num_batches_tracked")
    assert str(err.value).endswith("(36 in all); unexpected keys: other.weight. Was it saved from a different model "
                                   "or config?")


def test_bad_inputs_have_clear_messages(tmp_path, capsys):
    run = ["train", "--recipe", "image-classification"]
    missing = tmp_path / "nope"
    rc, _, err = cli(run + sets(f"data.path={missing}", f"run_dir={tmp_path / 'r0'}"), capsys)
    assert rc == 1 and f"data.path '{missing}' does not exist" in err

    flat = tmp_path / "flat"
    write_png(flat / "a.png", np.zeros((8, 8)))
    rc, _, err = cli(run + sets(f"data.path={flat}", f"run_dir={tmp_path / 'r1'}"), capsys)
    assert rc == 1 and f"data.path '{flat}' has no class sub-folders (it holds images such as a.png directly); " \
        f"put each class's images in '{flat}/<class name>/'" in err

    root = make_image_folder(tmp_path / "shapes", per_class=4)
    bad = root / "cross" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    rc, _, err = cli(run + sets(f"data.path={root}", f"run_dir={tmp_path / 'r2'}", "epochs=1", *TINY_MODEL), capsys)
    assert rc == 1 and str(bad) in err and "unreadable or corrupt" in err and "skip_bad_samples" in err
    assert not (tmp_path / "r2" / "checkpoints").exists()

    rc, out, err = cli(run + sets(f"data.path={root}", f"run_dir={tmp_path / 'r3'}", "epochs=1", "max_steps=1",
                                  "data.skip_bad_samples=true", *TINY_MODEL), capsys)
    assert rc == 0, err
    assert "skipped 1 unreadable image" in err
    listed = (tmp_path / "r3" / "bad_samples.txt").read_text()
    assert "1 unreadable" in listed and str(bad) in listed

    mixed = make_image_folder(tmp_path / "mixed", per_class=2)
    write_png(mixed / "cross" / "big.png", np.zeros((20, 20)))
    rc, _, err = cli(run + sets(f"data.path={mixed}", f"run_dir={tmp_path / 'r4'}"), capsys)
    assert rc == 1 and "the train images have different sizes (12x12, 20x20 …); set image.size=N (pixels) to " \
        "resize and center-crop them to N x N" in err

    rc, _, err = cli(run + sets(f"data.path={root}", "image.class_map={cross: 0}", f"run_dir={tmp_path / 'r5'}"), capsys)
    assert rc == 1 and f"data.path '{root}': image.class_map does not match the class folders (folders not in the " \
        f"map: ['circle', 'square']; map entries without a folder: none)" in err

    rc, _, err = cli(run + sets(f"data.path={root}", "model.name=resnet19", f"run_dir={tmp_path / 'r6'}"), capsys)
    assert rc == 1 and "unknown image model 'resnet19'; did you mean 'resnet18'?" in err

    rc, _, err = cli(["predict", "--checkpoint", tmp_path / "r3", "--input", bad, "--output", tmp_path / "p.csv"], capsys)
    assert rc == 1 and str(bad) in err


@pytest.mark.slow
def test_two_rank_ddp_equals_one_process_with_twice_the_batch(tmp_path):
    """2 ranks × batch 4 end where 1 process × batch 8 ends: the same 24 images per 3 steps, the same random
    crops (seeded per sample in the loader workers), gradients averaged over the ranks. The model has no
    BatchNorm, which would normalise each rank's batch on its own (see recipe_helpers.PlainCNN)."""
    root = make_image_folder(tmp_path / "shapes", per_class=8, size=8)

    def args(run: str, batch: int) -> list:
        return ["train", "--recipe", "image-classification"] + sets(
            f"data.path={root}", "data.val_fraction=0", "max_steps=3", "image.random_crop_padding=1",
            "data.num_workers=1", "model.name=plain_cnn", f"run_dir={tmp_path / run}", f"data.batch_size={batch}")

    p0, p1 = ddp_train(tmp_path, args("run", 4))
    assert_same_params(p0, p1)
    assert max_param_diff(p0, one_process_train(args("one", 8), tmp_path / "one")) < 1e-6
    # and the comparison can tell: batch 4 in one process (half the samples per step) ends elsewhere
    assert max_param_diff(p0, one_process_train(args("half", 4), tmp_path / "half")) > 1e-3


def test_timm_model_through_the_recipe(tmp_path, capsys):
    """timm models resolve by name (pretrained=False, in_chans / num_classes set) and train end to end."""
    pytest.importorskip("timm", reason="timm is not installed (pip install timm, part of the 'all' extra)")
    from torchrig.models.vision import build_image_model

    model = build_image_model("timm:resnet10t", num_classes=3, in_channels=1)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 3)
    root = make_image_folder(tmp_path / "shapes", per_class=6)
    run = tmp_path / "run"
    rc, out, err = cli(["train", "--recipe", "image-classification"]
                       + sets(f"data.path={root}", "data.val_fraction=0.34", "model.name=timm:resnet10t",
                              "image.size=32", f"run_dir={run}", "epochs=1", "data.batch_size=6"), capsys)
    assert rc == 0, err
    rc, out, err = cli(["evaluate", "--checkpoint", run, "--split", "val", "--json", "--set", "metrics=[accuracy,top2]"],
                       capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(_by_hand(run, "val"), rel=1e-5)


def test_uint8_loader_with_normalisation_on_the_device_equals_the_float_pipeline(tmp_path):
    """The loader gives uint8 images; the steps convert and normalise them on the device. Same images,
    same augmentation seeds: the same inputs, parameters, metrics and predictions as float32 images
    normalised in the loader."""
    from torchvision.transforms import v2 as T

    from helpers import QUIET
    from torchrig import Trainer
    from torchrig.data.datasets.images import ImageSamples
    from torchrig.recipes import get_recipe
    from torchrig.recipes.image import DeviceNormalize, build_transform
    from torchrig.recipes.run import build_config

    root = make_image_folder(tmp_path / "shapes", per_class=6)
    cfg = build_config(None, [f"data.path={root}", "data.val_fraction=0.34", "image.size=10", "image.resize=11",
                              "image.hflip=true", "image.random_crop_padding=2"] + TINY_MODEL, "image-classification")
    recipe = get_recipe("image-classification")
    data = recipe.build_data(cfg)
    ic, train, val = cfg.image, data["train"], data["val"]
    assert train[0][0].dtype == val.tensors[0].dtype == torch.uint8
    to_float = [T.ToDtype(torch.float32, scale=True), T.Normalize(list(ic.mean), list(ic.std))]
    old_train = T.Compose([build_transform(ic, train=True), *to_float])
    old_val = T.Compose([build_transform(ic, train=False), *to_float])
    norm = DeviceNormalize(ic)
    for i in range(len(train)):
        torch.manual_seed(i)
        new = norm(train[i][0][None])[0]
        torch.manual_seed(i)
        assert (new - old_train(train.image(i))).abs().max() <= 1e-6
    float_train = ImageSamples(train.items, train.labels, old_train, ic.channels)
    val_items, val_labels = recipe._prepare(cfg).splits["val"]  # the decoded images, before any transform
    float_val = ImageSamples(val_items, val_labels, old_val, ic.channels)
    assert torch.equal(torch.stack([norm(val[i][0]) for i in range(len(val))]),
                       torch.stack([float_val[i][0] for i in range(len(val))]))

    def run(name, train_data, val_data, **kw):
        torch.manual_seed(0)
        trainer = Trainer(recipe.build_model(cfg), **QUIET, run_dir=str(tmp_path / name), optimizer="sgd", lr=0.1,
                          batch_size=4, max_steps=4, num_workers=0, metrics=["accuracy"], **kw)
        trainer.fit(train_data)
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        return params, trainer.evaluate(val_data), trainer.predict(val_data)

    p_old, m_old, y_old = run("float", float_train, float_val)
    p_new, m_new, y_new = run("uint8", train, val, **recipe.trainer_kwargs(cfg, data))
    assert (p_old - p_new).abs().max() <= 1e-6
    assert m_new == pytest.approx(m_old, abs=1e-6)
    assert y_new.shape == (len(val), 3) and (y_old - y_new).abs().max() <= 1e-6
    assert torch.allclose(y_new.sum(1), torch.ones(len(val)), atol=1e-5)  # probabilities by default
    trainer = Trainer(recipe.build_model(cfg), **QUIET, run_dir=str(tmp_path / "raw"), num_workers=0,
                      **recipe.trainer_kwargs(cfg, data))
    logits = trainer.predict(val, activation="none")  # predict_fn honours activation=
    assert not torch.allclose(logits.sum(1), torch.ones(len(val)), atol=1e-3)
    assert torch.allclose(logits.softmax(1), trainer.predict(val), atol=1e-6)
