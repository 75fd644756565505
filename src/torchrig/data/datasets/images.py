"""Image folders: ImageFolder-style scanning, safe decoding, bad-file handling, the digits as PNGs.

A class folder layout is ``ROOT/<class name>/**/<image>`` (torchvision's ImageFolder semantics:
classes are the sorted sub-folder names unless a class -> index map is given, files are found
recursively and kept if their extension is an image one). Decoding uses Pillow; a file that cannot
be decoded is a :class:`BadImageError` naming it, or — when the caller skips bad samples — is left
out and reported.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from ...config.files import make_temp_dir, write_atomic
from ..common import DataError

GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")


class BadImageError(DataError):
    """An image file that is unreadable or corrupt; the message names the file."""

    def __init__(self, path: Path, reason: str, hint: bool = True):
        self.path, self.reason = path, reason
        fix = ("; fix or remove it, or set data.skip_bad_samples=true to skip such files" if hint else "")
        super().__init__(f"image '{path}' is unreadable or corrupt ({reason}){fix}")


def cache_root() -> Path:
    """Where generated data sets live: ``$TORCHRIG_CACHE``, else ``$XDG_CACHE_HOME/torchrig``, else ~/.cache."""
    env = os.environ.get("TORCHRIG_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torchrig"


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading images needs Pillow; pip install 'torchrig[vision]'") from None
    return Image


# ----------------------------------------------------------------------------- scanning


def scan_image_folder(root: Union[str, Path], extensions: Sequence[str], class_map: Optional[dict] = None,
                      key: str = "data.path") -> tuple[list[tuple[Path, int]], list[str]]:
    """``([(file, class index), …], class names by index)`` for a class-folder tree."""
    root = Path(root)
    if not root.exists():
        raise DataError(f"{key} '{root}' does not exist; give a folder with one sub-folder per class")
    if not root.is_dir():
        raise DataError(f"{key} '{root}' is a file; give a folder with one sub-folder per class")
    exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)
    folders = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    if not folders:
        loose = [p.name for p in root.iterdir() if p.suffix.lower() in exts][:3]
        extra = f" (it holds images such as {', '.join(loose)} directly)" if loose else ""
        raise DataError(f"{key} '{root}' has no class sub-folders{extra}; put each class's images in "
                        f"'{root}/<class name>/'")
    if class_map:
        unknown = [f for f in folders if f not in class_map]
        missing = [c for c in class_map if c not in folders]
        if unknown or missing:
            raise DataError(f"{key} '{root}': image.class_map does not match the class folders "
                            f"(folders not in the map: {unknown or 'none'}; map entries without a folder: "
                            f"{missing or 'none'}); give every class folder an index in image.class_map, "
                            f"or leave it empty to number the folders in sorted order")
        try:
            index = {c: int(i) for c, i in class_map.items()}
        except (TypeError, ValueError):
            raise DataError("image.class_map values must be integers (class folder -> index)") from None
        if sorted(index.values()) != list(range(len(index))):
            raise DataError(f"image.class_map indices must be 0 … {len(index) - 1}, each once; got "
                            f"{sorted(index.values())}")
        classes = [c for c, _ in sorted(index.items(), key=lambda kv: kv[1])]
    else:
        index = {c: i for i, c in enumerate(folders)}
        classes = folders
    samples: list[tuple[Path, int]] = []
    for c in folders:
        found = []
        for dirpath, dirnames, filenames in os.walk(root / c, followlinks=True):
            dirnames.sort()
            found += [Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix.lower() in exts]
        if not found:
            raise DataError(f"class folder '{root / c}' holds no image files (looked for "
                            f"{', '.join(exts)}); remove it or add images")
        samples += [(p, index[c]) for p in found]
    return samples, classes


# ----------------------------------------------------------------------------- decoding


def image_mode(path: Path) -> str:
    Image = _pil()
    try:
        with Image.open(path) as im:
            return im.mode
    except Exception as exc:
        raise BadImageError(path, _reason(exc), hint=False) from None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_image(path: Path, channels: int) -> torch.Tensor:
    """``(channels, H, W)`` uint8 from any Pillow-readable file, converted to L (1) or RGB (3)."""
    Image = _pil()
    try:
        with Image.open(path) as im:
            im = im.convert("L" if channels == 1 else "RGB")
            a = np.asarray(im, dtype=np.uint8)
    except Exception as exc:
        raise BadImageError(path, _reason(exc)) from None
    if a.ndim == 2:
        a = a[:, :, None]
    return torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous()


def verify_image(path: Path) -> tuple[int, int]:
    """Cheap check without decoding the pixels: the header parses and (PNG) chunks are intact.
    Returns the image's (height, width)."""
    Image = _pil()
    try:
        with Image.open(path) as im:
            size = (im.size[1], im.size[0])
            im.verify()
            return size
    except Exception as exc:
        raise BadImageError(path, _reason(exc)) from None


def detect_channels(paths: Sequence[Path], probe: int = 16) -> int:
    """1 if the first ``probe`` readable images are all grayscale, else 3."""
    seen = 0
    for p in paths:
        try:
            mode = image_mode(p)
        except BadImageError:
            continue
        if mode not in GRAY_MODES:
            return 3
        seen += 1
        if seen >= probe:
            break
    return 1


def load_checked(samples: list[tuple[Path, int]], channels: int, decode: bool, skip_bad: bool
                 ) -> tuple[list, list[int], list[tuple[Path, str]], set]:
    """Decode (``decode=True``: uint8 tensors in memory) or verify every file.

    Returns ``(items, labels, bad, sizes)``: items are tensors or paths; ``bad`` lists
    ``(file, reason)`` of the files left out; ``sizes`` the distinct (H, W) seen. Without
    ``skip_bad`` the first bad file raises :class:`BadImageError`.
    """
    items, labels, bad, sizes = [], [], [], set()
    for path, label in samples:
        try:
            if decode:
                x = read_image(path, channels)
                items.append(x)
                sizes.add(tuple(x.shape[1:]))
            else:
                sizes.add(verify_image(path))
                items.append(path)
        except BadImageError as exc:
            if not skip_bad:
                raise
            bad.append((path, exc.reason))
            continue
        labels.append(label)
    return items, labels, bad, sizes


class ImageSamples(Dataset):
    """``(transform(image), label)`` for in-memory uint8 tensors or files decoded on access.

    A file that fails to decode here (after passing the up-front check) raises, or with
    ``skip_bad`` is replaced by the next readable sample, so batch sizes stay fixed.
    """

    def __init__(self, items: list, labels: Optional[list[int]], transform: Callable, channels: int,
                 skip_bad: bool = False):
        self.items, self.labels, self.transform = items, labels, transform
        self.channels, self.skip_bad = channels, skip_bad

    def __len__(self) -> int:
        return len(self.items)

    def image(self, i: int) -> torch.Tensor:
        item = self.items[i]
        if isinstance(item, torch.Tensor):
            return item
        for k in range(len(self.items)):
            j = (i + k) % len(self.items)
            item = self.items[j]
            try:
                return item if isinstance(item, torch.Tensor) else read_image(item, self.channels)
            except BadImageError:
                if not self.skip_bad:
                    raise
        raise DataError("no image of the data set could be decoded")

    def __getitem__(self, i: int) -> Any:
        x = self.transform(self.image(i))
        return x if self.labels is None else (x, self.labels[i])


def write_bad_list(path: Path, bad: list[tuple[Path, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # (the run directory)
    lines = [f"# {len(bad)} unreadable image(s) skipped (data.skip_bad_samples=true)"] + [f"{p}\t{r}" for p, r in bad]
    write_atomic(path, "".join(line + "\n" for line in lines).encode(), root=path.parent)


# ----------------------------------------------------------------------------- the digits as PNGs


def export_digits(out_dir: Union[str, Path], overwrite: bool = False) -> dict[str, int]:
    """Write the embedded 8x8 digits as grayscale PNGs: ``OUT/train/<digit>/`` and ``OUT/test/<digit>/``
    (the fixed 80/20 split of ``digits_split``). Returns the number of images per split."""
    from .digits import digits_split

    Image = _pil()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DataError(f"'{out}' exists and is not empty; choose a new folder (or pass --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-", root=out.parent)
    counts = {}
    try:
        for split, ds in digits_split(0.0).items():
            images, labels = ds.tensors
            for c in range(10):
                (tmp / split / str(c)).mkdir(parents=True)
            for i, (img, y) in enumerate(zip(images, labels.tolist())):
                a = (img[0].numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
                Image.fromarray(a, mode="L").save(tmp / split / str(y) / f"{split}_{i:04d}.png")
            counts[split] = len(labels)
        write_atomic(tmp / "README.txt", root=tmp, data=(
            b"The 8x8 handwritten digits shipped with scikit-learn (UCI optdigits test set), as PNGs.\n"
            b"train/ and test/ hold one folder per digit (the fixed torchrig split: 80/20, stratified).\n"))
        if out.exists() and overwrite:
            shutil.rmtree(out)
        os.replace(tmp, out)  # fails (OSError) if another process created a non-empty `out` meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def digits_image_folder() -> Path:
    """The exported digits in the cache, created on first use (safe when several ranks race)."""
    path = cache_root() / "digits-png-v1"
    if (path / "README.txt").exists():
        return path
    try:
        export_digits(path, overwrite=False)
    except (DataError, OSError):
        if not (path / "README.txt").exists():  # another process won the race: theirs is complete
            raise
    return path


__all__ = ["BadImageError", "ImageSamples", "cache_root", "detect_channels", "digits_image_folder",
           "export_digits", "load_checked", "read_image", "scan_image_folder", "verify_image", "write_bad_list"]
