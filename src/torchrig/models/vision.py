"""Image classifiers: a small ResNet for tiny images, and adapters for torchvision and timm.

``build_image_model(name, num_classes, in_channels)`` resolves a name in this order: torchrig's own
models (``small_resnet``, ``digits_cnn``, …), a ``torchvision.models`` classification builder
(``resnet18``, ``resnet50``, ``efficientnet_b0`` …, always ``weights=None``), then a timm model when
timm is installed (``pretrained=False``). ``torchvision:NAME`` and ``timm:NAME`` force a source.
Nothing is ever downloaded: a local weights file is loaded by the recipe (``model.weights``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from ..errors import suggest
from .errors import ModelError


class BasicBlock(nn.Module):
    """Two 3x3 Conv-BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet for small images (8x8 to 64x64): 3x3 stem without max-pool, then stages of
    BasicBlocks with stride 2 between stages, global average pooling and a linear classifier.

    With the defaults (widths 32/64/128, one block per stage) it has ~0.7 M parameters and sees an
    8x8 digit at 8x8, 4x4 and 2x2 resolution.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, widths: Sequence[int] = (32, 64, 128),
                 blocks: Sequence[int] = (1, 1, 1), dropout: float = 0.0):
        super().__init__()
        if len(widths) != len(blocks):
            raise ModelError(f"small_resnet: widths {list(widths)} and blocks {list(blocks)} differ in length")
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        stages, cin = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layers = [BasicBlock(cin, w, stride=1 if i == 0 else 2)]
            layers += [BasicBlock(w, w) for _ in range(n - 1)]
            stages.append(nn.Sequential(*layers))
            cin = w
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():  # zero-init the last BN of each residual branch (starts as identity)
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(self.dropout(self.pool(x).flatten(1)))


NOT_IMAGE = ("mlp", "bert", "unet_generator", "patch_discriminator", "pix2pix")  # left out of the name list


def _builtin_builders() -> dict:
    from . import builders

    return builders()


def torchvision_names() -> list[str]:
    try:
        import torchvision.models as tvm
    except ImportError:
        return []
    return sorted(tvm.list_models(module=tvm))


def timm_names() -> list[str]:
    try:
        import timm
    except ImportError:
        return []
    return list(timm.list_models())


def is_external(name: str) -> bool:
    """True when ``name`` resolves to a torchvision or timm model (which expect 3-channel input)."""
    if name.startswith(("torchvision:", "timm:")):
        return True
    return name not in _builtin_builders() and (name in torchvision_names() or name in timm_names())


def check_image_model_name(name: str) -> None:
    """Raise the unknown-model error early (before any data is read) for a name that cannot resolve."""
    bare = name.split(":", 1)[1] if name.startswith(("torchvision:", "timm:")) else name
    if bare in _builtin_builders() and ":" not in name:
        return
    if bare in torchvision_names() and not name.startswith("timm:"):
        return
    if bare in timm_names() and not name.startswith("torchvision:"):
        return
    build_image_model(name, 2, 3)  # raises the full message


def build_image_model(name: str, num_classes: int, in_channels: int = 3, options: Optional[dict] = None) -> nn.Module:
    options = dict(options or {})
    builtins = _builtin_builders()
    source = None
    if ":" in name:
        source, name = name.split(":", 1)
        if source not in ("torchvision", "timm"):
            raise ModelError(f"model '{source}:{name}': the prefix must be torchvision: or timm:")
    if source is None and name in builtins:
        try:
            return builtins[name](num_classes=num_classes, in_channels=in_channels, **options)
        except TypeError as exc:
            raise ModelError(f"model '{name}' does not accept options {sorted(options)} ({exc})") from None
    if source in (None, "torchvision"):
        tv = torchvision_names()
        if name in tv:
            import torchvision.models as tvm

            if options.pop("weights", None) is not None:
                raise ModelError("torchrig never downloads weights: set model.weights to a local file instead")
            try:
                return tvm.get_model(name, weights=None, num_classes=num_classes, **options)
            except TypeError as exc:
                raise ModelError(f"torchvision model '{name}' does not accept options {sorted(options)} ({exc})") from None
        if source == "torchvision":
            if not tv:
                raise ModelError(f"model 'torchvision:{name}' needs torchvision; pip install 'torchrig[vision]'")
            raise ModelError(f"torchvision has no classification model '{name}'{suggest(name, tv)}")
    tm = timm_names()
    if name in tm:
        import timm

        options.pop("pretrained", None)
        return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **options)
    if source == "timm":
        raise ModelError(f"model 'timm:{name}' needs timm (pip install 'torchrig[timm]')" if not tm
                         else f"timm has no model '{name}'{suggest(name, tm)}")
    known = [n for n in sorted(builtins) if n not in NOT_IMAGE]
    listing = (f"Built-in: {', '.join(known)}; or any torchvision.models classification builder (resnet18, "
               f"resnet50, …)" + ("; or a timm model" if tm else " (timm models too, once timm is installed)"))
    raise ModelError(f"unknown image model '{name}'{suggest(name, known + torchvision_names(), listing=listing)}")


__all__ = ["BasicBlock", "SmallResNet", "build_image_model", "check_image_model_name", "is_external", "torchvision_names", "timm_names"]
