"""Small reference models for the lessons, tests and benchmarks."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten, then ``depth`` Linear+ReLU layers of ``width``, then a Linear classifier."""

    def __init__(self, n_in: int = 64, width: int = 256, depth: int = 2, n_out: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(n_in if i == 0 else width, width), nn.ReLU()]
        layers.append(nn.Linear(width if depth else n_in, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """Conv-BatchNorm-ReLU blocks on 8x8 digits, then a Linear classifier."""

    def __init__(self, channels: int = 32, n_out: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        )
        self.head = nn.Linear(2 * c * 4 * 4, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take, as requested (not rounded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
