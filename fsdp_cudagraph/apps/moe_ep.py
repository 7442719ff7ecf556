"""Expert parallelism for the reference model's dropless MoE: the token exchange between the graphs.

With ``GPTConfig(expert_parallel_size=EP)`` every rank of an expert-parallel (EP) group holds ``E/EP``
consecutive experts (EP rank ``q`` holds global experts ``q*E/EP .. (q+1)*E/EP - 1``) and the tokens travel to
them. :class:`~fsdp_cudagraph.apps.moe.Experts` runs, eagerly, after the ``moe_preprocess`` graph:

1. the preprocess gave the rows sorted by global expert and the per-expert counts ``[E]`` on the device;
2. ``all_to_all_single`` of the counts over the EP group: rank ``q`` receives, from every source rank ``s``,
   how many rows ``s`` sends to each of ``q``'s local experts (a ``[EP, E/EP]`` table);
3. one host read of both tables (``tolist()`` of one stacked tensor): the split sizes of the token all-to-all
   and of the local experts. The one device-to-host sync of an MoE layer (``grouped_mm`` takes its sizes from
   the device table, :func:`local_expert_counts`: a host list copied back would synchronize the stream again);
4. dispatch: ``all_to_all_single`` of the rows with variable splits; what arrives is ordered (source rank,
   local expert) and is regrouped to (local expert, source rank), so each local expert gets one contiguous
   batch, its sources in rank order;
5. the local experts (``split``, ``grouped_mm``, ``te_grouped`` over the ``E/EP`` local experts);
6. the outputs go back to (source rank, local expert) order and through the reverse all-to-all (combine);
   each rank then holds its own rows in the preprocess's order, and the block unpermutes as at ``EP = 1``.

[Note: deterministic expert parallelism] Both regroups are gathers by a permutation computed on the device
(:func:`regroup_index`, from step 2's table and the row count the host already has from step 3): the dispatch
side by the permutation, the combine side by its inverse (the regroup of the transposed table), and each one's
backward (:class:`Permute`) gathers by the other. A gather copies every row once and adds nothing: no scatter,
no atomics, the same bits as moving whole chunks. The index costs a fixed handful of device ops and no host
read, whatever ``EP * E/EP`` is; a ``split``/``cat`` of the ``EP * E/EP`` chunks (:func:`regroup`, the
definition the index is tested against) costs host work per chunk in forward and backward, right after the
layer's host sync, while the device waits for launches. The all-to-all's backward is the reverse all-to-all
with the splits swapped. So a run is bit-for-bit repeatable. Against ``EP = 1`` the rows each expert sees are
the same rows (when each rank's batch is a contiguous slice of the global batch, even in the same order); only
the grouping of the expert weights' gradient sums differs (one matmul over all sources at the owner instead of
per-rank sums reduced by the engine), a few ulp (``tests/graphs/test_moe_ep.py``, [Note: EP tolerance of the
GPT]).

Capture: the all-to-alls are collectives on the EP group and their sizes come from the host, so an EP
``Experts`` module is never inside a graph (its ``cuda_graph_unsafe`` says why): scope ``moe`` and whole
layers are refused at selection; ``attn moe_router moe_preprocess`` graph everything before it.

Parameters: the experts module holds ``w1 [E/EP, h, f]`` and ``w2 [E/EP, f, h]``, the EP=1 model's slices
(initialised from the same random stream: :func:`slice_expert_state_dict` maps an EP=1 state dict to an EP
rank's, :func:`merge_expert_state_dicts` the ranks' back). The module carries ``is_expert = True``, the
engine's tag: its parameters are sharded over the expert-data-parallel group; and ``stacked_expert_dims =
{"w1": 0, "w2": 0}``: megatron_fsdp's state dicts (full and DCP) hold the global ``[E, ...]`` tensors under the
EP=1 keys ([Note: expert parallelism] in megatron_fsdp/_expert.py, Checkpoints), so no slicing or merging is needed
there.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "Transfer", "start_all_to_all", "finish_all_to_all", "exchange_counts", "receive_counts",
           "host_tables", "local_expert_counts", "regroup",
           "regroup_index", "Permute", "slice_expert_state_dict", "merge_expert_state_dicts", "EXPERT_KEY"]

#: State-dict keys of the stacked expert weights (``w1``/``w2``: dim 0 is the expert) and of TE's per-expert
#: ``GroupedLinear`` weights (``fc1.weight{i}``: the index is the expert).
EXPERT_KEY = re.compile(r"^(?P<prefix>.*\bexperts\.)(?:(?P<stacked>w[12])|(?P<fc>fc[12]\.weight)(?P<i>\d+))$")


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with host split sizes; backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


# [Note: overlapped expert groups]
# With ``GPTConfig(moe_ep_chunks=C)`` each rank's ``E/EP`` local experts form ``C`` groups of consecutive experts,
# and each group's rows travel by their own all-to-alls: all ``C`` dispatches are started before the first group's
# experts run, and each group's combine is started as soon as its experts are done. The collectives queue on the
# communicator's stream in that order, so group ``c + 1``'s dispatch (and group ``c - 1``'s combine) move while
# group ``c``'s experts compute on the compute stream. Backward mirrors it: the two autograd functions below pass the
# gradient's transfer from one to the other, started in :class:`_FinishAllToAll`'s backward and waited for in
# :class:`_StartAllToAll`'s, and autograd runs the other group's nodes in between (later-created nodes first).
# The host sync is unchanged (one per layer, before the first dispatch). Each expert still sees the same rows in the
# same order (its group's rows are regrouped by source rank exactly as without groups), so its outputs and weight
# gradients are the same as with one group; the groups only change which rows share a transfer and a grouped GEMM
# launch (tests/graphs/test_moe_ep.py compares them bit for bit on Gloo; tests/gpu/scripts/ep_align.py on GPUs).
# Measured on 2 x H200 at EP 2 (Qwen3-30B-A3B-shaped, 64 local experts in 2 groups): about 2.3 ms slower a layer at
# sequence 1024 and at 4096 alike, so the cost is per call (twice the all-to-alls, a permutation into groups and back,
# two half-size grouped GEMMs), and over NVLink the overlap does not repay it. Hence one group by default.


class Transfer:
    """One all-to-all in flight: its work handle, and in backward the handle and buffer of the gradient's."""

    def __init__(self) -> None:
        self.work: Any = None
        self.grad_work: Any = None
        self.grad: Optional[torch.Tensor] = None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int],  # type: ignore[override]
                group: dist.ProcessGroup, transfer: Transfer) -> torch.Tensor:
        ctx.transfer = transfer
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        transfer.work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        # ``grad`` only orders this after _FinishAllToAll.backward, whose transfer fills ``transfer.grad``
        t = ctx.transfer
        t.grad_work.wait()
        back, t.grad_work, t.grad = t.grad, None, None
        return back, None, None, None, None


class _FinishAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, out_splits: List[int], in_splits: List[int],  # type: ignore[override]
                group: dist.ProcessGroup, transfer: Transfer) -> torch.Tensor:
        transfer.work.wait()
        transfer.work = None
        ctx.splits, ctx.group, ctx.transfer = (out_splits, in_splits), group, transfer
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        t = ctx.transfer
        t.grad = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        t.grad_work = dist.all_to_all_single(t.grad, grad.contiguous(), in_splits, out_splits, group=ctx.group,
                                             async_op=True)
        return grad, None, None, None, None


def start_all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: dist.ProcessGroup
                     ) -> Tuple[torch.Tensor, Transfer]:
    """Start ``all_to_all_single`` of ``x``'s rows; the returned buffer may be read only after
    :func:`finish_all_to_all` ([Note: overlapped expert groups])."""
    transfer = Transfer()
    return _StartAllToAll.apply(x, out_splits, in_splits, group, transfer), transfer


def finish_all_to_all(out: torch.Tensor, out_splits: List[int], in_splits: List[int], group: dist.ProcessGroup,
                      transfer: Transfer) -> torch.Tensor:
    """Wait for :func:`start_all_to_all`'s transfer; returns its rows. In backward the two swap roles: this one starts
    the gradient's transfer back, the start waits for it."""
    return _FinishAllToAll.apply(out, out_splits, in_splits, group, transfer)


def receive_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Step 2, on the device: ``received`` ``[E]`` laid out ``[EP][E/EP]``, ``received[s * E/EP + l]`` the rows
    source rank ``s`` sends to this rank's local expert ``l``. One all-to-all of the ``E`` counts, no host read."""
    counts = counts.contiguous()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def host_tables(counts: torch.Tensor, received: torch.Tensor, ep_size: int) -> Tuple[List[List[int]], List[List[int]]]:
    """Step 3: ``(send, recv)``, each ``[EP][E/EP]`` host lists. ``send[q][l]``: rows this rank sends to EP rank
    ``q``'s local expert ``l``; ``recv[s][l]``: rows source rank ``s`` sends to this rank's local expert ``l``. One
    device-to-host copy of both tables: the host sync."""
    num_local = counts.numel() // ep_size
    send, recv = torch.stack([counts, received]).view(2, ep_size, num_local).tolist()
    return send, recv


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, ep_size: int
                    ) -> Tuple[List[List[int]], List[List[int]]]:
    """Steps 2-3: :func:`receive_counts` then :func:`host_tables`."""
    return host_tables(counts, receive_counts(counts, group), ep_size)


def local_expert_counts(received: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Rows each local expert gets from all sources, ``[E/EP]`` on the device (the sum over source ranks of
    :func:`receive_counts`' table): the grouped GEMM's sizes without a second host-to-device copy, which would
    synchronize the stream again (a ``torch.tensor(list, device=...)`` copy waits for the stream)."""
    return received.reshape(ep_size, -1).sum(0)


def regroup(x: torch.Tensor, sizes: Sequence[Sequence[int]]) -> torch.Tensor:
    """Chunks laid out ``[a][b]`` (sizes ``sizes[a][b]``, ``a`` major) -> laid out ``[b][a]``, by ``split`` and
    ``cat`` of whole chunks on host sizes. The definition :func:`regroup_index` is held to; ``A*B`` chunks cost
    host work in proportion, which is why the experts use :func:`regroup_index` and :class:`Permute` instead."""
    rows_a, rows_b = len(sizes), len(sizes[0])
    chunks = x.split([c for row in sizes for c in row])
    return torch.cat([chunks[a * rows_b + b] for b in range(rows_b) for a in range(rows_a)])


def regroup_index(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """``idx [total]`` with ``x.index_select(0, idx)`` equal to ``regroup(x, sizes.tolist())``: chunk sizes
    ``sizes [A, B]`` laid out ``[a][b]``, on the device; ``total`` their sum, a host integer the caller already
    has. The inverse permutation is ``regroup_index(sizes.t(), total)``.

    Output row ``r`` of chunk ``(b, a)`` reads input row ``r + in_start[a][b] - out_start[b][a]``: one offset per
    chunk, repeated over the chunk's rows. A fixed handful of device ops whatever ``A*B`` is, and no host read:
    ``repeat_interleave`` is told its output size (without it, it reads the sum on the host, a sync)."""
    sizes = sizes.to(torch.long)
    in_start = sizes.flatten().cumsum(0).view_as(sizes) - sizes  # [a][b], a major: where the chunk is now
    sizes_t = sizes.t().flatten()  # [b][a]: the order the chunks go to
    out_start = sizes_t.cumsum(0) - sizes_t
    shift = in_start.t().flatten() - out_start
    return torch.arange(total, device=sizes.device) + shift.repeat_interleave(sizes_t, output_size=total)


class Permute(torch.autograd.Function):
    """``x.index_select(0, idx)`` whose backward is ``grad.index_select(0, inv_idx)``, ``inv_idx`` the inverse
    permutation. ``index_select``'s own backward is ``index_add_``, a scatter that accumulates (atomic adds on a
    GPU; under ``use_deterministic_algorithms`` a sorting ``index_put_`` instead); a permutation's gradient is a
    gather by its inverse: every row copied once, nothing added ([Note: deterministic expert parallelism])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor, inv_idx: torch.Tensor  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.save_for_backward(inv_idx)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        (inv_idx,) = ctx.saved_tensors
        return grad.index_select(0, inv_idx), None, None


def _expert_count(state_dict: Mapping[str, torch.Tensor], prefix: str, stacked: bool, name: str) -> int:
    if stacked:
        return state_dict[prefix + name].shape[0]
    pattern = re.compile(re.escape(prefix + name) + r"(\d+)$")
    return sum(1 for k in state_dict if pattern.match(k))


def slice_expert_state_dict(state_dict: Mapping[str, torch.Tensor], *, expert_parallel_size: int,
                            ep_rank: int) -> Dict[str, torch.Tensor]:
    """An EP=1 state dict -> the state dict of EP rank ``ep_rank`` of an ``expert_parallel_size`` model.

    Expert weights keep their keys: stacked ``experts.w1``/``w2`` are sliced along dim 0 (the experts
    ``ep_rank*L .. (ep_rank+1)*L - 1``, ``L = E/EP``); TE's ``experts.fc1.weight{i}`` keep the local ones,
    renumbered from 0. Every other entry is passed through (dense parameters are the same at every EP).
    """
    if expert_parallel_size < 1 or not 0 <= ep_rank < expert_parallel_size:
        raise ValueError(f"ep_rank={ep_rank} with expert_parallel_size={expert_parallel_size}: need "
                         "expert_parallel_size >= 1 and 0 <= ep_rank < expert_parallel_size")
    out: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        stacked = m.group("stacked") is not None
        num = _expert_count(state_dict, m.group("prefix"), stacked, m.group("stacked") or m.group("fc"))
        if num % expert_parallel_size:
            raise ValueError(f"{key}: {num} experts do not split over expert_parallel_size={expert_parallel_size}; "
                             "pass a divisor of the number of experts")
        local = num // expert_parallel_size
        first = ep_rank * local
        if stacked:
            out[key] = value[first:first + local]
        elif first <= int(m.group("i")) < first + local:
            out[f"{m.group('prefix')}{m.group('fc')}{int(m.group('i')) - first}"] = value
    return out


def merge_expert_state_dicts(per_ep_rank: Sequence[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The EP ranks' state dicts (in EP rank order) -> the EP=1 state dict (the inverse of
    :func:`slice_expert_state_dict`). Dense entries must agree bit for bit."""
    out: Dict[str, torch.Tensor] = {}
    for q, sd in enumerate(per_ep_rank):
        for key, value in sd.items():
            m = EXPERT_KEY.match(key)
            if m is not None and m.group("stacked"):
                if q == 0:
                    out[key] = torch.cat([r[key] for r in per_ep_rank])
                continue
            if m is not None:
                local = _expert_count(sd, m.group("prefix"), False, m.group("fc"))
                out[f"{m.group('prefix')}{m.group('fc')}{q * local + int(m.group('i'))}"] = value
                continue
            if key in out and not torch.equal(out[key], value):
                raise ValueError(f"{key} differs between EP ranks 0 and {q}: dense entries are replicated; merge "
                                 "state dicts of one model at one step")
            out.setdefault(key, value)
    return out
