"""A stand-in for TE's FP8 weights on the CPU (not a test module): ``megatron_fsdp/_fp8.py``'s contract built on
torch's ``float8_e4m3fn``, and a tiny net whose linears use it.

TE's ``Float8Tensor`` and its kernels need CUDA, so the engine's FP8 all-gather is tested on the CPU through
:class:`StandInOps`, registered with ``megatron_fsdp._fp8.register_ops``: a :class:`Fp8Param` holds its FP8
bytes in ``_data`` (uint8), its ``_scale_inv`` and its transpose in ``_transpose``, as TE's tensor does, and
:class:`Fp8Linear` computes with the dequantized bytes (``_Fp8Matmul``: the weight's gradient goes to the
parameter, as TE's GEMM gives it). The quantization is current scaling as TE does it for weights: the amax of
the bf16-rounded weight, ``scale = 448 / amax``, E4M3 with saturation.

``Fp8Linear(quantized=False)`` is the same layer with a plain weight quantized in forward (TE's path without
primary FP8 weights): the reference the all-gather must equal bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from megatron_fsdp._fp8 import QuantizedOps

E4M3_MAX = 448.0


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values -> E4M3 bytes (uint8) at ``scale``, from the bf16-rounded values."""
    y = (x.to(torch.bfloat16).float() * scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def quantize(w: torch.Tensor):
    """Current scaling of a whole weight: (bytes, scale_inv)."""
    scale = _scale(w.detach().to(torch.bfloat16).float().abs().max())
    return _cast(w.detach(), scale), 1.0 / scale


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.view(torch.float8_e4m3fn).float() * scale_inv


class Fp8Param(nn.Parameter):
    """A weight stored as FP8 bytes (``_data``), its ``_scale_inv`` and its column-wise copy (``_transpose``)."""

    def __new__(cls, values: torch.Tensor) -> "Fp8Param":
        p = super().__new__(cls, values.detach().clone(), requires_grad=True)
        p._hp = values.detach().clone()
        p._data, p._scale_inv = quantize(values)
        p._scale_inv = p._scale_inv.reshape(1).clone()
        p._transpose = None
        return p

    def dequantized(self) -> torch.Tensor:
        return dequantize(self._data, self._scale_inv)


class StandInOps(QuantizedOps):
    """The engine's contract for :class:`Fp8Param`. ``reduce_amax=False`` is a negative control: each rank scales by
    the amax of its own piece, as an engine that forgot the all-reduce would."""

    name = "stand-in float8"

    def __init__(self, reduce_amax: bool = True) -> None:
        self.reduce_amax = reduce_amax
        self.quantize_calls = 0

    def matches(self, p: torch.Tensor) -> bool:
        return isinstance(p, Fp8Param)

    def initial_values(self, p: torch.Tensor) -> torch.Tensor:
        return p._hp

    def needs_transpose(self, p: torch.Tensor) -> bool:
        return True

    def bind(self, p: torch.Tensor, data: torch.Tensor, transpose: Optional[torch.Tensor]) -> None:
        p._data, p._transpose = data, transpose

    def quantize(self, params: Sequence[torch.Tensor], pieces: Sequence[Optional[torch.Tensor]],
                 offsets: Sequence[Optional[int]], outs: Sequence[Optional[torch.Tensor]],
                 group: dist.ProcessGroup) -> None:
        self.quantize_calls += 1
        amax = torch.stack([piece.to(torch.bfloat16).float().abs().max() if piece is not None and piece.numel()
                            else torch.zeros(()) for piece in pieces])
        if self.reduce_amax:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = _scale(amax)
        for p, piece, out, s in zip(params, pieces, outs, scale):
            p._scale_inv.copy_(1.0 / s)
            if piece is not None:
                out.copy_(_cast(piece, s))

    def after_gather(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            p._transpose.copy_(p._data.t())


class _Fp8Matmul(torch.autograd.Function):
    """``x @ W^T`` with ``W`` the dequantized FP8 weight; the weight's gradient goes to ``weight``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        gw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ w, gw, None


class Fp8Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, quantized: bool) -> None:
        super().__init__()
        w = torch.randn(fan_out, fan_in) / fan_in ** 0.5
        self.weight = Fp8Param(w) if quantized else nn.Parameter(w)
        self.bias = nn.Parameter(torch.randn(fan_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, Fp8Param):
            w = self.weight.dequantized()
        else:
            w = dequantize(*quantize(self.weight))  # TE's path without primary FP8 weights
        return _Fp8Matmul.apply(x, self.weight, w) + self.bias


class Block(nn.Module):
    def __init__(self, h: int, quantized: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = Fp8Linear(h, 3 * h, quantized)
        self.fc2 = Fp8Linear(3 * h, h, quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Root: an input projection and a head (plain); ``blocks`` blocks (two by default), each an FSDP unit with two
    FP8 weights; ``recompute``: each block under non-reentrant activation checkpointing."""

    def __init__(self, quantized: bool, h: int = 16, frozen_fp8: bool = False, blocks: int = 2,
                 recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.inp = nn.Linear(6, h)
        self.blocks = nn.ModuleList(Block(h, quantized) for _ in range(blocks))
        self.head = nn.Linear(h, 3)
        if frozen_fp8:
            self.blocks[0].fc1.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.recompute else b(x)
        return self.head(x)
