"""The reference model's mixture of experts: dropless routing with eager experts, the way Megatron graphs it.

One MoE block (tag ``moe``) is four steps; ``GPTConfig.moe_experts`` picks how the experts run:

1. :class:`Router` (tag ``moe_router``): ``linear -> softmax (fp32) -> top-k -> renormalise``; returns the
   top-k weights [T, K] (fp32) and expert ids [T, K] (int64). Static shapes.
2. :class:`MoEPreprocess` (tag ``moe_preprocess``): a stable argsort of the T*K expert ids gives the
   permuted token rows [T*K, h], the permuted weights [T*K], the tokens per expert as a *device* tensor
   [E] (int64, no host sync) and the inverse permutation [T*K]. Static shapes: always T*K rows (dropless).
3. :class:`Experts`: the data-dependent part. ``"split"``: ``counts.tolist()`` (a device-to-host sync)
   then one matmul pair per expert; ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` with device
   offsets ``cumsum(counts)`` (no sync); ``"te_grouped"``: TE ``GroupedLinear`` with
   ``m_splits=counts.tolist()`` (sync); ``"capacity"``: drop-and-pad to a static [E, C, h] batch,
   ``C = ceil(T*K/E * moe_capacity_factor)``, rows past C dropped (no sync; equal to the dropless paths when
   no expert gets more than C rows); ``"dense"``: every expert applied to every token and mixed by a
   [T, E] combine matrix (the old static toy, kept as the numerical oracle and the default).
4. Unpermute (in :class:`MoEBlock`, eager unless ``moe`` is graphed): weight each row by its probability,
   undo the permutation by indexing with the inverse map, ``view(T, K, h).sum(1)``, add the residual.

Expert parallelism (``GPTConfig.expert_parallel_size > 1``, ``apps/moe_ep.py``): :class:`Experts` holds only
this rank's ``E/EP`` experts (tagged ``is_expert`` for the engine) and, in step 3, exchanges the counts over the
expert-parallel group, reads them on the host once, sends the rows to their experts' ranks, runs its local
experts (``split``, ``grouped_mm`` or ``te_grouped``) and sends the outputs back; steps 1, 2 and 4 are unchanged.

[Note: deterministic dispatch] Every step is deterministic and uses no floating-point atomics. The forward
gathers (``rows[order]``, ``rows[inverse]``) index with a permutation, so their backward (``index_put_``
with accumulate) writes each destination row exactly once onto zeros: exact, whatever the order. The K
copies of a token are summed by ``view(T, K, h).sum(1)`` (forward) and by ``expand`` (whose backward is a
sum over K), never by ``index_add_`` on floats. The counts come from ``searchsorted`` on the sorted ids and the
inverse map from a second argsort: no scatter at all, so nothing changes under ``use_deterministic_algorithms``.
``capacity`` gathers too; its only repeated indices point at a zero padding row whose gradient is discarded.
Memory: the T*K rows are materialised (the expanded tokens, then the permuted copy), about 2 x T*K*h values.

[Note: capturability of the experts] A module whose forward cannot be captured (a host sync, shapes that
depend on data) says so with a ``cuda_graph_unsafe`` attribute holding the reason (None: capturable);
``PartialCudaGraphs`` and ``FullIterationCudaGraph`` refuse, at selection, a graphed callable that contains
such a module (``fsdp_cudagraph.config.graph_unsafe_modules``). So scope ``moe`` (or whole layers) is
refused with ``split``/``te_grouped`` experts, as Megatron refuses ``moe`` for dropless MoE, and accepted with
``grouped_mm``, ``capacity`` and ``dense``; the Megatron scopes ``attn moe_router moe_preprocess`` run the
experts eagerly between the graphs. With expert parallelism the experts are unsafe whatever the mode: their
all-to-alls are collectives with host split sizes, so only the Megatron scopes are accepted. torch's CUDA
``grouped_mm`` has a fast (no-sync) kernel only for bf16 on sm90+; other dtypes take a fallback loop that copies
the offsets to the host, so fp32 ``grouped_mm`` on CUDA is refused (``moe_grouped_mm_dtype="bfloat16"`` computes
the experts in bf16).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_cudagraph.apps import moe_ep

__all__ = ["MOE_EXPERTS", "Router", "MoEPreprocess", "Experts", "SharedExpert", "MoEBlock", "unpermute"]

#: ``GPTConfig.moe_experts`` values; ``_SYNC_REASON`` names the paths that read the counts on the host.
MOE_EXPERTS = ("dense", "split", "grouped_mm", "te_grouped", "capacity")
_SYNC_REASON = {
    "split": "Experts(moe_experts='split') calls counts.tolist() (a device-to-host sync) and splits the tokens "
             "into data-dependent shapes",
    "te_grouped": "Experts(moe_experts='te_grouped') passes m_splits=counts.tolist() (a device-to-host sync) to "
                  "TE GroupedLinear",
}


class Router(nn.Module):
    """Top-k routing. Dense toy: the softmax probabilities [T, E]; dropless: (weights [T, K] fp32, ids [T, K])."""

    cuda_graph_module = "moe_router"

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.top_k = cfg.moe_top_k
        self.dense = cfg.moe_experts == "dense"

    def forward(self, x: torch.Tensor) -> Any:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        if self.dense:
            return probs
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class MoEPreprocess(nn.Module):
    """Dispatch preparation. Dense toy: the [T, E] combine matrix. Dropless: the permutation (see module doc)."""

    cuda_graph_module = "moe_preprocess"

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.num_experts = cfg.num_experts
        self.dense = cfg.moe_experts == "dense"

    def forward(self, x: torch.Tensor, probs: Optional[torch.Tensor] = None, ids: Optional[torch.Tensor] = None) -> Any:
        """Dense toy: ``forward(probs [T, E]) -> combine [T, E]`` (the old signature). Dropless:
        ``forward(tokens [T, h], weights [T, K], ids [T, K]) -> (rows [T*K, h], probs [T*K], counts [E],
        inverse [T*K])``."""
        if self.dense:
            probs = x
            idx = torch.topk(probs, self.top_k, dim=-1).indices
            mask = torch.zeros_like(probs).scatter_(-1, idx, 1.0)
            weights = probs * mask
            return weights / weights.sum(dim=-1, keepdim=True)
        if probs is None or ids is None:
            raise TypeError("MoEPreprocess(dropless).forward(x, weights, ids) needs the router's weights and ids")
        t, h = x.shape
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token-major ties keep the token order inside each expert
        inverse = torch.argsort(order)  # the inverse permutation (a sort: no scatter, deterministic)
        rows = x.unsqueeze(1).expand(t, k, h).reshape(t * k, h)  # row t*K + j is token t's j-th choice
        # tokens per expert from the sorted ids: where each expert's run starts (exact, no atomics, no sync)
        edges = torch.arange(self.num_experts + 1, dtype=flat.dtype, device=flat.device)
        counts = torch.searchsorted(flat[order], edges).diff()
        return rows[order], probs.reshape(-1)[order], counts, inverse


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: grouped_mm's backward refuses stride-0 gradients
    (e.g. from ``.sum()``: "Invalid strides/sizes" on torch 2.13 CPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Experts(nn.Module):
    """The experts' FFNs ``gelu(x W1[e]) W2[e]``; ``mode`` (``GPTConfig.moe_experts``) picks the kernel.

    Parameters ``w1`` [E, h, f] and ``w2`` [E, f, h] for ``dense``/``split``/``grouped_mm`` (the same layout,
    so the paths load each other's weights); TE ``GroupedLinear`` ``fc1``/``fc2`` for ``te_grouped``. With expert
    parallelism ``w1``/``w2`` hold this rank's ``E/EP`` experts and are declared stacked along dim 0
    (``stacked_expert_dims``), so megatron_fsdp checkpoints them whole; TE's ``fc1.weight{i}`` carry a local index
    and their engine state dicts are refused at EP > 1 (docs/moe.md, Checkpoints).
    """

    #: The engine's tag for expert parameters (megatron_fsdp shards them over the expert-data-parallel group
    #: when ``expert_parallel_size > 1``; at 1 every parameter is dense, as before).
    is_expert = True

    def __init__(self, cfg: Any, ep_group: Optional[Any] = None) -> None:
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        f = cfg.moe_ffn_hidden_size
        self.mode = cfg.moe_experts
        self.grouped_mm_dtype = cfg.moe_grouped_mm_dtype
        self.capacity_factor = cfg.moe_capacity_factor
        #: Expert parallelism (``apps/moe_ep.py``): this rank holds global experts ``first .. first+num_local-1``.
        self.ep_group = ep_group
        self.ep_size = getattr(cfg, "expert_parallel_size", 1)
        self.num_local = e // self.ep_size
        #: the local experts in this many groups, each with its own transfers ([Note: overlapped expert groups])
        self.ep_chunks = getattr(cfg, "moe_ep_chunks", 1)
        ep_rank = _ep_rank(ep_group, self.ep_size)
        self.first = ep_rank * self.num_local
        if self.mode == "te_grouped":
            from fsdp_cudagraph.capture.te import require_te

            # EP > 1: TE initialises each local weight itself (not the EP=1 slice); load a sliced EP=1 state
            # dict (apps/moe_ep.py slice_expert_state_dict) to start from the same values.
            te = require_te("GPTConfig(moe_experts='te_grouped')")
            self.fc1 = te.GroupedLinear(self.num_local, h, f, bias=False, params_dtype=torch.float32)
            self.fc2 = te.GroupedLinear(self.num_local, f, h, bias=False, params_dtype=torch.float32)
        else:
            # All E experts drawn from the random stream, then this rank's slice kept: the EP=k model's local
            # experts equal the EP=1 model's, and every module built afterwards draws the same values too.
            local = slice(self.first, self.first + self.num_local)
            self.w1 = nn.Parameter((torch.randn(e, h, f) / math.sqrt(h))[local].clone())
            self.w2 = nn.Parameter((torch.randn(e, f, h) / math.sqrt(f))[local].clone())
            #: The engine's declaration: dim 0 of w1 and w2 indexes this rank's experts, so under expert
            #: parallelism megatron_fsdp's state dicts hold the global [E, ...] tensors under the EP=1 keys
            #: ([Note: expert parallelism] in megatron_fsdp/_expert.py, Checkpoints).
            self.stacked_expert_dims = {"w1": 0, "w2": 0}

    @property
    def cuda_graph_unsafe(self) -> Optional[str]:
        """Why this module's forward cannot be captured, or None ([Note: capturability of the experts])."""
        if self.ep_size > 1:
            return _ep_reason(self.ep_size)
        if self.mode in _SYNC_REASON:
            return _SYNC_REASON[self.mode]
        if self.mode == "grouped_mm" and self.w1.is_cuda and self._gmm_dtype(self.w1.dtype) != torch.bfloat16:
            return _fp32_gmm_reason(self._gmm_dtype(self.w1.dtype))
        return None

    def _gmm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.grouped_mm_dtype == "bfloat16" else dtype

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dense: ``forward(tokens [T, h], combine [T, E]) -> [T, h]``; else ``forward(rows [T*K, h] grouped by
        expert, counts [E]) -> [T*K, h]`` (unweighted expert outputs). With expert parallelism the rows go to
        their experts' ranks and come back (``apps/moe_ep.py``)."""
        if self.ep_size > 1:
            return self._expert_parallel(x, counts)
        if self.mode == "dense":
            hid = F.gelu(torch.einsum("th,ehf->etf", x, self.w1))
            out = torch.einsum("etf,efh->eth", hid, self.w2)
            return torch.einsum("eth,te->th", out, counts.to(out.dtype))
        if self.mode == "grouped_mm":
            return self._grouped_mm(x, counts)
        if self.mode == "capacity":
            return self._capacity(x, counts)
        return self._on_host_sizes(x, counts.tolist())  # the host sync that keeps these paths out of graphs

    def _on_host_sizes(self, x: torch.Tensor, sizes: List[int], first: int = 0) -> torch.Tensor:
        """``split``/``te_grouped`` given the rows per (local) expert as host integers; ``first``: the local expert of
        ``sizes[0]`` (a group of [Note: overlapped expert groups])."""
        if self.mode == "te_grouped":
            return self.fc2(F.gelu(self.fc1(x, sizes)), sizes)
        outs = [F.gelu(rows @ self.w1[first + e]) @ self.w2[first + e] for e, rows in enumerate(x.split(sizes))]
        return torch.cat(outs)

    def _expert_parallel(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Exchange counts, dispatch, local experts, combine ([Note: deterministic expert parallelism])."""
        group = self.ep_group
        received = moe_ep.receive_counts(counts, group)
        send, recv = moe_ep.host_tables(counts, received, self.ep_size)  # the layer's one host sync
        if self.ep_chunks > 1:
            return self._expert_groups(x, counts, received, send, recv)
        send_splits = [sum(row) for row in send]
        recv_splits = [sum(row) for row in recv]
        arrived = moe_ep.AllToAll.apply(x, recv_splits, send_splits, group)  # (source, local expert)
        back = self._local(arrived, received.view(self.ep_size, self.num_local), recv, 0)
        return moe_ep.AllToAll.apply(back, send_splits, recv_splits, group)

    def _local(self, arrived: torch.Tensor, table: torch.Tensor, recv: List[List[int]], first: int) -> torch.Tensor:
        """Rows laid out (source, local expert) -> this rank's experts ``first ..`` -> the outputs in the same layout.
        ``table``: the rows per (source, expert) on the device, ``recv`` the same on the host."""
        total = sum(sum(row) for row in recv)
        to_expert = moe_ep.regroup_index(table, total)  # on the device: the index needs no host list
        to_source = moe_ep.regroup_index(table.t(), total)  # the inverse
        by_expert = moe_ep.Permute.apply(arrived, to_expert, to_source)  # (local expert, source)
        sizes = [sum(row[l] for row in recv) for l in range(len(recv[0]))]
        # A rank that receives no rows runs the loop: grouped_mm's CPU backward refuses an empty gradient.
        if self.mode == "grouped_mm" and total > 0:
            n = len(sizes)
            # one group: the parameters themselves, as without groups; else this group's slices
            w1, w2 = (None, None) if n == self.num_local else (self.w1[first:first + n], self.w2[first:first + n])
            out = self._grouped_mm(by_expert, moe_ep.local_expert_counts(table, len(recv)), w1, w2)
        else:
            out = self._on_host_sizes(by_expert, sizes, first)
        return moe_ep.Permute.apply(out, to_source, to_expert)  # (source, local expert)

    def _expert_groups(self, x: torch.Tensor, counts: torch.Tensor, received: torch.Tensor,
                       send: List[List[int]], recv: List[List[int]]) -> torch.Tensor:
        """[Note: overlapped expert groups]: the rows in groups of local experts, every group's dispatch started first,
        each group's combine started once its experts ran."""
        group, ep, c = self.ep_group, self.ep_size, self.ep_chunks
        per = self.num_local // c
        # this rank's rows, (destination, local expert) -> (group, destination, expert of the group)
        by_group = counts.view(ep, c, per).sum(-1)
        total = sum(sum(row) for row in send)
        to_groups = moe_ep.regroup_index(by_group, total)
        from_groups = moe_ep.regroup_index(by_group.t(), total)
        grouped = moe_ep.Permute.apply(x, to_groups, from_groups)
        sends = [[sum(row[g * per:(g + 1) * per]) for row in send] for g in range(c)]
        recvs = [[row[g * per:(g + 1) * per] for row in recv] for g in range(c)]
        splits = [[sum(r) for r in recvs[g]] for g in range(c)]
        dispatched = [moe_ep.start_all_to_all(rows, splits[g], sends[g], group)
                      for g, rows in enumerate(grouped.split([sum(s) for s in sends]))]
        combined = []
        for g, (buf, transfer) in enumerate(dispatched):
            arrived = moe_ep.finish_all_to_all(buf, splits[g], sends[g], group, transfer)
            table = received.view(ep, c, per)[:, g]
            back = self._local(arrived, table, recvs[g], g * per)
            combined.append((moe_ep.start_all_to_all(back, sends[g], splits[g], group), g))
        outs = [moe_ep.finish_all_to_all(buf, sends[g], splits[g], group, transfer)
                for (buf, transfer), g in combined]
        return moe_ep.Permute.apply(torch.cat(outs), from_groups, to_groups)  # (destination, local expert) again

    def _grouped_mm(self, x: torch.Tensor, counts: torch.Tensor, w1: Optional[torch.Tensor] = None,
                    w2: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = self._gmm_dtype(x.dtype)
        if x.is_cuda and dtype != torch.bfloat16:
            raise NotImplementedError(_fp32_gmm_reason(dtype))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w1 = (self.w1 if w1 is None else w1).to(dtype)
        w2 = (self.w2 if w2 is None else w2).to(dtype)
        hid = F.gelu(_DenseGrad.apply(F.grouped_mm(x.to(dtype), w1, offs=offs)))
        return _DenseGrad.apply(F.grouped_mm(hid, w2, offs=offs)).to(x.dtype)


    def capacity(self, num_rows: int) -> int:
        """Rows each expert takes in ``capacity`` mode: ``ceil(T*K / E * moe_capacity_factor)`` (from shapes)."""
        return max(1, math.ceil(num_rows / self.w1.shape[0] * self.capacity_factor))

    def _capacity(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Drop-and-pad: each expert takes at most C rows (its first C in token order) into a static
        [E, C, h] batch, padded with zero rows; rows past C get a zero output (Megatron's
        ``moe_pad_expert_input_to_capacity``). Gathers only, no host read, static shapes."""
        n, h = x.shape
        e = self.w1.shape[0]
        c = self.capacity(n)
        ends = torch.cumsum(counts, 0)
        starts = ends - counts
        slot = torch.arange(c, device=x.device)
        # [E, C]: the row each slot takes, or n (a zero row) past the expert's count
        src = torch.where(slot[None] < counts[:, None], starts[:, None] + slot[None], n)
        padded = torch.cat([x, x.new_zeros(1, h)])[src.reshape(-1)].view(e, c, h)
        out = torch.bmm(F.gelu(torch.bmm(padded, self.w1)), self.w2).reshape(e * c, h)
        # back to the rows: row r of expert g sits at slot r - starts[g]; past C it reads a zero row
        rows = torch.arange(n, device=x.device)
        expert = torch.searchsorted(ends, rows, right=True)
        pos = rows - starts[expert]
        dst = torch.where(pos < c, expert * c + pos, e * c)
        return torch.cat([out, out.new_zeros(1, h)])[dst]


def _ep_rank(group: Optional[Any], ep_size: int) -> int:
    if ep_size == 1:
        return 0
    if group is None:
        raise ValueError(f"Experts with expert_parallel_size={ep_size} needs the expert-parallel process group; pass "
                         f"it (e.g. megatron_fsdp.expert_parallel_groups({ep_size})[0]), as GPT does")
    import torch.distributed as dist

    return dist.get_rank(group)


def _ep_reason(ep_size: int) -> str:
    return (f"Experts with expert_parallel_size={ep_size} send the tokens to their experts' ranks with "
            "all_to_all_single over the expert-parallel group (collectives, never inside a graph) whose split sizes "
            "come from counts.tolist() (a device-to-host sync), whatever moe_experts is; graph "
            "cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess'] and the dispatch, experts and combine run "
            "eagerly between the graphs")


def _fp32_gmm_reason(dtype: torch.dtype) -> str:
    return (f"Experts(moe_experts='grouped_mm') in {dtype} on CUDA: torch's grouped_mm has a fast kernel only "
            "for bfloat16 (sm90+); other dtypes take a fallback loop that copies the offsets to the host (a sync "
            "that breaks capture); set GPTConfig(moe_grouped_mm_dtype='bfloat16') or moe_experts='split' with "
            "the experts eager")


class SharedExpert(nn.Module):
    """An FFN every token goes through (``moe_shared_expert``), added to the routed output."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.moe_ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.moe_ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def unpermute(rows: torch.Tensor, probs: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert outputs [T*K, h] in expert order -> token outputs [T, h]: weight, undo the permutation, sum over
    the K choices ([Note: deterministic dispatch])."""
    weighted = rows * probs.to(rows.dtype).unsqueeze(-1)
    return weighted[inverse].view(-1, top_k, rows.shape[-1]).sum(1)


class MoEBlock(nn.Module):
    """Pre-norm mixture of experts with its residual (see the module docstring for the steps)."""

    cuda_graph_module = "moe"

    def __init__(self, cfg: Any, ep_group: Optional[Any] = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden_size)
        self.router = Router(cfg)
        self.preprocess = MoEPreprocess(cfg)
        self.experts = Experts(cfg, ep_group)
        self.shared = SharedExpert(cfg) if cfg.moe_shared_expert else None
        self.top_k = cfg.moe_top_k
        self.dense = cfg.moe_experts == "dense"

    def forward(self, x: torch.Tensor, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s, h = x.shape
        t = self.ln(x).reshape(b * s, h)
        if self.dense:
            routed = self.experts(t, self.preprocess(self.router(t)))
        else:
            weights, ids = self.router(t)
            rows, probs, counts, inverse = self.preprocess(t, weights, ids)
            routed = unpermute(self.experts(rows, counts), probs, inverse, self.top_k)
        if self.shared is not None:
            routed = routed + self.shared(t)
        out = x + routed.view(b, s, h)
        return out if skip is None else out + 0.5 * skip.to(out.dtype)
