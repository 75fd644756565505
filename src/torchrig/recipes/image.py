"""``image-classification``: an image folder (one sub-folder per class) and any classifier.

Data: ``data.path`` is a class-folder tree (torchvision ImageFolder semantics), or a folder holding
``train/`` and ``val/`` (or ``valid/``, ``validation/``) and/or ``test/`` class trees; ``data.val_path``
and ``data.test_path`` name other trees; without a validation tree ``data.val_fraction`` of each class
is held out with a fixed seed. With no ``data.path`` the embedded digits are exported once as PNGs
into the cache and read from there, so the default run exercises the real image-folder path.

The class names, channel count and normalisation statistics are written into the run's config, so
a checkpoint alone is enough to predict (no access to the training folder needed).

Inputs: the recipe's data sets and ``load_inputs`` give images as **uint8** ``(C, H, W)`` tensors in
0 … 255, already resized, cropped and augmented in the loader; the conversion to float32 (``/ 255``)
and ``image.normalize`` (``(x - mean) / std``) run on the device inside the recipe's training,
evaluation and prediction steps (:class:`DeviceNormalize`): a quarter of the host-to-device bytes of
float32 images, with the same numbers. The model and its checkpoint are the bare model: to call it by
hand, pass ``recipe.model_inputs(cfg, images)``. Floating-point inputs (from a ``data.factory``) are
taken as already normalised and reach the model unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils.data import TensorDataset

from .. import config as C
from ..config import rules as R
from ..config.files import write_atomic
from ..data.datasets import images as I
from .base import Recipe, RecipeError
from .common import display_name, input_files, say, stratified_split

VAL_NAMES = ("val", "valid", "validation")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _crop_scale(v: Any) -> tuple:
    R.accept(isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(x) and 0 < x <= 1 for x in v), v)
    return tuple(R.accept(v[0] <= v[1], v))


def _per_channel(positive: bool) -> C.Rule:
    def check(v: Any) -> Any:
        return v if v is None else R.accept(all(_number(x) and (x > 0 or not positive) for x in v), v)

    return C.Rule(f"one number per channel{' (each above 0)' if positive else ''}", check)


@dataclass
class ImageConfig:
    """Image folders and their transforms (sizes in pixels), for the image-classification recipe."""

    size: Optional[int] = C.key(None, R.optional(R.at_least(1)), "final square side; null: as stored (all images "
                                                                 "must then share one size)")
    resize: Optional[int] = C.key(None, R.optional(R.at_least(1)), "resize the shorter side to this before "
                                                                   "cropping; null: image.size")
    random_resized_crop: bool = C.key(False, R.BOOL, "train: a random area / aspect crop resized to image.size")
    crop_scale: tuple = C.key((0.08, 1.0), C.Rule("two fractions of the image area 0 < low <= high <= 1", _crop_scale),
                              "random_resized_crop: the range of the crop's area, as fractions of the image")
    random_crop_padding: int = C.key(0, R.at_least(0), "train: pad by this many pixels, then random-crop back to "
                                                       "the size")
    hflip: bool = C.key(False, R.BOOL, "train: random horizontal flip")
    normalize: bool = C.key(True, R.BOOL, "(x - mean) / std per channel, on the device")
    mean: Optional[list] = C.key(None, _per_channel(False), "per channel, in [0, 1]; null: computed from the "
                                                            "training images")
    std: Optional[list] = C.key(None, _per_channel(True), "per channel; null: computed from the training images")
    channels: Optional[int] = C.key(None, R.optional(R.one_of(1, 3)), "1 or 3; null: from the images (3 for "
                                                                      "torchvision / timm models)")
    class_map: dict = C.key({}, R.kind("a mapping of class folder to index", dict),
                            "class folder -> index; empty: the sorted folder names")
    classes: list = C.key([], R.kind("a list of class names", list), "index -> class name; filled in by training")
    cache: Union[bool, str] = C.key("auto", R.AUTO_BOOL, "decode every image into memory once; auto: for small "
                                                         "data sets")
    extensions: list = C.key([".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"],
                             R.list_of(R.TEXT, "a list of file extensions"), "the image files read")

    def validate(self) -> None:
        if self.random_resized_crop and self.size is None:
            raise C.ConfigError("config key 'image.random_resized_crop': needs image.size (the side of the crop, "
                                "in pixels)")


C.register_section("image", ImageConfig)


class _PadRandomCrop(torch.nn.Module):
    """Zero-pad by ``padding`` pixels and crop back to the input size at a random offset."""

    def __init__(self, padding: int):
        super().__init__()
        self.padding = padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.padding
        h, w = x.shape[-2:]
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        i, j = torch.randint(0, 2 * p + 1, (2,)).tolist()
        return padded[..., i:i + h, j:j + w]


def build_transform(ic: ImageConfig, train: bool):
    """uint8 ``(C, H, W)`` -> uint8, resized, cropped and (train) augmented, from the ``image`` config
    section; :class:`DeviceNormalize` does the rest on the device."""
    try:
        from torchvision.transforms import v2 as T
    except ImportError:
        raise RecipeError("recipe 'image-classification' needs torchvision for its transforms; "
                          "pip install 'torchrig[vision]'") from None
    ops: list = []
    if train and ic.random_resized_crop:
        if ic.resize:
            ops.append(T.Resize(ic.resize, antialias=True))
        ops.append(T.RandomResizedCrop(ic.size, scale=tuple(ic.crop_scale), antialias=True))
    elif ic.size is not None:
        ops += [T.Resize(ic.resize or ic.size, antialias=True), T.CenterCrop(ic.size)]
    elif ic.resize:
        ops.append(T.Resize(ic.resize, antialias=True))
    if train and ic.random_crop_padding:
        ops.append(_PadRandomCrop(ic.random_crop_padding))
    if train and ic.hflip:
        ops.append(T.RandomHorizontalFlip())
    return T.Compose(ops or [T.Identity()])


def to_unit_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in [0, 1], exactly as torchvision's ``ToDtype(float32, scale=True)``."""
    return x.to(torch.float32).mul_(1.0 / 255)


class DeviceNormalize:
    """The end of the image transform, run where the batch is (the device): uint8 -> float32 in
    [0, 1], then ``(x - mean) / std`` per channel when ``image.normalize`` is on (torchvision's
    ``Normalize`` arithmetic). Floating-point tensors are already normalised and pass unchanged."""

    def __init__(self, ic: ImageConfig):
        self.ic = ic  # read at the first batch: the statistics may be computed after this is made
        self._on: dict = {}  # device -> (mean, std) as (C, 1, 1) float32 tensors

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            return x
        x = to_unit_float(x)
        if not self.ic.normalize:
            return x
        if x.device not in self._on:
            if self.ic.mean is None or self.ic.std is None:
                raise RecipeError("image.normalize is on but image.mean / image.std are not set; give both, "
                                  "or build the recipe's data first (it computes them)")
            self._on[x.device] = tuple(torch.tensor(list(v), dtype=torch.float32).view(-1, 1, 1).to(x.device)
                                       for v in (self.ic.mean, self.ic.std))
        mean, std = self._on[x.device]
        return x.sub_(mean).div_(std)

    def batch(self, batch: Any) -> Any:
        """A batch with its images (a tensor, or the first element of a tuple / list) normalised."""
        if isinstance(batch, torch.Tensor):
            return self(batch)
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            return [self(batch[0]), *batch[1:]]
        return batch


def _has_random(ic: ImageConfig) -> bool:
    return bool(ic.random_resized_crop or ic.random_crop_padding or ic.hflip)


class _Prepared:
    def __init__(self):
        self.splits: dict[str, tuple[list, list[int]]] = {}
        self.bad: list = []
        self.cached = False


class ImageClassificationRecipe(Recipe):
    name = "image-classification"
    description = ("image folder (one sub-folder per class) + small ResNet / torchvision / timm model; "
                   "embedded default: the digits exported as PNGs")
    defaults = {
        "epochs": 15, "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 5e-4},
        "scheduler": {"name": "onecycle"}, "metrics": ["accuracy", "top5"],
        "model": {"name": "small_resnet"},
        "data": {"batch_size": 64, "val_fraction": 0.1},
        "checkpoint": {"monitor": "val/accuracy", "mode": "max"},
        "image": {"random_crop_padding": 1},
    }

    def __init__(self):
        # id(cfg) -> (cfg, prepared data); holding cfg keeps its id from being reused by another config
        self._cache: dict[int, tuple[C.Config, _Prepared]] = {}

    # -------------------------------------------------------------------------------- data
    def _roots(self, cfg: C.Config) -> dict[str, Optional[Path]]:
        d = cfg.data
        if d.path is None:
            root = I.digits_image_folder()
            return {"train": root / "train", "val": None, "test": root / "test"}
        root = Path(d.path)
        roots: dict[str, Optional[Path]] = {"train": root, "val": None, "test": None}
        if root.is_dir() and (root / "train").is_dir() and d.val_path is None and d.test_path is None:
            subs = {p.name for p in root.iterdir() if p.is_dir()}
            if subs & set(VAL_NAMES + ("test",)):
                roots["train"] = root / "train"
                roots["val"] = next((root / v for v in VAL_NAMES if v in subs), None)
                roots["test"] = root / "test" if "test" in subs else None
        if d.val_path is not None:
            roots["val"] = Path(d.val_path)
        if d.test_path is not None:
            roots["test"] = Path(d.test_path)
        return roots

    def _prepare(self, cfg: C.Config) -> _Prepared:
        if id(cfg) in self._cache:
            return self._cache[id(cfg)][1]
        ic, d = cfg.image, cfg.data
        roots = self._roots(cfg)
        samples, classes = I.scan_image_folder(roots["train"], ic.extensions, ic.class_map or None,
                                               key="data.path")
        if ic.classes and list(ic.classes) != classes:
            raise RecipeError(f"image.classes {list(ic.classes)} (from an earlier run's config) do not match the "
                              f"class folders of '{roots['train']}' {classes}; clear image.classes")
        ic.classes = classes
        if len(classes) <= 5 and cfg.metrics == self.defaults["metrics"]:  # every sample is in the top 5 of 5
            cfg.metrics = [m for m in cfg.metrics if m != "top5"]
        index = {c: i for i, c in enumerate(classes)}
        other: dict[str, list] = {}
        for split in ("val", "test"):
            if roots[split] is not None:
                key = "data.val_path" if split == "val" else "data.test_path"
                s, cls = I.scan_image_folder(roots[split], ic.extensions, None, key=key)
                unknown = [c for c in cls if c not in index]
                if unknown:
                    raise RecipeError(f"{key} '{roots[split]}' has class folders {unknown} that the training "
                                      f"folder '{roots['train']}' does not have")
                other[split] = [(p, index[cls[y]]) for p, y in s]
        if ic.channels is None:
            from ..models.vision import is_external

            ic.channels = 3 if is_external(cfg.model.name) else I.detect_channels([p for p, _ in samples])
        if ic.channels not in (1, 3):
            raise RecipeError(f"image.channels must be 1 or 3, got {ic.channels}")
        prep = _Prepared()
        n_all = len(samples) + sum(len(v) for v in other.values())
        prep.cached = ic.cache is True or (ic.cache == "auto" and self._small(samples[0][0], n_all, ic.channels))
        for split, items in [("train", samples)] + list(other.items()):
            got, labels, bad, sizes = I.load_checked(items, ic.channels, prep.cached, d.skip_bad_samples)
            if not got:
                raise RecipeError(f"no readable image in the {split} data ({len(bad)} unreadable)")
            if len(sizes) > 1 and ic.size is None and ic.resize is None:
                shown = ", ".join(f"{h}x{w}" for h, w in sorted(sizes)[:3])
                raise RecipeError(f"the {split} images have different sizes ({shown} …); set image.size=N "
                                  f"(pixels) to resize and center-crop them to N x N")
            prep.splits[split] = (got, labels)
            prep.bad += bad
        if prep.bad:
            say(f"torchrig: skipped {len(prep.bad)} unreadable image(s) (data.skip_bad_samples=true); "
                f"listed in {Path(cfg.run_dir) / 'bad_samples.txt'}")
        if "val" not in prep.splits and d.val_fraction > 0:
            items, labels = prep.splits["train"]
            keep, held = stratified_split(labels, d.val_fraction)
            prep.splits["val"] = ([items[i] for i in held], [labels[i] for i in held])
            prep.splits["train"] = ([items[i] for i in keep], [labels[i] for i in keep])
        if ic.normalize and (ic.mean is None) != (ic.std is None):
            raise RecipeError("give both image.mean and image.std, or neither (then they are computed)")
        if ic.normalize and ic.mean is None:
            ic.mean, ic.std = self._stats(ic, prep)
        if ic.normalize and (len(ic.mean) != ic.channels or len(ic.std) != ic.channels):
            raise RecipeError(f"image.mean / image.std need {ic.channels} value(s) (one per channel), got "
                              f"{list(ic.mean)} / {list(ic.std)}")
        self._cache[id(cfg)] = (cfg, prep)
        return prep

    @staticmethod
    def _small(first: Path, n: int, channels: int) -> bool:
        """Decode everything into memory when it fits easily (under ~1 GB as uint8)."""
        try:
            h, w = I.verify_image(first)
        except I.BadImageError:
            return n <= 20000
        return n * h * w * channels <= 1 << 30

    @staticmethod
    def _stats(ic: ImageConfig, prep: _Prepared) -> tuple[list, list]:
        """Per-channel mean and std (of values in [0, 1]) over up to 2,000 training images."""
        items, _ = prep.splits["train"]
        step = max(1, len(items) // 2000)
        plain = build_transform(ic, train=False)
        ds = I.ImageSamples(items[::step], None, plain, ic.channels, skip_bad=True)
        total = torch.zeros(ic.channels, dtype=torch.float64)
        sq = torch.zeros(ic.channels, dtype=torch.float64)
        count = 0
        for i in range(len(ds)):
            x = to_unit_float(ds[i]).to(torch.float64).flatten(1)
            total += x.sum(1)
            sq += (x * x).sum(1)
            count += x.shape[1]
        mean = total / count
        std = (sq / count - mean * mean).clamp_min(1e-12).sqrt()
        return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        prep = self._prepare(cfg)
        ic = cfg.image
        out: dict[str, Any] = {}
        for split, (items, labels) in prep.splits.items():
            train = split == "train"
            ds = I.ImageSamples(items, labels, build_transform(ic, train), ic.channels, cfg.data.skip_bad_samples)
            if prep.cached and not (train and _has_random(ic)) and self._fits(ds):
                # deterministic transforms: apply once, then the Trainer's in-memory fast path
                xs = torch.stack([ds[i][0] for i in range(len(ds))])
                ds = TensorDataset(xs, torch.tensor(labels, dtype=torch.long))
            out[split] = ds
        return out

    @staticmethod
    def _fits(ds: I.ImageSamples, limit: int = 1 << 29) -> bool:
        x = ds[0][0]
        return len(ds) * x.numel() * x.element_size() <= limit

    def trainer_kwargs(self, cfg: C.Config, data: dict) -> dict:
        """Steps that normalise each batch's uint8 images on the device, then run the default ones."""
        from ..trainer import default_eval_step, default_step
        from ..trainer.inference import default_predict_step

        norm = DeviceNormalize(cfg.image)
        return {"step_fn": lambda step, batch: default_step(step, norm.batch(batch)),
                "eval_fn": lambda step, batch: default_eval_step(step, norm.batch(batch)),
                "predict_fn": lambda step, batch: default_predict_step(step, norm.batch(batch), step.activation)}

    def model_inputs(self, cfg: C.Config, images: torch.Tensor) -> torch.Tensor:
        """The model's float inputs for uint8 images as this recipe's data gives them (on their device)."""
        return DeviceNormalize(cfg.image)(images)

    # -------------------------------------------------------------------------------- model
    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        from ..models.vision import build_image_model, check_image_model_name

        try:
            check_image_model_name(cfg.model.name)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        if not cfg.image.classes or cfg.image.channels is None:
            self._prepare(cfg)
        try:
            return build_image_model(cfg.model.name, len(cfg.image.classes), cfg.image.channels, cfg.model.options)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None

    def class_names(self, cfg: C.Config) -> Optional[list[str]]:
        return list(cfg.image.classes) or None

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        ic = cfg.image
        info = {"classes": list(ic.classes), "channels": ic.channels, "mean": ic.mean, "std": ic.std,
                "size": ic.size}
        write_atomic(run_dir / "classes.json", (json.dumps(info, indent=2) + "\n").encode(), root=run_dir)
        prep = self._cache.get(id(cfg), (None, None))[1]
        bad_file = run_dir / "bad_samples.txt"
        if prep is not None and prep.bad:
            I.write_bad_list(bad_file, prep.bad)
        elif bad_file.exists():
            bad_file.unlink()

    # -------------------------------------------------------------------------------- predict
    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        ic = cfg.image
        files = input_files(path, ic.extensions, "input")
        transform = build_transform(ic, train=False)
        xs, names, bad = [], [], []
        for f in files:
            try:
                xs.append(transform(I.read_image(f, ic.channels)))
            except I.BadImageError as exc:
                if not cfg.data.skip_bad_samples:
                    raise RecipeError(str(exc)) from None
                bad.append(f)
                continue
            names.append(display_name(f, path))
        if bad:
            say(f"torchrig: skipped {len(bad)} unreadable input image(s): {', '.join(str(b) for b in bad[:5])}"
                + (" …" if len(bad) > 5 else ""))
        if not xs:
            raise RecipeError(f"no readable image in '{path}'")
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise RecipeError(f"input images have different sizes after the transforms {sorted(shapes)[:3]}; "
                              f"train with image.size=N so that every image is resized to N x N")
        return torch.stack(xs), names

