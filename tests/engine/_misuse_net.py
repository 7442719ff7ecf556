"""The small model of the misuse and optimizer tests (not a test module): four units of an attention stand-in
and an MLP, with switches for how the root calls them (see tests/engine/test_misuse.py)."""

from __future__ import annotations

from typing import Set

import torch
from torch import nn

BATCH = 8
HIDDEN = 16


class Layer(nn.Module):
    """The FSDP unit: an attention stand-in and an MLP, each a submodule owning parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        #: Apply ``attn`` twice inside this unit's forward (a submodule reused within its own unit).
        self.attn_twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x)
        if self.attn_twice:
            h = self.attn(torch.tanh(h))
        out = x + self.mlp(torch.tanh(h))
        # A module of another unit kept as a plain attribute (not a registered submodule), called from here.
        borrowed = self.__dict__.get("borrowed")
        return out if borrowed is None else out + borrowed(out)


class Net(nn.Module):
    """``mode``: how layer 1 is called this step ("normal", "submodules", "twice"), or "root_read" (the root
    reads layer 3's ``attn.weight`` itself); ``skip``: layers left out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(HIDDEN, 1)
        self.mode = "normal"
        self.skip: Set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.mode == "root_read":  # a unit's parameter read directly in the root's forward, before the unit
            h = h + nn.functional.linear(h, self.layers[3].attn.weight)
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            if i == 1 and self.mode == "submodules":
                h = h + layer.mlp(torch.tanh(layer.attn(h)))  # the misuse: the unit's hooks never run
            elif i == 1 and self.mode == "twice":
                h = layer(layer(h))
            else:
                h = layer(h)
        return self.head(h)


def data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)
