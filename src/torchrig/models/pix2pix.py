"""pix2pix networks (Isola et al., 2017): a U-Net generator and a PatchGAN discriminator.

Blocks are Convolution-BatchNorm-ReLU with 4x4 kernels and stride 2. As in the paper, the encoder's
ReLUs are leaky (slope 0.2) and the decoder's are not; the first encoder layer has no BatchNorm;
the decoder's three blocks after the bottleneck use dropout; the output is ``tanh`` in [-1, 1].
Every weight starts from N(0, 0.02) (BatchNorm scales from N(1, 0.02)).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .errors import ModelError
from .init import normal_init_


class UNetGenerator(nn.Module):
    """Encoder-decoder with a skip connection from each encoder level to the mirrored decoder level.

    ``num_downs`` halvings take an ``image_size`` image to ``image_size / 2**num_downs`` at the
    bottleneck (1x1 when ``num_downs = log2(image_size)``, as in the paper's 256 px / 8 levels).
    """

    def __init__(self, in_channels: int = 3, out_channels: int = 3, ngf: int = 64, num_downs: int = 8,
                 dropout: float = 0.5):
        super().__init__()
        if num_downs < 2:
            raise ModelError(f"U-Net needs num_downs >= 2, got {num_downs}")
        chans = [ngf * min(2 ** i, 8) for i in range(num_downs)]
        downs: list[nn.Module] = [nn.Conv2d(in_channels, chans[0], 4, 2, 1)]
        for i in range(1, num_downs):
            innermost = i == num_downs - 1
            downs.append(nn.Sequential(
                nn.LeakyReLU(0.2, inplace=True),
                nn.Conv2d(chans[i - 1], chans[i], 4, 2, 1, bias=innermost),
                nn.Identity() if innermost else nn.BatchNorm2d(chans[i])))
        ups: list[nn.Module] = []
        for i in range(num_downs - 1, -1, -1):  # innermost first
            cin = chans[i] if i == num_downs - 1 else 2 * chans[i]
            if i == 0:
                ups.append(nn.Sequential(nn.ReLU(inplace=True), nn.ConvTranspose2d(cin, out_channels, 4, 2, 1),
                                         nn.Tanh()))
                continue
            layers = [nn.ReLU(inplace=True), nn.ConvTranspose2d(cin, chans[i - 1], 4, 2, 1, bias=False),
                      nn.BatchNorm2d(chans[i - 1])]
            if dropout and num_downs - 4 <= i < num_downs - 1:
                layers.append(nn.Dropout(dropout))
            ups.append(nn.Sequential(*layers))
        self.down = nn.ModuleList(downs)
        self.up = nn.ModuleList(ups)
        self.num_downs = num_downs
        normal_init_(self)

    def forward(self, x):
        if x.shape[-1] % (2 ** self.num_downs) or x.shape[-2] % (2 ** self.num_downs):
            raise ModelError(f"U-Net with {self.num_downs} levels needs image sides divisible by "
                             f"{2 ** self.num_downs}, got {tuple(x.shape[-2:])}")
        skips = []
        for d in self.down:
            x = d(x)
            skips.append(x)
        x = skips.pop()
        for j, u in enumerate(self.up):
            x = u(x)
            if j < len(self.up) - 1:
                x = torch.cat([skips.pop(), x], dim=1)
        return x


class PatchDiscriminator(nn.Module):
    """PatchGAN: classifies each overlapping patch of the (input, output) pair as real or fake.

    Returns logits of shape ``(N, 1, h, w)``; with ``n_layers=3`` each logit sees a 70x70 patch.
    """

    def __init__(self, in_channels: int = 6, ndf: int = 64, n_layers: int = 3):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_channels, ndf, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True)]
        mult = 1
        for n in range(1, n_layers):
            prev, mult = mult, min(2 ** n, 8)
            layers += [nn.Conv2d(ndf * prev, ndf * mult, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * mult),
                       nn.LeakyReLU(0.2, inplace=True)]
        prev, mult = mult, min(2 ** n_layers, 8)
        layers += [nn.Conv2d(ndf * prev, ndf * mult, 4, 1, 1, bias=False), nn.BatchNorm2d(ndf * mult),
                   nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(ndf * mult, 1, 4, 1, 1)]
        self.net = nn.Sequential(*layers)
        normal_init_(self)

    def forward(self, x):
        return self.net(x)


def build_pix2pix(in_channels: int = 3, out_channels: int = 3, image_size: int = 256, ngf: int = 64, ndf: int = 64,
                  num_downs: Optional[int] = None, d_layers: int = 3, dropout: float = 0.5) -> nn.ModuleDict:
    """``nn.ModuleDict({"G": UNetGenerator, "D": PatchDiscriminator})``: one module, two optimizers."""
    if num_downs is None:
        num_downs = int(math.log2(image_size))
    if image_size % (2 ** num_downs):
        raise ModelError(f"pix2pix.image_size {image_size} must be divisible by 2**num_downs = {2 ** num_downs}")
    side = image_size // 2 ** d_layers
    if side < 4:
        raise ModelError(f"pix2pix.d_layers {d_layers} is too deep for image_size {image_size}; lower it")
    return nn.ModuleDict({"G": UNetGenerator(in_channels, out_channels, ngf, num_downs, dropout),
                          "D": PatchDiscriminator(in_channels + out_channels, ndf, d_layers)})


__all__ = ["UNetGenerator", "PatchDiscriminator", "build_pix2pix"]
