"""``bench_engines.py --config mcore70b``: ours against NVIDIA Megatron-FSDP with TP, on megatron-core's GPTModel.

``--config llama70b`` measures tensor parallelism on the project's reference GPT, which NVIDIA's engine cannot shard
(``_engines_tp.NVIDIA_TP_REASON``). Here both engines train megatron-core's own ``GPTModel``, built by
``fsdp_cudagraph.apps.mcore_gpt`` (:func:`shape`, ``mcore_gpt.build``) at the Llama-3-70B slice's dimensions: hidden
8192, SwiGLU FFN 28672 (``gated_linear_unit=True``), 64 query / 8 KV heads of 128 (``num_query_groups=8``), RMSNorm,
RoPE, vocabulary 128256 with an untied output layer, bf16 parameters on the GPU (``params_dtype``), TE's layer spec
when TE is importable on the GPU, megatron-core's local spec otherwise; ``--layers`` deep (by world size, as
llama70b). megatron-core's parallel state (``mcore_gpt.init_parallel_state``) holds TP = ``--tensor-parallel``
(default: the world size; contiguous TP ranks, data-parallel groups strided by TP) with sequence parallelism; every
TP rank of a data-parallel rank takes the same micro-batch. Columns (bf16 compute, fp32 main parameters and
gradients, Adam, ZeRO-3 over the data-parallel group, unit ``TransformerLayer``; same seed and batches):

- ``ours_mcore_tp_eager``: our engine (the checker's ``megatron_fsdp`` builder): ``fully_shard(process_group=dp,
  tensor_parallel_group=tp)`` with megatron-core's groups (``mcore_gpt.tensor_groups``);
- ``ours_mcore_tp_partial``: + ``PartialCudaGraphs`` over ``mcore_gpt.SCOPES['attn_mlp']`` (each layer's
  ``self_attention`` and ``mlp``, the TP collectives inside the graphs, FSDP's outside);
- ``nvidia_mcore_tp_eager``: NVIDIA Megatron-FSDP as megatron-core ships it (the checker's ``nvidia`` builder,
  ``wrapper='mcore'``: ``FullyShardedDataParallel`` over parallel_state's (DP, TP) mesh, megatron-core's
  ``finalize_model_grads`` before each optimizer step; [Note: NVIDIA Megatron-FSDP under tensor parallelism]);
- ``nvidia_mcore_tp_partial``: + ``PartialCudaGraphs`` over the same modules.

The NVIDIA columns need a GPU (NVIDIA's engine builds CUDA streams when constructed) and have not run on one yet;
their first loss must equal ours bit for bit (both engines run the same bf16 weights through the same forward)
and every loss stay within ``_engines_report.LOSS_RTOL`` of ours. The CPU smoke runs the ours columns on Gloo at a
tiny shape (local spec, fp32 as ``mcore_gpt`` runs on the host, under ``mcore_gpt.cpu_shims``) and reports the
NVIDIA columns as not run.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import _engines_tp

__all__ = ["MCORE_COLUMNS", "SCOPE", "NVIDIA_CPU_REASON", "shape", "layer_numel", "build", "shard", "forward_loss",
           "not_applicable", "device_context", "tensor_parallel_size", "data_parallel_rank"]

#: The columns of ``--config mcore70b`` (their specs are in bench_engines.COLUMN_SPECS).
MCORE_COLUMNS = ["ours_mcore_tp_eager", "ours_mcore_tp_partial", "nvidia_mcore_tp_eager", "nvidia_mcore_tp_partial"]
#: mcore_gpt's scope the partial columns graph
SCOPE = "attn_mlp"
SEED = 1234
NVIDIA_CPU_REASON = ("not run: needs a GPU (NVIDIA Megatron-FSDP builds CUDA streams and buffers when it is "
                     "constructed, so megatron-core's FullyShardedDataParallel cannot be built on the CPU); run on "
                     "GPUs without --cpu-smoke")


def tensor_parallel_size(args: argparse.Namespace, world: int) -> int:
    """``--tensor-parallel`` (default: the world size); ValueError naming the rule when it does not divide the
    world or is below 2 (the config compares the engines under TP)."""
    tp = _engines_tp.tensor_parallel_size(args, world)
    if tp < 2:
        raise ValueError(f"--config mcore70b with --tensor-parallel {tp} on {world} rank(s): the config compares the "
                         "engines under tensor parallelism, which needs 2+ TP ranks; run with --nproc-per-node 2 "
                         "or more (and --tensor-parallel 2 or more)")
    return tp


def shape(args: argparse.Namespace, tp: int) -> Any:
    """The column's ``mcore_gpt.MCoreShape``: the 70B slice at ``--layers`` (``--seq``, ``--micro-batch``), or a tiny
    one with the same features under ``--cpu-smoke`` (local spec)."""
    from fsdp_cudagraph.apps import mcore_gpt

    common = dict(num_layers=args.layers, micro_batch_size=args.micro_batch, tensor_parallel_size=tp, swiglu=True,
                  normalization="RMSNorm")  # untied: megatron-core's default
    if args.cpu_smoke:
        return mcore_gpt.base_shape(torch.device("cpu"), "dense", vocab_size=128, hidden_size=32, ffn_hidden_size=64,
                                    num_heads=4, num_query_groups=2, seq_len=16, use_te=False, **common)
    return mcore_gpt.base_shape(torch.device("cuda"), "dense", vocab_size=128256, hidden_size=8192,
                                ffn_hidden_size=28672, num_heads=64, num_query_groups=8, seq_len=args.seq or 4096,
                                **common)


def layer_numel(args: argparse.Namespace, world: int) -> int:
    """Parameters of one layer's TP slice (the size of FSDP's collectives, whose rates the run measures)."""
    tp = tensor_parallel_size(args, world)
    s = shape(args, tp)
    return _engines_tp.slice_numel(hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_query_groups or s.num_heads,
                                   head_dim=s.hidden_size // s.num_heads, ffn=s.ffn_hidden_size,
                                   mlp_matrices=3 if s.swiglu else 2, tp=tp)


def build(args: argparse.Namespace, device: torch.device) -> Tuple[nn.Module, Any, Dict[str, Any]]:
    """This rank's TP slice of the model (megatron-core's parallel state set up first, the same seed in every
    column), its shape and the counts the report needs (whole-model parameters, this TP rank's, the TP size)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fsdp_cudagraph.apps import mcore_gpt

    world = dist.get_world_size()
    tp = tensor_parallel_size(args, world)
    s = shape(args, tp)
    mcore_gpt.init_parallel_state(SEED, device, 1, tp)
    torch.manual_seed(SEED)
    module = mcore_gpt.build(s, device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                             use_te=s.use_te)
    mcore_gpt.check_megatron_graphs_off(module)

    def whole(p: torch.Tensor) -> int:  # megatron-core tags its TP shards
        return p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)

    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    in_units = {id(p) for m in layers for p in m.parameters()}
    tables = {id(module.embedding.word_embeddings.weight)}
    counts = {"num_params": sum(whole(p) for p in module.parameters()),
              "rank_params": sum(p.numel() for p in module.parameters()),
              "root_params": sum(p.numel() for p in module.parameters() if id(p) not in in_units),
              "layer_params": sum(whole(p) for p in layers[0].parameters()),
              # Megatron's model FLOPs, as llama70b counts them: every matmul weight (the output layer included,
              # the embedding lookup not), attention by query heads
              "matmul_params": float(sum(whole(p) for p in module.parameters() if p.dim() >= 2
                                         and id(p) not in tables)),
              "num_layers": s.num_layers, "hidden_size": s.hidden_size, "seq_len": s.seq_len,
              "attn_hidden": s.hidden_size, "expert_parallel_size": 1, "tensor_parallel_size": tp,
              "data_parallel_size": world // tp, "layout": mcore_gpt.layout(module)}
    return module, s, counts


def data_parallel_rank() -> Tuple[int, int]:
    """``(dp_rank, dp_size)`` from megatron-core's parallel state (the TP ranks of one DP rank share its rows)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def forward_loss(device: torch.device, seq_len: int) -> Callable[[nn.Module, torch.Tensor, torch.Tensor],
                                                                  torch.Tensor]:
    """``(model, tokens, targets) -> loss``: ``mcore_gpt.loss`` on the inputs GPTModel takes (position ids; on
    the CPU the explicit causal mask, on the GPU none: megatron-core's layers mask causally themselves)."""
    from fsdp_cudagraph.apps import mcore_gpt

    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = (torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
            .view(1, 1, seq_len, seq_len) if device.type == "cpu" else None)

    def call(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mcore_gpt.loss(model, {"input_ids": x, "position_ids": positions.expand(x.shape[0], -1),
                                      "attention_mask": mask, "labels": y})

    return call


def shard(column: str, module: nn.Module, device: torch.device,
          make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer]) -> Tuple[Any, Any, bool, str]:
    """Shard an mcore column's model with its engine's builder and megatron-core's (TP, DP) groups: (model,
    optimizer, use_megatron_fsdp, precision)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fsdp_cudagraph.apps import mcore_gpt
    from fsdp_cudagraph.engines.registry import engine_builder

    name = "megatron_fsdp" if column.startswith("ours") else "nvidia"
    builder = engine_builder(name, device)
    extra = {"options": {"wrapper": "mcore"}} if name == "nvidia" else {}
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    run = builder.build(module, unit_modules=[TransformerLayer], make_optimizer=make_optimizer, device=device,
                        sharding_strategy="optim_grads_params", compute_dtype=compute,
                        tensor_groups=mcore_gpt.tensor_groups(), **extra)
    return run.model, run.optimizer, builder.use_megatron_fsdp, run.precision + "; sequence parallel"


def not_applicable(column: str, world: int, device: torch.device, args: argparse.Namespace) -> Optional[str]:
    """Why an mcore column cannot run here (None: it can)."""
    from fsdp_cudagraph.apps import mcore_gpt

    if not mcore_gpt.HAS_MCORE:
        return mcore_gpt.MCORE_REASON
    few = _engines_tp.too_few_tp_ranks(args, world)
    if few:
        return few
    if column.startswith("nvidia") and device.type != "cuda":
        return NVIDIA_CPU_REASON
    return None


def device_context(device: torch.device) -> Any:
    """What a column runs inside: ``mcore_gpt.cpu_shims()`` on the CPU (megatron-core's CUDA-only calls given
    their host equivalents), nothing on the GPU."""
    if device.type == "cpu":
        from fsdp_cudagraph.apps.mcore_gpt import cpu_shims

        return cpu_shims()
    return contextlib.nullcontext()
