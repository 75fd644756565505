"""Small models that train in seconds on a CPU."""

from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 (or any small square) single-channel images: the default job's model."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 4, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10, depth: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        # parallel.tp_plan=auto: the first two layers as a column-split / row-split pair
        first, second = [f"net.{i}" for i, m in enumerate(layers) if isinstance(m, nn.Linear)][:2]
        self.tp_plan = {first: "colwise", second: "rowwise"}

    def forward(self, x):
        return self.net(x)
