"""The small model of the fused weight-gradient tests (not a test module): :class:`ProtocolLinear` follows TE's
``fuse_wgrad_accumulation`` protocol the way TE 2.20's ``Linear`` does (see tests/engine/test_fused_wgrad.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, fuse: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        if fuse:  # read at forward time, as TE does
            ctx.main_grad_func = weight.get_main_grad
            ctx.overwrite = getattr(weight, "overwrite_main_grad", False)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.fuse:
            main_grad = ctx.main_grad_func()
            if ctx.overwrite:
                main_grad.copy_(gw)
            else:
                main_grad.add_(gw)
            gw = None
        return gy @ w, gw, g2.sum(0), None


class ProtocolLinear(nn.Module):
    """A linear layer that honours ``fuse_wgrad_accumulation`` as TE's modules do."""

    def __init__(self, i: int, o: int, fuse: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i ** 0.5)
        self.bias = nn.Parameter(torch.randn(o) * 0.1)
        self.fuse_wgrad_accumulation = fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self.fuse_wgrad_accumulation)


class Block(nn.Module):
    def __init__(self, h: int, fuse: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = ProtocolLinear(h, 2 * h, fuse)
        self.fc2 = ProtocolLinear(2 * h, h, fuse)
        self.extra = ProtocolLinear(h, h, fuse)  # skipped at odd steps
        self.use_extra = True
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if self.use_extra:
            y = y + self.extra(y)
        if self.twice:
            y = y + self.extra(y)
        return y


class Net(nn.Module):
    def __init__(self, fuse: bool, h: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(6, h)
        self.layers = nn.ModuleList(Block(h, fuse) for _ in range(3))
        self.head = ProtocolLinear(h, 3, fuse)  # in the root unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        # the head's weight also gets an ordinary gradient through this second use
        return self.head(x) + 0.1 * (x @ self.head.weight.t())
