"""A Llama-3-shaped decoder for benchmarks and the checker: TE layers on a GPU, the same math in plain torch on CPU.

Llama-3-8B's shape (:func:`llama3_8b_config`): hidden 4096, 32 heads with 8 key/value heads (grouped-query
attention), SwiGLU MLP of 14336, RMSNorm, rotary position embeddings (theta 500000), vocabulary 128256,
sequence 4096, no biases, an untied output head. ``num_layers`` is the knob a benchmark turns to fit its
GPUs (32 is the real model).

Two implementations of a layer, picked by ``LlamaConfig.layers_impl``:

- ``te``: ``transformer_engine.pytorch.TransformerLayer(normalization="RMSNorm", activation="swiglu",
  num_gqa_groups=..., bias=False, self_attn_mask_type="causal")``, called as ``block(x, rotary_pos_emb=rope)``
  where ``rope`` is one static fp32 tensor [seq, 1, 1, head_dim] (TE's format) shared by all layers.
  Sequence-first layout [seq, batch, hidden]. Needs TE and CUDA.
- ``torch``: :class:`LlamaTorchLayer`, the same math from torch ops (RMSNorm, q/k/v/o projections, rotary
  embedding with ``rotate_half``, ``scaled_dot_product_attention(enable_gqa=True)``, SwiGLU), same layout and
  call; for CPU smoke runs and as a fallback. The two are not numerically identical (different kernels and
  parameter layouts); each is deterministic.

The FSDP unit is :class:`LlamaLayer` (either block inside, ``unit_class``), called ``layer(x)``: it passes the
rotary table itself, so no engine casts it (see :class:`_RopeTable`).

No dropout (bit-exact eager-vs-graph comparisons need deterministic kernels). Parameters are created in fp32;
engines cast for compute (bf16) and keep fp32 main weights.

Checker: ``python -m fsdp_cudagraph.check --model fsdp_cudagraph.apps.llama:tiny`` (a 2-layer, hidden-64
Llama, TE layers on CUDA with TE, torch layers otherwise) or ``...llama:llama3_8b_2layers`` (two 8B-shaped
layers, sequence 4096: the benchmark's shape, for a GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.capture.te import HAS_TE, require_te

__all__ = ["LlamaConfig", "llama3_8b_config", "Llama", "LlamaLayer", "LlamaTorchLayer", "rope_table", "loss_fn",
           "synthetic_batch", "checker_spec", "tiny", "llama3_8b_2layers"]

LAYERS_IMPLS = ("te", "torch")


@dataclasses.dataclass
class LlamaConfig:
    """Shape of a Llama-3-style decoder; see :func:`llama3_8b_config` for the 8B preset."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 128
    seq_len: int = 32
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    #: ``te`` (TransformerEngine TransformerLayer; CUDA) or ``torch`` (LlamaTorchLayer)
    layers_impl: str = "torch"
    #: TE only: weight gradients accumulate straight into the engine's fp32 ``main_grad``
    #: (``fuse_wgrad_accumulation=True`` with ``fuse_qkv_params=True``, TE's rule); our engine only.
    fuse_wgrad: bool = False
    #: TE only: one fused QKV weight (``fuse_qkv_params``); None: as ``fuse_wgrad`` (TE needs it fused there). FP8
    #: primary weights need it fused too (TE refuses to split a quantized weight into q, k and v).
    fuse_qkv: Optional[bool] = None
    #: TE only: the dtype TE builds its parameters in. Primary FP8 weights (built under TE's
    #: ``quantized_model_init``) take the engine's compute dtype (``torch.bfloat16``): TE checks that every
    #: parameter's dtype is the input's, and an FP8 weight keeps the dtype it was built with.
    te_params_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.layers_impl not in LAYERS_IMPLS:
            raise ValueError(f"layers_impl={self.layers_impl!r} is not one of {LAYERS_IMPLS}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}: "
                             "grouped-query attention shares each key/value head among num_heads/num_kv_heads heads")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim={self.hidden_size // self.num_heads} is odd; rotary embeddings rotate pairs")
        if self.fuse_wgrad and self.fuse_qkv is False:
            raise ValueError("fuse_wgrad=True with fuse_qkv=False: TE's fuse_wgrad_accumulation needs fuse_qkv_params; "
                             "leave fuse_qkv unset (None) or True")
        if self.fuse_wgrad and self.layers_impl != "te":
            raise ValueError("fuse_wgrad=True is TE's fuse_wgrad_accumulation and needs layers_impl='te'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_params(self) -> int:
        """Parameters of one layer: two RMSNorm weights, q/k/v/o, SwiGLU's gate, up and down (no biases)."""
        h, kv, f = self.hidden_size, self.num_kv_heads * self.head_dim, self.ffn_hidden_size
        return 2 * h + h * h + 2 * h * kv + h * h + 3 * h * f

    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, untied head."""
        return 2 * self.vocab_size * self.hidden_size + self.num_layers * self.layer_params() + self.hidden_size


def llama3_8b_config(**overrides: Any) -> LlamaConfig:
    """Llama-3-8B's shape (32 layers, 8.03 B parameters); ``overrides`` replace fields, e.g. ``num_layers=4``."""
    fields = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                  ffn_hidden_size=14336, seq_len=4096, rope_theta=500000.0, norm_eps=1e-5,
                  layers_impl="te" if HAS_TE and torch.cuda.is_available() else "torch")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)})
    if unknown:
        raise ValueError(f"llama3_8b_config: {unknown} are not LlamaConfig fields")
    fields.update(overrides)
    return LlamaConfig(**fields)


def rope_table(cfg: LlamaConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """Rotary angles [seq, 1, 1, head_dim] in fp32, halves repeated (TE's ``rotary_pos_emb`` format, the
    ``rotate_half`` convention of Llama)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32, device=device), inv)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``x`` [seq, batch, heads, head_dim]; ``rope`` [seq, 1, 1, head_dim] fp32."""
    s = x.shape[0]
    cos, sin = rope[:s].cos().to(x.dtype), rope[:s].sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class LlamaTorchLayer(nn.Module):
    """One Llama decoder layer from torch ops, sequence-first ([seq, batch, hidden]); called like TE's layer:
    ``layer(x, rotary_pos_emb=rope)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_norm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.q, self.k, self.v = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.post_norm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.gate = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.up = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden_size, h, bias=False)

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        y = self.input_norm(x)
        q = _apply_rope(self.q(y).view(s, b, self.num_heads, self.head_dim), rotary_pos_emb)
        k = _apply_rope(self.k(y).view(s, b, self.num_kv_heads, self.head_dim), rotary_pos_emb)
        v = self.v(y).view(s, b, self.num_kv_heads, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.permute(2, 0, 1, 3).reshape(s, b, h))
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def _te_layer(cfg: LlamaConfig, layer_number: int) -> nn.Module:
    te = require_te("LlamaConfig(layers_impl='te')")
    return te.TransformerLayer(
        cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads, num_gqa_groups=cfg.num_kv_heads,
        layernorm_epsilon=cfg.norm_eps, hidden_dropout=0.0, attention_dropout=0.0, layer_number=layer_number,
        self_attn_mask_type="causal", normalization="RMSNorm", activation="swiglu", bias=False,
        params_dtype=cfg.te_params_dtype, seq_length=cfg.seq_len,
        fuse_wgrad_accumulation=cfg.fuse_wgrad,
        fuse_qkv_params=cfg.fuse_wgrad if cfg.fuse_qkv is None else cfg.fuse_qkv,
    )


class _RopeTable:
    """The rotary table every layer reads, made once per device at the first forward (outside any graph: capture
    follows eager steps) and then the same tensor at the same address every step.

    Deliberately neither a buffer nor a forward argument: engines cast what a unit receives or holds (FSDP2's
    ``MixedPrecisionPolicy`` casts floating forward inputs to ``param_dtype``; NVIDIA's builder casts the module,
    buffers included), and angles up to ``seq_len`` radians in bf16 would be wrong by whole radians. Held here,
    the table stays fp32 under every engine.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        self.cfg = cfg
        self.table: Optional[torch.Tensor] = None

    def get(self, device: torch.device) -> torch.Tensor:
        if self.table is None or self.table.device != device:
            self.table = rope_table(self.cfg, device)
        return self.table


class LlamaLayer(nn.Module):
    """The FSDP unit: one decoder layer (``block``: TE's ``TransformerLayer`` or :class:`LlamaTorchLayer`), called
    ``layer(x)`` on [seq, batch, hidden]; it hands the model's rotary table to the block as ``rotary_pos_emb``."""

    def __init__(self, cfg: LlamaConfig, layer_number: int, rope: _RopeTable) -> None:
        super().__init__()
        self.te = cfg.layers_impl == "te"
        self.block = _te_layer(cfg, layer_number) if self.te else LlamaTorchLayer(cfg)
        self._rope = rope  # a plain object: not a parameter, buffer or submodule (see _RopeTable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TE's block takes is_first_microbatch when the FP8 region caches quantized weights
        extra = _fp8.te_call_kwargs() if self.te else {}
        return self.block(x, rotary_pos_emb=self._rope.get(x.device), **extra)


class Llama(nn.Module):
    """Token embedding, ``num_layers`` decoder layers (:class:`LlamaLayer`, the FSDP units), final RMSNorm, untied
    head. The rotary table is fp32 under every engine (see :class:`_RopeTable`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rope = _RopeTable(cfg)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i + 1, rope) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.cfg.seq_len:
            raise ValueError(f"tokens of length {tokens.shape[1]}: this Llama's rotary table and graphs are built for "
                             f"seq_len={self.cfg.seq_len}; pad or crop the batch to that length")
        x = self.tok(tokens).transpose(0, 1).contiguous()  # [seq, batch, hidden]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x.transpose(0, 1)))

    @property
    def unit_class(self) -> type:
        """The class whose instances are the FSDP units (the decoder layers)."""
        return LlamaLayer


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(step: int, batch_size: int, cfg: Any, device: torch.device, *,
                    seed: int = 1234) -> Tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step``: (tokens, next-token targets), each [batch, seq] (``cfg``: any
    config with ``vocab_size`` and ``seq_len``)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def checker_spec(cfg: LlamaConfig, device: torch.device, *, micro_batch_size: int = 1) -> Any:
    """A :class:`fsdp_cudagraph.check.ModelSpec` for ``cfg``: units are the decoder layers, each rank trains its
    own slice of a deterministic global batch."""
    import torch.distributed as dist

    from fsdp_cudagraph.check import ModelSpec

    model = Llama(cfg).to(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batch(step, micro_batch_size * world, cfg, device)
        sl = slice(rank * micro_batch_size, (rank + 1) * micro_batch_size)
        return x[sl].contiguous(), y[sl].contiguous()

    return ModelSpec(model=model, unit_modules=[model.unit_class], batch=batch,
                     loss=lambda m, b: loss_fn(m(b[0]), b[1]))


def tiny(device: torch.device) -> Any:
    """Checker factory: a 2-layer Llama (hidden 64, 4 heads, 2 KV heads, seq 32); TE layers on CUDA with TE."""
    impl = "te" if device.type == "cuda" and HAS_TE else "torch"
    return checker_spec(LlamaConfig(layers_impl=impl), device)


def llama3_8b_2layers(device: torch.device) -> Any:
    """Checker factory: two Llama-3-8B layers at sequence 4096 with the 8B embedding and head (1.5 B parameters;
    TE layers on CUDA with TE): the benchmark's layer shape, checked bit for bit. GPU-sized."""
    impl = "te" if device.type == "cuda" and HAS_TE else "torch"
    return checker_spec(llama3_8b_config(num_layers=2, layers_impl=impl), device)
