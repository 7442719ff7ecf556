"""A small GPT for tests, the demo and benchmarks, split the way partial CUDA graphs select callables.

Each :class:`TransformerBlock` (the FSDP unit) holds an ``attn`` submodule and either a dense ``mlp`` or an
MoE block ``moe`` whose ``router`` and ``preprocess`` are submodules of their own. Each of those classes
carries a ``cuda_graph_module`` tag naming its :class:`~fsdp_cudagraph.config.CudaGraphModule`, which is
how the capture layer finds callables for a scope. Every tagged submodule takes and returns tensors only,
with static shapes. The MoE (``apps/moe.py``) is the static dense toy by default (``moe_experts="dense"``:
every scope, whole layers included, is graphable) or dropless with eager experts between graphs
(``"split"``, ``"te_grouped"``: host sync, ``moe``/whole layers refused) or without a sync (``"grouped_mm"``,
and ``"capacity"``: drop-and-pad).

Built from TransformerEngine modules with ``use_te=True`` (needs TE and CUDA) and from plain torch
otherwise. Dropout is absent on purpose: bit-exact eager-vs-graph comparisons need deterministic kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.capture.te import require_te
from fsdp_cudagraph.apps.moe import MOE_EXPERTS, Experts, MoEBlock, MoEPreprocess, Router, SharedExpert, unpermute
from fsdp_cudagraph.apps.moe_ep import merge_expert_state_dicts, slice_expert_state_dict
from fsdp_cudagraph.apps import tp as _tp
from fsdp_cudagraph.apps.tp import merge_tp_state_dicts, slice_tp_state_dict

__all__ = ["GPTConfig", "GPT", "TransformerBlock", "SelfAttention", "MLP", "MoEBlock", "Router", "MoEPreprocess",
           "Experts", "SharedExpert", "unpermute", "MOE_EXPERTS", "olmoe_config", "qwen3_moe_config",
           "mixtral_config", "llama70b_config", "loss_fn",
           "synthetic_batch", "moe_checker_spec", "moe_split", "moe_grouped_mm", "moe_capacity", "EP_EXPERTS",
           "check_expert_parallel", "check_parallel_size",
           "slice_expert_state_dict", "merge_expert_state_dicts", "slice_tp_state_dict", "merge_tp_state_dicts"]


def check_parallel_size(name: str, value: Any, meaning: str) -> None:
    """A parallel size of a model config (``name``: the field, ``meaning``: what 1 switches off): a positive
    integer, ``bool`` not counted as one; ValueError naming the value otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (1: no {meaning})")


@dataclasses.dataclass
class GPTConfig:
    """Shape of the reference model. ``moe_every=k`` makes every k-th layer (1-based) an MoE layer."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    #: Key/value heads (grouped-query attention, each shared by ``num_heads / num_kv_heads`` query heads);
    #: default ``num_heads`` (multi-head attention).
    num_kv_heads: Optional[int] = None
    #: Width of one head; default ``hidden_size / num_heads``. Another value (Qwen3's 128 at hidden 2048 with 32
    #: heads) makes the query projection ``num_heads * head_dim`` wide.
    head_dim: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    seq_len: int = 32
    moe_every: int = 0
    num_experts: int = 4
    moe_top_k: int = 2
    #: How the experts run (``apps/moe.py``): ``dense`` (the static toy, every expert on every token; the
    #: numerical oracle and the default, so every scope stays graphable), ``split`` (dropless,
    #: ``counts.tolist()`` then per-expert matmuls), ``grouped_mm`` (dropless, ``F.grouped_mm`` with device
    #: offsets, no sync), ``te_grouped`` (dropless, TE ``GroupedLinear``, needs TE), ``capacity`` (drop-and-pad
    #: to a static [E, C, h] batch, no sync).
    moe_experts: str = "dense"
    #: Each expert's FFN width; default ``ffn_hidden_size``.
    moe_ffn_hidden_size: Optional[int] = None
    #: A shared expert (an FFN every token goes through) added to the routed output.
    moe_shared_expert: bool = False
    #: ``grouped_mm`` experts compute in the input dtype (``"input"``) or in ``"bfloat16"`` (operands cast,
    #: output cast back). On CUDA only bfloat16 has torch's no-sync kernel; fp32 there is refused.
    moe_grouped_mm_dtype: str = "input"
    #: ``capacity`` experts: each takes ``ceil(T*K/E * moe_capacity_factor)`` rows (static), the rest dropped.
    moe_capacity_factor: float = 1.0
    #: Expert parallelism (``apps/moe_ep.py``): each rank of an expert-parallel group of this size holds
    #: ``num_experts / expert_parallel_size`` experts and the tokens travel to them by all-to-all. Build the
    #: model with ``GPT(cfg, expert_parallel_group=...)`` (e.g. ``megatron_fsdp.expert_parallel_groups(ep)[0]``)
    #: and shard it with ``fully_shard(..., expert_parallel_size=ep)``. 1: today's model, unchanged.
    expert_parallel_size: int = 1
    #: Expert parallelism only: the local experts in this many groups, each group's tokens dispatched, computed and
    #: combined by its own all-to-alls, so that one group's transfer runs beside another's experts
    #: ([Note: overlapped expert groups] in ``apps/moe_ep.py``). 1: one dispatch and one combine per layer.
    moe_ep_chunks: int = 1
    #: Tensor parallelism (``apps/tp.py``, [Note: tensor parallelism of the reference GPT]): each rank of a
    #: tensor-parallel group of this size holds ``1/TP`` of every layer (attention heads, MLP columns) and the
    #: activations between layers are split along the sequence. Build the model with ``GPT(cfg,
    #: tensor_parallel_group=...)`` (e.g. ``megatron_fsdp.tensor_parallel_groups(tp)[0]``) and shard it with
    #: ``fully_shard(..., tensor_parallel_size=tp)`` (or the same groups). 1: today's model, unchanged.
    tensor_parallel_size: int = 1
    #: Sequence parallelism between the layers (megatron-core's ``sequence_parallel``); required with
    #: ``tensor_parallel_size > 1`` (the only TP layout implemented), ignored at 1.
    sequence_parallel: bool = False
    #: With ``tensor_parallel_size > 1``: the token embedding and the LM head split over the vocabulary across the
    #: TP group (each rank holds ``vocab_size / TP`` rows of each; the logits are gathered, so the model's output
    #: and ``loss_fn`` are unchanged), as megatron-core and torchtitan split them ([Note: tensor parallelism of the
    #: reference GPT] in ``apps/tp.py``). False: both replicated on every TP rank.
    vocab_parallel: bool = False
    use_te: bool = False
    #: ``block``: our TransformerBlock (batch-first); ``te_layer``: TE's own ``TransformerLayer`` as the unit
    #: (sequence-first layout, needs ``use_te``).
    unit: str = "block"
    #: Calls the way real models make them: attention returns a tuple ``(out, normed_input)`` and the MLP
    #: takes that second tensor as a keyword argument (``skip=``); exercises tuple outputs and tensor kwargs.
    rich_calls: bool = False
    #: TE modules write weight gradients straight into the engine's fp32 gradient buffer
    #: (``fuse_wgrad_accumulation=True``; needs ``use_te`` and an engine that offers ``main_grad``, see
    #: [Note: fused weight gradients] in ``megatron_fsdp/_fused_wgrad.py``).
    fuse_wgrad: bool = False
    #: FP8 training with TE's recipe of this name (``delayed``, ``current``, ``block``; ``capture/fp8.py``), or
    #: None (bf16). The model itself is the same: the training loop runs each micro-batch's forward inside
    #: ``FP8Recipe(cfg.fp8).autocast()`` (eager and graphed alike), and the TE modules take the region's
    #: ``is_first_microbatch`` (weight caching). Needs ``use_te`` and TE's FP8 GEMM shapes (multiples of 16).
    fp8: Optional[str] = None

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_experts not in MOE_EXPERTS:
            raise ValueError(f"moe_experts={self.moe_experts!r} is not one of {list(MOE_EXPERTS)}; pick one of those")
        if not self.moe_capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be > 0 (1.0: T*K/E rows per expert)")
        if self.moe_grouped_mm_dtype not in ("input", "bfloat16"):
            raise ValueError(f"moe_grouped_mm_dtype={self.moe_grouped_mm_dtype!r} is not 'input' or 'bfloat16'")
        if self.moe_experts == "dense" and self.moe_shared_expert:
            raise ValueError("moe_shared_expert=True needs a dropless moe_experts ('split', 'grouped_mm', "
                             "'te_grouped'); the dense toy has none")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; pick num_heads that "
                "divides hidden_size, or set head_dim"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}: each key/value "
                             "head serves num_heads / num_kv_heads query heads; pick a divisor of num_heads")
        if self.unit not in ("block", "te_layer"):
            raise ValueError(f"unit={self.unit!r} is not 'block' or 'te_layer'; pick one of those")
        if self.unit == "te_layer" and (not self.use_te or self.moe_every or self.rich_calls):
            raise ValueError(
                f"unit='te_layer' (TE TransformerLayer) needs use_te=True, moe_every=0 and rich_calls=False (got "
                f"use_te={self.use_te}, moe_every={self.moe_every}, rich_calls={self.rich_calls})"
            )
        if self.fuse_wgrad and not self.use_te:
            raise ValueError("fuse_wgrad=True is TE's fuse_wgrad_accumulation and needs use_te=True (got use_te=False)")
        self._check_expert_parallel()
        self._check_fp8()
        self._check_tensor_parallel()
        if self.moe_every < 0 or not (1 <= self.moe_top_k <= self.num_experts):
            raise ValueError(
                f"moe_every={self.moe_every}, moe_top_k={self.moe_top_k}, num_experts={self.num_experts}: need "
                "moe_every >= 0 and 1 <= moe_top_k <= num_experts"
            )


    def _check_fp8(self) -> None:
        self.fp8 = _fp8.parse_fp8_recipe(self.fp8, "GPTConfig(fp8=...)")
        if self.fp8 is None:
            return
        if not self.use_te:
            raise ValueError(f"fp8={self.fp8!r} with use_te=False: FP8 runs in TransformerEngine's modules (plain torch "
                             "layers would stay in bf16 under TE's autocast, silently); set use_te=True or fp8=None")
        dims = {"hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size, "seq_len": self.seq_len}
        bad = {k: v for k, v in dims.items() if v % 16}
        if bad:
            raise ValueError(f"fp8={self.fp8!r} with {', '.join(f'{k}={v}' for k, v in bad.items())}: TE's FP8 GEMMs need "
                             "the hidden and FFN sizes and the sequence length (tokens) in multiples of 16; round "
                             f"{' and '.join(bad)} up to a multiple of 16, or fp8=None")
        if self.moe_experts == "te_grouped":
            raise ValueError(f"fp8={self.fp8!r} with moe_experts='te_grouped': the dropless GroupedLinear's per-expert "
                             "row counts vary per step and are not multiples of 16; use another moe_experts (they "
                             "run in bf16 under the autocast) or fp8=None")

    def _check_expert_parallel(self) -> None:
        ep = self.expert_parallel_size
        check_parallel_size("expert_parallel_size", ep, "expert parallelism")
        chunks = self.moe_ep_chunks
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"moe_ep_chunks={chunks!r}: pass a positive integer (1: one dispatch per MoE layer)")
        if chunks > 1 and (ep == 1 or self.num_experts % ep or (self.num_experts // ep) % chunks
                           or self.moe_experts == "te_grouped"):
            raise ValueError(f"moe_ep_chunks={chunks} with expert_parallel_size={ep}, num_experts={self.num_experts}, "
                             f"moe_experts={self.moe_experts!r}: the groups split each rank's local experts, so they "
                             "need expert_parallel_size > 1, a chunk count dividing num_experts / "
                             "expert_parallel_size, and moe_experts 'split' or 'grouped_mm' (TE's GroupedLinear holds "
                             "all local experts in one module); set moe_ep_chunks=1 otherwise")
        if ep == 1:
            return
        if self.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={self.num_experts}: every rank "
                             f"of an expert-parallel group holds num_experts / expert_parallel_size experts; pick a "
                             f"divisor of {self.num_experts}")
        if self.moe_every <= 0:
            raise ValueError(f"expert_parallel_size={ep} with moe_every={self.moe_every}: the model has no MoE layer "
                             "whose experts could be spread; set moe_every >= 1 or expert_parallel_size=1")
        if self.moe_experts not in EP_EXPERTS:
            raise ValueError(f"moe_experts={self.moe_experts!r} with expert_parallel_size={ep}: expert parallelism "
                             f"moves the dropless rows to the experts' ranks, which {EP_EXPERTS} implement; pick one "
                             "of those (or expert_parallel_size=1)")
        if self.unit != "block":
            raise ValueError(f"expert_parallel_size={ep} with unit={self.unit!r}: only unit='block' has MoE layers")


    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        check_parallel_size("tensor_parallel_size", tp, "tensor parallelism")
        if self.vocab_parallel and tp == 1:
            raise ValueError("vocab_parallel=True with tensor_parallel_size=1: the embedding and the LM head split "
                             "over the vocabulary across the tensor-parallel group, and there is none; set "
                             "tensor_parallel_size > 1 (with sequence_parallel=True) or vocab_parallel=False")
        if tp == 1:
            return
        if self.vocab_parallel and self.vocab_size % tp:
            raise ValueError(f"vocab_parallel=True with tensor_parallel_size={tp} does not divide vocab_size="
                             f"{self.vocab_size}: each TP rank holds vocab_size / TP rows of the embedding and the "
                             f"LM head; pad vocab_size to a multiple of {tp} or set vocab_parallel=False")
        if self.fp8 is not None:
            raise NotImplementedError(
                f"tensor_parallel_size={tp} with fp8={self.fp8!r}: FP8 with tensor-parallel TE layers (amax reductions "
                "over the TP group, FP8 all-gathers of the sequence) is not built here; use fp8=None or "
                "tensor_parallel_size=1")
        if not self.sequence_parallel:
            raise NotImplementedError(
                f"tensor_parallel_size={tp} with sequence_parallel=False: the reference GPT implements tensor "
                "parallelism with sequence parallelism only (activations split along the sequence between layers, "
                "megatron-core's sequence_parallel=True); set sequence_parallel=True")
        for what, value in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                            ("ffn_hidden_size", self.ffn_hidden_size), ("seq_len", self.seq_len)):
            if value % tp:
                why = {"num_heads": "each TP rank runs num_heads / TP query heads",
                       "num_kv_heads": "each TP rank holds num_kv_heads / TP key/value heads (with its query heads: "
                                       "a key/value head is not split between ranks)",
                       "ffn_hidden_size": "each TP rank holds ffn_hidden_size / TP columns of the MLP",
                       "seq_len": "sequence parallelism gives each TP rank seq_len / TP positions"}[what]
                raise ValueError(f"tensor_parallel_size={tp} does not divide {what}={value}: {why}; pick a "
                                 f"tensor_parallel_size that divides {value} (or change {what})")
        for bad, what in ((self.moe_every > 0, f"moe_every={self.moe_every} (MoE layers)"),
                          (self.expert_parallel_size > 1, f"expert_parallel_size={self.expert_parallel_size}"),
                          (self.rich_calls, "rich_calls=True"), (self.unit != "block", f"unit={self.unit!r}")):
            if bad:
                raise NotImplementedError(
                    f"tensor_parallel_size={tp} with {what}: tensor parallelism is implemented for dense layers of "
                    "unit='block' (torch or TE modules) with plain calls; set moe_every=0, expert_parallel_size=1, "
                    "rich_calls=False and unit='block', or tensor_parallel_size=1")


#: ``moe_experts`` values that run with ``expert_parallel_size > 1``.
EP_EXPERTS = ("split", "grouped_mm", "te_grouped")


class SelfAttention(nn.Module):
    """Pre-norm causal self-attention with its residual: ``x + proj(attn(ln(x)))``; x is [batch, seq, hidden]."""

    cuda_graph_module = "attn"

    def __init__(self, cfg: GPTConfig, tp_group: Optional[Any] = None) -> None:
        super().__init__()
        h, self.num_heads, self.num_kv_heads, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.head_dim = d
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d  # [q heads | k heads | v heads]
        self.use_te = cfg.use_te
        self.rich_calls = cfg.rich_calls
        #: tensor parallelism ([Note: tensor parallelism of the reference GPT] in apps/tp.py): None at TP=1
        self.tp_group = tp_group if cfg.tensor_parallel_size > 1 else None
        if self.tp_group is not None:
            self._build_tp(cfg)
        elif cfg.use_te:
            te = require_te("GPTConfig(use_te=True)")
            fuse = {"fuse_wgrad_accumulation": cfg.fuse_wgrad}
            self.ln_qkv = te.LayerNormLinear(h, qkv, bias=True, params_dtype=torch.float32, **fuse)
            gqa = {} if cfg.num_kv_heads == cfg.num_heads else {"num_gqa_groups": cfg.num_kv_heads}
            self.core = te.DotProductAttention(cfg.num_heads, d, attn_mask_type="causal", qkv_format="bshd", **gqa)
            self.proj = te.Linear(cfg.num_heads * d, h, bias=True, params_dtype=torch.float32, **fuse)
        else:
            self.ln = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, qkv)
            self.proj = nn.Linear(cfg.num_heads * d, h)

    def _build_tp(self, cfg: GPTConfig) -> None:
        """This TP rank's heads: the TP=1 module is drawn first (the same random draws as at TP=1), then the local
        modules are built without drawing and take their slice."""
        import torch.distributed as dist

        tp, rank, h, d = cfg.tensor_parallel_size, dist.get_rank(self.tp_group), cfg.hidden_size, cfg.head_dim
        self.local_heads, self.local_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d  # [q heads | k heads | v heads] at TP=1
        full = SelfAttention(dataclasses.replace(cfg, tensor_parallel_size=1, vocab_parallel=False))
        with torch.random.fork_rng(devices=_tp.fork_rng_devices()):
            if cfg.use_te:
                te = require_te("GPTConfig(use_te=True)")
                par = dict(tp_group=self.tp_group, tp_size=tp, sequence_parallel=True)
                fuse = {"fuse_wgrad_accumulation": cfg.fuse_wgrad}
                self.ln_qkv = te.LayerNormLinear(h, qkv, bias=True, params_dtype=torch.float32,
                                                 parallel_mode="column", **par, **fuse)
                gqa = {} if cfg.num_kv_heads == cfg.num_heads else {"num_gqa_groups": cfg.num_kv_heads}
                self.core = te.DotProductAttention(cfg.num_heads, d, attn_mask_type="causal", qkv_format="sbhd",
                                                   tp_size=tp, tp_group=self.tp_group, **gqa)
                self.proj = te.Linear(cfg.num_heads * d, h, bias=True, params_dtype=torch.float32,
                                      parallel_mode="row", **par, **fuse)
            else:
                self.ln = nn.LayerNorm(h)
                self.qkv = _tp.local_linear(h, qkv // tp)
                self.proj = _tp.local_linear(cfg.num_heads * d // tp, h)
                _tp.mark_tensor_parallel(self.qkv.weight, 0)
                _tp.mark_tensor_parallel(self.qkv.bias, 0)
                _tp.mark_tensor_parallel(self.proj.weight, 1)
                for p in (self.ln.weight, self.ln.bias, self.proj.bias):
                    _tp.mark_sequence_parallel(p)
        _tp.copy_tp_slice(self, full, prefix="attn.", tp_rank=rank, tp_size=tp, num_heads=cfg.num_heads,
                          num_kv_heads=cfg.num_kv_heads)

    def _tp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's positions, ``[s/TP, b, h]`` (sequence first); the same back."""
        group, nq, nkv, d = self.tp_group, self.local_heads, self.local_kv_heads, self.head_dim
        if self.use_te:
            qkv = self.ln_qkv(x)  # TE: norm on the local positions, all-gather, column-parallel GEMM
            s, b = qkv.shape[:2]
            q, k, v = qkv.view(s, b, nq + 2 * nkv, d).split([nq, nkv, nkv], dim=2)
            return x + self.proj(self.core(q, k, v))  # TE: row-parallel GEMM, reduce-scatter, bias
        full = _tp.gather_sequence(self.ln(x), group)
        s, b = full.shape[:2]
        q, k, v = self.qkv(full).view(s, b, nq + 2 * nkv, d).permute(1, 2, 0, 3).split([nq, nkv, nkv], dim=1)
        gqa = {} if nkv == nq else {"enable_gqa": True}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).permute(2, 0, 1, 3).reshape(s, b, nq * d)
        return x + (_tp.reduce_scatter_sequence(F.linear(y, self.proj.weight), group) + self.proj.bias)

    def forward(self, x: torch.Tensor) -> Any:
        if self.tp_group is not None:
            return self._tp_forward(x)
        b, s, _ = x.shape
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.use_te:
            q, k, v = self.ln_qkv(x, **_fp8.te_call_kwargs()).view(b, s, nq + 2 * nkv, d).split([nq, nkv, nkv], dim=2)
            y = self.core(q, k, v)
        else:
            q, k, v = self.qkv(self.ln(x)).view(b, s, nq + 2 * nkv, d).transpose(1, 2).split([nq, nkv, nkv], dim=1)
            gqa = {} if nkv == nq else {"enable_gqa": True}
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).transpose(1, 2).reshape(b, s, nq * d)
        out = x + (self.proj(y, **_fp8.te_call_kwargs()) if self.use_te else self.proj(y))
        return (out, y) if self.rich_calls else out


class MLP(nn.Module):
    """Pre-norm dense MLP with its residual."""

    cuda_graph_module = "mlp"

    def __init__(self, cfg: GPTConfig, tp_group: Optional[Any] = None) -> None:
        super().__init__()
        self.use_te = cfg.use_te
        self.tp_group = tp_group if cfg.tensor_parallel_size > 1 else None
        if self.tp_group is not None:
            self._build_tp(cfg)
        elif cfg.use_te:
            te = require_te("GPTConfig(use_te=True)")
            self.ln_mlp = te.LayerNormMLP(cfg.hidden_size, cfg.ffn_hidden_size, bias=True, params_dtype=torch.float32,
                                          fuse_wgrad_accumulation=cfg.fuse_wgrad)
        else:
            self.ln = nn.LayerNorm(cfg.hidden_size)
            self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
            self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def _build_tp(self, cfg: GPTConfig) -> None:
        """This TP rank's MLP columns, drawn as at TP=1 (see SelfAttention._build_tp)."""
        import torch.distributed as dist

        tp, rank, h, f = cfg.tensor_parallel_size, dist.get_rank(self.tp_group), cfg.hidden_size, cfg.ffn_hidden_size
        full = MLP(dataclasses.replace(cfg, tensor_parallel_size=1, vocab_parallel=False))
        with torch.random.fork_rng(devices=_tp.fork_rng_devices()):
            if cfg.use_te:
                te = require_te("GPTConfig(use_te=True)")
                self.ln_mlp = te.LayerNormMLP(h, f, bias=True, params_dtype=torch.float32,
                                              fuse_wgrad_accumulation=cfg.fuse_wgrad, tp_group=self.tp_group,
                                              tp_size=tp, sequence_parallel=True, set_parallel_mode=True)
            else:
                self.ln = nn.LayerNorm(h)
                self.fc1 = _tp.local_linear(h, f // tp)
                self.fc2 = _tp.local_linear(f // tp, h)
                _tp.mark_tensor_parallel(self.fc1.weight, 0)
                _tp.mark_tensor_parallel(self.fc1.bias, 0)
                _tp.mark_tensor_parallel(self.fc2.weight, 1)
                for p in (self.ln.weight, self.ln.bias, self.fc2.bias):
                    _tp.mark_sequence_parallel(p)
        _tp.copy_tp_slice(self, full, prefix="mlp.", tp_rank=rank, tp_size=tp, num_heads=cfg.num_heads)

    def forward(self, x: torch.Tensor, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.tp_group is not None and not self.use_te:
            full = _tp.gather_sequence(self.ln(x), self.tp_group)
            partial = F.linear(F.gelu(self.fc1(full)), self.fc2.weight)
            return x + (_tp.reduce_scatter_sequence(partial, self.tp_group) + self.fc2.bias)
        out = x + self.ln_mlp(x, **_fp8.te_call_kwargs()) if self.use_te else x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return out if skip is None else out + 0.5 * skip.to(out.dtype)


class TransformerBlock(nn.Module):
    """One layer: attention then a dense MLP or an MoE block. The FSDP unit of the reference model."""

    def __init__(self, cfg: GPTConfig, layer_number: int, ep_group: Optional[Any] = None,
                 tp_group: Optional[Any] = None) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg, tp_group)
        is_moe = cfg.moe_every > 0 and layer_number % cfg.moe_every == 0
        if is_moe:
            self.moe = MoEBlock(cfg, ep_group)
        else:
            self.mlp = MLP(cfg, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.attn.rich_calls:
            x, y = self.attn(x)
            return ffn(x, skip=y)
        return ffn(self.attn(x))


class GPT(nn.Module):
    """Token and position embeddings, ``num_layers`` blocks, final norm and an untied LM head.

    ``expert_parallel_group``: with ``cfg.expert_parallel_size > 1``, the process group of the ranks that share
    the experts (size ``expert_parallel_size``); this rank builds only its ``E/EP`` experts, equal to the EP=1
    model's slice for the same seed. Take it from ``megatron_fsdp.expert_parallel_groups(ep)[0]`` (the layout
    ``fully_shard(..., expert_parallel_size=ep)`` builds too) after ``init_process_group``.

    ``tensor_parallel_group``: with ``cfg.tensor_parallel_size > 1``, the process group of the ranks that split
    every layer (size ``tensor_parallel_size``); this rank builds only its slice, equal to the TP=1 model's slice
    for the same seed ([Note: tensor parallelism of the reference GPT] in ``apps/tp.py``). Take it from
    ``megatron_fsdp.tensor_parallel_groups(tp)[0]``. The layers then take and return ``[s/TP, b, h]`` (sequence
    first, this rank's positions); the model's input and logits keep their shapes (every TP rank computes the
    same logits). With ``cfg.vocab_parallel`` this rank's ``tok`` and ``head`` hold only its ``vocab_size / TP``
    rows (the TP=1 model's rows of the same seed); the logits are still whole.
    """

    #: Declared for graph kinds that pad sequences (inference ``seq_buckets``): position i never attends later.
    causal = True

    def __init__(self, cfg: GPTConfig, *, expert_parallel_group: Optional[Any] = None,
                 tensor_parallel_group: Optional[Any] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.expert_parallel_group = _check_ep_group(cfg, expert_parallel_group)
        #: The TP group (read by megatron_fsdp.fully_shard, which refuses another layout); None at TP=1.
        self.tensor_parallel_group = _check_tp_group(cfg, tensor_parallel_group)
        #: The embedding and the LM head split over the vocabulary across the TP group (``cfg.vocab_parallel``).
        self.vocab_parallel = cfg.vocab_parallel and self.tensor_parallel_group is not None
        self.tok = self._vocab_slice(nn.Embedding(cfg.vocab_size, cfg.hidden_size), "tok.")
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(_layer(cfg, i + 1, self.expert_parallel_group, self.tensor_parallel_group)
                                    for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = self._vocab_slice(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False), "head.")
        if self.tensor_parallel_group is not None:
            for p in self.ln_f.parameters():  # runs on this rank's positions: a partial gradient
                _tp.mark_sequence_parallel(p)

    def _vocab_slice(self, full: nn.Module, prefix: str) -> nn.Module:
        """``full`` (drawn as at TP=1), or with ``vocab_parallel`` this TP rank's rows of it (vocabulary ids
        ``[r*V/TP, (r+1)*V/TP)``), tagged as a TP shard split along dim 0."""
        if not self.vocab_parallel:
            return full
        import torch.distributed as dist

        cfg = self.cfg
        tp, rank = cfg.tensor_parallel_size, dist.get_rank(self.tensor_parallel_group)
        if isinstance(full, nn.Embedding):
            local: nn.Module = _tp.local_embedding(cfg.vocab_size // tp, cfg.hidden_size)
        else:
            local = _tp.local_linear(cfg.hidden_size, cfg.vocab_size // tp, bias=False)
        _tp.copy_tp_slice(local, full, prefix=prefix, tp_rank=rank, tp_size=tp, num_heads=cfg.num_heads,
                          vocab_parallel=True)
        _tp.mark_tensor_parallel(local.weight, 0)
        return local

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits ``[batch, seq, vocab]``; with ``targets`` (next-token ids ``[batch, seq]``) the mean loss
        instead, :func:`loss_fn` of the logits; with ``vocab_parallel`` that loss is computed on each TP rank's
        vocabulary slice without gathering the logits (``apps/tp.py`` ``vocab_parallel_cross_entropy``)."""
        s = tokens.shape[1]
        group = self.tensor_parallel_group
        if group is not None:  # [Note: tensor parallelism of the reference GPT] in apps/tp.py
            tp = self.cfg.tensor_parallel_size
            if s % tp:
                raise ValueError(f"GPT got sequences of {s} positions with tensor_parallel_size={tp}: sequence "
                                 f"parallelism splits them over the TP ranks; pad them to a multiple of {tp}")
            if self.vocab_parallel:  # this rank's vocabulary rows, summed over TP into this rank's positions
                x = _tp.reduce_scatter_sequence(
                    _tp.vocab_parallel_embedding(tokens, self.tok.weight, group).transpose(0, 1), group)
                x = x + _tp.scatter_sequence(self.pos(torch.arange(s, device=tokens.device))[:, None], group)
            else:
                x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))[None]
                x = _tp.scatter_sequence(x.transpose(0, 1), group)  # [s/TP, b, h]: this rank's positions
            for layer in self.layers:
                x = layer(x)
            if self.vocab_parallel:  # this rank's V/TP logits of every position
                local = self.head(_tp.gather_sequence(self.ln_f(x), group).transpose(0, 1))
                if targets is not None:  # the loss from the slices, the logits never gathered
                    return _tp.vocab_parallel_cross_entropy(local, targets, group)
                return _tp.gather_vocab(local, group)  # gathered along the vocabulary
            return self._loss_or_logits(self.head(_tp.gather_sequence_replicated(self.ln_f(x), group).transpose(0, 1)),
                                        targets)
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))[None]
        seq_first = self.cfg.unit == "te_layer"
        if seq_first:
            x = x.transpose(0, 1).contiguous()  # TE TransformerLayer's default layout is [seq, batch, hidden]
        for layer in self.layers:
            x = layer(x)
        if seq_first:
            x = x.transpose(0, 1)
        return self._loss_or_logits(self.head(self.ln_f(x)), targets)

    @staticmethod
    def _loss_or_logits(logits: torch.Tensor, targets: Optional[torch.Tensor]) -> torch.Tensor:
        return logits if targets is None else loss_fn(logits, targets)

    @property
    def max_positions(self) -> int:
        """Positions the positional embedding has: the longest (padded) sequence the model accepts."""
        return self.pos.num_embeddings

    @property
    def unit_class(self) -> type:
        """The class whose instances are the FSDP units (the layers)."""
        return type(self.layers[0])


def _check_ep_group(cfg: GPTConfig, group: Optional[Any]) -> Optional[Any]:
    return _check_parallel_group(cfg.expert_parallel_size, group, "expert")


def _check_tp_group(cfg: GPTConfig, group: Optional[Any]) -> Optional[Any]:
    return _check_parallel_group(cfg.tensor_parallel_size, group, "tensor", also=", sequence_parallel=True")


def _check_parallel_group(size: int, group: Optional[Any], kind: str, also: str = "") -> Optional[Any]:
    """The model's ``{kind}_parallel_group`` against ``GPTConfig({kind}_parallel_size=size)``: None at size 1 (a
    one-rank group is accepted and dropped), else the group, which must have ``size`` ranks. ``also``: further
    config fields the fix names when a group comes with size 1."""
    import torch.distributed as dist

    field, arg, groups = f"{kind}_parallel_size", f"{kind}_parallel_group", f"megatron_fsdp.{kind}_parallel_groups"
    if size == 1:
        if group is not None and dist.get_world_size(group) != 1:
            raise ValueError(f"GPT got {arg}= of {dist.get_world_size(group)} ranks but cfg.{field}=1; set "
                             f"GPTConfig({field}={dist.get_world_size(group)}{also}) or drop the group")
        return None
    if group is None:
        raise ValueError(f"GPTConfig({field}={size}) needs the {kind}-parallel process group: "
                         f"GPT(cfg, {arg}={groups}({size})[0]) after torch.distributed.init_process_group")
    got = dist.get_world_size(group)
    if got != size:
        raise ValueError(f"{arg} has {got} ranks but GPTConfig({field}={size}); they must agree: pass the group of "
                         f"{groups}({size}) or set {field}={got}")
    return group


def check_expert_parallel(sharded: Any) -> None:
    """After ``fully_shard``: the GPT's experts and all-to-all must match the engine's expert parallelism.

    ``sharded``: what ``megatron_fsdp.fully_shard`` returned around a :class:`GPT`. The engine shards and reduces
    the expert parameters by its EP and expert-data-parallel groups; a model whose ``expert_parallel_size`` or
    all-to-all group differs would train wrong gradients without an error, so call this once after wrapping.
    Raises ValueError naming both sizes or both rank lists and the fix.
    """
    import torch.distributed as dist

    gpt = getattr(sharded, "module", None)
    if not isinstance(gpt, GPT):
        raise TypeError(f"check_expert_parallel takes what fully_shard returned around a GPT, got "
                        f"{type(sharded).__name__}; pass the sharded model")
    want = gpt.cfg.expert_parallel_size
    got = getattr(sharded, "expert_parallel_size", 1)
    if got != want:
        raise ValueError(f"fully_shard(expert_parallel_size={got}) around GPTConfig(expert_parallel_size={want}): "
                         "the engine would shard and reduce the experts for another layout than the model's "
                         f"all-to-all; pass expert_parallel_size={want} to both")
    if want > 1:
        mine = dist.get_process_group_ranks(gpt.expert_parallel_group)
        theirs = dist.get_process_group_ranks(sharded.expert_parallel_group)
        if mine != theirs:
            raise ValueError(f"[rank {dist.get_rank()}] the GPT's expert_parallel_group has ranks {mine} but the "
                             f"engine's expert-parallel group has {theirs}: the all-to-all and the engine's expert "
                             "reduction must use the same groups; build the model with "
                             f"megatron_fsdp.expert_parallel_groups({want})[0] (or pass the model's groups to "
                             "fully_shard as expert_parallel_group= and expert_data_parallel_group=)")


def _layer(cfg: GPTConfig, layer_number: int, ep_group: Optional[Any] = None,
           tp_group: Optional[Any] = None) -> nn.Module:
    if cfg.unit == "block":
        return TransformerBlock(cfg, layer_number, ep_group, tp_group)
    te = require_te("GPTConfig(unit='te_layer')")
    return te.TransformerLayer(
        cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads, layer_number=layer_number, hidden_dropout=0.0,
        attention_dropout=0.0, self_attn_mask_type="causal", params_dtype=torch.float32, seq_length=cfg.seq_len,
        fuse_wgrad_accumulation=cfg.fuse_wgrad, fuse_qkv_params=cfg.fuse_wgrad,  # TE requires both together
    )


def olmoe_config(**overrides: Any) -> GPTConfig:
    """An OLMoE-1B-7B-shaped config: hidden 2048, 16 layers, 16 heads, 64 experts, top-8, expert FFN 1024,
    every layer MoE, vocabulary 50304. Experts ``grouped_mm`` in bf16 (no host sync) unless overridden."""
    base: Dict[str, Any] = dict(vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16, seq_len=4096,
                                moe_every=1, num_experts=64, moe_top_k=8, moe_ffn_hidden_size=1024,
                                moe_experts="grouped_mm", moe_grouped_mm_dtype="bfloat16")
    return GPTConfig(**{**base, **overrides})


def qwen3_moe_config(**overrides: Any) -> GPTConfig:
    """A Qwen3-30B-A3B-shaped config: hidden 2048, 48 layers, 32 query heads of 128 and 4 key/value heads, 128
    experts, top-8, every layer MoE, vocabulary 151936, sequence 4096. Qwen3's experts are SwiGLU with three
    2048 x 768 matrices; ours are ``gelu(x W1) W2`` with two, so the expert FFN is 1152 = 3/2 x 768: each expert has
    Qwen3's weights (4.72 M) and FLOPs per token. Norms are LayerNorm and positions learned (Qwen3: RMSNorm, RoPE,
    QK-norm): a few vector operations, no matmul. Experts ``grouped_mm`` in bf16 unless overridden."""
    base: Dict[str, Any] = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                head_dim=128, seq_len=4096, moe_every=1, num_experts=128, moe_top_k=8,
                                moe_ffn_hidden_size=1152, moe_experts="grouped_mm", moe_grouped_mm_dtype="bfloat16")
    return GPTConfig(**{**base, **overrides})


def llama70b_config(**overrides: Any) -> GPTConfig:
    """A Llama-3-70B-shaped dense config: hidden 8192, 80 layers, 64 query heads of 128 and 8 key/value heads,
    vocabulary 128256, sequence 4096. Llama's MLP is SwiGLU with three 8192 x 28672 matrices; ours is ``gelu(x W1)
    W2`` with two, so the FFN is 43008 = 3/2 x 28672: each layer has Llama's MLP weights (705 M) and FLOPs per
    token (attention 151 M, a layer 856 M). Norms are LayerNorm and positions learned (Llama: RMSNorm, RoPE): a few
    vector operations, no matmul; the linears carry biases (a few thousand parameters a layer). For a slice,
    override ``num_layers``; with ``tensor_parallel_size=TP`` pass ``sequence_parallel=True`` too."""
    base: Dict[str, Any] = dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                head_dim=128, ffn_hidden_size=43008, seq_len=4096)
    return GPTConfig(**{**base, **overrides})


def mixtral_config(**overrides: Any) -> GPTConfig:
    """A reduced Mixtral-8x7B shape: 8 experts, top-2, hidden 1024, 8 layers, 8 heads (head dim 128), expert
    FFN 3584 (Mixtral's 14336 / 4), every layer MoE, vocabulary 32000. Experts ``grouped_mm`` in bf16."""
    base: Dict[str, Any] = dict(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=8, seq_len=2048,
                                moe_every=1, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=3584,
                                moe_experts="grouped_mm", moe_grouped_mm_dtype="bfloat16")
    return GPTConfig(**{**base, **overrides})


def moe_checker_spec(cfg: GPTConfig, device: torch.device, *, micro_batch_size: int = 2) -> Any:
    """A :class:`fsdp_cudagraph.check.ModelSpec` of the reference GPT for ``cfg`` (the checker's factory
    protocol): units are the layers, each rank trains its slice of a deterministic global batch."""
    import torch.distributed as dist

    from fsdp_cudagraph.check import ModelSpec

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batch(step, micro_batch_size * world, cfg, device)
        sl = slice(rank * micro_batch_size, (rank + 1) * micro_batch_size)
        return x[sl].contiguous(), y[sl].contiguous()

    model = GPT(cfg).to(device)
    return ModelSpec(model=model, unit_modules=[model.unit_class], batch=batch,
                     loss=lambda m, b: loss_fn(m(b[0]), b[1]))


#: The checker factories' model: 2 layers, hidden 64, every layer a top-2-of-4 MoE, seq 32.
_MOE_TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, seq_len=32, moe_every=1, num_experts=4,
                 moe_top_k=2)


def moe_split(device: torch.device) -> Any:
    """Checker factory: dropless MoE, ``split`` experts (host sync; graph ``attn moe_router moe_preprocess``)."""
    return moe_checker_spec(GPTConfig(moe_experts="split", **_MOE_TINY), device)


def moe_grouped_mm(device: torch.device) -> Any:
    """Checker factory: dropless MoE, ``grouped_mm`` experts (no sync; bf16 on CUDA; any scope)."""
    dtype = "bfloat16" if device.type == "cuda" else "input"
    return moe_checker_spec(GPTConfig(moe_experts="grouped_mm", moe_grouped_mm_dtype=dtype, **_MOE_TINY), device)


def moe_capacity(device: torch.device) -> Any:
    """Checker factory: drop-and-pad MoE, ``capacity`` experts, factor 1 (no sync; any scope)."""
    return moe_checker_spec(GPTConfig(moe_experts="capacity", **_MOE_TINY), device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(
    step: int, batch_size: int, cfg: GPTConfig, device: torch.device, *, seed: int = 1234
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step``: (tokens, next-token targets), each [batch, seq]."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)
