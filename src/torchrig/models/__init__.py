"""Built-in models and a name registry (recipes add torchvision / timm / Hugging Face adapters)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..errors import suggest
from .errors import ModelError

from .pix2pix import PatchDiscriminator, UNetGenerator, build_pix2pix
from .small import DigitsCNN, MLP
from .text import BertClassifier
from .vision import SmallResNet

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "mlp": MLP,
    "small_resnet": SmallResNet,  # image-classification: ResNet for small images (8x8 digits …)
    "bert": BertClassifier,  # text-classification: BERT-style encoder (vocab_size, num_classes, …)
    "unet_generator": UNetGenerator,  # pix2pix
    "patch_discriminator": PatchDiscriminator,
    "pix2pix": build_pix2pix,  # ModuleDict {"G", "D"}
}


def register_model(name: str, builder: Callable[..., nn.Module]) -> None:
    _BUILDERS[name] = builder


def builders() -> dict[str, Callable[..., nn.Module]]:
    """The registered model builders by name (a copy)."""
    return dict(_BUILDERS)


def model_names() -> list[str]:
    return sorted(_BUILDERS)


def build_model(name: str, **options) -> nn.Module:
    if name not in _BUILDERS:
        listing = f"Valid names: {', '.join(model_names())}"
        raise ModelError(f"unknown model '{name}'{suggest(name, _BUILDERS, listing=listing)}")
    try:
        return _BUILDERS[name](**options)
    except TypeError as exc:
        raise ModelError(f"model '{name}' does not accept options {sorted(options)} ({exc})") from None


__all__ = ["BertClassifier", "DigitsCNN", "MLP", "ModelError", "PatchDiscriminator", "SmallResNet", "UNetGenerator",
           "build_model", "build_pix2pix", "register_model", "model_names"]
