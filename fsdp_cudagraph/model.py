"""A small GPT for tests, the demo and benchmarks, split the way partial CUDA graphs select callables.

Each :class:`TransformerBlock` (the FSDP unit) holds an ``attn`` submodule and either a dense ``mlp`` or an
MoE block ``moe`` whose ``router`` and ``preprocess`` are submodules of their own. Each of those classes
carries a ``cuda_graph_module`` tag naming its :class:`~fsdp_cudagraph.config.CudaGraphModule`, which is
how the capture layer finds callables for a scope. Every tagged submodule takes and returns tensors only,
with static shapes (the MoE routes densely with top-k masks, no token dropping or variable-size dispatch),
so any scope, whole layers included, is graphable.

Built from TransformerEngine modules with ``use_te=True`` (needs TE and CUDA) and from plain torch
otherwise. Dropout is absent on purpose: bit-exact eager-vs-graph comparisons need deterministic kernels.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._te import require_te

__all__ = ["GPTConfig", "GPT", "TransformerBlock", "SelfAttention", "MLP", "MoEBlock", "Router", "MoEPreprocess", "Experts", "loss_fn", "synthetic_batch"]


@dataclasses.dataclass
class GPTConfig:
    """Shape of the reference model. ``moe_every=k`` makes every k-th layer (1-based) an MoE layer."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    seq_len: int = 32
    moe_every: int = 0
    num_experts: int = 4
    moe_top_k: int = 2
    use_te: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; pick num_heads that "
                "divides hidden_size"
            )
        if self.moe_every < 0 or not (1 <= self.moe_top_k <= self.num_experts):
            raise ValueError(
                f"moe_every={self.moe_every}, moe_top_k={self.moe_top_k}, num_experts={self.num_experts}: need "
                "moe_every >= 0 and 1 <= moe_top_k <= num_experts"
            )


class SelfAttention(nn.Module):
    """Pre-norm causal self-attention with its residual: ``x + proj(attn(ln(x)))``; x is [batch, seq, hidden]."""

    cuda_graph_module = "attn"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.use_te = cfg.use_te
        if cfg.use_te:
            te = require_te("GPTConfig(use_te=True)")
            self.ln_qkv = te.LayerNormLinear(h, 3 * h, bias=True, params_dtype=torch.float32)
            self.core = te.DotProductAttention(cfg.num_heads, h // cfg.num_heads, attn_mask_type="causal", qkv_format="bshd")
            self.proj = te.Linear(h, h, bias=True, params_dtype=torch.float32)
        else:
            self.ln = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.num_heads
        if self.use_te:
            q, k, v = self.ln_qkv(x).view(b, s, 3, self.num_heads, d).unbind(2)
            y = self.core(q, k, v)
        else:
            q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.num_heads, d).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        return x + self.proj(y)


class MLP(nn.Module):
    """Pre-norm dense MLP with its residual."""

    cuda_graph_module = "mlp"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.use_te = cfg.use_te
        if cfg.use_te:
            te = require_te("GPTConfig(use_te=True)")
            self.ln_mlp = te.LayerNormMLP(cfg.hidden_size, cfg.ffn_hidden_size, bias=True, params_dtype=torch.float32)
        else:
            self.ln = nn.LayerNorm(cfg.hidden_size)
            self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
            self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_te:
            return x + self.ln_mlp(x)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Router(nn.Module):
    """Token-to-expert probabilities: ``softmax(x W)``, [tokens, experts]."""

    cuda_graph_module = "moe_router"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate(x).float(), dim=-1)


class MoEPreprocess(nn.Module):
    """Dispatch preparation: top-k mask of the router probabilities, renormalised combine weights."""

    cuda_graph_module = "moe_preprocess"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        idx = torch.topk(probs, self.top_k, dim=-1).indices
        mask = torch.zeros_like(probs).scatter_(-1, idx, 1.0)
        weights = probs * mask
        return weights / weights.sum(dim=-1, keepdim=True)


class Experts(nn.Module):
    """All experts applied densely and mixed by the combine weights (static shapes, graph-friendly)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
        self.w1 = nn.Parameter(torch.randn(e, h, f) / math.sqrt(h))
        self.w2 = nn.Parameter(torch.randn(e, f, h) / math.sqrt(f))

    def forward(self, x: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        hid = F.gelu(torch.einsum("th,ehf->etf", x, self.w1))
        out = torch.einsum("etf,efh->eth", hid, self.w2)
        return torch.einsum("eth,te->th", out, combine.to(out.dtype))


class MoEBlock(nn.Module):
    """Pre-norm mixture of experts with its residual."""

    cuda_graph_module = "moe"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden_size)
        self.router = Router(cfg)
        self.preprocess = MoEPreprocess(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        t = self.ln(x).reshape(b * s, h)
        combine = self.preprocess(self.router(t))
        return x + self.experts(t, combine).view(b, s, h)


class TransformerBlock(nn.Module):
    """One layer: attention then a dense MLP or an MoE block. The FSDP unit of the reference model."""

    def __init__(self, cfg: GPTConfig, layer_number: int) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        is_moe = cfg.moe_every > 0 and layer_number % cfg.moe_every == 0
        if is_moe:
            self.moe = MoEBlock(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x)
        return self.moe(x) if hasattr(self, "moe") else self.mlp(x)


class GPT(nn.Module):
    """Token and position embeddings, ``num_layers`` blocks, final norm and an untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i + 1) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))[None]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(
    step: int, batch_size: int, cfg: GPTConfig, device: torch.device, *, seed: int = 1234
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step``: (tokens, next-token targets), each [batch, seq]."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)
