"""megatron-core's own ``GPTModel`` (dense and MoE) under an FSDP engine, eager against partial CUDA graphs.

The model is built as megatron-core users build it: ``parallel_state.initialize_model_parallel`` (PP = 1,
TP = ``--tensor-parallel``, EP = ``--expert-parallel``, default 1) over the existing default process group, a ``TransformerConfig``,
TransformerEngine's layer spec (``get_gpt_layer_with_transformer_engine_spec``) when TE is importable, else
megatron-core's local spec (``get_gpt_layer_local_spec``), and ``GPTModel``. The FSDP unit is
``TransformerLayer``; engines ``megatron_fsdp`` (ours), ``nvidia`` (NVIDIA Megatron-FSDP, the bundled
``fully_shard`` or megatron-core's ``FullyShardedDataParallel``: ``--nvidia-wrapper``) and ``fsdp2`` (PyTorch
FSDP2), as the checker builds them.
Models:

- ``dense``: a GPT with a dense MLP;
- ``moe_alltoall`` / ``moe_allgather``: every layer a dropless MoE (``num_moe_experts``, top-k routing),
  with the ``alltoall`` or ``allgather`` token dispatcher; with TE, ``moe_grouped_gemm`` (``TEGroupedMLP``)
  and ``moe_permute_fusion`` are on, without TE the local ``SequentialMLP`` and the unfused permute run.

What is graphed (scopes, :data:`SCOPES`; see [Note: megatron-core modules as graph scopes]):

- ``layer``: whole ``TransformerLayer`` units (dense only);
- ``attn``: ``self_attention`` (with TE's spec the input layernorm is fused into ``linear_qkv``, so it is in
  the graph; with the local spec ``input_layernorm`` is a module of its own and stays eager);
- ``attn_mlp`` (dense): ``self_attention`` and ``mlp``;
- ``attn_router`` (MoE): ``self_attention`` and ``mlp.router`` (``TopKRouter``): the graph returns the
  routing probabilities and map; dispatch preprocess (permute), the counts' host copy, the experts, the
  combine and the residual add run eagerly between graphs.

Refused (``ValueError`` before any work): ``moe_preprocess`` (megatron-core's dispatch preprocess is a method
of the token dispatcher, not a module), ``moe``/``layer``/``mlp`` on an MoE model (dropless experts copy their
per-expert counts to the host), a router with an auxiliary loss (it records into a Python-side tracker),
and Megatron's own graph machinery switched on (:func:`check_megatron_graphs_off`).

Expert parallelism (``--expert-parallel N``, ``MCoreShape.expert_parallel_size``; MoE models, ``N`` dividing
the world size and the 4 experts): ``initialize_model_parallel(expert_model_parallel_size=N)``, each rank builds
its ``4 / N`` local experts (``local_experts.0 ..`` on every EP rank) and still trains its own micro-batch; the
dispatcher brings every token to its experts' ranks. megatron-core's own groups (:func:`expert_groups`:
``get_expert_model_parallel_group()``, ``get_expert_data_parallel_group()``; contiguous EP ranks, EDP strided,
this project's engine's layout) reach the engine as ``ModelSpec.expert_groups``: ``megatron_fsdp`` passes them
to ``fully_shard(expert_parallel_group=, expert_data_parallel_group=)``, ``nvidia`` builds NVIDIA's expert
device mesh over the EDP group (wrapper ``fully_shard``) or lets megatron-core's ``FullyShardedDataParallel``
read them from ``parallel_state`` (wrapper ``mcore``, checked to be the same). ``fsdp2`` is refused
(``NotImplementedError``: it would shard the ranks' different local experts over all ranks; Megatron-LM refuses
FSDP2 with EP too), and so are EP on the dense model and an ``N`` that divides neither. What is graphed does
not change: ``attn_router``, the exchange and the experts eager between graphs. State dicts of an EP model are
refused by our engine (the EP ranks' local experts share names); training is not affected.

Tensor parallelism (``--tensor-parallel N``, ``MCoreShape.tensor_parallel_size``; the dense model, ``N`` dividing
the world size, the heads, the MLP, the vocabulary and the sequence): ``initialize_model_parallel(
tensor_model_parallel_size=N)`` and ``TransformerConfig(tensor_model_parallel_size=N, sequence_parallel=True)``;
each rank builds its TP slice (megatron-core tags the shards ``tensor_model_parallel``, the vocabulary-parallel
embedding among them, and the norms ``sequence_parallel``); every TP rank of a data-parallel group takes the same
micro-batch (:func:`batch`). megatron-core's groups (:func:`tensor_groups`) reach the engine as
``ModelSpec.tensor_groups``: ``megatron_fsdp`` passes them as ``fully_shard(process_group=dp,
tensor_parallel_group=tp)``, which sums the ``sequence_parallel`` gradients over TP in its gradient fold;
``nvidia`` with ``--nvidia-wrapper mcore`` checks that they are parallel_state's (megatron-core's
``FullyShardedDataParallel`` shards over the DP group of its (DP, TP) mesh) and calls megatron-core's
``finalize_model_grads`` before each optimizer step, which sums those gradients over TP as in Megatron-LM
([Note: NVIDIA Megatron-FSDP under tensor parallelism] in ``engines/nvidia/build.py``; CUDA only, as every nvidia
run). Scopes ``attn_mlp`` and ``layer``, the TP collectives inside the graphs. Refused (``NotImplementedError``):
``fsdp2`` and ``nvidia`` with wrapper ``fully_shard`` (they shard over one group of all ranks); and TP on the MoE
models, TP with EP. On the local spec without apex the norms are :class:`SequenceParallelLayerNorm`.

Run (1 GPU, 2 GPUs, CPU on Gloo with the protocol backend)::

    python -m fsdp_cudagraph.apps.mcore_gpt --engine megatron_fsdp --model moe_alltoall --scope attn_router
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.mcore_gpt --engine nvidia --model dense --scope layer
    python -m fsdp_cudagraph.apps.mcore_gpt --device cpu --model moe_allgather --scope attn_router --json r.json
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.mcore_gpt --model moe_alltoall --expert-parallel 2
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.mcore_gpt --model dense --tensor-parallel 2 --scope attn_mlp
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.mcore_gpt --engine nvidia --nvidia-wrapper mcore \\
        --model dense --tensor-parallel 2 --scope attn_mlp

and through the alignment checker (the factories :func:`dense`, :func:`moe_alltoall`, :func:`moe_allgather`
and :func:`moe_alltoall_ep`, EP = world size, tag ``self_attention`` as ``attn``, a dense ``mlp`` as ``mlp``
and ``mlp.router`` as ``moe_router``)::

    python -m fsdp_cudagraph.check --engine nvidia --model fsdp_cudagraph.apps.mcore_gpt:moe_alltoall \\
        --modules attn moe_router

On the CPU, megatron-core calls a few CUDA-only functions; :func:`cpu_shims` replaces them (see its
docstring): the model's math is megatron-core's own. docs/models.md, "megatron-core models", has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.apps.mcore_cpu import check_device, cpu_shims, shims_for_factory
from fsdp_cudagraph.apps.model import check_parallel_size

__all__ = ["HAS_MCORE", "MCORE_REASON", "MCORE_VERSION", "MCoreShape", "MODELS", "SCOPES", "cpu_shims",
           "init_parallel_state", "expert_groups", "tensor_groups",
           "check_tensor_parallel_world", "check_engine_tensor_parallel", "SequenceParallelLayerNorm", "check_expert_parallel_world", "check_engine_expert_parallel",
           "build", "layout", "tag_modules", "scope_patterns", "check_megatron_graphs_off", "batch", "loss", "spec",
           "dense", "moe_alltoall", "moe_allgather", "moe_alltoall_ep", "run", "main"]

logger = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the machine
    import megatron.core as _mcore
    from megatron.core import parallel_state as _ps

    HAS_MCORE = True
    MCORE_REASON = ""
    MCORE_VERSION: Optional[str] = getattr(_mcore, "__version__", None)
except Exception as exc:  # ImportError, or a megatron-core that fails at import
    HAS_MCORE = False
    MCORE_REASON = (f"megatron-core is not importable ({type(exc).__name__}: {exc}); install it with: "
                    "pip install 'megatron-core==0.19.2'")
    MCORE_VERSION = None


@dataclasses.dataclass
class MCoreShape:
    """Model and batch size. ``num_experts=None``: dense. ``micro_batch_size`` is per rank."""

    vocab_size: int = 128
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 16
    micro_batch_size: int = 2
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 32
    moe_token_dispatcher_type: str = "alltoall"
    #: None: on with TE, off without (both need TE)
    moe_grouped_gemm: Optional[bool] = None
    moe_permute_fusion: Optional[bool] = None
    #: TE's layer spec; None: when TE is importable and the device is CUDA
    use_te: Optional[bool] = None
    #: megatron-core's ``expert_model_parallel_size`` (EP): each rank builds ``num_experts / EP`` local experts
    #: and the dispatcher brings them their tokens (alltoall: an all-to-all over the EP group; allgather: every
    #: rank of the group gathers every token, then a reduce-scatter); 1: every rank holds every expert
    expert_parallel_size: int = 1
    #: megatron-core's ``tensor_model_parallel_size`` (TP, with sequence parallelism; dense model only): each rank
    #: builds its TP slice of every layer and of the vocabulary-parallel embedding and output layer; 1: no TP
    tensor_parallel_size: int = 1
    #: megatron-core's ``num_query_groups`` (grouped-query attention: the key/value heads); None: one per head
    num_query_groups: Optional[int] = None
    #: a SwiGLU MLP (``gated_linear_unit=True``, ``activation_func=silu``; ``ffn_hidden_size`` is the gate's and
    #: the up projection's width each, as Llama counts it); False: megatron-core's default GELU MLP
    swiglu: bool = False
    #: ``TransformerConfig.normalization``: ``LayerNorm`` or ``RMSNorm``
    normalization: str = "LayerNorm"
    #: ``GPTModel(share_embeddings_and_output_weights=)``: the output layer reuses the embedding's weight (False,
    #: megatron-core's default: an output layer of its own)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
            raise ValueError(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r} is not 'alltoall' or "
                             "'allgather' (the flex dispatcher needs DeepEP/HybridEP, not checked here)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size({self.hidden_size}) % num_heads({self.num_heads}) != 0")
        if self.num_query_groups is not None and (self.num_query_groups < 1 or self.num_heads % self.num_query_groups):
            raise ValueError(f"num_query_groups={self.num_query_groups} does not divide num_heads={self.num_heads}: "
                             "each key/value head serves num_heads / num_query_groups query heads; pick a divisor "
                             f"of {self.num_heads} (None: one group per head)")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={self.normalization!r} is not 'LayerNorm' or 'RMSNorm' (the norms this "
                             "app builds on both layer specs)")
        self._check_tensor_parallel()
        self._check_expert_parallel()

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        check_parallel_size("tensor_parallel_size", tp, "tensor parallelism")
        if tp == 1:
            return
        if self.expert_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tp} with expert_parallel_size={self.expert_parallel_size}: "
                             "the engine takes one of the two (its expert and tensor-parallel groups are not built "
                             "for a third dimension); use one of them")
        if self.num_experts is not None:
            raise ValueError(f"tensor_parallel_size={tp} on an MoE model: megatron-core's expert tensor parallelism "
                             "and the MoE layer's sequence-parallel dispatch are not wired into this app or checked; "
                             "use model dense with tensor parallelism, or tensor_parallel_size=1 (expert "
                             "parallelism: --expert-parallel)")
        groups = () if self.num_query_groups is None else (("num_query_groups", self.num_query_groups),)
        for what, n in (("num_heads", self.num_heads), *groups, ("ffn_hidden_size", self.ffn_hidden_size),
                        ("vocab_size", self.vocab_size), ("seq_len", self.seq_len)):
            if n % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {what}={n}: megatron-core splits the "
                                 f"heads, the MLP's hidden units and the vocabulary over the TP ranks, and sequence "
                                 f"parallelism the sequence; pick a TP size dividing {what}")

    def _check_expert_parallel(self) -> None:
        ep = self.expert_parallel_size
        check_parallel_size("expert_parallel_size", ep, "expert parallelism")
        if ep == 1:
            return
        if self.num_experts is None:
            raise ValueError(f"expert_parallel_size={ep} on the dense model: it has no experts to spread over ranks; "
                             "use model moe_alltoall, or expert_parallel_size=1")
        if self.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={self.num_experts}: every rank of "
                             f"an expert-parallel group holds num_experts / expert_parallel_size experts; pick a "
                             f"divisor of {self.num_experts}")


#: model name -> shape overrides (on top of the device's base shape)
MODELS: Dict[str, Dict[str, Any]] = {
    "dense": {},
    "moe_alltoall": {"num_experts": 4, "moe_token_dispatcher_type": "alltoall"},
    "moe_allgather": {"num_experts": 4, "moe_token_dispatcher_type": "allgather"},
}

#: A shape a GPU run is worth doing with (bf16 on an H100; still seconds per run).
GPU_BASE = dict(vocab_size=1024, hidden_size=512, ffn_hidden_size=1536, num_layers=4, num_heads=8, seq_len=256,
                micro_batch_size=2, moe_ffn_hidden_size=512)

# [Note: megatron-core modules as graph scopes]
# Our PartialCudaGraphs graphs modules. In a megatron-core TransformerLayer:
# - attn -> `self_attention` (SelfAttention). With TE's spec `input_layernorm` is IdentityOp and the norm is
#   fused into `linear_qkv` (TELayerNormColumnParallelLinear), so the graph holds norm + attention + proj, as
#   Megatron's own `attn` scope does; with the local spec the norm is a separate module left eager.
# - mlp -> `mlp` when it is an MLP (dense). On an MoE model `mlp` is the MoELayer: refused like `moe`.
# - moe_router -> `mlp.router` (TopKRouter): gating linear, top-k, probabilities and routing map, all of
#   static shape. Without an aux loss it has no side effect (with one, it writes into a Python-side tracker
#   that a replay would not update: refused).
# - moe_preprocess: in megatron-core the dispatch preprocess is `MoELayer.preprocess` ->
#   `token_dispatcher.dispatch_preprocess`, a method of a dispatcher that is not an nn.Module. Megatron graphs it
#   by stopping its whole-layer graph early (MoECudaGraphPartialCaptureSignal); we graph modules, so it has no
#   module to graph and runs eagerly after the router's graph. Refused by name rather than silently dropped.
# - moe (the MoELayer) and whole MoE layers: dropless experts copy `tokens_per_expert` to the host
#   (`.tolist()` in TEGroupedMLP/SequentialMLP, the alltoall dispatcher's D2H sync, allgather's `.cpu()`):
#   uncapturable, as Megatron refuses `moe` for dropless MoE. Refused.
# Megatron's own graph machinery stays off: `TransformerConfig.cuda_graph_impl` must be "none" (then
# `MegatronModule.__call__` finds no `cudagraph_manager` and `_should_call_te_cudagraph` is False, so it falls
# through to nn.Module.__call__, whose `forward` our dispatcher replaces), and the MoE decorators
# (`maybe_skip_or_early_return_by_cudagraph`) only act when cuda_graph_impl == "transformer_engine".
SCOPES: Dict[str, Tuple[str, ...]] = {
    "layer": (),
    "attn": ("decoder.layers.*.self_attention",),
    "attn_mlp": ("decoder.layers.*.self_attention", "decoder.layers.*.mlp"),
    "attn_router": ("decoder.layers.*.self_attention", "decoder.layers.*.mlp.router"),
}
_DENSE_ONLY = ("layer", "attn_mlp")
_MOE_ONLY = ("attn_router",)
_REFUSED = {
    "moe_preprocess": "megatron-core's dispatch preprocess is `token_dispatcher.dispatch_preprocess`, a method of a "
                      "dispatcher that is not an nn.Module, so there is no module to graph; use scope attn_router "
                      "(the preprocess then runs eagerly after the router's graph)",
    "moe": "the dropless experts copy their per-expert token counts to the host (tokens_per_expert.tolist(), the "
           "dispatcher's device-to-host sync), which cannot be captured (Megatron refuses `moe` for dropless MoE "
           "too); use scope attn_router",
}


def _require() -> None:
    if not HAS_MCORE:
        raise ImportError(f"fsdp_cudagraph.apps.mcore_gpt needs megatron-core: {MCORE_REASON}")


def _has_te() -> bool:
    from fsdp_cudagraph.capture.te import HAS_TE

    return HAS_TE


# ---------------------------------------------------------------------------------------------- the model


def check_expert_parallel_world(expert_parallel_size: int, world_size: int) -> None:
    """Refuse (ValueError) an expert-parallel size that does not divide the number of ranks."""
    if world_size % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} does not divide the world size {world_size}: "
                         "megatron-core splits the data-parallel ranks into expert-parallel groups of that size; "
                         f"pick a divisor of {world_size} (e.g. --expert-parallel {world_size})")


def check_tensor_parallel_world(tensor_parallel_size: int, world_size: int) -> None:
    """Refuse (ValueError) a tensor-parallel size that does not divide the number of ranks."""
    if world_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world_size}: "
                         "megatron-core splits the ranks into tensor-parallel groups of that size; pick a divisor of "
                         f"{world_size} (e.g. --tensor-parallel {world_size})")


def init_parallel_state(seed: int, device: torch.device, expert_parallel_size: int = 1,
                        tensor_parallel_size: int = 1) -> None:
    """megatron-core's parallel state over the default process group (PP = 1, ``tensor_model_parallel_size=
    tensor_parallel_size``, data parallel over the rest, ``expert_model_parallel_size=expert_parallel_size``),
    once per EP and TP size (another size rebuilds it:
    ``destroy_model_parallel`` then ``initialize_model_parallel``); and, on CUDA, its model-parallel RNG states
    from ``seed`` (what TE's layers fork; the experts of each EP rank draw from their own state).

    megatron-core's rank order (``tp-cp-ep-dp-pp``) makes the expert-parallel groups contiguous ranks and the
    expert-data-parallel groups strided by EP, the layout of ``megatron_fsdp``'s expert parallelism
    ([Note: expert parallelism] in ``megatron_fsdp/_expert.py``): :func:`expert_groups` hands both to the
    engine, which checks that they tile the ranks. ``tensor_parallel_size`` > 1: megatron-core's TP groups are
    contiguous ranks and its data-parallel groups strided by TP, the layout of ``megatron_fsdp``'s tensor
    parallelism ([Note: tensor parallelism] in ``megatron_fsdp/_tensor.py``); :func:`tensor_groups` hands both
    to the engine."""
    _require()
    if not dist.is_initialized():
        raise RuntimeError("init_parallel_state needs torch.distributed initialised first (init_process_group or "
                           "torchrun); megatron-core builds its groups over the default group")
    check_expert_parallel_world(expert_parallel_size, dist.get_world_size())
    check_tensor_parallel_world(tensor_parallel_size, dist.get_world_size())
    if _ps.model_parallel_is_initialized() and (
            _ps.get_expert_model_parallel_world_size() != expert_parallel_size
            or _ps.get_tensor_model_parallel_world_size() != tensor_parallel_size):
        _ps.destroy_model_parallel()  # drops megatron-core's references to its groups; new ones are built below
    if not _ps.model_parallel_is_initialized():
        _ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size, pipeline_model_parallel_size=1,
                                      expert_model_parallel_size=expert_parallel_size)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # Graph-safe RNG states (what Megatron's own CUDA graphs use): TE's and megatron-core's attention enter
        # the tracker's fork on every call, and setting a plain CUDA RNG state inside a capture is refused by
        # torch ("set_current_seed can be called during stream capture only if ..."); the graph-safe states are
        # switched without that. Dropout is 0: no random number is drawn either way. With TE importable the
        # tracker is TE's (megatron-core's `te_rng_tracker`, Megatron-LM's --te-rng-tracker): TE's attention
        # asserts during a capture that the tracker is its own ("Unsupported RNG states tracker."), and TE's
        # graph maker registers that tracker's states with each graph.
        params = inspect.signature(model_parallel_cuda_manual_seed).parameters
        reset = {"force_reset_rng": True} if "force_reset_rng" in params else {}
        model_parallel_cuda_manual_seed(seed, te_rng_tracker=_has_te(), use_cudagraphable_rng=True, **reset)


def expert_groups() -> Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]]:
    """megatron-core's ``(expert-parallel group, expert-data-parallel group)`` of this rank (the groups its MoE
    layers exchange tokens over and its own FSDP shards experts over), or None at EP = 1. The EDP group is
    ``parallel_state.get_expert_data_parallel_group()`` in 0.16.1 and 0.19.2 alike (0.19's default
    ``with_gtp_remat=True`` is the same group unless expert GTP rematerialisation is on; the older
    ``get_data_modulo_expert_parallel_group`` is a deprecated alias)."""
    if _ps.get_expert_model_parallel_world_size() == 1:
        return None
    return _ps.get_expert_model_parallel_group(), _ps.get_expert_data_parallel_group()


def tensor_groups() -> Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]]:
    """megatron-core's ``(tensor-parallel group, data-parallel group)`` of this rank (the groups its TP layers
    gather and reduce-scatter over, and the ranks that hold the same TP slice), or None at TP = 1. Our engine
    takes them as ``fully_shard(tensor_parallel_group=, process_group=)``."""
    if _ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return _ps.get_tensor_model_parallel_group(), _ps.get_data_parallel_group()


class SequenceParallelLayerNorm:
    """[Note: megatron-core's local norm under sequence parallelism]
    megatron-core's local spec builds its norms as ``LNImpl``: apex's ``FusedLayerNorm`` when apex imports, else
    ``WrappedTorchNorm`` (a ``torch.nn.LayerNorm``), which asserts ``not config.sequence_parallel``. Under
    sequence parallelism a norm needs nothing from the TP group in its forward (it normalises each position on
    its own, and each TP rank holds its positions): ``FusedLayerNorm`` only tags its weight and bias
    ``sequence_parallel = True`` so that their gradients, partial per TP rank, are summed over TP after
    backward (megatron-core's ``finalize_model_grads``; our engine does it in its gradient fold). This class is
    that: a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (what ``WrappedTorchNorm`` builds for
    ``config.normalization``) with the tags, used by :func:`build` for
    the layers' and the final norm when TP > 1, the local spec is chosen and apex is missing (the CPU)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> nn.Module:
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={config.normalization!r} with sequence parallelism on the local spec "
                             "without apex: only LayerNorm and RMSNorm are provided here; use one of them or TE")
        norm = (nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _sequence_parallel_local_spec(layer_spec: Any, num_layers: int) -> Any:
    """The local layer spec with :class:`SequenceParallelLayerNorm` in place of ``WrappedTorchNorm`` (its layers'
    norms and the block's final norm), as a ``TransformerBlockSubmodules``; unchanged when apex provides
    ``FusedLayerNorm`` (it handles sequence parallelism itself)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    subs = layer_spec.submodules
    if subs.input_layernorm is not WrappedTorchNorm and subs.pre_mlp_layernorm is not WrappedTorchNorm:
        return layer_spec
    norms = {f: SequenceParallelLayerNorm for f in ("input_layernorm", "pre_mlp_layernorm")
             if getattr(subs, f) is WrappedTorchNorm}
    layer_spec = dataclasses.replace(layer_spec, submodules=dataclasses.replace(subs, **norms))
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelLayerNorm)


def _fix_router_without_te() -> None:
    # megatron-core 0.16.1 binds moe_utils.te_general_gemm only when TE imports, and the router reads the name
    # unconditionally (NameError without TE; 0.19 sets it to None itself). None is what 0.19 uses for "no TE".
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build(shape: MCoreShape, device: torch.device, *, dtype: torch.dtype = torch.float32,
          use_te: Optional[bool] = None) -> nn.Module:
    """megatron-core's ``GPTModel`` with ``shape`` on ``device``, random weights from torch's RNG state.

    ``use_te``: TE's layer spec (default: when TE is importable and ``device`` is CUDA); else the local spec.
    ``dtype``: ``params_dtype`` (``bf16=True`` when bfloat16). Call :func:`init_parallel_state` first, with
    ``shape.expert_parallel_size`` (then this rank builds its ``num_experts / EP`` local experts, numbered from 0
    on every EP rank: EP rank ``q`` holds global experts ``q * E/EP ..``).
    """
    _require()
    check_device(device)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    te = (_has_te() and device.type == "cuda") if use_te is None else use_te
    if te and not _has_te():
        from fsdp_cudagraph.capture.te import TE_REASON

        raise ImportError(f"use_te=True needs TransformerEngine: {TE_REASON}")
    moe = shape.num_experts is not None
    held = _ps.get_expert_model_parallel_world_size() if _ps.model_parallel_is_initialized() else None
    held_tp = _ps.get_tensor_model_parallel_world_size() if _ps.model_parallel_is_initialized() else None
    if held != shape.expert_parallel_size or held_tp != shape.tensor_parallel_size:
        raise ValueError(f"expert_parallel_size={shape.expert_parallel_size}, tensor_parallel_size="
                         f"{shape.tensor_parallel_size} but megatron-core's parallel state has expert_model_parallel_"
                         f"size={held}, tensor_model_parallel_size={held_tp} (None: not initialised); call "
                         "init_parallel_state(seed, device, shape.expert_parallel_size, shape.tensor_parallel_size) "
                         "first")
    grouped = te if shape.moe_grouped_gemm is None else shape.moe_grouped_gemm
    fusion = te if shape.moe_permute_fusion is None else shape.moe_permute_fusion
    if moe and (grouped or fusion) and not te:
        raise ValueError(f"moe_grouped_gemm={grouped}, moe_permute_fusion={fusion} without TE's spec: both need "
                         "TransformerEngine here (the local grouped GEMM needs the grouped_gemm package); set them "
                         "False or install TE")
    kwargs: Dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
        # Megatron's own graphs stay off (check_megatron_graphs_off); NVIDIA Megatron-FSDP under partial graphs
        # needs gradients returned, not fused into main_grad (docs/engines.md).
        cuda_graph_impl="none", gradient_accumulation_fusion=False,
    )
    if shape.num_query_groups is not None:
        kwargs.update(num_query_groups=shape.num_query_groups)
    if shape.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    kwargs.update(normalization=shape.normalization)
    tp = shape.tensor_parallel_size
    if tp > 1:  # every TP rank builds its slice; activations between TP regions are split along the sequence
        kwargs.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if moe:
        kwargs.update(num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk,
                      moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                      moe_token_dispatcher_type=shape.moe_token_dispatcher_type, moe_grouped_gemm=grouped,
                      moe_permute_fusion=fusion, moe_aux_loss_coeff=0.0,
                      expert_model_parallel_size=shape.expert_parallel_size)
        _fix_router_without_te()
    config = TransformerConfig(**kwargs)
    spec_fn = get_gpt_layer_with_transformer_engine_spec if te else get_gpt_layer_local_spec
    # TE's spec reads the norm from the config; the local one picks its norm class by this argument
    layer_spec = spec_fn(num_experts=shape.num_experts, moe_grouped_gemm=grouped,
                         **({} if te else {"normalization": shape.normalization}))
    if tp > 1 and not te:  # [Note: megatron-core's local norm under sequence parallelism]
        layer_spec = _sequence_parallel_local_spec(layer_spec, shape.num_layers)
    model = GPTModel(config, layer_spec, vocab_size=shape.vocab_size, max_sequence_length=shape.seq_len,
                     position_embedding_type="rope",
                     share_embeddings_and_output_weights=shape.tie_embeddings)
    model = model.to(device)
    tag_modules(model)
    return model


_EXPERTS_UNSAFE = ("megatron-core's dropless experts copy tokens_per_expert to the host (.tolist() for their "
                   "GEMMs, and the dispatcher synchronises on that copy), which cannot be captured; graph attn and "
                   "moe_router and leave the MoE layer's dispatch and experts eager")


def tag_modules(model: nn.Module) -> List[str]:
    """Tag ``self_attention`` ``attn``, a dense ``mlp`` ``mlp`` and an MoE ``mlp.router`` ``moe_router`` on the
    instances (``cuda_graph_module``), so ``cuda_graph_modules`` selects them; returns the tagged names. An MoE
    layer's ``mlp.experts`` gets ``cuda_graph_unsafe`` (the reason), so every graph kind refuses a callable that
    contains them (a whole MoE layer, the MoE layer) when it selects its callables."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    tagged = []
    for name, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer):
            continue
        attn, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
        if isinstance(attn, nn.Module) and type(attn).__name__ != "IdentityOp":
            attn.cuda_graph_module = "attn"
            tagged.append(f"{name}.self_attention")
        router = getattr(mlp, "router", None)
        if isinstance(router, nn.Module):
            router.cuda_graph_module = "moe_router"
            tagged.append(f"{name}.mlp.router")
        experts = getattr(mlp, "experts", None)
        if isinstance(experts, nn.Module):  # [Note: graph-unsafe modules] in config.py: refused inside any graph
            experts.cuda_graph_unsafe = _EXPERTS_UNSAFE
        elif isinstance(mlp, nn.Module) and type(mlp).__name__ == "MLP":
            mlp.cuda_graph_module = "mlp"
            tagged.append(f"{name}.mlp")
    return tagged


def scope_patterns(scope: str, *, moe: bool) -> Tuple[str, ...]:
    """The ``cuda_graph_module_patterns`` of ``scope`` (``()``: whole FSDP units); ValueError for a scope that
    cannot be graphed on this model, naming why and what to use instead."""
    if scope in _REFUSED and (moe or scope == "moe_preprocess"):
        raise ValueError(f"scope={scope!r} is refused: {_REFUSED[scope]}")
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {sorted(SCOPES)}")
    if moe and scope in _DENSE_ONLY:
        raise ValueError(f"scope={scope!r} on an MoE model would graph the experts: {_REFUSED['moe']}")
    if not moe and scope in _MOE_ONLY:
        raise ValueError(f"scope={scope!r} graphs an MoE router; the dense model has none: use attn, attn_mlp or "
                         "layer")
    return SCOPES[scope]


def check_megatron_graphs_off(model: nn.Module) -> None:
    """Refuse (ValueError) a megatron-core model whose own CUDA-graph machinery is on: ``cuda_graph_impl`` other
    than "none", a ``cudagraph_manager`` on a module (the "local" implementation), or filled ``cuda_graphs``
    (Megatron's TE implementation): ``MegatronModule.__call__`` would route calls to Megatron's graphs instead
    of through ``nn.Module.__call__``, where our graphs and the FSDP engine's hooks live."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "cuda_graph_impl", "none")
        if impl not in ("none", None):
            raise ValueError(f"{name or type(model).__name__}: TransformerConfig.cuda_graph_impl={impl!r}; Megatron's "
                             "own graphs would replace ours. Build the model with cuda_graph_impl='none' (and "
                             "enable_cuda_graph=False) and graph it with fsdp_cudagraph's PartialCudaGraphs")
        if hasattr(module, "cudagraph_manager") or getattr(module, "cuda_graphs", None):
            raise ValueError(f"{name}: has Megatron's own CUDA graphs (cudagraph_manager or cuda_graphs); build "
                             "the model with cuda_graph_impl='none'")


def batch(step: int, shape: MCoreShape, device: torch.device, *, seed: int = 1234) -> Dict[str, torch.Tensor]:
    """This rank's batch of ``step``: token ids, position ids, the attention mask and the labels (next tokens),
    deterministic and different on each rank. The mask is None on CUDA (megatron-core's layers apply their
    causal mask themselves, as Megatron-LM trains with ``--no-create-attention-mask-in-dataloader``); on the CPU
    the explicit causal mask (True = masked), because the local attention's default mask is made on "cuda".

    With tensor parallelism (``shape.tensor_parallel_size`` > 1) the batch is the data-parallel rank's, as
    megatron-core feeds it: every TP rank of a data-parallel group takes the same micro-batch (``[b, s]`` token
    ids; the embedding scatters its ``[s, b, h]`` output along the sequence), different DP ranks different ones."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if shape.tensor_parallel_size > 1:
        rank, world = _ps.get_data_parallel_rank(), _ps.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch_size * world, shape.seq_len + 1), generator=g)
    mine = tokens[rank * shape.micro_batch_size:(rank + 1) * shape.micro_batch_size].to(device)
    s = shape.seq_len
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(shape.micro_batch_size, s)
    return {"input_ids": mine[:, :-1].contiguous(), "position_ids": positions,
            "attention_mask": mask if device.type == "cpu" else None,
            "labels": mine[:, 1:].contiguous()}


def loss(model: nn.Module, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean of megatron-core's per-token cross entropy (``GPTModel(..., labels=...)``)."""
    return model(inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"],
                 labels=inputs["labels"]).float().mean()


def layout(model: nn.Module) -> Dict[str, Any]:
    """What a built ``GPTModel`` runs, read from its first layer, for the records: the layer spec (``te`` when
    the attention's linear layers are megatron-core's TE wrappers, else ``local``), the classes of the model,
    the layer, the QKV projection, the core attention and the MLP, and for MoE the experts (``TEGroupedMLP``
    with ``moe_grouped_gemm``, else ``SequentialMLP``), the token dispatcher and the grouped-GEMM and
    fused-permute switches as the config holds them."""
    layer = model.decoder.layers[0]
    attn, mlp, config = layer.self_attention, layer.mlp, model.config
    out: Dict[str, Any] = {
        "spec": "te" if type(attn.linear_qkv).__module__.endswith("extensions.transformer_engine") else "local",
        "model": type(model).__name__, "layer": type(layer).__name__, "linear_qkv": type(attn.linear_qkv).__name__,
        "core_attention": type(attn.core_attention).__name__, "mlp": type(mlp).__name__}
    if getattr(config, "num_moe_experts", None):
        out.update(experts=type(mlp.experts).__name__, dispatcher=type(mlp.token_dispatcher).__name__,
                   moe_grouped_gemm=config.moe_grouped_gemm, moe_permute_fusion=config.moe_permute_fusion,
                   expert_parallel_size=config.expert_model_parallel_size,
                   num_local_experts=mlp.num_local_experts)
    return out


def base_shape(device: torch.device, name: str, **overrides: Any) -> MCoreShape:
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not one of {sorted(MODELS)}")
    base = dict(GPU_BASE) if device.type == "cuda" else {}
    base.update(MODELS[name])
    base.update(overrides)
    return MCoreShape(**base)


def spec(name: str, device: torch.device, shape: Optional[MCoreShape] = None, *, seed: int = 1234) -> Any:
    """A :class:`fsdp_cudagraph.check.ModelSpec` for model ``name`` (the checker's factory protocol). On CUDA
    the model is bf16 (``bf16=True``, as Megatron trains it); on the CPU fp32."""
    from fsdp_cudagraph.check import ModelSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _require()
    shims_for_factory(device)
    shape = shape or base_shape(device, name)
    init_parallel_state(seed, device, shape.expert_parallel_size, shape.tensor_parallel_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(shape, device, dtype=dtype, use_te=shape.use_te)
    check_megatron_graphs_off(model)
    return ModelSpec(model=model, unit_modules=[TransformerLayer],
                     batch=lambda step: batch(step, shape, device, seed=seed), loss=loss, expert_groups=expert_groups(),
                     tensor_groups=tensor_groups())


def dense(device: torch.device) -> Any:
    """Checker factory: megatron-core GPTModel, dense MLP (units: ``TransformerLayer``)."""
    return spec("dense", device)


def moe_alltoall(device: torch.device) -> Any:
    """Checker factory: megatron-core GPTModel, dropless MoE, alltoall dispatcher (units: ``TransformerLayer``)."""
    return spec("moe_alltoall", device)


def moe_allgather(device: torch.device) -> Any:
    """Checker factory: megatron-core GPTModel, dropless MoE, allgather dispatcher (units: ``TransformerLayer``)."""
    return spec("moe_allgather", device)


def moe_alltoall_ep(device: torch.device) -> Any:
    """Checker factory: :func:`moe_alltoall` with expert parallelism over every rank (EP = world size, which must
    divide its 4 experts): each rank holds ``4 / EP`` local experts, sharded over its expert-data-parallel group
    (engines megatron_fsdp and nvidia; fsdp2 is refused)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return spec("moe_alltoall", device, base_shape(device, "moe_alltoall", expert_parallel_size=world))


# ---------------------------------------------------------------------------------------------- the app


def check_engine_expert_parallel(engine: str, expert_parallel_size: int) -> None:
    """Refuse (NotImplementedError) an engine that cannot shard megatron-core's local experts: ``fsdp2`` at
    EP > 1 (the checker's FSDP2 builder shards every parameter over all ranks; Megatron-LM refuses
    ``--use-torch-fsdp2`` with expert parallelism too)."""
    if engine == "fsdp2" and expert_parallel_size > 1:
        raise NotImplementedError(
            f"engine='fsdp2' with expert_parallel_size={expert_parallel_size}: FSDP2 here shards every parameter over "
            "one mesh of all ranks, while each rank holds only its own local experts, which must be sharded over "
            "the expert-data-parallel group alone (Megatron-LM refuses --use-torch-fsdp2 with expert parallelism "
            "too); use --engine megatron_fsdp or nvidia, or --expert-parallel 1")


def check_engine_tensor_parallel(engine: str, tensor_parallel_size: int, nvidia_wrapper: Optional[str] = None
                                 ) -> None:
    """Refuse (NotImplementedError) an engine that cannot take megatron-core's TP and DP groups at TP > 1:
    ``fsdp2``, and ``nvidia`` with wrapper ``fully_shard`` (the default): their builders shard over one group of
    all ranks, which would treat the TP ranks' different slices as one data-parallel model. ``megatron_fsdp`` and
    ``nvidia`` with wrapper ``mcore`` (megatron-core's ``FullyShardedDataParallel``) run."""
    if tensor_parallel_size == 1 or engine == "megatron_fsdp" or (engine == "nvidia" and nvidia_wrapper == "mcore"):
        return
    what = f"engine={engine!r}" + (f" with nvidia_wrapper={nvidia_wrapper or 'fully_shard'!r}"
                                   if engine == "nvidia" else "")
    raise NotImplementedError(
        f"{what} and tensor_parallel_size={tensor_parallel_size}: this app hands megatron-core's tensor-parallel and "
        "data-parallel groups to megatron_fsdp (fully_shard(process_group=dp, tensor_parallel_group=tp)) and to "
        "megatron-core's FullyShardedDataParallel (nvidia wrapper mcore, which reads them from parallel_state); "
        "its builder would shard the TP ranks' different slices over all ranks as if they were one model; use "
        "--engine megatron_fsdp, or --engine nvidia --nvidia-wrapper mcore, or --tensor-parallel 1")


def run(*, model: str, engine: str, scope: str, device: torch.device, steps: int = 6, capture_step: int = 2,
        backend: Optional[str] = None, perturb: Optional[str] = None, shape: Optional[MCoreShape] = None,
        sharding_strategy: str = "optim_grads_params", nvidia_wrapper: Optional[str] = None) -> Any:
    """Train ``model`` under ``engine`` eagerly and with partial graphs of ``scope``; the checker's
    :class:`~fsdp_cudagraph.check.AlignmentReport` (``equal``: every loss and final parameter ``torch.equal``
    on every rank). Needs an initialised process group and, on the CPU, :func:`cpu_shims` entered.
    ``shape.expert_parallel_size`` > 1: megatron-core's expert parallelism (its groups go to the engine through
    the factory's ``ModelSpec.expert_groups``); engines megatron_fsdp and nvidia, fsdp2 refused.
    ``shape.tensor_parallel_size`` > 1: engines megatron_fsdp and nvidia with ``nvidia_wrapper='mcore'``
    (:func:`check_engine_tensor_parallel`). ``nvidia_wrapper`` (engine nvidia): ``fully_shard`` (default) or ``mcore`` (megatron-core's
    ``FullyShardedDataParallel``; see ``engines/nvidia/build.py``)."""
    from fsdp_cudagraph.check import check_alignment

    shape = shape or base_shape(device, model)
    patterns = scope_patterns(scope, moe=shape.num_experts is not None)
    check_engine_expert_parallel(engine, shape.expert_parallel_size)
    check_expert_parallel_world(shape.expert_parallel_size, dist.get_world_size())
    check_engine_tensor_parallel(engine, shape.tensor_parallel_size, nvidia_wrapper)
    check_tensor_parallel_world(shape.tensor_parallel_size, dist.get_world_size())
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    return check_alignment(lambda dev: spec(model, dev, shape), steps=steps, capture_step=capture_step,
                           backend=backend, cuda_graph_module_patterns=list(patterns),
                           sharding_strategy=sharding_strategy, compute_dtype=compute, device=device,
                           perturb=perturb, engine=engine,
                           engine_options={"wrapper": nvidia_wrapper} if nvidia_wrapper else None)


def _versions() -> Dict[str, Any]:
    from fsdp_cudagraph.capture import te as _te

    return {"torch": torch.__version__, "megatron_core": MCORE_VERSION,
            "transformer_engine": getattr(_te, "TE_VERSION", None) if _te.HAS_TE else None,
            "python": sys.version.split()[0]}


def main(argv: Optional[List[str]] = None) -> int:
    from fsdp_cudagraph.checker.check import _init_process_group, plain_text

    p = argparse.ArgumentParser(prog="python -m fsdp_cudagraph.apps.mcore_gpt", description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="dense")
    p.add_argument("--engine", choices=["megatron_fsdp", "nvidia", "fsdp2"], default="megatron_fsdp",
                   help="megatron_fsdp (ours), nvidia (NVIDIA Megatron-FSDP; CUDA only), fsdp2 (PyTorch FSDP2 with "
                        "keep_unsharded_storage, the checker's fsdp2 engine)")
    p.add_argument("--scope", default=None, help=f"one of {sorted(SCOPES)} (default: layer for dense, "
                                                 "attn_router for MoE)")
    p.add_argument("--nvidia-wrapper", choices=["fully_shard", "mcore"], default=None,
                   help="engine nvidia: the bundled fully_shard (default) or megatron-core's FullyShardedDataParallel")
    p.add_argument("--spec", choices=["te", "local"], default=None,
                   help="layer spec (default: te when TE is importable on CUDA, else local)")
    p.add_argument("--moe-grouped-gemm", choices=["on", "off"], default=None, help="default: on with TE's spec")
    p.add_argument("--moe-permute-fusion", choices=["on", "off"], default=None, help="default: on with TE's spec")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="megatron-core's expert_model_parallel_size (MoE models; N divides the world size and the 4 "
                        "experts; engines megatron_fsdp and nvidia)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="megatron-core's tensor_model_parallel_size with sequence parallelism (dense model; N divides "
                        "the world size, the heads, the MLP and the vocabulary; engine megatron_fsdp, or nvidia "
                        "with --nvidia-wrapper mcore)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--capture-step", type=int, default=2)
    p.add_argument("--backend", choices=["te", "torch", "protocol"], default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--perturb", default=None, help="negative control: scale this callable's graphed output by 1.01")
    p.add_argument("--json", default=None, help="write the report, versions and command here (rank 0)")
    args = p.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.basicConfig(level=logging.WARNING)
    _require()
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = _init_process_group(kind)
    scope = args.scope or ("layer" if args.model == "dense" else "attn_router")
    onoff = {"on": True, "off": False, None: None}
    shape = base_shape(device, args.model, use_te={"te": True, "local": False, None: None}[args.spec],
                       moe_grouped_gemm=onoff[args.moe_grouped_gemm], moe_permute_fusion=onoff[args.moe_permute_fusion],
                       expert_parallel_size=args.expert_parallel, tensor_parallel_size=args.tensor_parallel)
    with (cpu_shims() if device.type == "cpu" else contextlib.nullcontext()):
        report = run(model=args.model, engine=args.engine, scope=scope, device=device, steps=args.steps,
                     capture_step=args.capture_step, backend=args.backend, perturb=args.perturb,
                     nvidia_wrapper=args.nvidia_wrapper, shape=shape)
    if dist.get_rank() == 0:
        print(report.format())
        record = {"app": "mcore_gpt", "model": args.model, "engine": args.engine, "scope": scope,
                  "nvidia_wrapper": args.nvidia_wrapper, "shape": dataclasses.asdict(shape),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "world_size": dist.get_world_size(), "versions": _versions(), "command": sys.argv,
                  "report": report.to_dict()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1, default=str)
        print(json.dumps({"equal": report.equal, "params_equal": report.params_equal, "culprit": report.culprit,
                          "model": args.model, "engine": args.engine, "wrapper": args.nvidia_wrapper,
                          "scope": scope, "expert_parallel": args.expert_parallel,
                          "tensor_parallel": args.tensor_parallel}))
    ok = report.culprit == args.perturb if args.perturb else report.equal
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(main())
