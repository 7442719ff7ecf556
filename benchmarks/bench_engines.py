"""The engines side by side on a real shape: ours, FSDP2 and NVIDIA Megatron-FSDP, eager and with our graphs.

Configs (``--config``):
  llama8b  Llama-3-8B-shaped layers (``apps/llama.py``: hidden 4096, 32 heads, 8 KV heads, FFN 14336, RMSNorm,
           SwiGLU, RoPE, vocab 128256, sequence 4096, micro-batch 1; TE ``TransformerLayer`` units, or the same
           math in torch with ``--layers-impl torch``); whole layers graphed. Depth ``--layers`` (default by
           world size: 1 GPU 4, 2 GPUs 16 (the per-GPU state of 32 on 4), 4+ GPUs 32).
  olmoe    OLMoE-1B-7B-shaped MoE (``apps.model.olmoe_config``: hidden 2048, 64 experts, top-8, expert FFN 1024,
           sequence 4096); partial graphs over ``attn moe_router moe_preprocess`` with the experts eager between
           graphs; full-iteration with ``grouped_mm`` experts. Depth by world size (1 GPU 4, 2 GPUs 8, 4+ GPUs
           16: 16 layers, ~7 B parameters, do not fit one GPU with fp32 Adam).
  qwen3moe Qwen3-30B-A3B-shaped MoE (``apps.model.qwen3_moe_config``: hidden 2048, 32 query / 4 KV heads of 128,
           128 experts, top-8, each expert Qwen3's weights, vocab 151936, sequence 4096 or ``--seq``), the layout of
           today (every expert sharded over every rank and gathered every step) beside expert parallelism at
           EP = world size (each rank owns 128/EP experts whole; tokens travel by all-to-all, see
           ``apps/moe_ep.py``); partial graphs over ``attn moe_router moe_preprocess``. Needs 2+ GPUs (EP);
           depth by world size (2 GPUs 4, 4+ GPUs 8; 48 in Qwen3), printed.
  llama70b Llama-3-70B-shaped dense slice under tensor parallelism (``apps.model.llama70b_config``: hidden 8192, 64
           query / 8 KV heads of 128, Llama's SwiGLU FFN 28672 as a two-matrix MLP of 43008 (the same weights and
           FLOPs), vocab 128256, sequence 4096 or ``--seq``; torch layers) on a (dp, tp) grid, ``--tensor-parallel N``
           (default: the world size; TP ranks contiguous, the TP ranks of a data-parallel rank take the same
           micro-batch); partial graphs over ``attn mlp``. Depth by world size (2 GPUs 4, 4+ GPUs 8; 80 in Llama),
           printed. Tokens/s and TFLOP/s per GPU divide a data-parallel rank's micro-batch by TP. ``--vocab-parallel``:
           the token embedding and the LM head split over the vocabulary too, in ours and FSDP2's columns alike
           (default: both replicated over TP). See ``_engines_tp.py``.
  mcore70b megatron-core's own ``GPTModel`` (``apps/mcore_gpt.py``) at the llama70b slice's dimensions (hidden 8192,
           SwiGLU FFN 28672 (``gated_linear_unit``), 64 query / 8 KV heads, RMSNorm, RoPE, vocab 128256 untied, bf16
           parameters; TE's layer spec when TE is importable, else the local spec) under megatron-core's parallel
           state, TP = ``--tensor-parallel`` (default: the world size) with sequence parallelism: ours against NVIDIA
           Megatron-FSDP on the same model (NVIDIA's engine shards megatron-core's TP layers through megatron-core's
           FullyShardedDataParallel). Partial graphs over each layer's ``self_attention`` and ``mlp``. Depth as
           llama70b, printed. The NVIDIA columns have not run on a GPU yet. See ``_engines_mcore.py``.
  llama8b_fp8 the Llama-3-8B shape of llama8b at sequence 8192 (the published FP8 records' setting), bf16 beside TE's
           FP8 recipes (delayed, current, block), FP8 with partial and whole-step graphs, NVIDIA Megatron-FSDP in FP8,
           FSDP2 bf16 and FSDP2 + torchao float8 (torch layers, each compiled); ``--micro-batches N`` for gradient
           accumulation (``--fp8-cache-quantized-params``: the eager bf16-weight FP8 columns quantize their weights on
           a step's first micro-batch only, as Megatron does). Depth as llama8b. See ``_engines_fp8.py``.

Columns (bf16 compute, fp32 main weights, Adam, ZeRO-3, unit = decoder layer; same seed and batches):
  ours_eager           megatron_fsdp (double buffer, persistent buffers); TE layers fuse weight gradients into
                       the fp32 main gradients (``--fuse-wgrad on``); each gather casts the fp32 shard to bf16
  ours_partial         + PartialCudaGraphs (TE's graph maker with TE, else torch's)
  ours_full            + FullIterationCudaGraph (forward+backward in one graph, optimizer eager)
  ours_kept_eager      ours_eager with ``fully_shard(keep_compute_shard=True)``: a bf16 copy of the shards, cast
                       once a step, gathered from ([Note: cast on gather] in megatron_fsdp/_unit.py); also in
                       llama8b_fp8, with ``ours_fp8_attention_kept_eager``
  fsdp2_eager          torch FSDP2 as its users run it: fully_shard per layer and the root, default ZeRO-3,
                       fp32 sharded parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
  fsdp2_keep_partial   the same + keep_unsharded_storage + PartialCudaGraphs
  fsdp2_slots_partial  the same + use_unsharded_slots (two slots, ZeRO-3 memory; 2+ ranks) + PartialCudaGraphs
  nvidia_eager         NVIDIA Megatron-FSDP (megatron-core's bundled copy, the checker's ``nvidia`` builder:
                       double buffer, fp32 main parameters and gradients); GPU and megatron-core only
  nvidia_partial       + PartialCudaGraphs
  ours_ep_eager        (qwen3moe) megatron_fsdp with ``expert_parallel_size`` = world size, the model built with
                       the matching expert-parallel group
  ours_ep_groups_eager  the same with each rank's local experts in ``--ep-chunks`` groups (default 2) whose
                       all-to-alls overlap the other groups' experts (GPTConfig.moe_ep_chunks)
  ours_ep_partial      + PartialCudaGraphs (the count exchange, host sync, all-to-alls and experts eager between
                       the graphs)
  fsdp2_ep_eager       (qwen3moe) FSDP2 as fsdp2_eager, with torchtitan's expert layout: each experts module
                       sharded over the expert-data-parallel mesh, gradient divide factor the world size
                       (``shard_fsdp2(expert_parallel_size=)``, docs/engines.md)
  fsdp2_ep_partial     the same + keep_unsharded_storage + PartialCudaGraphs
  nvidia_ep_eager      (qwen3moe) NVIDIA Megatron-FSDP (as nvidia_eager) on the same EP model: its expert mesh
                       ``expt_device_mesh`` over the expert-data-parallel group (one rank at EP = world size), the
                       experts found by name (``moe.experts.*``) and marked as megatron-core marks its own ([Note:
                       NVIDIA's expert-parallel column]); its losses are checked against ours_ep_eager's
  nvidia_ep_partial    + PartialCudaGraphs (as ours_ep_partial)
  ours_tp_eager        (llama70b) megatron_fsdp with the model's TP slice (``GPTConfig(tensor_parallel_size=N,
                       sequence_parallel=True)``), ``fully_shard(process_group=dp, tensor_parallel_group=tp)``
  ours_tp_partial      + PartialCudaGraphs over ``attn mlp`` (the TP collectives inside the graphs, FSDP's outside)
  ours_tp_full         + FullIterationCudaGraph (the TP collectives and FSDP's in one graph)
  ours_tp_kept_eager   ours_tp_eager with ``fully_shard(keep_compute_shard=True)``: at TP = world size each unit's
                       data-parallel group is one rank, so its bf16 cast stays in a buffer of its own (cast once a
                       step instead of at every gather)
  fsdp2_tp_eager       (llama70b) FSDP2 + DTensor TP as torchtitan composes it: ``parallelize_module`` per layer over
                       ``mesh['tp']`` (q, k, v split; no sequence parallelism), ``fully_shard`` over ``mesh['dp']``
  fsdp2_tp_gathered_eager  with --vocab-parallel: the same, its head's logits gathered whole for the plain loss
  fsdp2_tp_partial     the same + keep_unsharded_storage + PartialCudaGraphs over ``attn mlp``
  nvidia_tp_eager      (llama70b) NVIDIA Megatron-FSDP with TP: not applicable to the reference GPT (it takes TP from
                       megatron-core's parallel state, for megatron-core models); NVIDIA with TP: see --config mcore70b
  ours_mcore_tp_eager  (mcore70b) megatron_fsdp on megatron-core's GPTModel, ``fully_shard(process_group=dp,
                       tensor_parallel_group=tp)`` with megatron-core's groups
  ours_mcore_tp_partial  + PartialCudaGraphs over ``decoder.layers.*.self_attention`` and ``.mlp`` (attn_mlp)
  nvidia_mcore_tp_eager  (mcore70b) NVIDIA Megatron-FSDP on the same model through megatron-core's
                       FullyShardedDataParallel (the ``nvidia`` builder, ``wrapper='mcore'``; megatron-core's
                       ``finalize_model_grads`` before each optimizer step); its first loss must equal
                       ours_mcore_tp_eager's bit for bit, the others within LOSS_RTOL ([Note: losses across
                       engines]); GPU only, not yet run on one
  nvidia_mcore_tp_partial  + PartialCudaGraphs (as ours_mcore_tp_partial)
  ours_fp8_<r>_eager   (llama8b_fp8) ours_eager under TE's FP8 autocast with recipe r (delayed, current, block)
  ours_fp8_partial     + PartialCudaGraphs with the recipe (``--fp8-recipe``, default current)
  ours_fp8_full        + FullIterationCudaGraph, the autocast inside the captured step (``--fp8-recipe``)
  ours_fp8_gather_eager  the layers built under TE's quantized_model_init (primary FP8 weights), current scaling: our
                       engine gathers the weights as FP8 bytes ([Note: FP8 parameter all-gather])
  ours_fp8_gather_partial  + PartialCudaGraphs (whole layers)
  ours_fp8_gather_attention_eager  ours_fp8_gather_eager with attention in FP8 (delayed-scaled on Hopper through
                       NVTE_DPA_FP8_RECIPE=DelayedScaling, set in the column's own process); eager only
  nvidia_fp8_eager     NVIDIA Megatron-FSDP under the same autocast (``--fp8-recipe``; bf16 parameter all-gather)
  nvidia_fp8_gather_eager  NVIDIA Megatron-FSDP on ours_fp8_gather_eager's layers: it gathers the FP8 weights as bytes
  ours_fp8_attention_eager  delayed scaling with attention in FP8 too (TE's fp8_dpa: cuDNN's FP8 fused attention;
                       [Note: FP8 attention]); ours_fp8_attention_partial: + PartialCudaGraphs (whole layers);
                       nvidia_fp8_attention_eager: NVIDIA Megatron-FSDP under the same recipe
  fsdp2_torch_eager    FSDP2 bf16 on the torch layers, each layer compiled (``--fsdp2-compile``)
  fsdp2_float8_eager   the same + torchao float8 (tensorwise, float8 all-gather; torchtitan's composition)

Per column: median step time over the timed steps (CUDA events; the slowest rank's), tokens/s per GPU, MFU
(model FLOPs / the bf16 matmul rate measured in the same run), peak memory per GPU (max over ranks), host time
per step (wall time for Python to issue the step, no synchronize inside it; once the host is a launch queue
ahead of a GPU-bound step it waits there, so it then reads as the step time: ``--profile-step K`` records step
K's CUDA runtime calls and operators by their own host time) and the first losses. Each
column is reported against the floor with communication ([Note: the floor with communication] in
``_perf_goals.py``; the all-gather and reduce-scatter rates of a layer-sized collective measured in the same
run) and the engines-at-scale goals (llama8b), the MoE goals (olmoe), the expert-parallel goals (qwen3moe, among
them ours EP eager >= 1.2x NVIDIA EP eager's tokens/s at no more peak) and the TP goals (llama70b; mcore70b: ours
eager >= 1.1x NVIDIA's tokens/s per GPU, partial never slower than eager) get PASS / NOISE
/ FAIL / MISSING verdicts (``_perf_goals.ENGINE_GOALS``); the losses of a column of another engine on the same EP
model are checked against ours EP eager's ([Note: losses across engines] in ``_engines_report.py``: AGREE or
DISAGREE, which fails the run). A column that does not apply here (slots on one rank, EP on one rank, NVIDIA on CPU
or without megatron-core) is ``skipped`` with its reason and its goals are N/A.

Isolation: by default every column (and the rate measurement) runs in its own ``torchrun`` child, so each peak
is the column's alone and a column that crashes (out of memory, an NCCL abort) is recorded as failed while the
others run. Under ``torchrun`` (or with ``--isolate none``) all columns run in one process, each after
``gc.collect()`` and ``empty_cache()``, with ``own_peak_gib`` (peak minus what was allocated at the start);
there a column that fails on one rank only (out of memory) leaves the others waiting in a collective, where
the children's run ends that column at once and goes on.

    python benchmarks/bench_engines.py --config llama8b --out llama8b-1gpu.json                    # 1 GPU, 4 layers
    python benchmarks/bench_engines.py --config llama8b --nproc-per-node 2 --out llama8b-2gpu.json  # 16 layers
    python benchmarks/bench_engines.py --config olmoe --nproc-per-node 2 --out olmoe-2gpu.json
    python benchmarks/bench_engines.py --config qwen3moe --nproc-per-node 2 --seq 4096 --out qwen3moe-2gpu.json
    torchrun --nproc-per-node 2 benchmarks/bench_engines.py --config llama8b   # one process per rank, no isolation
    python benchmarks/bench_engines.py --config llama70b --nproc-per-node 2 --seq 8192 --out tp2.json   # TP 2
    python benchmarks/bench_engines.py --config llama70b --nproc-per-node 4 --tensor-parallel 2 --out tp2x2.json
    python benchmarks/bench_engines.py --config llama70b --nproc-per-node 2 --layers 2 --vocab-parallel --out vp.json
    python benchmarks/bench_engines.py --config mcore70b --nproc-per-node 4 --out mcore-tp4.json    # TP 4, 8 layers
    python benchmarks/bench_engines.py --config mcore70b --nproc-per-node 2 --seq 8192 --out mcore-tp2.json  # TP 2
    python benchmarks/bench_engines.py --config llama8b_fp8 --nproc-per-node 4 --out fp8-4gpu.json   # 32 layers, seq 8192
    python benchmarks/bench_engines.py --cpu-smoke --config llama8b            # Gloo, tiny shapes, protocol backend

Bit for bit: the speed record runs torch's fast kernels (flash attention's backward accumulates with atomics), so
its graphed and eager columns may differ after the first step. ``--deterministic`` runs every column on
deterministic kernels (SDPA's math kernel; TE's attention is deterministic already), where each graphed column
must train bit for bit like its eager column, or the run fails naming it.

A child costs its start (Python, torch, TE, NCCL: ~15-25 s) on top of its column. Under a per-command time
limit, run the columns in two commands (``--columns ...``, each measuring the rates in its first child) and
combine them into one table and verdicts without running anything::

    python benchmarks/bench_engines.py --merge half1.json half2.json --out llama8b-2gpu.json

Exit status: 0 when every column that applies ran and every goal is PASS or NOISE, 1 otherwise, 2 without a
GPU (unless ``--cpu-smoke``, whose times and verdicts mean nothing: it exits 0 when its columns ran).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import _engines_fp8  # noqa: E402
import _engines_mcore  # noqa: E402
import _engines_tp  # noqa: E402
import _flops  # noqa: E402
from _comm_bytes import count_collectives, reduce_max  # noqa: E402
from _engines_report import assemble, merge  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.capture.te import HAS_TE  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402

#: column -> (engine builder, engine_options, mode)
COLUMN_SPECS: Dict[str, Tuple[str, Optional[Dict[str, Any]], str]] = {
    "ours_eager": ("megatron_fsdp", None, "eager"),
    "ours_partial": ("megatron_fsdp", None, "partial"),
    "ours_full": ("megatron_fsdp", None, "full"),
    "ours_kept_eager": ("megatron_fsdp", {"keep_compute_shard": True}, "eager"),
    "fsdp2_eager": ("fsdp2_default", None, "eager"),
    "fsdp2_keep_partial": ("fsdp2", {"storage": "keep", "mixed_precision": "bf16"}, "partial"),
    "fsdp2_slots_partial": ("fsdp2", {"storage": "slots", "mixed_precision": "bf16"}, "partial"),
    "nvidia_eager": ("nvidia", None, "eager"),
    "nvidia_partial": ("nvidia", None, "partial"),
    "ours_ep_eager": ("megatron_fsdp", {"expert_parallel": True}, "eager"),
    "ours_ep_groups_eager": ("megatron_fsdp", {"expert_parallel": True, "ep_groups": True}, "eager"),
    "ours_ep_partial": ("megatron_fsdp", {"expert_parallel": True}, "partial"),
    "fsdp2_ep_eager": ("fsdp2_default", {"expert_parallel": True}, "eager"),
    "fsdp2_ep_partial": ("fsdp2", {"storage": "keep", "mixed_precision": "bf16", "expert_parallel": True}, "partial"),
    "nvidia_ep_eager": ("nvidia", {"expert_parallel": True}, "eager"),
    "nvidia_ep_partial": ("nvidia", {"expert_parallel": True}, "partial"),
    "ours_tp_eager": ("megatron_fsdp", {"tensor_parallel": True}, "eager"),
    "ours_tp_partial": ("megatron_fsdp", {"tensor_parallel": True}, "partial"),
    "ours_tp_full": ("megatron_fsdp", {"tensor_parallel": True}, "full"),
    "ours_tp_kept_eager": ("megatron_fsdp", {"tensor_parallel": True, "keep_compute_shard": True}, "eager"),
    "fsdp2_tp_eager": ("fsdp2", {"tensor_parallel": True}, "eager"),
    "fsdp2_tp_gathered_eager": ("fsdp2", {"tensor_parallel": True}, "eager"),
    "fsdp2_tp_partial": ("fsdp2", {"tensor_parallel": True, "storage": "keep"}, "partial"),
    "nvidia_tp_eager": ("nvidia", {"tensor_parallel": True}, "eager"),
    "ours_mcore_tp_eager": ("megatron_fsdp", {"mcore": True}, "eager"),
    "ours_mcore_tp_partial": ("megatron_fsdp", {"mcore": True}, "partial"),
    "nvidia_mcore_tp_eager": ("nvidia", {"mcore": True}, "eager"),
    "nvidia_mcore_tp_partial": ("nvidia", {"mcore": True}, "partial"),
    "ours_fp8_delayed_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_current_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_block_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_partial": ("megatron_fsdp", {"fp8": True}, "partial"),
    "ours_fp8_full": ("megatron_fsdp", {"fp8": True}, "full"),
    "ours_fp8_gather_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_gather_partial": ("megatron_fsdp", {"fp8": True}, "partial"),
    "nvidia_fp8_eager": ("nvidia", {"fp8": True}, "eager"),
    "nvidia_fp8_gather_eager": ("nvidia", {"fp8": True}, "eager"),
    "ours_fp8_gather_attention_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_attention_eager": ("megatron_fsdp", {"fp8": True}, "eager"),
    "ours_fp8_attention_partial": ("megatron_fsdp", {"fp8": True}, "partial"),
    "ours_fp8_attention_kept_eager": ("megatron_fsdp", {"fp8": True, "keep_compute_shard": True}, "eager"),
    "nvidia_fp8_attention_eager": ("nvidia", {"fp8": True}, "eager"),
    "fsdp2_torch_eager": ("fsdp2_torchtitan", None, "eager"),
    "fsdp2_float8_eager": ("fsdp2_torchtitan", {"float8": True}, "eager"),
}
COLUMNS = {
    "llama8b": [c for c in COLUMN_SPECS if "_ep_" not in c and c not in _engines_tp.TP_COLUMNS
                and c not in _engines_mcore.MCORE_COLUMNS
                and (c in ("ours_eager", "ours_kept_eager") or c not in _engines_fp8.FP8_COLUMNS)],
    "olmoe": ["ours_eager", "ours_partial", "ours_full", "fsdp2_eager", "fsdp2_keep_partial", "nvidia_eager",
              "nvidia_partial"],
    "qwen3moe": ["ours_eager", "ours_partial", "ours_ep_eager", "ours_ep_groups_eager", "ours_ep_partial",
                 "fsdp2_ep_eager", "fsdp2_ep_partial", "nvidia_ep_eager", "nvidia_ep_partial"],
    "llama70b": list(_engines_tp.TP_COLUMNS),
    "mcore70b": list(_engines_mcore.MCORE_COLUMNS),
    "llama8b_fp8": list(_engines_fp8.FP8_COLUMNS),
}
#: depth by world size when --layers is not given (see the module docstring)
DEFAULT_LAYERS = {"llama8b": {1: 4, 2: 16}, "olmoe": {1: 4, 2: 8}, "qwen3moe": {1: 2, 2: 4}, "llama70b": {1: 2, 2: 4},
                  "mcore70b": {1: 2, 2: 4}, "llama8b_fp8": {1: 4, 2: 16}}
DEEPEST = {"llama8b": 32, "olmoe": 16, "qwen3moe": 8, "llama70b": 8, "mcore70b": 8, "llama8b_fp8": 32}
OLMOE_SCOPES = ["attn", "moe_router", "moe_preprocess"]
CHILD_ENV = "BENCH_ENGINES_CHILD"


def default_layers(config: str, world: int) -> int:
    return DEFAULT_LAYERS[config].get(world, DEEPEST[config])


# ---------------------------------------------------------------------------------------------- the model


@dataclasses.dataclass
class Model:
    """One column's model before sharding, and what the benchmark needs to know about it."""

    module: nn.Module
    unit_class: type
    scopes: List[str]
    seq_len: int
    vocab_size: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int, int, torch.device], Tuple[torch.Tensor, torch.Tensor]]
    counts: Dict[str, Any]
    #: this rank's (data-parallel rank, data-parallel size) where it differs from (rank, world): TP ranks of one
    #: data-parallel rank take the same rows
    data_parallel: Optional[Tuple[int, int]] = None
    #: with expert parallelism, this rank's ``(EP group, EDP group)``: the model's all-to-all runs over the first;
    #: NVIDIA's columns build its expert mesh from the second (our engine and FSDP2 build groups of the same ranks)
    expert_groups: Optional[Tuple[Any, Any]] = None
    #: what each micro-batch's forward and backward run inside (FSDP2's vocabulary-split loss: ``loss_parallel``)
    loss_context: Callable[[], Any] = contextlib.nullcontext
    #: the model computes its own loss, ``module(x, y)`` (ours with the vocabulary split: from the slices)
    fused_loss: bool = False
    #: ``(model, tokens, targets) -> loss`` for a model that takes other inputs than the tokens (megatron-core's
    #: GPTModel: position ids, mask, labels); None: ``module(x)`` or ``module(x, y)`` as above
    call_loss: Optional[Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = None
    #: the partial columns' ``cuda_graph_module_patterns`` (modules selected by name), instead of ``scopes``
    scope_patterns: List[str] = dataclasses.field(default_factory=list)
    #: the model's tensor-parallel group where the module does not carry it as ``tensor_parallel_group``
    tensor_parallel_group: Optional[Any] = None


def _llama_config(args: argparse.Namespace, *, fuse_wgrad: bool, layers_impl: Optional[str] = None,
                  overrides: Optional[Dict[str, Any]] = None) -> Any:
    from fsdp_cudagraph.apps.llama import LlamaConfig, llama3_8b_config

    if args.cpu_smoke:
        return LlamaConfig(vocab_size=128, hidden_size=32, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                           ffn_hidden_size=64, seq_len=16, layers_impl="torch")
    impl = layers_impl or args.layers_impl
    seq = args.seq or (8192 if args.config == "llama8b_fp8" else None)
    return llama3_8b_config(num_layers=args.layers, layers_impl=impl, fuse_wgrad=fuse_wgrad and impl == "te",
                            **({"seq_len": seq} if seq else {}), **(overrides or {}))


def _olmoe_config(args: argparse.Namespace, *, fuse_wgrad: bool, experts: str) -> Any:
    from fsdp_cudagraph.apps import model as gpt

    if not hasattr(gpt, "olmoe_config"):
        raise ImportError("fsdp_cudagraph.apps.model has no olmoe_config yet (the dropless MoE); "
                          "--config olmoe needs it")
    if args.cpu_smoke:
        return gpt.olmoe_config(vocab_size=128, hidden_size=32, num_layers=args.layers, num_heads=4, seq_len=16,
                                num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_experts=experts,
                                moe_grouped_mm_dtype="input")
    use_te = args.layers_impl == "te"
    return gpt.olmoe_config(num_layers=args.layers, use_te=use_te, moe_experts=experts,
                            fuse_wgrad=fuse_wgrad and use_te, **({"seq_len": args.seq} if args.seq else {}))


def _qwen3_moe_config(args: argparse.Namespace, *, fuse_wgrad: bool, ep: int, groups: int = 1) -> Any:
    from fsdp_cudagraph.apps import model as gpt

    if args.cpu_smoke:
        return gpt.qwen3_moe_config(vocab_size=128, hidden_size=32, num_layers=args.layers, num_heads=4,
                                    num_kv_heads=2, head_dim=16, seq_len=16, num_experts=4, moe_top_k=2,
                                    moe_ffn_hidden_size=32, moe_experts=args.moe_experts,
                                    moe_grouped_mm_dtype="input", expert_parallel_size=ep, moe_ep_chunks=groups)
    use_te = args.layers_impl == "te"
    return gpt.qwen3_moe_config(num_layers=args.layers, use_te=use_te, moe_experts=args.moe_experts,
                                fuse_wgrad=fuse_wgrad and use_te, expert_parallel_size=ep,
                                moe_ep_chunks=groups, **({"seq_len": args.seq} if args.seq else {}))


def expert_parallel_size(column: str) -> int:
    """EP of a column: the world size for the ``*_ep_*`` columns (each rank owns E/W experts), else 1."""
    options = COLUMN_SPECS[column][1] or {}
    return dist.get_world_size() if options.get("expert_parallel") else 1


def build_model(args: argparse.Namespace, device: torch.device, *, ours: bool, full: bool, ep: int = 1,
                layers_impl: Optional[str] = None, column: str = "") -> Model:
    """The column's model, seeded alike on every rank and in every column (``ours``: TE layers fuse weight
    gradients into our engine's main gradients when ``--fuse-wgrad on``; ``full``: the full-iteration column,
    whose MoE experts must be ``grouped_mm``; ``ep``: expert parallelism, the model built with this rank's
    ``E/ep`` experts and the matching expert-parallel group; ``layers_impl``: the Llama layers, te or torch,
    instead of ``--layers-impl``)."""
    torch.manual_seed(1234)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(1234)
    fuse = ours and args.fuse_wgrad == "on"
    expert_groups = None
    if args.config == "llama70b":
        return _tensor_parallel_model(args, device, ours=ours, gathered=column in _engines_tp.GATHERED_LOGITS)
    if args.config == "mcore70b":
        return _mcore_model(args, device)
    if args.config in ("llama8b", "llama8b_fp8"):
        from fsdp_cudagraph.apps import llama

        cfg = _llama_config(args, fuse_wgrad=fuse, layers_impl=layers_impl,
                            overrides=_engines_fp8.layer_overrides(column))
        # parameters made where they train: an 8B-shaped model initialised on the host takes minutes
        with device, _engines_fp8.weights_init(column):
            module = llama.Llama(cfg)
        top_k = num_experts = 1
        scopes: List[str] = []
        loss, batch = llama.loss_fn, llama.synthetic_batch
    elif args.config == "qwen3moe":
        import megatron_fsdp

        from fsdp_cudagraph.apps import model as gpt

        groups = args.ep_chunks if (COLUMN_SPECS.get(column, (None, None))[1] or {}).get("ep_groups") else 1
        cfg = _qwen3_moe_config(args, fuse_wgrad=fuse, ep=ep, groups=groups)
        expert_groups = megatron_fsdp.expert_parallel_groups(ep) if ep > 1 else None
        with device:
            module = gpt.GPT(cfg, expert_parallel_group=expert_groups[0] if expert_groups else None)
        top_k, num_experts = cfg.moe_top_k, cfg.num_experts // ep  # the local experts' share of a token
        scopes = list(OLMOE_SCOPES)
        loss, batch = gpt.loss_fn, gpt.synthetic_batch
    else:
        from fsdp_cudagraph.apps import model as gpt

        cfg = _olmoe_config(args, fuse_wgrad=fuse, experts="grouped_mm" if full else args.moe_experts)
        with device:
            module = gpt.GPT(cfg)
        top_k, num_experts = cfg.moe_top_k, cfg.num_experts
        scopes = list(OLMOE_SCOPES)
        loss, batch = gpt.loss_fn, gpt.synthetic_batch
    unit_class = module.unit_class
    in_units = {id(p) for m in module.modules() if isinstance(m, unit_class) for p in m.parameters()}
    layer = next(m for m in module.modules() if isinstance(m, unit_class))
    # parameters of the whole model: a rank of an EP model holds 1/ep of the experts
    global_numel = sum(p.numel() * (ep if "experts" in n else 1) for n, p in module.named_parameters())
    counts = {"num_params": global_numel,
              "root_params": sum(p.numel() for p in module.parameters() if id(p) not in in_units),
              # the layers' matmul weights: what an FP8 recipe runs in FP8 (the LM head and attention stay bf16)
              "unit_matmul_params": sum(p.numel() for m in module.modules() if isinstance(m, unit_class)
                                        for p in m.parameters() if p.dim() >= 2),
              "layer_params": sum(p.numel() for p in layer.parameters()),
              "matmul_params": _flops.active_matmul_params(module, top_k=top_k, num_experts=num_experts),
              "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "seq_len": cfg.seq_len,
              "attn_hidden": getattr(cfg, "num_heads", 0) * (getattr(cfg, "head_dim", None) or 0)
              or cfg.hidden_size, "expert_parallel_size": ep,
              "model_config": {k: v for k, v in dataclasses.asdict(cfg).items()
                               if isinstance(v, (int, float, str, bool, type(None)))}}
    return Model(module, unit_class, scopes, cfg.seq_len, cfg.vocab_size, loss,
                 lambda step, n, dev: batch(step, n, cfg, dev), counts,
                 expert_groups=expert_groups)


def _tensor_parallel_model(args: argparse.Namespace, device: torch.device, *, ours: bool, gathered: bool) -> Model:
    """``--config llama70b``: ours' TP slice of the reference GPT, or FSDP2's DTensor model (``_engines_tp.py``;
    ``gathered``: its vocabulary-split head gathers the logits)."""
    from fsdp_cudagraph.apps import model as gpt

    module, cfg, counts = _engines_tp.build(args, device, dtensor=not ours, gathered=gathered)
    counts["model_config"] = {k: v for k, v in dataclasses.asdict(cfg).items()
                              if isinstance(v, (int, float, str, bool, type(None)))}
    tp = counts["tensor_parallel_size"]
    return Model(module, module.unit_class, list(_engines_tp.SCOPES), cfg.seq_len, cfg.vocab_size, gpt.loss_fn,
                 lambda step, n, dev: gpt.synthetic_batch(step, n, cfg, dev), counts,
                 _engines_tp.data_parallel_rank(tp),
                 loss_context=_engines_tp.loss_context(args, not ours and not gathered, tp),
                 fused_loss=ours and cfg.vocab_parallel)


def _mcore_model(args: argparse.Namespace, device: torch.device) -> Model:
    """``--config mcore70b``: this rank's TP slice of megatron-core's GPTModel (``_engines_mcore.py``), the same
    model for both engines."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fsdp_cudagraph.apps import mcore_gpt
    from fsdp_cudagraph.apps.model import synthetic_batch

    module, shape, counts = _engines_mcore.build(args, device)
    counts["model_config"] = {k: v for k, v in dataclasses.asdict(shape).items()
                              if isinstance(v, (int, float, str, bool, type(None)))}
    # the loss is call_loss's; synthetic_batch reads the shape's vocab_size and seq_len
    return Model(module, TransformerLayer, [], shape.seq_len, shape.vocab_size, None,
                 lambda step, n, dev: synthetic_batch(step, n, shape, dev), counts,
                 _engines_mcore.data_parallel_rank(),
                 call_loss=_engines_mcore.forward_loss(device, shape.seq_len),
                 scope_patterns=list(mcore_gpt.SCOPES[_engines_mcore.SCOPE]),
                 tensor_parallel_group=ps.get_tensor_model_parallel_group())


# ---------------------------------------------------------------------------------------------- the engines


@dataclasses.dataclass
class Sharded:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    use_megatron_fsdp: bool
    precision: str


def _adam(device: torch.device) -> Callable[[List[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.Adam(params, lr=1e-4, fused=device.type == "cuda")


def _fsdp2_default(model: nn.Module, unit_class: type, device: torch.device, ep: int = 1) -> Sharded:
    """FSDP2 as its documentation runs it: no storage option (the checker's builder always picks one)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2
    from fsdp_cudagraph.engines.fsdp2.build import FSDP2_MIXED_PRECISION

    # the policy the FSDP2 graph columns get from the checker's builder (mixed_precision="bf16"), by construction
    policy = MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION["bf16"])
    shard_fsdp2(model, list(reversed([m for m in model.modules() if isinstance(m, unit_class)])), device=device,
                mp_policy=policy, expert_parallel_size=ep)
    return Sharded(model, _adam(device)(list(model.parameters())), False,
                   "fp32 sharded parameters, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), "
                   "reshard_after_forward=True (default ZeRO-3)")


# [Note: NVIDIA's expert-parallel column]
# nvidia_ep_eager / nvidia_ep_partial train the model of the other qwen3moe columns (the reference GPT, its
# ``grouped_mm`` experts, EP = world size, built with this rank's E/EP experts and the EP group its all-to-all
# runs over) under NVIDIA Megatron-FSDP's ``fully_shard``: only the engine differs. NVIDIA's engine takes a
# parameter for an expert parameter when its name contains ``.experts.`` (``is_expert_parameter`` in its
# ``param_and_grad_buffer.py``, megatron-core 0.16.1 and 0.19.2), which the reference GPT's ``moe.experts.w1``/
# ``w2`` do; the checker's ``nvidia`` builder, given ``expert_groups``, marks them ``allreduce = False`` as
# megatron-core marks its own (``tag_expert_parameters``; then NVIDIA refuses to run without an expert group) and
# builds NVIDIA's expert mesh ``expt_device_mesh`` over the expert-data-parallel group, of one rank at EP = world:
# each rank keeps its experts whole (its fp32 main weights, gradients and Adam state too), as ours and FSDP2's EP
# layouts do. NVIDIA scales dense and expert gradients alike by 1 / data-parallel size (``average_in_collective``
# off), the same mean as ours and FSDP2 (gradient divide factor W). NVIDIA casts the whole module to bf16 and
# keeps fp32 main parameters and gradients, as its other columns do (its fp32 main weights start from the
# bf16-rounded ones, ours from the fp32 ones: the same first forward, then a drift). The first losses must agree with
# ours_ep_eager ([Note: losses across engines] in ``_engines_report.py``); that check needs the GPU, since
# NVIDIA's engine builds CUDA streams when constructed.


def shard(column: str, model: Model, device: torch.device, args: argparse.Namespace) -> Sharded:
    from fsdp_cudagraph.engines.registry import engine_builder

    name, options, _ = COLUMN_SPECS[column]
    if name == "fsdp2_torchtitan":
        net, opt, precision = _engines_fp8.float8_fsdp2(model.module, model.unit_class, device,
                                                        compile_layers=args.fsdp2_compile == "on",
                                                        float8=bool((options or {}).get("float8")),
                                                        make_optimizer=_adam(device))
        return Sharded(net, opt, False, precision)
    # FP8 is the training loop's (the autocast around each forward): the engine is built as without it
    options = {k: v for k, v in (options or {}).items() if k != "fp8"} or None
    if (options or {}).get("mcore"):
        return Sharded(*_engines_mcore.shard(column, model.module, device, _adam(device)))
    if (options or {}).get("tensor_parallel"):
        net, opt, use_mf, precision, _ = _engines_tp.shard(column, model.module, model.unit_class, device,
                                                           model.counts["tensor_parallel_size"], _adam(device),
                                                           keep_compute_shard=bool(options.get("keep_compute_shard")))
        return Sharded(net, opt, use_mf, precision)
    if name == "fsdp2_default":
        return _fsdp2_default(model.module, model.unit_class, device, expert_parallel_size(column))
    if (options or {}).get("expert_parallel") and name == "megatron_fsdp":
        from megatron_fsdp import fully_shard

        ep = expert_parallel_size(column)
        sharded = fully_shard(model.module, fsdp_unit_modules=[model.unit_class], sharding_strategy="optim_grads_params",
                              compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                              fsdp_db_use_persist_buf_on_alloc_fail=True, expert_parallel_size=ep)
        return Sharded(sharded, _adam(device)(list(sharded.optimizer_parameters())), True,
                       f"compute in bf16, fp32 main parameters and gradients, ZeRO-3; EP {ep}: experts whole on "
                       f"their rank (expert-data-parallel groups of {dist.get_world_size() // ep})")
    builder = engine_builder(name, device)
    if (options or {}).get("expert_parallel") and name == "nvidia":
        # [Note: NVIDIA's expert-parallel column]
        run = builder.build(model.module, unit_modules=[model.unit_class], make_optimizer=_adam(device), device=device,
                            sharding_strategy="optim_grads_params", compute_dtype=torch.bfloat16,
                            expert_groups=nvidia_expert_groups(model))
        return Sharded(run.model, run.optimizer, builder.use_megatron_fsdp, run.precision)
    if options and options.get("expert_parallel"):  # the builder's option: EP = the world size
        options = {**{k: v for k, v in options.items() if k != "expert_parallel"},
                   "expert_parallel_size": expert_parallel_size(column)}
    extra = {"options": options} if options else {}
    run = builder.build(model.module, unit_modules=[model.unit_class], make_optimizer=_adam(device), device=device,
                        sharding_strategy="optim_grads_params",
                        compute_dtype=None if name == "fsdp2" else torch.bfloat16, **extra)
    return Sharded(run.model, run.optimizer, builder.use_megatron_fsdp, run.precision)


def nvidia_expert_groups(model: Model) -> Tuple[Any, Any]:
    """The ``(EP group, EDP group)`` NVIDIA's column shards ``model`` with: the groups the model was built with
    (its experts' all-to-all runs over the first), refused (ValueError) where the model has none or its experts
    exchange over another group."""
    if model.expert_groups is None:
        raise ValueError("NVIDIA's expert-parallel column needs the model built with expert parallelism "
                         "(build_model(..., ep=world size) keeps its groups in Model.expert_groups); got a model "
                         "without expert groups: build it with ep > 1")
    ep_group = model.expert_groups[0]
    for name, m in model.module.named_modules():
        if getattr(m, "is_expert", False) is True and getattr(m, "ep_group", None) is not ep_group:
            raise ValueError(f"{name}: its all-to-all group is not Model.expert_groups[0]; NVIDIA's expert mesh would "
                             "describe other ranks than the exchange; build the model and its groups together "
                             "(build_model)")
    return model.expert_groups


def not_applicable(column: str, world: int, device: torch.device,
                   args: Optional[argparse.Namespace] = None) -> Optional[str]:
    """Why ``column`` cannot run here by design (None: it can). A failure to run is not this: it is an error."""
    if column in _engines_tp.TP_COLUMNS:
        return _engines_tp.not_applicable(column, world, args if args is not None else parse([]))
    if column in _engines_mcore.MCORE_COLUMNS:
        return _engines_mcore.not_applicable(column, world, device, args if args is not None else parse([]))
    if column in _engines_fp8.FP8_COLUMNS:
        why = _engines_fp8.not_applicable(column, device, args if args is not None else parse([]))
        if why is not None:
            return why
    if column == "fsdp2_slots_partial" and world < 2:
        return ("use_unsharded_slots needs 2+ ranks (on one rank FSDP2 copies its all-gather into the outputs' "
                "storage directly); run with --nproc-per-node 2")
    if "_ep_" in column and world < 2:
        return "expert parallelism needs 2+ ranks (EP = world size); run with --nproc-per-node 2 or more"
    if column.startswith("nvidia"):
        if device.type != "cuda":
            return "NVIDIA Megatron-FSDP builds CUDA streams and buffers when constructed: GPU only"
        if not _has_megatron_core():
            return ("NVIDIA Megatron-FSDP is megatron-core's bundled copy and megatron-core is not importable here; "
                    "install it with: pip install 'megatron-core==0.19.2'")
    return None


def _has_megatron_core() -> bool:
    try:
        from megatron.core.distributed.fsdp.src import megatron_fsdp  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a megatron-core that fails at import
        return False
    return True


# ---------------------------------------------------------------------------------------------- one column


def _graph_config(args: argparse.Namespace, scopes: List[str], use_megatron_fsdp: bool,
                  patterns: Optional[List[str]] = None) -> Any:
    from fsdp_cudagraph.config import CudaGraphConfig

    return CudaGraphConfig(cuda_graph_impl="transformer_engine" if args.backend == "te" else "local",
                           cuda_graph_modules=list(scopes), cuda_graph_module_patterns=list(patterns or []),
                           cuda_graph_warmup_steps=args.capture_step,
                           use_megatron_fsdp=use_megatron_fsdp, fsdp_double_buffer=use_megatron_fsdp,
                           fsdp_db_use_persist_buf_on_alloc_fail=use_megatron_fsdp)


def _host_profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _host_profile_summary(prof: Any, top: int = 12) -> Dict[str, Any]:
    """Where one step's host time goes (``--profile-step``): the CUDA runtime and driver calls (a
    ``cudaStreamSynchronize`` or ``cudaFree`` that waits for the device shows up here, a launch costs
    microseconds) and the operators with the most host time of their own, in milliseconds."""
    events = prof.key_averages()
    cuda_calls = sorted((e for e in events if e.key.startswith("cu")), key=lambda e: -e.self_cpu_time_total)
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)
    out: Dict[str, Any] = {
        "cuda_api": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in cuda_calls[:top]],
        "ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in ops[:top]],
        "total_self_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 3),
    }
    # On a GPU, the step's kernels too: milliseconds by category, busy and idle (diagnose/profile_step.py)
    from diagnose.profile_step import cuda_kernels, summarize_kernels

    kernels = cuda_kernels(prof)
    if kernels:
        out["gpu"] = summarize_kernels(kernels, 1)
    return out


def run_column(column: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """Build, shard and train ``column`` for ``--warmup + --steps`` steps; its row (every rank returns it)."""
    if column in _engines_mcore.MCORE_COLUMNS:  # megatron-core on the CPU: its CUDA-only calls shimmed
        with _engines_mcore.device_context(device):
            return _run_column(column, args, device)
    return _run_column(column, args, device)


def _run_column(column: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    from fsdp_cudagraph import FullIterationCudaGraph, PartialCudaGraphs
    from fsdp_cudagraph.config import CudaGraphConfig

    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:  # start as a fresh process would: an earlier graphed column may have left a side stream current
        default = torch.cuda.default_stream(device)
        default.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.set_stream(default)
        gc.collect()
        torch.cuda.empty_cache()
    start_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    mode = COLUMN_SPECS[column][2]
    t_build = time.perf_counter()
    model = build_model(args, device, ours=column.startswith("ours"), full=mode == "full",
                        ep=expert_parallel_size(column), layers_impl=_engines_fp8.layers_impl(column, args),
                        column=column)
    fp8 = _engines_fp8.make_recipe(column, args)  # the column's FP8Recipe, or None (bf16, torchao's float8)
    counts = model.counts
    sharded = shard(column, model, device, args)
    build_s = time.perf_counter() - t_build
    if cuda:  # the peak of training, not of building (engines shard a full model each their own way)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    mbs = args.micro_batch
    dp_rank, dp = model.data_parallel or (rank, world)
    tp = counts.get("tensor_parallel_size", 1)
    tp_group = model.tensor_parallel_group
    if tp_group is None and tp > 1:
        tp_group = getattr(model.module, "tensor_parallel_group", None)
    n_micro = args.micro_batches
    batches = []  # per step, its micro-batches
    for step in range(args.warmup + args.steps):
        micro = []
        for i in range(n_micro):
            x, y = model.batch(step * n_micro + i, mbs * dp, device)
            micro.append((x[dp_rank * mbs:(dp_rank + 1) * mbs].contiguous(),
                          y[dp_rank * mbs:(dp_rank + 1) * mbs].contiguous()))
        batches.append(micro)
    loss_of, loss_context, fused_loss, call_loss = model.loss, model.loss_context, model.fused_loss, model.call_loss

    def forward_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor, first: bool = True) -> torch.Tensor:
        # FP8: one autocast region around each micro-batch's forward, eager, replayed and captured alike
        with _engines_fp8.autocast(fp8, first):
            if call_loss is not None:
                return call_loss(m, x, y) / n_micro
            if fused_loss:
                return m(x, y) / n_micro
            out = m(x)
        return loss_of(out, y) / n_micro

    net, opt = sharded.model, sharded.optimizer
    partial = full = None
    if mode == "partial":
        partial = PartialCudaGraphs(net, _graph_config(args, model.scopes, sharded.use_megatron_fsdp,
                                                       model.scope_patterns),
                                    backend=args.backend, **({"fp8": fp8} if fp8 is not None else {}))
    elif mode == "full":
        full = FullIterationCudaGraph(net, forward_loss,
                                      CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                      cuda_graph_warmup_steps=args.capture_step),
                                      backend="torch" if cuda else "protocol")
    del model
    losses: List[torch.Tensor] = []
    events: List[Any] = []
    host_ms: List[float] = []
    profile: Optional[Dict[str, Any]] = None
    comm_bytes: Dict[str, int] = {}
    capture_s = None
    try:
        for step, micro in enumerate(batches):
            if partial is not None and step == args.capture_step:
                t0 = time.perf_counter()
                partial.capture()
                capture_s = time.perf_counter() - t0
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            profiling = step == args.profile_step
            prof = _host_profiler(cuda) if profiling else contextlib.nullcontext()
            # the last untimed step, graphs captured: its bytes by kind; with TP the first (eager in every column),
            # since the TP collectives inside the graphs are not seen ([Note: counting a step's bytes])
            counting = step == (0 if tp > 1 else args.warmup - 1)
            counter = count_collectives(tp_group) if counting else contextlib.nullcontext()
            t0 = time.perf_counter()
            with prof, counter as moved:
                if full is not None:
                    loss = full.step(micro).sum()
                    full.optimizer_step(opt)
                else:
                    loss = torch.zeros((), device=device)
                    for i, (x, y) in enumerate(micro):
                        with loss_context():
                            mb_loss = forward_loss(net, x, y, first=i == 0)
                            mb_loss.backward()
                        loss = loss + (mb_loss.full_tensor() if hasattr(mb_loss, "full_tensor") else mb_loss).detach()
                    opt.step()
                _engines_fp8.after_optimizer_step(column, net)
                opt.zero_grad(set_to_none=True)
            host_ms.append((time.perf_counter() - t0) * 1e3)
            if counting:
                comm_bytes = dict(moved)
            if profiling:
                profile = _host_profile_summary(prof)
            if cuda:
                end.record()
                events.append((start, end))
            losses.append(loss.detach().float())
        if cuda:
            torch.cuda.synchronize(device)
        step_ms = [s.elapsed_time(e) for s, e in events] if cuda else list(host_ms)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    finally:
        if partial is not None:
            partial.delete()
        if full is not None:
            full.delete()
    timed = slice(args.warmup, None)
    tokens = mbs * n_micro * counts["seq_len"] / tp  # the TP ranks of a data-parallel rank share its micro-batch
    row: Dict[str, Any] = {
        "step_ms": statistics.median(step_ms[timed]), "step_ms_all": step_ms,
        "host_ms": statistics.median(host_ms[timed]), "host_ms_all": host_ms,
        "peak_memory_gib": peak / 2**30, "own_peak_gib": (peak - start_bytes) / 2**30,
        "losses": [float(v) for v in torch.stack(losses).cpu()], "tokens_per_gpu_per_step": tokens,
        "build_s": build_s, "precision": sharded.precision + (f"; FP8 {fp8!r}" if fp8 is not None else ""),
        "counts": counts, "micro_batches": n_micro,
        # which GEMMs run in FP8: TE's recipe, or torchao's float8 (the FP8 floor of _engines_report.assemble)
        "fp8": fp8.name if fp8 is not None else ("torchao-float8" if column == "fsdp2_float8_eager" else None),
        "fp8_attention": bool(fp8 is not None and fp8.dot_product_attention),
    }
    row["comm_bytes"] = reduce_max(comm_bytes, device)  # [Note: counting a step's bytes]; the largest rank's
    if capture_s is not None:
        row["capture_s"] = capture_s
    if profile is not None:
        row["host_profile"] = profile
    if full is not None:
        train = full.reports.get("train")
        if train is not None:
            row["capture_s"] = train.capture_seconds
    # the slowest rank's step and host time, the largest peak
    keys = ["step_ms", "host_ms", "peak_memory_gib", "own_peak_gib"]
    t = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    row.update(zip(keys, t.tolist()))
    row["tokens_per_s_per_gpu"] = tokens / (row["step_ms"] * 1e-3)
    del net, opt, sharded, partial, full
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def measure_rates(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """The device's bf16 matmul rate and copy bandwidth (GPU), and the collective rates of a layer-sized
    all-gather / reduce-scatter (2+ ranks): the floor's denominators, measured in this run."""
    out: Dict[str, Any] = {}
    if device.type == "cuda":
        out["matmul_tflops"] = _flops.matmul_peak_tflops(device)
        out["copy_gbps"] = _flops.copy_bandwidth_gbps(device)
        if args.config == "llama8b_fp8" and torch.cuda.get_device_capability(device) >= (8, 9):
            out["fp8_matmul_tflops"] = _flops.fp8_matmul_peak_tflops(device)  # the FP8 columns' floor
    out.update(_flops.collective_rates_gbps(device, layer_numel(args), all_to_all_numel=all_to_all_numel(args)))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def all_to_all_numel(args: argparse.Namespace) -> Optional[int]:
    """MoE configs: the elements one rank's tokens send to their experts in one MoE layer (``seq x top-k x
    hidden`` per sequence), the size of the timed all-to-all; None for dense models."""
    if args.config != "qwen3moe":
        return None
    cfg = _qwen3_moe_config(args, fuse_wgrad=False, ep=1)
    return args.micro_batch * cfg.seq_len * cfg.moe_top_k * cfg.hidden_size


def layer_numel(args: argparse.Namespace) -> int:
    """Parameters of one layer from the config's arithmetic (the size of the timed collectives)."""
    if args.config in ("llama8b", "llama8b_fp8"):
        return _llama_config(args, fuse_wgrad=False).layer_params()
    if args.config == "llama70b":
        return _engines_tp.layer_numel(args, dist.get_world_size())
    if args.config == "mcore70b":
        return _engines_mcore.layer_numel(args, dist.get_world_size())
    if args.config == "qwen3moe":
        cfg = _qwen3_moe_config(args, fuse_wgrad=False, ep=1)
        h, d = cfg.hidden_size, cfg.head_dim
        attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
        return attn + 2 * cfg.num_experts * h * cfg.moe_ffn_hidden_size
    if args.cpu_smoke:
        h, e, f = 32, 4, 32
    else:
        h, e, f = 2048, 64, 1024
    return 4 * h * h + 2 * e * h * f  # attention, and each expert's two matrices (apps/moe.py Experts: w1, w2)


# ---------------------------------------------------------------------------------------------- drivers


def _run_guarded(column: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    try:
        return run_column(column, args, device)
    except Exception as exc:  # noqa: BLE001 - one failing column is recorded, the others still run
        if dist.get_rank() == 0:
            traceback.print_exc()
        row = {"error": f"{type(exc).__name__}: {exc}"[:3000], "traceback": traceback.format_exc()[-4000:]}
    # after the except clause: the exception's frames (the column's model and optimizer) are gone only now
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _line(column: str, row: Dict[str, Any]) -> str:
    if "step_ms" in row:
        return (f"{column:20s} {row['step_ms']:9.2f} ms  {row['tokens_per_s_per_gpu']:9.0f} tok/s/GPU  peak "
                f"{row['peak_memory_gib']:6.2f} GiB  host {row['host_ms']:7.2f} ms  losses "
                + " ".join(f"{v:.4f}" for v in row["losses"][:3]))
    return f"{column:20s} FAILED {row.get('error', '?')[:300]}"


def run_in_process(args: argparse.Namespace, device: torch.device, columns: List[str],
                   skipped: Dict[str, str]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    rates = measure_rates(args, device)
    _say(f"rates: {json.dumps({k: round(v, 2) for k, v in rates.items()})}")
    rows: Dict[str, Dict[str, Any]] = {}
    for c in columns:
        if c in skipped:
            rows[c] = {"skipped": skipped[c]}
            continue
        rows[c] = _run_guarded(c, args, device)
        _say(_line(c, rows[c]))
    return rates, rows


def run_child(args: argparse.Namespace, device: torch.device) -> int:
    """One column in this torchrun child (with ``--child-rates``, the device and collective rates first, before
    the column's peak is reset); rank 0 writes ``{"row", "rates"}`` to ``--child-out``.

    A rank whose column raises writes its error next to it (``--child-out`` + ``.rank<N>``) and exits 1, so that
    torchrun ends the other ranks at once, wherever they wait (a failure on one rank only, e.g. out of memory,
    would otherwise leave the others in a collective until NCCL's timeout).
    """
    rank = dist.get_rank()
    rates = None
    if args.child_rates:
        try:
            rates = measure_rates(args, device)
        except Exception as exc:  # noqa: BLE001 - the column still runs; the floor is then missing
            rates = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    try:
        row = run_column(args.child, args, device)
    except Exception as exc:  # noqa: BLE001 - recorded, then this child ends
        traceback.print_exc()
        row = {"error": f"[rank {rank}] {type(exc).__name__}: {exc}"[:3000],
               "traceback": traceback.format_exc()[-4000:]}
        with open(f"{args.child_out}.rank{rank}", "w") as fh:
            json.dump({"row": row, "rates": rates}, fh)
        return 1
    if rank == 0:
        with open(args.child_out, "w") as fh:
            json.dump({"row": row, "rates": rates}, fh)
        print(_line(args.child, row), flush=True)
        for kind, rows in row.get("host_profile", {}).items():
            if isinstance(rows, list):
                print(f"  host profile, {kind} (name, calls, self ms): "
                      + "; ".join(f"{n} {c} {ms}" for n, c, ms in rows), flush=True)
        gpu = row.get("host_profile", {}).get("gpu")
        if gpu:
            print(f"  gpu profile: span {gpu['span_ms']:.1f} ms, busy {gpu['busy_ms']:.1f}, idle {gpu['idle_ms']:.1f}, "
                  f"exposed collectives {gpu['exposed_collective_ms']:.1f}; by category (ms): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in gpu["category_ms"].items()), flush=True)
            print("  gpu profile, top kernels (ms): " + "; ".join(f"{k[:70]} {v:.2f}" for k, v in gpu["top_kernels_ms"]),
                  flush=True)
    return 0


def run_isolated(args: argparse.Namespace, argv: List[str], world: int, columns: List[str],
                 skipped: Dict[str, str]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """Each column in a fresh ``torchrun --nproc-per-node world`` of this script; the first child that gets
    that far also measures the rates (one child fewer to start)."""
    port = int(os.environ.get("MASTER_PORT", "29561"))
    results: Dict[str, Dict[str, Any]] = {}
    rates: Dict[str, Any] = {}
    # on CPU with one rank there is nothing to measure (no matmul rate, no collective)
    need_rates = not args.cpu_smoke or world > 1
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(columns):
            if c in skipped:
                results[c] = {"skipped": skipped[c]}
                continue
            out, err = os.path.join(tmp, f"{c}.json"), os.path.join(tmp, f"{c}.err")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--master-port", str(port + i), os.path.abspath(__file__), *argv,
                   "--isolate", "none", "--child", c, "--child-out", out] + (["--child-rates"] if need_rates else [])
            with open(err, "w") as fh:
                try:
                    proc = subprocess.run(cmd, stderr=fh, timeout=args.column_timeout,
                                          env={**os.environ, CHILD_ENV: "1", **_engines_fp8.column_env(c)})
                    rc: Any = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = f"timeout after {args.column_timeout} s"
            failed = sorted(f for f in os.listdir(tmp) if f.startswith(f"{c}.json.rank"))
            if os.path.exists(out) or failed:
                with open(out if os.path.exists(out) else os.path.join(tmp, failed[0])) as fh:
                    got = json.load(fh)
                if "error" in got["row"]:
                    print(_line(c, got["row"]), flush=True)
                results[c] = got["row"]
                if got["rates"] is not None:
                    if "error" in got["rates"]:
                        print(f"rates FAILED in child {c}: {got['rates']['error'][:500]}", flush=True)
                    else:
                        rates, need_rates = got["rates"], False
                        print(f"rates: {json.dumps({k: round(v, 2) for k, v in rates.items()})}", flush=True)
            else:
                with open(err) as fh:
                    tail = fh.read()[-3000:]
                results[c] = {"error": f"child exited ({rc}) without a result; stderr tail:\n{tail}"}
                print(_line(c, results[c]), flush=True)
            print(f"[{time.time() - t0:5.0f} s] {c} done", flush=True)
    return rates, results


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(COLUMNS), default="llama8b")
    p.add_argument("--layers", type=int, default=None, help="depth (default: by world size, printed)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's, 4096)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--tensor-parallel", type=int, default=None,
                   help="llama70b, mcore70b: TP ranks per data-parallel rank (default: the world size)")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="llama70b: split the token embedding and the LM head over the vocabulary across the TP group "
                        "(ours: GPTConfig(vocab_parallel=True); FSDP2: RowwiseParallel/ColwiseParallel on tok/head)")
    p.add_argument("--ep-chunks", type=int, default=2,
                   help="qwen3moe, column ours_ep_groups_eager: GPTConfig(moe_ep_chunks=N), each rank's local "
                        "experts in N groups whose all-to-alls overlap the other groups' experts")
    p.add_argument("--columns", nargs="+", default=None, choices=list(COLUMN_SPECS),
                   help="default: every column of the config")
    _engines_fp8.add_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (graphs are captured at --capture-step)")
    p.add_argument("--steps", type=int, default=8, help="timed steps after the warmup")
    p.add_argument("--capture-step", type=int, default=2)
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step's host side (CUDA runtime calls, operators) into each row's host_profile")
    p.add_argument("--layers-impl", choices=["te", "torch"], default="te" if HAS_TE else "torch",
                   help="TE TransformerLayer (default with TE) or the torch layers")
    p.add_argument("--backend", choices=["te", "torch", "protocol"], default=None,
                   help="partial graphs' backend (default: te with TE, torch without; protocol on CPU)")
    p.add_argument("--fuse-wgrad", choices=["on", "off"], default="on",
                   help="TE layers of our columns accumulate weight gradients into the fp32 main gradients")
    p.add_argument("--moe-experts", default="grouped_mm",
                   help="olmoe: expert path of the eager and partial columns (full-iteration always grouped_mm)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per column when columns run as children")
    p.add_argument("--isolate", choices=["process", "none"], default=None,
                   help="process: each column in its own torchrun child (default under python); none: all in this "
                        "process (default under torchrun)")
    p.add_argument("--column-timeout", type=int, default=300, help="seconds per child column")
    p.add_argument("--cpu-smoke", action="store_true", help="Gloo, tiny shapes, torch layers, protocol backend")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels in every column (apps.train.use_deterministic_kernels: SDPA's math "
                        "kernel, torch's deterministic algorithms, CUBLAS_WORKSPACE_CONFIG); each graphed column must "
                        "then train bit for bit like its eager column, or the run fails (slower: not the speed record)")
    p.add_argument("--out", default=None, help="JSON record")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-rates", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: combine the columns of these records (same config, depth, world size; the first "
                        "record's rates) into one table and verdicts")
    args = p.parse_args(argv)
    if args.cpu_smoke:  # (no compile: the smoke checks the path, not the kernels)
        args.layers_impl, args.backend, args.fsdp2_compile = "torch", "protocol", "off"
    if args.vocab_parallel and args.config != "llama70b":
        p.error(f"--vocab-parallel with --config {args.config}: the vocabulary split is the tensor-parallel reference "
                "GPT's (--config llama70b); drop the flag or use --config llama70b")
    if args.config == "llama70b":  # torch layers (TE's TP modules are not run on GPUs yet)
        args.layers_impl = "torch"
    _engines_fp8.check_arguments(p, args)
    if args.backend is None:
        args.backend = "te" if HAS_TE and args.layers_impl == "te" else "torch"
    if not 0 < args.capture_step < args.warmup:
        p.error(f"--capture-step {args.capture_step} --warmup {args.warmup}: need 0 < capture step < warmup, so "
                "that graphs are captured (after an eager step) before the timed steps")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: need at least one timed step")
    under_torchrun = "RANK" in os.environ
    if args.isolate is None:
        args.isolate = "none" if under_torchrun else "process"
    if args.isolate == "process" and under_torchrun:
        p.error("--isolate process starts torchrun children itself; run it under plain python, or pass "
                "--isolate none under torchrun")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.deterministic:  # before CUDA starts, in this process and in every column's child (same argv)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        from fsdp_cudagraph.apps.train import use_deterministic_kernels

        use_deterministic_kernels()
    if args.merge:
        margs, world, rates, rows, skipped, parts = merge(args.merge)
        result = assemble(margs, world, rates, rows, skipped)
        print(result["table"], flush=True)
        if args.out:
            # the measurements' machines and commands, not this (merging) one's
            write_record(args.out, {**record_fields(), "world_size": world, "versions": parts[0]["versions"],
                                    "merged_from": parts, "config": vars(margs), "columns": rows, **result})
        ran = all("step_ms" in r for c, r in rows.items() if c not in skipped)
        return 0 if ran and (margs.cpu_smoke or not result["evaluation"]["failed"]) else 1
    if any(COLUMN_SPECS[c][0] == "megatron_fsdp" for c in args.columns or COLUMNS[args.config]):
        # before any column starts: NVIDIA's standalone megatron-fsdp, first on the path, would fail every one of
        # ours with another engine's error; importing our engine's folder refuses it, naming the path and the fix
        # ([Note: one import name, two packages]: the check runs once, at that import)
        import fsdp_cudagraph.engines.megatron_fsdp  # noqa: F401
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_engines needs a CUDA GPU (it times the engines and measures the device's rates); none is "
              "visible, so nothing was measured (exit 2). --cpu-smoke runs the script's path on CPU.", file=sys.stderr)
        return 2
    cuda = not args.cpu_smoke
    if args.child is not None:
        device = init_process_group(cuda=cuda, default_port=29561)
        return run_child(args, device)
    if args.isolate == "process":
        world = args.nproc_per_node
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    else:
        device = init_process_group(cuda=cuda, default_port=29561)
        world = dist.get_world_size()
    if args.layers is None:
        args.layers = 2 if args.cpu_smoke else default_layers(args.config, world)
        argv += ["--layers", str(args.layers)]
    columns = args.columns or COLUMNS[args.config]
    if args.config in ("llama70b", "mcore70b"):
        tp = _engines_tp.tensor_parallel_size(args, world)
        model = "reference GPT" if args.config == "llama70b" else "megatron-core GPTModel"
        _say(f"{args.config}: {args.layers} of Llama-3-70B's 80 layers ({model}), TP {tp} x DP {world // tp}, "
             f"sequence {16 if args.cpu_smoke else args.seq or 4096}, micro-batch {args.micro_batch}")
    skipped = {c: why for c in columns if (why := not_applicable(c, world, device, args)) is not None}
    _say(f"bench_engines: config {args.config}, {args.layers} layers, {world} rank(s), layers {args.layers_impl}, "
         f"graphs {args.backend}, columns {columns}, isolation {args.isolate}"
         + (" (CPU smoke: times and verdicts mean nothing)" if args.cpu_smoke else ""))
    if args.isolate == "process":
        rates, rows = run_isolated(args, argv, world, columns, skipped)
    else:
        rates, rows = run_in_process(args, device, columns, skipped)
    result = assemble(args, world, rates, rows, skipped)
    record = {**record_fields(), "world_size": world,
              "config": {k: v for k, v in vars(args).items() if not k.startswith("child")},
              "columns": rows, **result}
    _say(result["table"])
    if args.out and (not dist.is_initialized() or dist.get_rank() == 0):
        write_record(args.out, record)
    ran = all("step_ms" in r for c, r in rows.items() if c not in skipped)
    if args.cpu_smoke:
        return 0 if ran else 1
    return 0 if ran and not result["evaluation"]["failed"] else 1


def _main() -> int:
    try:
        return main()
    finally:
        if dist.is_initialized():
            gc.collect()  # engines' objects sit in reference cycles: free them while the group is alive
            dist.destroy_process_group()


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(_main())
