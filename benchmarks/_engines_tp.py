"""``bench_engines.py --config llama70b``: the tensor-parallel columns on a Llama-3-70B-shaped slice.

The model is the reference GPT at ``apps.model.llama70b_config`` (hidden 8192, FFN 43008 = Llama's SwiGLU 28672 in
two matrices, 64 query / 8 KV heads of 128, vocabulary 128256), ``--layers`` deep, torch layers (TE's TP modules
are not run on GPUs yet), on a ``(dp, tp)`` grid of ``--tensor-parallel`` TP ranks (contiguous) by ``world / TP``
data-parallel ranks; the TP ranks of one data-parallel rank take the same micro-batch.

- ours (``ours_tp_*``): ``GPTConfig(tensor_parallel_size=TP, sequence_parallel=True)``, built with
  ``megatron_fsdp.tensor_parallel_groups(TP)`` and sharded with ``fully_shard(process_group=dp,
  tensor_parallel_group=tp)`` (docs/tensor-parallel.md); the embeddings and the LM head are replicated over TP,
  or with ``--vocab-parallel`` the token embedding and the LM head split over the vocabulary
  (``GPTConfig(vocab_parallel=True)``), the loss then taken from the vocabulary slices (``model(x, y)``: the
  logits are never gathered). ``ours_tp_kept_eager`` adds ``keep_compute_shard=True``: at TP = world size every
  unit's data-parallel group is one rank, so each keeps its bf16 cast in a buffer of its own, cast once a step.
- FSDP2 (``fsdp2_tp_*``): the same model at TP=1 with the same seed, its fused ``[q | k | v]`` projection split
  into ``q``, ``k`` and ``v`` linears (:class:`SplitQKVAttention`: ``ColwiseParallel`` must give each rank whole
  heads), then torchtitan's composition as ``tests/adapters/test_fsdp2_tp.py`` builds it: ``parallelize_module``
  of every layer over ``mesh['tp']`` (``ColwiseParallel`` q, k, v, ``fc1``; ``RowwiseParallel`` ``proj``,
  ``fc2``; no sequence parallelism: not tried with FSDP2 here; with ``--vocab-parallel`` also the root's
  ``tok``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())`` and ``head``:
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` with the loss under ``loss_parallel()``, as
  torchtitan does by default, :func:`_root_tp_plan`), ``shard_fsdp2(mesh=mesh['dp'])`` with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the partial column adds
  ``keep_unsharded_storage``. Each rank starts from the same values as ours (the TP=1 model's slice).
- NVIDIA Megatron-FSDP: not applicable (:func:`not_applicable`); NVIDIA with TP: see ``--config mcore70b``
  (``_engines_mcore.py``: both engines on megatron-core's GPTModel).

No CUDA needed to import; the CPU smoke runs it on Gloo at a tiny shape.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["TP_COLUMNS", "GATHERED_LOGITS", "NVIDIA_TP_REASON", "SCOPES", "tensor_parallel_size", "too_few_tp_ranks",
           "config", "slice_numel", "layer_numel", "build", "shard", "not_applicable", "SplitQKVAttention"]

#: The columns of ``--config llama70b`` (their specs are in bench_engines.COLUMN_SPECS).
TP_COLUMNS = ["ours_tp_eager", "ours_tp_partial", "ours_tp_full", "ours_tp_kept_eager", "fsdp2_tp_eager",
              "fsdp2_tp_gathered_eager", "fsdp2_tp_partial", "nvidia_tp_eager"]
#: FSDP2 columns whose vocabulary-split head gathers the logits (``Replicate`` output, the plain loss) instead of
#: taking the loss under ``loss_parallel()``: the other way torchtitan's plan can run, measured beside it.
GATHERED_LOGITS = ["fsdp2_tp_gathered_eager"]
SCOPES = ["attn", "mlp"]
NVIDIA_TP_REASON = (
    "NVIDIA Megatron-FSDP takes tensor parallelism from megatron-core's parallel state, for megatron-core models "
    "(vocabulary-parallel embedding, TE or megatron-core TP linears); this model is the reference GPT, whose TP "
    "layers NVIDIA's fully_shard does not know (it would shard the TP ranks' different slices over all ranks as one "
    "data-parallel model). For megatron-core's GPTModel the project runs it with TP only through megatron-core's "
    "FullyShardedDataParallel (wrapper mcore) and refuses wrapper fully_shard with TP "
    "(check_engine_tensor_parallel in fsdp_cudagraph/apps/mcore_gpt.py). NVIDIA with TP: see --config mcore70b "
    "(ours and NVIDIA on megatron-core's GPTModel at this slice's dimensions)")

_GROUPS: Dict[int, Tuple[Any, Any]] = {}
_MESHES: Dict[Tuple[str, int], Any] = {}


def tensor_parallel_size(args: argparse.Namespace, world: int) -> int:
    """``--tensor-parallel`` (default: the world size); ValueError when it does not divide the world."""
    tp = args.tensor_parallel or world
    if tp < 1 or world % tp:
        raise ValueError(f"--tensor-parallel {tp} on {world} rank(s): TP must divide the world size (the ranks form a "
                         f"(dp, tp) grid of world / TP rows); pass a divisor of {world}")
    return tp


def config(args: argparse.Namespace, tp: int) -> Any:
    """The column's GPTConfig: the 70B shape at ``--layers`` (``--seq``), or a tiny one under ``--cpu-smoke``."""
    from fsdp_cudagraph.apps.model import llama70b_config

    par = dict(tensor_parallel_size=tp, sequence_parallel=tp > 1,
               vocab_parallel=bool(getattr(args, "vocab_parallel", False)) and tp > 1)
    if args.cpu_smoke:
        return llama70b_config(vocab_size=128, hidden_size=32, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                               head_dim=8, ffn_hidden_size=64, seq_len=16, **par)
    return llama70b_config(num_layers=args.layers, **({"seq_len": args.seq} if args.seq else {}), **par)


def slice_numel(*, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, mlp_matrices: int, tp: int) -> int:
    """Parameters of one decoder layer's TP slice: the query, key/value and output projections and ``mlp_matrices``
    matrices of ``hidden x ffn`` (2, or 3 with a gated MLP), split over ``tp`` ranks (norms and biases left out)."""
    layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + mlp_matrices * hidden * ffn
    return layer // tp


def layer_numel(args: argparse.Namespace, world: int) -> int:
    """Parameters of one layer's TP slice (the size of FSDP's collectives, whose rates the run measures)."""
    cfg = config(args, 1)
    return slice_numel(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       ffn=cfg.ffn_hidden_size, mlp_matrices=2, tp=tensor_parallel_size(args, world))


def _groups(tp: int) -> Tuple[Any, Any]:
    """``megatron_fsdp.tensor_parallel_groups(tp)``, made once per process (columns in one process share them)."""
    import megatron_fsdp

    if tp not in _GROUPS:
        _GROUPS[tp] = megatron_fsdp.tensor_parallel_groups(tp)
    return _GROUPS[tp]


def _mesh(device: torch.device, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    return _MESHES[key]


class SplitQKVAttention(nn.Module):
    """The reference GPT's ``SelfAttention`` (torch layers, TP=1) with its fused ``[q heads | k heads | v heads]``
    projection split into ``q``, ``k`` and ``v`` linears of the same values, and an attention over the heads this
    rank holds (``-1`` in the reshape): what ``ColwiseParallel`` needs to give each TP rank whole heads."""

    cuda_graph_module = "attn"
    rich_calls = False  # read by TransformerBlock.forward

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.head_dim, nq, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        self.ln, self.proj = attn.ln, attn.proj
        w, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()
        sizes = [nq * self.head_dim, nkv * self.head_dim, nkv * self.head_dim]
        for name, wp, bp in zip(("q", "k", "v"), w.split(sizes), b.split(sizes)):
            lin = torch.nn.utils.skip_init(nn.Linear, w.shape[1], wp.shape[0], device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(wp)
                lin.bias.copy_(bp)
            setattr(self, name, lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln(x)
        q, k, v = (m(y).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        gqa = {} if q.shape[1] == k.shape[1] else {"enable_gqa": True}
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).transpose(1, 2).reshape(b, s, -1)
        return x + self.proj(o)


def _tp_plan() -> Dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def _root_tp_plan(gathered: bool = False) -> Dict[str, Any]:
    """``--vocab-parallel``: the root's token embedding (rows by vocabulary; replicated ids in, the summed lookup
    out) and LM head (rows by vocabulary; the logits stay split over the vocabulary, a DTensor, and the loss is
    taken by ``loss_parallel``: torchtitan's default, which never gathers the ``[tokens, vocabulary]`` logits), the
    split ours makes with ``vocab_parallel``. ``gathered``: the head's logits gathered whole on every TP rank
    (``Replicate``) and the plain loss, the ``fsdp2_tp_gathered_eager`` column."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head = (ColwiseParallel(output_layouts=Replicate()) if gathered
            else ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    return {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()), "head": head}


def loss_context(args: argparse.Namespace, dtensor: bool, tp: int) -> Any:
    """What each micro-batch's forward and backward run inside: ``loss_parallel()`` for FSDP2's vocabulary-split
    head (its cross-entropy over logits split by vocabulary, forward and backward alike), else nothing."""
    import contextlib

    if dtensor and tp > 1 and getattr(args, "vocab_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext


def build(args: argparse.Namespace, device: torch.device, *, dtensor: bool,
          gathered: bool = False) -> Tuple[nn.Module, Any, Dict[str, Any]]:
    """This rank's model for a TP column (seeded by the caller): ours (``dtensor=False``: the reference GPT's own TP
    slice) or FSDP2's (the TP=1 model, q/k/v split, ``parallelize_module`` over ``mesh['tp']``); its config and
    the counts the report needs (whole-model parameters, this TP rank's, the TP size)."""
    from fsdp_cudagraph.apps.model import GPT

    world = dist.get_world_size()
    tp = tensor_parallel_size(args, world)
    if not dtensor:
        cfg = config(args, tp)
        with device:
            module = GPT(cfg, tensor_parallel_group=_groups(tp)[0] if tp > 1 else None)
        factor = {id(p): tp for p in module.parameters() if getattr(p, "tensor_model_parallel", False)}
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        cfg = config(args, 1)
        with device:
            module = GPT(cfg)
        for layer in module.layers:
            layer.attn = SplitQKVAttention(layer.attn)
        if tp > 1:
            mesh = _mesh(device, tp)
            for layer in module.layers:
                parallelize_module(layer, mesh["tp"], _tp_plan())
            if getattr(args, "vocab_parallel", False):
                parallelize_module(module, mesh["tp"], _root_tp_plan(gathered))
        factor = {}  # a DTensor's numel is the global one
    in_units = {id(p) for layer in module.layers for p in layer.parameters()}

    def whole(p: torch.Tensor) -> int:
        return p.numel() * factor.get(id(p), 1)

    def local(p: torch.Tensor) -> int:
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    counts = {"num_params": sum(whole(p) for p in module.parameters()),
              "rank_params": sum(local(p) for p in module.parameters()),
              "root_params": sum(p.numel() for p in module.parameters() if id(p) not in in_units),
              "layer_params": sum(whole(p) for p in module.layers[0].parameters()),
              # Megatron's model FLOPs: every matmul weight of the whole model (the LM head's vocabulary included,
              # the embedding lookups not), attention by query heads (GQA shrinks K and V, not QK^T or AV)
              "matmul_params": float(sum(whole(p) for p in module.parameters() if p.dim() >= 2 and id(p) not in tables)),
              "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "seq_len": cfg.seq_len,
              "attn_hidden": cfg.num_heads * cfg.head_dim, "expert_parallel_size": 1, "tensor_parallel_size": tp,
              "data_parallel_size": world // tp}
    return module, cfg, counts


def data_parallel_rank(tp: int) -> Tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank: TP groups are contiguous ranks, in ours and in the FSDP2 mesh alike."""
    return dist.get_rank() // tp, dist.get_world_size() // tp


def shard(column: str, module: nn.Module, unit_class: type, device: torch.device, tp: int,
          make_optimizer: Any, *, keep_compute_shard: bool = False) -> Tuple[nn.Module, torch.optim.Optimizer, bool,
                                                                            str, Any]:
    """Shard a TP column's model: (model, optimizer, use_megatron_fsdp, precision, the TP group or None);
    ``keep_compute_shard``: ours' ``fully_shard(keep_compute_shard=True)`` ([Note: cast on gather])."""
    if column.startswith("ours"):
        from megatron_fsdp import fully_shard

        tp_group, dp_group = _groups(tp) if tp > 1 else (None, None)
        kw = dict(process_group=dp_group, tensor_parallel_group=tp_group) if tp > 1 else {}
        sharded = fully_shard(module, fsdp_unit_modules=[unit_class], sharding_strategy="optim_grads_params",
                              compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                              fsdp_db_use_persist_buf_on_alloc_fail=True, keep_compute_shard=keep_compute_shard, **kw)
        extra = "; embedding and LM head split over the vocabulary" if module.cfg.vocab_parallel else ""
        extra += "; bf16 shards kept (keep_compute_shard)" if keep_compute_shard else ""
        return (sharded, make_optimizer(list(sharded.optimizer_parameters())), True,
                f"compute in bf16, fp32 main parameters and gradients, ZeRO-3 over the data-parallel group; TP {tp} "
                f"with sequence parallelism (the engine's){extra}", tp_group)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from fsdp_cudagraph import keep_unsharded_storage
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2
    from fsdp_cudagraph.engines.fsdp2.build import FSDP2_MIXED_PRECISION

    mesh = _mesh(device, tp)
    shard_fsdp2(module, list(reversed([m for m in module.modules() if isinstance(m, unit_class)])), device=device,
                mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION["bf16"]))
    keep = column == "fsdp2_tp_partial"
    if keep:
        keep_unsharded_storage(module)
    return (module, make_optimizer(list(module.parameters())), False,
            f"fp32 sharded parameters, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), ZeRO-3 over "
            f"mesh['dp']; DTensor TP {tp} over mesh['tp'] (no sequence parallelism)"
            + ("; embedding and LM head split over the vocabulary" if isinstance(module.head.weight, DTensor) else "")
            + ("; logits gathered whole for the loss" if column in GATHERED_LOGITS else "")
            + ("; keep_unsharded_storage" if keep else ""), None)


def too_few_tp_ranks(args: argparse.Namespace, world: int) -> Optional[str]:
    """Why no tensor-parallel column can run with ``--tensor-parallel`` on ``world`` ranks (None: it can)."""
    tp = args.tensor_parallel or world
    if tp < 2:
        return (f"tensor parallelism needs 2+ TP ranks (--tensor-parallel {tp} on {world} rank(s)); run with "
                "--nproc-per-node 2 or more")
    return None


def not_applicable(column: str, world: int, args: argparse.Namespace) -> Optional[str]:
    """Why a TP column cannot run here by design (None: it can)."""
    if column == "nvidia_tp_eager":
        return NVIDIA_TP_REASON
    return too_few_tp_ranks(args, world)
