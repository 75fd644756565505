"""Tiny on-disk data sets and runners shared by the recipe tests (tests/test_recipe_*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from helpers import PYTHON, dist_procs, subprocess_env

QUIET_SETS = ["log.plot=false", "log.tensorboard=false", "log.progress=none", "threads=1", "data.num_workers=0"]


def sets(*items: str) -> list[str]:
    out: list[str] = []
    for item in list(QUIET_SETS) + list(items):
        out += ["--set", item]
    return out


def cli(args: list[str], capsys=None) -> tuple[int, str, str]:
    """``torchrig.cli.main(args)`` in this process: (exit code, stdout, stderr)."""
    from torchrig.cli import main

    rc = main([str(a) for a in args])
    if capsys is None:
        return rc, "", ""
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def write_png(path: Path, array: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array.astype(np.uint8)).save(path)


def make_image_folder(root: Path, classes=("circle", "cross", "square"), per_class: int = 6, size: int = 12,
                      rgb: bool = False, seed: int = 0) -> Path:
    """Class folders of small synthetic images that a tiny CNN separates quickly."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    c = (size - 1) / 2
    shapes = {
        "circle": ((yy - c) ** 2 + (xx - c) ** 2 <= (size / 3) ** 2),
        "cross": (np.abs(yy - c) < 1.5) | (np.abs(xx - c) < 1.5),
        "square": (np.abs(yy - c) < size / 3) & (np.abs(xx - c) < size / 3),
    }
    for k, name in enumerate(classes):
        mask = shapes.get(name, (xx + yy) % (k + 2) == 0)
        for i in range(per_class):
            img = mask * 200 + rng.integers(0, 50, (size, size))
            if rgb:
                img = np.stack([img, img[::-1], np.full_like(img, 40 * k)], axis=-1)
            write_png(root / name / f"{name}_{i}.png", img)
    return root


def make_pairs(root: Path, n: int = 6, size: int = 16, layout: str = "side_by_side", seed: int = 0) -> Path:
    """Paired grayscale images: A = a bright square's outline, B = the filled square."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        a = np.zeros((size, size))
        b = np.zeros((size, size))
        y, x = rng.integers(1, size // 2, 2)
        s = int(rng.integers(4, size // 2))
        b[y:y + s, x:x + s] = 255
        a[y:y + s, x:x + s] = 255
        a[y + 1:y + s - 1, x + 1:x + s - 1] = 0
        if layout == "side_by_side":
            write_png(root / f"pair_{i}.png", np.concatenate([a, b], axis=1))
        else:
            write_png(root / "A" / f"pair_{i}.png", a)
            write_png(root / "B" / f"pair_{i}.png", b)
    return root


class PlainCNN(torch.nn.Module):
    """A small CNN without BatchNorm or dropout. Its gradient over a batch is the mean of the per-sample
    gradients, so 2 ranks × batch B must end where 1 process × batch 2B ends (BatchNorm would not:
    it normalises each rank's batch with that batch's own statistics)."""

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 4):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(in_channels, width, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten())
        self.fc = torch.nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


def register_test_models() -> None:
    """Add the tests' models to torchrig's model names (in this process)."""
    from torchrig.models import register_model

    register_model("plain_cnn", PlainCNN)


DDP_WORKER = '''
import os, sys, torch
from torchrig import runtime
from torchrig.trainer import Trainer
from helpers.recipe_helpers import register_test_models

register_test_models()

_fit = Trainer.fit

def fit(self, *args, **kwargs):
    out = _fit(self, *args, **kwargs)
    params = {k: v.detach().cpu().clone() for k, v in runtime.unwrap(self.model).named_parameters()}
    torch.save(params, os.path.join(os.environ["PARAMS_OUT"], f"rank{self.rank}.pt"))
    return out

Trainer.fit = fit
from torchrig.cli import main
sys.exit(main(sys.argv[1:]))
'''


def ddp_train(tmp_path: Path, args: list[str], timeout: int = 240) -> tuple[dict, dict]:
    """Run ``torchrig <args>`` on 2 CPU ranks (gloo) under torch.distributed.run; returns each rank's
    parameters after fit. Fails with both ranks' output on a non-zero exit."""
    worker = tmp_path / "recipe_ddp_worker.py"
    worker.write_text(DDP_WORKER)
    out = tmp_path / "params"
    out.mkdir()
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)] + \
          [str(a) for a in args]
    env = subprocess_env(PARAMS_OUT=str(out), TORCHRIG_CACHE=str(tmp_path / "cache"))
    proc = dist_procs.run(cmd, timeout, env=env, cwd=tmp_path)  # its process group: torchrun and its workers
    assert proc.returncode == 0, f"2-rank run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")


def assert_same_params(p0: dict, p1: dict) -> None:
    assert p0.keys() == p1.keys() and p0
    for k in p0:
        assert torch.equal(p0[k], p1[k]), f"parameter {k} differs between ranks"


def one_process_train(args: list[str], run_dir: Path) -> dict:
    """``torchrig <args>`` in this process; the trained weights from the final checkpoint of ``run_dir``."""
    from safetensors.torch import load_file

    register_test_models()
    rc, _, _ = cli(args)
    assert rc == 0
    return load_file(str(run_dir / "checkpoints" / "latest" / "model.safetensors"))


def max_param_diff(params: dict, reference: dict) -> float:
    """Largest absolute difference between ``params`` and the same names in ``reference``."""
    return max((params[k].double() - reference[k].double()).abs().max().item() for k in params)


def whole_split(checkpoint: Path, split: str):
    """The model of ``checkpoint`` in eval mode and every sample of ``split`` collated into one batch: the
    inputs to check ``torchrig evaluate`` by hand."""
    from torch.utils.data import default_collate

    from torchrig.recipes.run import load_for_inference

    recipe, cfg, model, _ = load_for_inference(str(checkpoint))
    data = recipe.build_data(cfg)[split]
    batch = default_collate([data[i] for i in range(len(data))])
    if hasattr(recipe, "model_inputs"):  # uint8 images: normalised as the recipe's steps do
        batch = [recipe.model_inputs(cfg, batch[0]), *batch[1:]]
    return model.eval(), batch


def read_json(path: Path):
    return json.loads(Path(path).read_text())

