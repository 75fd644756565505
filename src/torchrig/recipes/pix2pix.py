"""``pix2pix``: image-to-image translation with a conditional GAN (Isola et al., 2017).

The model is ``nn.ModuleDict({"G": U-Net, "D": PatchGAN})`` with one Adam per network (lr 2e-4,
β1 0.5). The training step is a custom step on the core's :class:`~torchrig.trainer.Step`: D learns
to tell (input, target) from (input, G(input)); then G learns to fool D while staying close to the
target, ``loss_G = GAN(D(input, G(input)), real) + λ·L1(G(input), target)``. Precision, gradient
accumulation, DDP (each network wrapped on its own), checkpoints and logging are the Trainer's.

Each epoch's validation writes ``RUN_DIR/samples/epoch-NNN.png`` (columns: input, output, target)
and reports the held-out L1 (``val/l1``, on images in [-1, 1]), which picks the best checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from .. import config as C
from ..config import rules as R
from ..data.datasets import paired as P
from ..data.datasets.images import BadImageError, GRAY_MODES, image_mode, read_image, write_bad_list
from ..runtime import is_main_process, unwrap
from .base import Recipe, RecipeError
from .common import display_name, input_files, say, stratified_split

PAPER = {"image_size": 256, "ngf": 64, "ndf": 64, "d_layers": 3}
DIGITS = {"image_size": 32, "ngf": 32, "ndf": 32, "d_layers": 2}
GAN_MODES = ("vanilla", "lsgan")


def _power_of_two(v: Any) -> Any:
    if not R.is_int(v):
        raise TypeError
    if v < 8 or v & (v - 1):
        raise C.Refused(f"must be a power of two >= 8, got {v}")
    return v


def _dropout(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError
    if not 0 <= v < 1:
        raise C.Refused(f"must be in [0, 1), got {v}")
    return v


_CHANNELS = R.optional(R.one_of(1, 3))


@dataclass
class Pix2PixConfig:
    """Paired images, the U-Net / PatchGAN sizes and the loss weights, for the pix2pix recipe."""

    layout: str = C.key("auto", R.one_of("auto", "side_by_side", "folders"),
                        "auto, side_by_side (A|B in one file) or folders (DIR/A and DIR/B, matching names)")
    direction: str = C.key("AtoB", R.one_of("AtoB", "BtoA"), "translate A to B, or B to A")
    image_size: Optional[int] = C.key(None, R.optional(C.Rule("a power of two >= 8", _power_of_two)),
                                      "square side fed to the networks; null: 256 (embedded digits: 32)")
    load_size: Optional[int] = C.key(None, R.optional(R.at_least(8)), "train: resize to this, then random-crop "
                                                                      "image_size (jitter)")
    flip: bool = C.key(False, R.BOOL, "train: random horizontal flip of both images together")
    channels_a: Optional[int] = C.key(None, _CHANNELS, "1 or 3; null: from the images")
    channels_b: Optional[int] = C.key(None, _CHANNELS, "1 or 3; null: from the images")
    lambda_l1: float = C.key(100.0, R.at_least(0, "a number"), "weight of the L1 term in the generator loss")
    gan_mode: str = C.key("vanilla", R.one_of(*GAN_MODES), "vanilla (BCE with logits) or lsgan (MSE)")
    ngf: Optional[int] = C.key(None, R.optional(R.at_least(1)), "generator filters in the first layer; null: 64 "
                                                                "(embedded digits: 32)")
    ndf: Optional[int] = C.key(None, R.optional(R.at_least(1)), "discriminator filters in the first layer; null: 64 "
                                                                "(embedded digits: 32)")
    num_downs: Optional[int] = C.key(None, R.optional(R.at_least(2)), "U-Net depth; null: log2(image_size) (a 1x1 "
                                                                      "bottleneck)")
    d_layers: Optional[int] = C.key(None, R.optional(R.at_least(1)), "PatchGAN strided layers; null: 3, the 70x70 "
                                                                     "PatchGAN (embedded digits: 2)")
    dropout: float = C.key(0.5, C.Rule("a number in [0, 1)", _dropout), "in the three decoder blocks after the "
                                                                       "bottleneck")
    samples: int = C.key(8, R.at_least(0), "pairs shown in the PNG grid written each epoch")


C.register_section("pix2pix", Pix2PixConfig)


def gan_loss(mode: str):
    """``loss(logits, real: bool)``: BCE with logits (vanilla) or least squares (lsgan)."""
    if mode == "vanilla":
        def loss(pred, real):
            return F.binary_cross_entropy_with_logits(pred, torch.full_like(pred, 1.0 if real else 0.0))
    elif mode == "lsgan":
        def loss(pred, real):
            return F.mse_loss(pred, torch.full_like(pred, 1.0 if real else 0.0))
    else:
        raise RecipeError(f"pix2pix.gan_mode {mode!r} is not one of {', '.join(GAN_MODES)}")
    return loss


class _Prepared:
    def __init__(self):
        self.splits: dict[str, Any] = {}
        self.bad: list = []


class Pix2PixRecipe(Recipe):
    name = "pix2pix"
    description = ("U-Net generator + PatchGAN discriminator, conditional GAN + λ·L1, two Adams; paired images "
                   "(A|B side by side, or A/ and B/ folders); embedded default: digit edge maps -> digits")
    defaults = {
        "epochs": 10, "optim": {"name": "adam", "lr": 2e-4, "betas": [0.5, 0.999]}, "metrics": [],
        "data": {"batch_size": 16, "val_fraction": 0.1},
        "checkpoint": {"monitor": "val/l1", "mode": "min"},
    }

    def __init__(self):
        # id(cfg) -> (cfg, prepared data); holding cfg keeps its id from being reused by another config
        self._cache: dict[int, tuple[C.Config, _Prepared]] = {}

    # -------------------------------------------------------------------------------- config
    @staticmethod
    def _resolve(cfg: C.Config) -> None:
        p = cfg.pix2pix  # values checked by Pix2PixConfig.validate; the profile fills in the unset ones
        profile = DIGITS if cfg.data.path is None else PAPER
        for key, value in profile.items():
            if getattr(p, key) is None:
                setattr(p, key, value)
        if p.load_size is not None and p.load_size < p.image_size:
            raise RecipeError(f"pix2pix.load_size ({p.load_size}) must be at least image_size ({p.image_size})")

    # -------------------------------------------------------------------------------- data
    def _prepare(self, cfg: C.Config) -> _Prepared:
        if id(cfg) in self._cache:
            return self._cache[id(cfg)][1]
        self._resolve(cfg)
        p, d = cfg.pix2pix, cfg.data
        prep = _Prepared()
        if d.path is None:
            p.channels_a = p.channels_a or 1
            p.channels_b = p.channels_b or 1
            if (p.channels_a, p.channels_b) != (1, 1):
                raise RecipeError("the embedded digits pairs are grayscale: pix2pix.channels_a/b must be 1")
            pairs = P.digits_pairs(p.image_size, d.val_fraction)
            if p.direction == "BtoA":
                pairs = {k: (b, a) for k, (a, b) in pairs.items()}
            p.layout = "folders"
            prep.splits = pairs
        else:
            roots = {"train": Path(d.path), "val": Path(d.val_path) if d.val_path else None,
                     "test": Path(d.test_path) if d.test_path else None}
            if p.layout == "auto":
                p.layout = P.detect_layout(roots["train"]) if roots["train"].is_dir() else "side_by_side"
            scanned = {s: P.scan_pairs(r, p.layout, key=f"data.{'path' if s == 'train' else s + '_path'}")
                       for s, r in roots.items() if r is not None}
            self._channels(cfg, scanned["train"])
            for split, items in scanned.items():
                side = p.load_size if (split == "train" and p.load_size) else p.image_size
                a_list, b_list = [], []
                for name, first, second in items:
                    try:
                        a, b = P.load_pair(first, second, (p.channels_a, p.channels_b), side, p.direction)
                    except BadImageError as exc:
                        if not d.skip_bad_samples:
                            raise
                        prep.bad.append((exc.path, exc.reason))
                        continue
                    a_list.append(a)
                    b_list.append(b)
                if not a_list:
                    raise RecipeError(f"no readable pair in the {split} data")
                prep.splits[split] = (a_list, b_list)
            if "val" not in prep.splits and d.val_fraction > 0 and len(prep.splits["train"][0]) > 1:
                a_list, b_list = prep.splits["train"]
                keep, held = stratified_split([0] * len(a_list), d.val_fraction)
                center = [P.resize_uint8(a_list[i], p.image_size) for i in held]  # eval at image_size
                prep.splits["val"] = (center, [P.resize_uint8(b_list[i], p.image_size) for i in held])
                prep.splits["train"] = ([a_list[i] for i in keep], [b_list[i] for i in keep])
            if prep.bad:
                say(f"torchrig: skipped {len(prep.bad)} unreadable image(s) (data.skip_bad_samples=true); "
                    f"listed in {Path(cfg.run_dir) / 'bad_samples.txt'}")
        self._cache[id(cfg)] = (cfg, prep)
        return prep

    @staticmethod
    def _channels(cfg: C.Config, items: list) -> None:
        p = cfg.pix2pix
        name, first, second = items[0]
        try:
            mode_a = image_mode(first)
            mode_b = image_mode(second) if second is not None else mode_a
        except BadImageError as exc:
            raise RecipeError(str(exc)) from None
        p.channels_a = p.channels_a or (1 if mode_a in GRAY_MODES else 3)
        p.channels_b = p.channels_b or (1 if mode_b in GRAY_MODES else 3)
        if p.direction == "BtoA" and second is not None:
            p.channels_a, p.channels_b = p.channels_b, p.channels_a

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        prep = self._prepare(cfg)
        p = cfg.pix2pix
        out = {}
        for split, (a, b) in prep.splits.items():
            if isinstance(a, torch.Tensor):
                out[split] = TensorDataset(a, b)  # embedded: in memory, no jitter
            else:
                out[split] = P.PairSamples(a, b, p.image_size, train=split == "train", flip=p.flip)
        return out

    # -------------------------------------------------------------------------------- model
    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        from ..models.pix2pix import build_pix2pix

        p = cfg.pix2pix
        if p.channels_a is None or p.channels_b is None or p.image_size is None:
            self._prepare(cfg)
        self._resolve(cfg)
        try:
            return build_pix2pix(p.channels_a, p.channels_b, p.image_size, p.ngf, p.ndf, p.num_downs, p.d_layers,
                                 p.dropout)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None

    def trainer_kwargs(self, cfg: C.Config, data: dict) -> dict:
        p = cfg.pix2pix
        gan = gan_loss(p.gan_mode)
        lam = float(p.lambda_l1)
        state: dict[str, Optional[int]] = {"epoch": None, "written": None}
        samples_dir = Path(cfg.run_dir) / "samples"

        def step_fn(step, batch) -> dict:
            a, b = batch
            G, D = step.models["G"], step.models["D"]
            state["epoch"] = step.epoch
            with step.autocast():
                fake = G(a)
            # 1) D: real pairs -> 1, generated pairs -> 0 (G's output detached)
            with step.autocast():
                loss_d_fake = gan(D(torch.cat([a, fake.detach()], 1)), False)
                loss_d_real = gan(D(torch.cat([a, b], 1)), True)
                loss_d = 0.5 * (loss_d_fake + loss_d_real)
            step.backward(loss_d)
            step.optimizer_step("D")
            # 2) G: fool D + λ·L1. D is frozen (G's backward leaves no gradient in D for D's next step)
            #    and called without its DDP wrapper (no gradient of D to sync)
            with step.frozen("D") as d_plain, step.autocast():
                loss_g_gan = gan(d_plain(torch.cat([a, fake], 1)), True)
            l1 = F.l1_loss(fake.float(), b.float())
            loss_g = loss_g_gan.float() + lam * l1
            step.backward(loss_g)
            step.optimizer_step("G")
            return {"loss_d": loss_d.detach(), "loss_g_gan": loss_g_gan.detach(), "l1": l1.detach(),
                    "loss_g": loss_g.detach()}

        def eval_fn(step, batch) -> dict:
            a, b = batch
            G = unwrap(step.model)["G"]
            with step.autocast():
                fake = G(a)
            fake = fake.float()
            epoch = state["epoch"]
            if epoch is not None and state["written"] != epoch and is_main_process():
                state["written"] = epoch
                n = min(p.samples, len(a))
                rows = [[x[i].float().add(1).div(2) for x in (a, fake, b)] for i in range(n)]
                img = P.grid(rows, pad=2, scale=max(1, 96 // a.shape[-1]))
                P.save_png(img.mul(2).sub(1), samples_dir / f"epoch-{epoch + 1:03d}.png", root=Path(cfg.run_dir))
            return {"l1": F.l1_loss(fake, b.float(), reduction="none").flatten(1).mean(1).mean()}

        def predict_fn(step, batch) -> torch.Tensor:
            a = batch[0] if isinstance(batch, (list, tuple)) else batch
            G = unwrap(step.model)["G"]
            with step.autocast():
                return G(a).float()

        return {"step_fn": step_fn, "eval_fn": eval_fn, "predict_fn": predict_fn,
                "optimizer": {"G": cfg.optim.name, "D": cfg.optim.name}}

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        prep = self._cache.get(id(cfg), (None, None))[1]
        if prep is not None and prep.bad:
            write_bad_list(run_dir / "bad_samples.txt", prep.bad)

    # -------------------------------------------------------------------------------- predict
    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        """Input images (a side-by-side A|B file, width = 2 x height, gives its input half)."""
        p = cfg.pix2pix
        files = input_files(path, P.IMAGE_SUFFIXES, "input")
        xs, names = [], []
        for f in files:
            try:
                img = read_image(f, p.channels_a)
            except BadImageError as exc:
                if cfg.data.skip_bad_samples:
                    say(f"torchrig: skipped unreadable input '{f}'")
                    continue
                raise RecipeError(str(exc)) from None
            if p.layout == "side_by_side" and img.shape[-1] == 2 * img.shape[-2]:
                img = P.split_input(img, p.direction)
            xs.append(P.to_unit_range(P.resize_uint8(img, p.image_size)))
            names.append(display_name(f, path))
        if not xs:
            raise RecipeError(f"no readable image in '{path}'")
        return torch.stack(xs), names

    output_kinds = None  # a folder of PNGs (or one .png / .jpg for one input)

    def write_predictions(self, cfg: C.Config, outputs: Any, names: list[str], out: Path, topk: int = 5) -> None:
        """One PNG per input in the folder ``out`` (same relative name, ``.png``)."""
        if out.suffix.lower() in (".png", ".jpg") and len(names) == 1:
            P.save_png(outputs[0], out, root=out.parent)
            return
        if out.exists() and not out.is_dir():
            raise RecipeError(f"--output '{out}' is a file; pix2pix writes one image per input into a folder")
        for t, name in zip(outputs, names):
            P.save_png(t, out / Path(name).with_suffix(".png"), root=out)
