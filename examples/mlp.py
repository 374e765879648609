"""A plain multi-layer perceptron: the simplest pipeline."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def build(batch_size: int = 16, seed: int = 0, width: int = 256, depth: int = 8):
    torch.manual_seed(seed)
    model = MLP(width, depth)
    x = torch.randn(batch_size, width)
    y = torch.randint(0, 10, (batch_size,))
    return model, (x,), nn.functional.cross_entropy, y
