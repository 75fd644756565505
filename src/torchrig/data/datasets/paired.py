"""Paired images for image-to-image translation (pix2pix).

Two layouts: ``side_by_side`` — each file holds A and B next to each other (A left, B right, the
pix2pix data sets' layout) — and ``folders`` — ``DIR/A/<name>`` and ``DIR/B/<name>`` with matching
file names (extensions may differ). Images are scaled to [-1, 1]. The embedded default pairs an edge
map of each 8x8 digit (upscaled) with the digit itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ...config.files import make_dir, write_atomic
from ..common import DataError
from .images import BadImageError, read_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def detect_layout(root: Path) -> str:
    if (root / "A").is_dir() and (root / "B").is_dir():
        return "folders"
    return "side_by_side"


def scan_pairs(root: Path, layout: str, key: str = "data.path") -> list[tuple[str, Path, Optional[Path]]]:
    """``[(name, file A or the side-by-side file, file B or None), …]`` sorted by name."""
    if not root.exists():
        raise DataError(f"{key} '{root}' does not exist; give a folder of side-by-side A|B images or a folder "
                        f"with A/ and B/ sub-folders")
    if not root.is_dir():
        raise DataError(f"{key} '{root}' is a file; give a folder of paired images")
    if layout == "auto":
        layout = detect_layout(root)

    def images(folder: Path) -> list[Path]:
        return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)

    if layout == "side_by_side":
        files = images(root)
        if not files:
            raise DataError(f"{key} '{root}' holds no images (side-by-side layout: each file is A|B); for two "
                            f"folders of matching names use '{root}/A' and '{root}/B'")
        return [(p.name, p, None) for p in files]
    if layout != "folders":
        raise DataError(f"pix2pix.layout {layout!r} is not one of auto, side_by_side, folders")
    for sub in ("A", "B"):
        if not (root / sub).is_dir():
            raise DataError(f"{key} '{root}' has no '{sub}' sub-folder (layout 'folders' needs {root}/A and {root}/B)")
    a = {p.stem: p for p in images(root / "A")}
    b = {p.stem: p for p in images(root / "B")}
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        raise DataError(f"{key} '{root}': A and B file names must match; only in A: {only_a[:5] or 'none'}, "
                        f"only in B: {only_b[:5] or 'none'}")
    if not a:
        raise DataError(f"{key} '{root}/A' holds no images")
    return [(a[k].name, a[k], b[k]) for k in sorted(a)]


def to_unit_range(x: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float [-1, 1]."""
    return x.float().div(127.5).sub(1.0)


def resize_uint8(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (C, H, W) -> uint8 (C, size, size), bilinear (antialiased when shrinking)."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    y = F.interpolate(x[None].float(), size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    return y.round().clamp(0, 255).to(torch.uint8)


def load_pair(first: Path, second: Optional[Path], channels: tuple[int, int], size: int,
              direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) as uint8 ``size`` x ``size`` for one pair (side-by-side when ``second`` is None)."""
    if second is None:
        whole = read_image(first, 3 if 3 in channels else 1)
        w = whole.shape[-1]
        if w % 2:
            raise BadImageError(first, f"width {w} is odd; a side-by-side pair needs A and B of equal width")
        a, b = whole[:, :, : w // 2], whole[:, :, w // 2:]
        a = a[:1] if channels[0] == 1 and a.shape[0] == 3 else a
        b = b[:1] if channels[1] == 1 and b.shape[0] == 3 else b
    else:
        a, b = read_image(first, channels[0]), read_image(second, channels[1])
    a, b = resize_uint8(a, size), resize_uint8(b, size)
    return (a, b) if direction == "AtoB" else (b, a)


def split_input(img: torch.Tensor, direction: str) -> torch.Tensor:
    """The input half of a side-by-side image (left for AtoB, right for BtoA)."""
    w = img.shape[-1] // 2
    return img[..., :w] if direction == "AtoB" else img[..., w:2 * w]


class PairSamples(Dataset):
    """In-memory uint8 pairs -> ``(input, target)`` floats in [-1, 1]. With ``train`` the pix2pix
    jitter applies: random crop from the stored (``load_size``) side to ``size`` and a random
    horizontal flip, identical for input and target."""

    def __init__(self, a: list, b: list, size: int, train: bool = False, flip: bool = False):
        self.a, self.b, self.size, self.train, self.flip = a, b, size, train, flip

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int):
        a, b = self.a[i], self.b[i]
        both = torch.cat([a, b])
        side = both.shape[-1]
        if side > self.size:
            if self.train:
                y, x = torch.randint(0, side - self.size + 1, (2,)).tolist()
            else:
                y = x = (side - self.size) // 2
            both = both[:, y:y + self.size, x:x + self.size]
        if self.train and self.flip and torch.rand(()) < 0.5:
            both = both.flip(-1)
        both = to_unit_range(both)
        return both[: a.shape[0]].contiguous(), both[a.shape[0]:].contiguous()


# ----------------------------------------------------------------------------- embedded digits pairs


def edge_map(img: torch.Tensor) -> torch.Tensor:
    """Gradient magnitude (Sobel) of (N, 1, H, W) images in [0, 1], scaled to [0, 1] per image."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    k = torch.stack([kx, kx.t()])[:, None]
    g = F.conv2d(F.pad(img, (1, 1, 1, 1), mode="replicate"), k)
    mag = g.pow(2).sum(1, keepdim=True).sqrt()
    return mag / mag.amax(dim=(2, 3), keepdim=True).clamp_min(1e-6)


def digits_pairs(size: int = 32, val_fraction: float = 0.1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Edge map -> digit pairs from the embedded digits, upscaled to ``size`` px, in [-1, 1]:
    ``{"train": (A, B), "val": …, "test": …}`` on the fixed digits split."""
    from .digits import digits_split

    out = {}
    for split, ds in digits_split(val_fraction).items():
        x = ds.tensors[0]  # (N, 1, 8, 8) in [0, 1]
        big = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)
        out[split] = (edge_map(big) * 2 - 1, big * 2 - 1)
    return out


def save_png(t: torch.Tensor, path: Path, root: Optional[Path] = None) -> None:
    """Write a (C, H, W) tensor in [-1, 1] as an 8-bit PNG (grayscale for C = 1), its folder made. ``root``: the
    folder the user named (the run directory, an output folder), as for ``files.write_atomic``."""
    import io

    from PIL import Image

    a = t.detach().float().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8).cpu()
    image = Image.fromarray(a[0].numpy(), mode="L") if a.shape[0] == 1 else \
        Image.fromarray(a[:3].permute(1, 2, 0).numpy(), mode="RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    make_dir(path.parent, root)
    write_atomic(path, buffer.getvalue(), root)


def grid(rows: Sequence[Sequence[torch.Tensor]], pad: int = 2, scale: int = 1) -> torch.Tensor:
    """Tile (C, H, W) images into one image: ``rows[i][j]`` at row i, column j; channels broadcast to 3
    when they differ. Background is white (1.0)."""
    channels = max(t.shape[0] for r in rows for t in r)
    h, w = rows[0][0].shape[-2:]
    n_r, n_c = len(rows), max(len(r) for r in rows)
    out = torch.ones(channels, n_r * (h + pad) + pad, n_c * (w + pad) + pad)
    for i, r in enumerate(rows):
        for j, t in enumerate(r):
            t = t.detach().float().cpu()
            if t.shape[0] != channels:
                t = t.expand(channels, -1, -1)
            y, x = pad + i * (h + pad), pad + j * (w + pad)
            out[:, y:y + h, x:x + w] = t
    if scale > 1:
        out = out.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    return out


__all__ = ["PairSamples", "detect_layout", "digits_pairs", "edge_map", "grid", "load_pair", "resize_uint8",
           "save_png", "scan_pairs", "split_input", "to_unit_range"]
