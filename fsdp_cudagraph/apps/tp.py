"""Tensor parallelism (TP) with sequence parallelism for the reference GPT: the collectives, the slices, the tags.

[Note: tensor parallelism of the reference GPT]
With ``GPTConfig(tensor_parallel_size=TP, sequence_parallel=True)`` and ``GPT(cfg, tensor_parallel_group=g)``
(``g``: this rank's TP group, e.g. ``megatron_fsdp.tensor_parallel_groups(TP)[0]``) every rank of a TP group holds
one slice of each layer, as megatron-core's ``ColumnParallelLinear``/``RowParallelLinear`` with
``sequence_parallel=True`` split it:

- attention: ``qkv`` column-parallel by heads (its output is ``[q heads | k heads | v heads]``; TP rank ``r``
  holds query heads ``r*H/TP .. (r+1)*H/TP - 1`` and key/value heads ``r*KV/TP .. (r+1)*KV/TP - 1``, each a block
  of rows of its section, so grouped-query attention keeps every query head with its key/value head), ``proj``
  row-parallel (the input columns of this rank's query heads); the MLP:
  ``fc1`` column-parallel (rows), ``fc2`` row-parallel (columns). Each rank runs attention on its heads only.
- between the layers the activations are split along the sequence (sequence parallelism): every rank holds
  ``s/TP`` positions of ``[s, b, h]`` (sequence first, megatron-core's layout; the layers take and return
  ``[s/TP, b, h]``). A layer's norm runs on the local positions; :func:`gather_sequence` (all-gather; backward
  reduce-scatter) gives the column-parallel GEMM the whole sequence, and :func:`reduce_scatter_sequence`
  (reduce-scatter; backward all-gather) sums the row-parallel GEMM's partial outputs and hands each rank its
  positions back. The row-parallel bias is added after the reduce-scatter, once.
- replicated over TP: the norms (``ln``, ``ln_f``) and the row-parallel biases, whose gradients are partial sums
  per TP rank (each rank saw its own positions): tagged ``sequence_parallel = True`` (megatron-core's and TE's
  attribute), and the engine sums them over the TP group before its data-parallel reduction ([Note: tensor
  parallelism] in ``megatron_fsdp/_tensor.py``). The embeddings and the LM head are replicated too, and not
  split over the vocabulary (the simplest honest choice for a reference model): the embedding output is scattered
  to the sequence split (:func:`scatter_sequence`, backward all-gather) and ``ln_f``'s output gathered before the
  head (:func:`gather_sequence_replicated`, backward: this rank's positions of the gradient, which is the same
  on every TP rank), so every TP rank computes the same logits and loss, and their gradients are whole, the same
  on every TP rank: no TP reduction, no tag. The head's GEMM is computed ``TP`` times.
- with ``GPTConfig(vocab_parallel=True)`` the token embedding and the LM head are split over the vocabulary instead
  (megatron-core's ``VocabParallelEmbedding`` and a column-parallel output layer): TP rank ``r`` holds rows
  ``[r*V/TP, (r+1)*V/TP)`` of each. The lookup (:func:`vocab_parallel_embedding`) gives zero rows for ids outside
  them, and :func:`reduce_scatter_sequence` sums the ranks' parts straight into the sequence split (a sum of one
  value and zeros: bit-equal to the whole lookup); the replicated positional embedding, ``[s, 1, h]``, is scattered
  (:func:`scatter_sequence`; its backward all-gathers the batch-summed ``[s/TP, 1, h]`` gradient, so ``pos``'s
  gradient is whole on every rank) and added, so the layers' input equals the replicated path's. The head takes the
  whole sequence from :func:`gather_sequence` (backward reduce-scatter: each rank's ``V/TP`` columns give a partial
  input gradient) and :func:`gather_vocab` all-gathers the ``V/TP`` logits along the vocabulary, so every TP rank
  still computes the same whole logits and loss (``loss_fn`` and the output shape unchanged). Gradient semantics:
  the loss, and so ``dL/dlogits``, is whole and alike on every TP rank; the gather's backward takes this rank's
  vocabulary columns (a sum would scale every gradient by TP), which makes the head slice's weight gradient the
  whole gradient of those rows, and the reduce-scatter's backward all-gathers ``dL/dx`` of every position, which
  makes the embedding slice's gradient whole for its rows (the masked ids get none). Neither needs a sum over TP:
  both are tagged ``tensor_model_parallel`` with ``partition_dim = 0`` (TP shards, no ``sequence_parallel`` tag), as
  the engine expects; ``pos`` stays replicated and untagged (whole gradient on every rank). The head's GEMM then
  runs once over the TP group, and each rank keeps ``1/TP`` of both tables and their optimizer state. The tables are
  plain torch modules also with ``use_te=True`` (only the layers are TE's), so the split does not depend on the
  layers' kind.
- TP-sharded parameters carry ``tensor_model_parallel = True`` and ``partition_dim`` (megatron-core's and TE's
  attributes): the engine keys them per TP rank in checkpoints.

Initial values: each rank's slice equals the TP=1 model's slice for the same seed. The layer draws the TP=1
module's values from the random stream (the same draws in the same order as at TP=1), then builds its local
module without drawing and copies its slice in (the vocabulary-parallel tables likewise, in the GPT);
:func:`slice_tp_state_dict` maps a TP=1 state dict to a TP rank's and :func:`merge_tp_state_dicts` the ranks' back.

State dicts of a vocabulary-parallel model: the rules are matched by key, and ``tok.weight``/``head.weight`` are the
same keys in a model with and without the split, so their rule (:data:`VOCAB_PARALLEL_RULES`) is not in
:data:`TP_RULES`: :func:`tp_kind`, :func:`slice_tp_state_dict`, :func:`merge_tp_state_dicts` and
:func:`copy_tp_slice` take ``vocab_parallel=False`` and apply it only when the caller says so (the GPT's
construction passes it for its two tables; callers of slice/merge pass ``cfg.vocab_parallel``). The default keeps
every existing call's meaning; a dict of the other kind is not silently misread: merging split tables as replicated
fails the replicated check (whose message names ``vocab_parallel=True``), and slicing whole tables for a split model
fails ``load_state_dict`` on the shapes. Inferring the split was rejected: ``slice`` gets a TP=1 dict, which cannot
say whether the target model splits its tables, and ``merge`` cannot tell a split table from a replicated one by its
shape.

With ``use_te=True`` the same split is TE's: ``LayerNormLinear(parallel_mode="column")``,
``Linear(parallel_mode="row")``, ``LayerNormMLP(set_parallel_mode=True)``, each with ``tp_group``, ``tp_size`` and
``sequence_parallel=True`` (TE then all-gathers and reduce-scatters along the first dimension itself and sets the
same tags), and ``DotProductAttention(tp_size=, tp_group=)`` (``qkv_format="sbhd"``). Only provable on GPUs.

Graphs: the TP collectives belong to the layer's computation, so a per-layer graph (``attn``, ``mlp`` or the
whole layer) captures them; on GPUs that needs the TP group's NCCL communicator created before the capture (the
eager steps before ``capture()`` do) and NCCL's graph support. FSDP's collectives stay outside, as without TP.
Seen with torch layers and the torch backend on 2 and 4 H200s (``tests/gpu/scripts/tp_graphs.py``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["gather_sequence", "reduce_scatter_sequence", "scatter_sequence", "gather_sequence_replicated",
           "gather_vocab", "vocab_parallel_embedding", "mark_tensor_parallel", "mark_sequence_parallel", "tp_kind",
           "slice_tp_state_dict", "merge_tp_state_dicts", "copy_tp_slice", "TP_RULES", "VOCAB_PARALLEL_RULES"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (TP rank order)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group),) + tuple(x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group, then this rank's part of dim 0."""
    x = x.contiguous()
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter of {x.shape[0]} rows over {size} tensor-parallel ranks: the sequence length "
                         "must be divisible by tensor_parallel_size")
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


def _split(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of dim 0 (no communication)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % size:
        raise ValueError(f"a sequence of {x.shape[0]} positions does not split over {size} tensor-parallel ranks: "
                         f"pass sequences whose length is a multiple of tensor_parallel_size={size}")
    per = x.shape[0] // size
    return x[rank * per:(rank + 1) * per].contiguous()


class _GatherSequence(torch.autograd.Function):
    """Before a column-parallel GEMM: all-gather; backward reduce-scatter (each rank's GEMM gave a partial input
    gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """After a row-parallel GEMM: reduce-scatter of the partial outputs; backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _gather(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Into the sequence-parallel region (after the replicated embedding): this rank's positions; backward
    all-gather (the embedding's gradient is whole on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _gather(grad, ctx.group), None


class _GatherSequenceReplicated(torch.autograd.Function):
    """Out of the sequence-parallel region into replicated compute (the LM head): all-gather; backward takes this
    rank's positions of the gradient, which every TP rank computed whole and alike."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _split(grad, ctx.group), None


class _GatherVocab(torch.autograd.Function):
    """After the vocabulary-parallel LM head: all-gather of each rank's ``V/TP`` logits along the last dimension
    (TP rank order), so every TP rank holds the whole logits and computes the same loss; backward: this rank's
    vocabulary slice of the gradient, no communication.

    Why a slice and not a sum: the loss is computed whole and alike on every TP rank, so the gradient arriving here
    is the whole ``dL/dlogits``, the same on every rank, not a partial sum. This rank's logits slice fed only its
    columns of the gather, so its gradient is exactly those columns. Summing over TP (a reduce-scatter) would scale
    the head's weight gradient and its input gradient by TP."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        size = dist.get_world_size(group)
        parts = _gather(x.unsqueeze(0), group)  # [TP, ..., V/TP]
        return parts.movedim(0, -2).reshape(tuple(x.shape[:-1]) + (size * x.shape[-1],))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        per = grad.shape[-1] // size
        return grad[..., rank * per:(rank + 1) * per].contiguous(), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits split over the vocabulary across the TP group, without gathering them.

    Each TP rank holds the logits of every position for its ``V/TP`` vocabulary ids. The row maximum (all-reduce
    MAX), then the sum of exponentials and the target's shifted logit (one all-reduce SUM of both; the target lies in
    exactly one rank's ids, the others add 0) give every rank the same per-position ``log(sum exp) - target``, and
    the same mean: the value of ``F.cross_entropy`` over the whole logits, up to the order of the sums. Backward
    needs no communication: this rank's slice of ``softmax - onehot(target)``, scaled by the mean, is exactly the
    slice of the whole gradient that ``gather_vocab``'s backward would hand it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        per = logits.shape[-1]
        local = targets - dist.get_rank(group) * per
        inside = (local >= 0) & (local < per)
        index = local.clamp(0, per - 1).unsqueeze(-1)
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), shifted.gather(-1, index).squeeze(-1) * inside])
        dist.all_reduce(sums, group=group)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, inside)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        softmax, index, inside = ctx.saved_tensors
        out = softmax.scatter(-1, index, softmax.gather(-1, index) - inside.unsqueeze(-1).to(softmax.dtype))
        return out * (grad / softmax[..., 0].numel()), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[..., V/TP]`` (this TP rank's vocabulary columns, rank order) against the
    global ids ``targets`` ``[...]``, computed in fp32 as ``apps.model.loss_fn`` is, without gathering the logits
    (:class:`_VocabParallelCrossEntropy`); every TP rank returns the same loss."""
    return _VocabParallelCrossEntropy.apply(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s/TP, ...] -> [s, ...]`` before a column-parallel GEMM (backward: reduce-scatter)."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s, ...]`` partial sums -> ``[s/TP, ...]`` summed, after a row-parallel GEMM (backward: all-gather)."""
    return _ReduceScatterSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s, ...]`` replicated -> this rank's ``[s/TP, ...]`` (backward: all-gather)."""
    return _ScatterSequence.apply(x, group)


def gather_sequence_replicated(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s/TP, ...] -> [s, ...]`` for compute replicated over TP (backward: this rank's positions)."""
    return _GatherSequenceReplicated.apply(x, group)


def gather_vocab(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[..., V/TP]`` this rank's logits -> ``[..., V]`` whole (backward: this rank's vocabulary slice)."""
    return _GatherVocab.apply(x, group)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of an embedding lookup split over the vocabulary: ``weight`` holds rows ``[r*V/TP,
    (r+1)*V/TP)`` of the table (TP rank ``r``); ids outside them give zero rows (and no gradient), so the sum over
    the TP group (the caller's reduce-scatter) is the whole lookup."""
    per = weight.shape[0]
    local = tokens - dist.get_rank(group) * per
    outside = (local < 0) | (local >= per)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def mark_tensor_parallel(p: torch.Tensor, partition_dim: int) -> None:
    """megatron-core's (and TE's) attributes of a TP-sharded parameter."""
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.partition_dim = partition_dim  # type: ignore[attr-defined]
    p.partition_stride = 1  # type: ignore[attr-defined]


def mark_sequence_parallel(p: torch.Tensor) -> None:
    """megatron-core's (and TE's) attribute of a parameter replicated over TP whose gradient is a partial sum per
    TP rank under sequence parallelism: the engine sums it over the TP group."""
    p.sequence_parallel = True  # type: ignore[attr-defined]


#: How each TP-sharded parameter of the reference GPT (``unit='block'``, torch or TE modules) splits, by its
#: state-dict key: ``qkv`` (rows of a ``[q heads | k heads | v heads]`` output, by heads), ``column`` (dim 0),
#: ``row`` (dim 1).
TP_RULES = (
    (re.compile(r"(^|\.)attn\.(qkv\.(weight|bias)|ln_qkv\.(weight|bias))$"), "qkv"),
    (re.compile(r"(^|\.)attn\.proj\.weight$"), "row"),
    (re.compile(r"(^|\.)mlp\.(fc1\.(weight|bias)|ln_mlp\.fc1_(weight|bias))$"), "column"),
    (re.compile(r"(^|\.)mlp\.(fc2\.weight|ln_mlp\.fc2_weight)$"), "row"),
)

#: With ``GPTConfig(vocab_parallel=True)`` also the token embedding and the LM head split by rows (vocabulary),
#: applied only when the caller passes ``vocab_parallel=True``: the same keys are replicated otherwise.
VOCAB_PARALLEL_RULES = (
    (re.compile(r"(^|\.)(tok|head)\.weight$"), "column"),
)


def tp_kind(key: str, *, vocab_parallel: bool = False) -> Optional[str]:
    """``qkv``, ``column`` or ``row`` for a TP-sharded parameter's key, None for one replicated over TP.
    ``vocab_parallel``: the model was built with ``GPTConfig(vocab_parallel=True)`` (its ``tok``/``head`` split)."""
    for pattern, kind in TP_RULES + (VOCAB_PARALLEL_RULES if vocab_parallel else ()):
        if pattern.search(key):
            return kind
    return None


def _sections(num_heads: int, num_kv_heads: Optional[int]) -> List[int]:
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return [num_heads, kv, kv]  # heads of q, k, v in the qkv output


def _slice(kind: str, value: torch.Tensor, rank: int, size: int, num_heads: int, key: str,
           num_kv_heads: Optional[int] = None) -> torch.Tensor:
    if kind == "row":
        if value.shape[1] % size:
            raise ValueError(f"{key}: {value.shape[1]} columns do not split over tensor_parallel_size={size}")
        per = value.shape[1] // size
        return value[:, rank * per:(rank + 1) * per]
    if kind == "column":
        if value.shape[0] % size:
            raise ValueError(f"{key} of shape {tuple(value.shape)} does not split over tensor_parallel_size={size}")
        per = value.shape[0] // size
        return value[rank * per:(rank + 1) * per]
    heads = _sections(num_heads, num_kv_heads)
    if value.shape[0] % sum(heads) or any(n % size for n in heads):
        raise ValueError(f"{key} of shape {tuple(value.shape)} does not split over tensor_parallel_size={size} by "
                         f"{heads[0]} query and {heads[1]} key/value heads")
    d = value.shape[0] // sum(heads)
    parts = value.split([n * d for n in heads])
    return torch.cat([p[rank * (n // size) * d:(rank + 1) * (n // size) * d] for p, n in zip(parts, heads)])


def _merge(kind: str, values: Sequence[torch.Tensor], num_heads: int, num_kv_heads: Optional[int] = None
           ) -> torch.Tensor:
    if kind == "row":
        return torch.cat(list(values), dim=1)
    if kind == "column":
        return torch.cat(list(values), dim=0)
    size = len(values)
    local = [n // size for n in _sections(num_heads, num_kv_heads)]
    d = values[0].shape[0] // sum(local)
    per_rank = [v.split([n * d for n in local]) for v in values]  # [rank][section]
    return torch.cat([per_rank[r][i] for i in range(3) for r in range(size)])


def slice_tp_state_dict(state_dict: Mapping[str, torch.Tensor], *, tensor_parallel_size: int, tp_rank: int,
                        num_heads: int, num_kv_heads: Optional[int] = None, vocab_parallel: bool = False
                        ) -> Dict[str, torch.Tensor]:
    """A TP=1 state dict of the reference GPT -> the state dict of TP rank ``tp_rank`` (same keys; TP-sharded
    entries sliced by :data:`TP_RULES`, replicated ones passed through). ``num_kv_heads``: default ``num_heads``.
    ``vocab_parallel``: for a model built with ``GPTConfig(vocab_parallel=True)``: ``tok.weight`` and
    ``head.weight`` sliced by rows too (:data:`VOCAB_PARALLEL_RULES`); otherwise they are replicated."""
    if tensor_parallel_size < 1 or not 0 <= tp_rank < tensor_parallel_size:
        raise ValueError(f"tp_rank={tp_rank} with tensor_parallel_size={tensor_parallel_size}: need "
                         "tensor_parallel_size >= 1 and 0 <= tp_rank < tensor_parallel_size")
    out: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        kind = tp_kind(key, vocab_parallel=vocab_parallel)
        out[key] = value if kind is None else _slice(kind, value, tp_rank, tensor_parallel_size, num_heads, key,
                                                     num_kv_heads).clone()
    return out


def merge_tp_state_dicts(per_tp_rank: Sequence[Mapping[str, torch.Tensor]], *, num_heads: int,
                         num_kv_heads: Optional[int] = None, check_replicated: bool = True,
                         vocab_parallel: bool = False) -> Dict[str, torch.Tensor]:
    """The TP ranks' state dicts (in TP rank order) -> the TP=1 state dict (the inverse of
    :func:`slice_tp_state_dict`, ``vocab_parallel`` as there). Replicated entries must agree bit for bit
    (``check_replicated=False``: TP rank 0's are taken, for diagnosing a run whose replicas drifted apart)."""
    out: Dict[str, torch.Tensor] = {}
    for key, value in per_tp_rank[0].items():
        kind = tp_kind(key, vocab_parallel=vocab_parallel)
        if kind is not None:
            out[key] = _merge(kind, [sd[key] for sd in per_tp_rank], num_heads, num_kv_heads)
            continue
        if check_replicated and isinstance(value, torch.Tensor):
            for q, sd in enumerate(per_tp_rank[1:], 1):
                if not torch.equal(sd[key], value):
                    hint = ("; or, if the model was built with GPTConfig(vocab_parallel=True) (its tok and head "
                            "split over the vocabulary), pass vocab_parallel=True"
                            if tp_kind(key, vocab_parallel=True) else "")
                    raise ValueError(f"{key} differs between TP ranks 0 and {q}: parameters replicated over TP must "
                                     "stay equal (their gradients summed over TP where sequence parallelism makes "
                                     f"them partial); merge state dicts of one model at one step{hint}")
        out[key] = value
    return out


def copy_tp_slice(local: nn.Module, full: nn.Module, *, prefix: str, tp_rank: int, tp_size: int,
                  num_heads: int, num_kv_heads: Optional[int] = None, vocab_parallel: bool = False) -> None:
    """Copy into ``local`` (a TP module) its slice of ``full`` (the same module at TP=1), parameter by parameter;
    ``prefix``: the modules' key in the GPT (e.g. ``"attn."``, ``"tok."``) that :data:`TP_RULES` (and with
    ``vocab_parallel``, :data:`VOCAB_PARALLEL_RULES`) match."""
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in local.named_parameters():
            value = full_params[name].detach()
            kind = tp_kind(prefix + name, vocab_parallel=vocab_parallel)
            if kind is not None:
                value = _slice(kind, value, tp_rank, tp_size, num_heads, prefix + name, num_kv_heads)
            if tuple(value.shape) != tuple(p.shape):
                raise AssertionError(f"{prefix}{name}: slice {tuple(value.shape)} vs local {tuple(p.shape)}")
            p.copy_(value)


def local_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose values the caller copies in (as :func:`local_linear`)."""
    return torch.nn.utils.skip_init(nn.Embedding, num_embeddings, embedding_dim, device=torch.get_default_device())


def local_linear(in_features: int, out_features: int, *, bias: bool = True) -> nn.Linear:
    """An ``nn.Linear`` whose values the caller copies in: made without drawing from the random stream, on the
    default device (``skip_init`` alone puts it on the CPU, also inside ``with torch.device("cuda"):``)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias,
                                    device=torch.get_default_device())


def fork_rng_devices() -> List[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []
