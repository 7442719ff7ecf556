"""The small model of the root-slot and reduce-dtype tests (not a test module): three units; the root holds the
input and output layers and ``side``, which only even steps use."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Three units; the root holds the input and output layers and ``side``, which only even steps use."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.inp, self.head, self.side = nn.Linear(6, h), nn.Linear(h, 3), nn.Linear(h, h)
        self.layers = nn.ModuleList(Block(h) for _ in range(3))
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x + self.side(x) if self.use_side else x)
