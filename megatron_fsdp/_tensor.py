"""Tensor parallelism (TP) inside the engine: the 2-D (dp, tp) layout, which parameters are TP shards, and the
checks made once at ``fully_shard``.

[Note: tensor parallelism]
*Layout.* ``W`` ranks form a 2-D grid ``(dp, tp)`` of shape ``(W/TP, TP)``, TP fastest (megatron-core's order):

- TP group ``i`` = ranks ``{i*TP, .., i*TP+TP-1}`` (contiguous): the ranks among which the model splits every
  layer. World 4, TP 2: ``{0,1}``, ``{2,3}``. Contiguous because the TP collectives (an all-gather before and a
  reduce-scatter after every column/row-parallel pair, forward and backward) sit on the critical path and cannot
  overlap the layer's compute: they want the fastest links (NVLink within a node).
- DP group ``j`` = ranks ``{j, j+TP, j+2TP, ..}`` (strided): the ranks that hold the same TP slice. World 4,
  TP 2: ``{0,2}``, ``{1,3}``. This is the engine's process group: FSDP shards, gathers and reduces over it only.

*TP first, FSDP last.* The model builds only its TP slice (each TP rank's parameters are different tensors), so
the engine never sees a TP split: every unit is sharded over the DP group as without TP (``W/TP`` ranks), the
initial values are broadcast from the DP group's first rank, and gradients are averaged over the DP size. Data:
every rank of a TP group trains on the same rows (the DP rank picks them); every TP rank computes the same loss.

*Which parameters.* With ``TP > 1`` a parameter is a TP shard if it carries ``tensor_model_parallel = True``
(megatron-core's and TE's attribute, with ``partition_dim``); every other parameter is replicated over TP and
must hold the same value on every TP rank (checked at ``fully_shard``). A replicated parameter that also
carries ``sequence_parallel = True`` (megatron-core's and TE's attribute: the norms and row-parallel biases under
sequence parallelism) has a gradient that is a partial sum per TP rank (each rank saw its own positions).

*Where the TP all-reduce runs: in the engine.* Megatron sums the ``sequence_parallel`` gradients over TP in its
``finalize_model_grads``, outside the model; the engine does it in the unit's gradient fold (``_reduce.py``),
before the DP reduce-scatter: a unit's parameters are laid out replicated-``sequence_parallel`` first, then the
other replicated ones, then the TP shards ([Note: two regions] per region), so those gradients are one contiguous
range of the unsharded gradient buffer, all-reduced (SUM) over the TP group in one call. The reduction over DP
that follows is linear, so the result is the sum over TP of the mean over DP. In the engine, not in a model-side
backward hook: the fold is where the gradients are already one flat buffer (one collective per unit, not per
parameter), no model has to carry hooks for it, and it stays outside the per-layer graphs with the rest of FSDP's
collectives (post-backward runs around a replay, not in it). At ``TP = 1`` the attributes are ignored
(megatron-core and TE set ``tensor_model_parallel`` at every TP size).

*Clipping.* One norm over both dimensions: each rank's main-gradient shard is split at the end of the replicated
range; the p-th powers of both parts are summed over DP (each element once per TP column), then the TP shards'
part over TP as well (each TP rank holds other elements), while the replicated part is counted once (every TP rank
holds the same values). The inf norm is the maximum over both groups.

*Checkpoints.* ``state_dict()`` holds this rank's TP slice under the model's own names (``apps/tp.py``'s
``merge_tp_state_dicts`` turns the TP ranks' dicts into the TP=1 one). ``sharded_state_dict()`` keys a TP shard
per TP rank: ``{name}@tp{r}of{TP}``, a DTensor ``Shard(0)`` over the DP group's mesh of the slice's shape, and
replicated parameters under their own names (every TP rank saves the same values; DCP stores them once). So a
checkpoint reshards over DP (saved at ``W`` ranks, loaded at ``W'`` with the same TP); loading at another TP is
not supported (DCP names the missing ``@tp`` key): go through full state dicts and the slice/merge functions.
Not a 2-D DTensor: the reference model's QKV slice is not a contiguous block of the TP=1 tensor (each rank takes
heads from each of q, k and v), which no ``Shard`` placement describes.

*Refused.* HSDP with TP and expert parallelism with TP (neither's groups are built for a third dimension); a TP
size that does not divide the world; explicit groups that do not tile the world as a grid; a model whose own TP
group (``module.tensor_parallel_group``) has other ranks than the engine's, or that has one of more than one rank
while the engine has no TP; TP ranks whose units or parameters differ (names, shapes, tags) or whose replicated
parameters differ in value.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TensorParallelTopology", "tensor_parallel_groups", "resolve", "is_tp_shard", "is_sequence_parallel",
           "tp_order", "check_tp_plan", "check_model_group", "dcp_key"]


class TensorParallelTopology:
    """This rank's TP group (held weakly, as the engine holds its group)."""

    def __init__(self, tp_group: dist.ProcessGroup) -> None:
        self._tp: Callable[[], Optional[dist.ProcessGroup]] = weakref.ref(tp_group)
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        self.tp_ranks = dist.get_process_group_ranks(tp_group)
        #: clean names of this rank's TP-shard parameters (their checkpoint keys carry the TP rank)
        self.shard_names: set = set()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        group = self._tp()
        if group is None:
            raise RuntimeError("megatron_fsdp: the tensor-parallel group was destroyed (torch.distributed."
                               "destroy_process_group()); use the model before destroying its groups")
        return group


def tensor_parallel_groups(tensor_parallel_size: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(tensor_parallel_group, data_parallel_group)`` for ``tensor_parallel_size`` over the world.

    The layout of [Note: tensor parallelism] in ``megatron_fsdp/_tensor.py``: TP groups of contiguous ranks, DP
    groups strided by ``tensor_parallel_size``. A collective over the world (``new_group`` for every group, in
    one order on every rank). Give the TP group to the model and both to ``fully_shard(process_group=dp,
    tensor_parallel_group=tp)`` (or let ``fully_shard(tensor_parallel_size=tp)`` build its own, the same layout).
    """
    world = dist.get_world_size()
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer that divides the "
                         f"world size ({world}); pass e.g. 1, 2 or {world}")
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world}: the "
                         "ranks form a (data-parallel, tensor-parallel) grid of tensor_parallel_size columns; pass a "
                         f"divisor of {world}")
    me = dist.get_rank()
    tp = dp = None
    for i in range(world // tensor_parallel_size):  # every rank creates every group, in the same order
        members = list(range(i * tensor_parallel_size, (i + 1) * tensor_parallel_size))
        g = dist.new_group(members)
        if me in members:
            tp = g
    for j in range(tensor_parallel_size):
        members = list(range(j, world, tensor_parallel_size))
        g = dist.new_group(members)
        if me in members:
            dp = g
    assert tp is not None and dp is not None
    return tp, dp


def resolve(*, process_group: Optional[dist.ProcessGroup], tensor_parallel_size: Optional[int],
            tensor_parallel_group: Optional[dist.ProcessGroup], hybrid: bool, expert: bool
            ) -> Tuple[Optional[dist.ProcessGroup], Optional[TensorParallelTopology]]:
    """Check ``fully_shard``'s TP arguments: ``(the data-parallel group to shard over, the topology)``; the
    topology is None without TP (the process group is returned unchanged)."""
    size = tensor_parallel_size
    if tensor_parallel_group is not None:
        got = dist.get_world_size(tensor_parallel_group)
        if size is not None and size != got:
            raise ValueError(f"tensor_parallel_size={size} but tensor_parallel_group has {got} ranks; they must agree: "
                             f"pass tensor_parallel_size={got} or drop it")
        size = got
    if size is None or (size == 1 and tensor_parallel_group is None):
        return process_group, None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer (1: no tensor parallelism)")
    if hybrid:
        raise NotImplementedError(
            f"tensor parallelism (tensor parallel size {size}) with hybrid sharding (mesh=, replicate_group=, "
            "shard_group=): the engine's data-parallel group would need a (replicate, shard) split per TP column, "
            "which it does not build; use a flat data-parallel group with TP (process_group= or "
            "tensor_parallel_size=), or HSDP without TP")
    if expert:
        raise NotImplementedError(
            f"tensor parallelism (tensor parallel size {size}) with expert parallelism: the expert groups would have "
            "to split each TP column's data-parallel ranks, which the engine does not build; use one of the two")
    if size == 1:
        return process_group, None
    if tensor_parallel_group is None:
        if process_group is not None:
            raise ValueError(f"fully_shard got tensor_parallel_size={size} and process_group=: with "
                             "tensor_parallel_size the engine builds both groups from the world; pass "
                             "tensor_parallel_group= with process_group= (e.g. from "
                             f"megatron_fsdp.tensor_parallel_groups({size})), or drop process_group=")
        tp, dp = tensor_parallel_groups(size)
        return dp, TensorParallelTopology(tp)
    if process_group is None:
        raise ValueError("fully_shard got tensor_parallel_group= without process_group=: the data-parallel group "
                         "would default to the world, whose ranks hold different TP slices; pass the "
                         "data-parallel group too (megatron_fsdp.tensor_parallel_groups(tp) returns both), or "
                         "tensor_parallel_size= alone")
    _check_grid(process_group, tensor_parallel_group)
    return process_group, TensorParallelTopology(tensor_parallel_group)


def _check_grid(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup) -> None:
    """Explicit groups: DP x TP must tile the world as a grid through this rank (a collective over the world)."""
    me = dist.get_rank()
    dp, tp = dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(tp_group)
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sorted(dp), sorted(tp)))
    problem = None
    if sorted(set(dp) & set(tp)) != [me]:
        problem = f"process_group {dp} and tensor_parallel_group {tp} must meet only in this rank (rows and columns)"
    else:
        for kind, k in (("data-parallel", 0), ("tensor-parallel", 1)):
            groups = {tuple(g[k]) for g in every}
            if sorted(r for g in groups for r in g) != list(range(len(every))):
                problem = f"the {kind} groups {sorted(groups)} do not partition the world's {len(every)} ranks"
                break
        if problem is None and len(dp) * len(tp) != len(every):
            problem = f"{len(dp)} data-parallel x {len(tp)} tensor-parallel ranks are not the world's {len(every)}"
    problems: List[Any] = [None] * len(every)
    dist.all_gather_object(problems, problem)
    bad = next(((r, p) for r, p in enumerate(problems) if p is not None), None)
    if bad is not None:
        raise ValueError(f"[rank {me}] the tensor-parallel layout is not a grid (rank {bad[0]}: {bad[1]}); build the "
                         "groups with megatron_fsdp.tensor_parallel_groups(tp), or pass tensor_parallel_size=")


def is_tp_shard(p: torch.Tensor) -> bool:
    """A TP shard: megatron-core's (and TE's) ``tensor_model_parallel`` attribute."""
    return bool(getattr(p, "tensor_model_parallel", False))


def is_sequence_parallel(p: torch.Tensor) -> bool:
    """Replicated over TP with a partial gradient per TP rank (``sequence_parallel``): summed over TP."""
    return bool(getattr(p, "sequence_parallel", False)) and not is_tp_shard(p)


def kind_of(p: torch.Tensor) -> str:
    return "shard" if is_tp_shard(p) else "sequence_parallel" if is_sequence_parallel(p) else "replicated"


_ORDER = {"sequence_parallel": 0, "replicated": 1, "shard": 2}


def tp_order(names: Sequence[str], params: Sequence[nn.Parameter]) -> Tuple[List[str], List[nn.Parameter]]:
    """The unit's parameters laid out replicated-``sequence_parallel`` first, then replicated, then TP shards
    (stable within each kind): [Note: tensor parallelism], Where the TP all-reduce runs."""
    order = sorted(range(len(params)), key=lambda i: _ORDER[kind_of(params[i])])
    return [names[i] for i in order], [params[i] for i in order]


def region_ends(layout: Any, params: Sequence[nn.Parameter]) -> Tuple[int, int]:
    """``(end of the sequence_parallel range, end of the replicated range)`` in a layout of :func:`tp_order`."""
    sp_end = rep_end = 0
    for o, n, p in zip(layout.offsets, layout.numels, params):
        k = kind_of(p)
        if k == "sequence_parallel":
            sp_end = rep_end = o + n
        elif k == "replicated":
            rep_end = o + n
    return sp_end, rep_end


def check_model_group(topo: Optional[TensorParallelTopology], module: nn.Module) -> None:
    """The model's own TP group (``module.tensor_parallel_group``, as the reference GPT exposes it) must be the
    engine's, rank for rank."""
    group = getattr(module, "tensor_parallel_group", None)
    if group is None:
        return
    mine = dist.get_process_group_ranks(group)
    if topo is None:
        if len(mine) > 1:
            raise ValueError(
                f"[rank {dist.get_rank()}] the model's tensor_parallel_group has ranks {mine} but fully_shard got no "
                "tensor parallelism: the engine would treat the TP ranks' different slices as one data-parallel "
                f"model (broadcast one slice over all, average unrelated gradients); pass tensor_parallel_size="
                f"{len(mine)} (or process_group= and tensor_parallel_group= from megatron_fsdp.tensor_parallel_groups"
                f"({len(mine)}))")
        return
    if mine != topo.tp_ranks:
        raise ValueError(
            f"[rank {dist.get_rank()}] the model's tensor_parallel_group has ranks {mine} but the engine's "
            f"tensor-parallel group has {topo.tp_ranks}: the model's TP collectives and the engine's data-parallel "
            "reduction would use other layouts, and train wrong gradients without an error; build the model with "
            f"megatron_fsdp.tensor_parallel_groups({topo.tp_size})[0] (or pass the model's groups to fully_shard as "
            "tensor_parallel_group= and process_group=)")


def check_tp_plan(topo: TensorParallelTopology, plan: Sequence[Tuple[str, List[Tuple[str, Tuple[int, ...], str]]]]
                  ) -> None:
    """Every TP rank must plan the same units with the same parameter names, shapes and kinds (their folds
    all-reduce together over TP); a collective over the TP group, raising on every rank together."""
    me = dist.get_rank()
    every: List[Any] = [None] * topo.tp_size
    dist.all_gather_object(every, list(plan), group=topo.tp_group)
    for q, theirs in enumerate(every):
        if theirs != every[0]:
            diff = next(((a[0], a[1][:3], b[1][:3]) for a, b in zip(every[0], theirs) if a != b),
                        (f"{len(every[0])} units", "", f"{len(theirs)} units"))
            raise ValueError(
                f"[rank {me}] the units of TP rank {q} differ from TP rank 0's (unit {diff[0]!r}: {diff[1]} vs "
                f"{diff[2]}); every TP rank must build the same model apart from its slices' values, with the same "
                "tensor_model_parallel / sequence_parallel tags")


def differing_replicated(topo: TensorParallelTopology, device: torch.device,
                         items: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    """Names of ``items`` (one unit's parameters replicated over TP: name, full fp32 value) whose values differ from
    TP rank 0's: one broadcast from TP rank 0 (a collective over TP; call it for every unit on every rank)."""
    from . import _collectives as C

    mine = torch.cat([v.reshape(-1) for _, v in items]) if items else torch.zeros(0, device=device)
    theirs = mine.clone()
    C.broadcast(theirs, 0, topo.tp_group, "replicated parameters over the tensor-parallel group")
    bad, o = [], 0
    for n, v in items:
        if not torch.equal(theirs[o:o + v.numel()], v.reshape(-1)):
            bad.append(n)
        o += v.numel()
    return bad


def refuse_differing_replicated(topo: TensorParallelTopology, bad: List[str]) -> None:
    """Every TP rank raises if any found replicated parameters that differ (one collective over TP)."""
    every: List[Any] = [None] * topo.tp_size
    dist.all_gather_object(every, bad, group=topo.tp_group)
    names = sorted({n for b in every for n in b})
    if names:
        raise ValueError(
            f"[rank {dist.get_rank()}] parameters {names[:5]} are replicated over the tensor-parallel group (no "
            "tensor_model_parallel tag) but differ between its ranks; build every TP rank's replicated parameters "
            "from the same seed, or tag TP shards with tensor_model_parallel=True (and partition_dim)")


def dcp_key(topo: Optional[TensorParallelTopology], name: str) -> str:
    """The checkpoint key of a parameter: a TP shard's names its TP rank ([Note: tensor parallelism])."""
    if topo is not None and name in topo.shard_names:
        return f"{name}@tp{topo.tp_rank}of{topo.tp_size}"
    return name


def foreign_tp_keys(topo: Optional[TensorParallelTopology], keys: Sequence[str]) -> List[str]:
    """Keys of ``keys`` that name a TP shard of another TP size than this engine's."""
    want = f"of{topo.tp_size}" if topo is not None else None
    out = []
    for k in keys:
        if "@tp" in k and (want is None or not k.endswith(want)):
            out.append(k)
    return out

