"""Expert parallelism (EP): which parameters are experts, the expert groups, and the checks made once at
``fully_shard``.

[Note: expert parallelism]
*Groups.* The ``W`` data-parallel ranks ``d_0 .. d_{W-1}`` (the DP group, in its rank order) form a 2-D grid
``(expert-data-parallel, expert-parallel)`` of shape ``(W/EP, EP)``, expert-parallel fastest:

- EP group ``i`` = ``{d_{i*EP}, .., d_{i*EP+EP-1}}`` (contiguous ranks): the ranks among which the model's
  all-to-all spreads the experts. World 4, EP 2: ``{0,1}``, ``{2,3}``.
- EDP group ``j`` = ``{d_j, d_{j+EP}, d_{j+2EP}, ..}``: the ranks that hold the same local experts. World 4,
  EP 2: ``{0,2}``, ``{1,3}``.

Contiguous EP groups because the EP all-to-all sits on the critical path of every MoE layer, forward and
backward, and cannot overlap the layer's compute; contiguous ranks share a node (NVLink) whenever EP divides
the GPUs per node. The EDP collectives (all-gather and reduce-scatter of the expert shards) are prefetched and
overlapped like the dense ones and can afford the slower links. This is Megatron-core's order (``ep`` varies
faster than ``dp`` in its rank generator) and torchtitan's mesh ``(efsdp, ep)``.

*Which parameters are experts.* A parameter is an expert parameter if a module on its path carries
``is_expert = True``, or if its name has a segment ``experts`` (megatron-core's ``mlp.experts.local_experts.0.*``
and torchtitan's ``moe.experts.*``; ``shared_experts`` is dense). Only with ``EP > 1``: at ``EP = 1`` every
parameter is dense, as before. The model builds only its local experts (``E/EP`` of them), as megatron-core
does with ``expert_model_parallel_size``: the engine never splits experts between ranks.

*Buckets.* A unit that owns both kinds (a transformer layer: attention, router and experts) becomes two
``FSDPUnit`` objects over the same module: the dense bucket, sharded and reduced over the DP group as before,
and the expert bucket, sharded over the EDP group (its flat buffers, main shard and optimizer state count
``W/EP`` ranks). Each has its own hooks on the module, so each all-gathers and reduce-scatters on its own group
with the unit's prefetch, recompute and fixed-address rules. Under ``fsdp_double_buffer`` the expert buckets
alternate between a pair of unshard slots of their own (2 and 3), the dense ones between 0 and 1, so a layer's
two buckets never evict each other; the one gradient slot is shared (a bucket's reduction is retired before
the next bucket folds into it). A layer's two buckets are partners: the unit that prefetches the layer
(the next in forward, the previous in backward) gathers both. Expert parameters must live in a unit: the
root's reduction has no second group.

*Gradient averaging.* The reference is the same model at ``EP = 1`` on the same global batch: every rank's
loss is the mean over its own tokens, and the gradient is ``(1/W) * sum_r dL_r/dtheta``. With EP the all-to-all
brings expert ``e`` the tokens of every rank of its EP group, and its backward returns their gradients to
``e``'s owner, so the owner's local gradient is ``sum_{r in its EP group} dL_r/dtheta_e``. Summing that over
the EDP group (one owner of ``e`` per EP group) covers every rank once: ``sum_r dL_r/dtheta_e``. So the
expert fold multiplies by ``1/W`` (the whole DP size, not the EDP size) and the reduce-scatter over EDP sums;
it never averages in the collective (NCCL's AVG would divide by ``W/EP``). Megatron-core does the same
(``expert_gradient_scaling_factor = 1/dp_size``).

*Clipping.* Under a sharded strategy each expert element is held by exactly one rank of the whole DP group
(one EDP group per local-expert position, sharded within it), as is each dense element; so one all-reduce over
the DP group of ``dense + expert`` local p-th powers is the sum over EDP then over EP, every expert counted
once. ``no_shard`` holds dense gradients whole on every rank (no reduction) and expert gradients whole on
every EDP peer, so only the expert part is summed, over the EP group.

*Checkpoints.* Expert parameters leave ``sharded_state_dict()`` as DTensors ``Shard(0)`` over the EDP group's
mesh, under their own names, so the names must tell the experts of different EP ranks apart (name each local
expert by its global index, e.g. ``experts.{e}``). Then DCP stores every expert once and reshards it like a
dense parameter: a checkpoint saved at ``W`` ranks loads at ``W'`` with the same ``EP`` (only the EDP size
changes), and, since the keys and shapes of a global expert do not depend on ``EP``, at another ``EP`` too.
A model that numbers its local experts from 0 on every EP rank (megatron-core's ``local_experts.0``) gives
several experts one name: its state dicts are refused (``NotImplementedError``), training is not affected.
``state_dict()`` holds the dense parameters and this rank's local experts (gathered over EDP);
``load_state_dict`` accepts the other EP ranks' expert keys and skips them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertTopology", "expert_parallel_groups", "resolve", "is_expert_param_name", "expert_param_ids"]


class ExpertTopology:
    """The EP and EDP groups of this rank (held weakly, as the engine holds its group)."""

    def __init__(self, ep_group: dist.ProcessGroup, edp_group: dist.ProcessGroup) -> None:
        self._ep: Callable[[], Optional[dist.ProcessGroup]] = weakref.ref(ep_group)
        self._edp: Callable[[], Optional[dist.ProcessGroup]] = weakref.ref(edp_group)
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self.edp_size = dist.get_world_size(edp_group)
        self.edp_rank = dist.get_rank(edp_group)
        #: expert parameter names held by the other ranks of the EP group (``load_state_dict`` skips them)
        self.foreign_names: Set[str] = set()
        #: the EP ranks give several experts one name ([Note: expert parallelism], Checkpoints)
        self.names_collide = False

    def _get(self, ref: Callable[[], Optional[dist.ProcessGroup]], what: str) -> dist.ProcessGroup:
        group = ref()
        if group is None:
            raise RuntimeError(f"megatron_fsdp: the {what} group was destroyed (torch.distributed."
                               "destroy_process_group()); use the model before destroying its groups")
        return group

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self._get(self._ep, "expert-parallel")

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self._get(self._edp, "expert-data-parallel")


def expert_parallel_groups(expert_parallel_size: int, process_group: Optional[dist.ProcessGroup] = None
                           ) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(expert_parallel_group, expert_data_parallel_group)`` for ``expert_parallel_size``.

    The layout of [Note: expert parallelism] in ``megatron_fsdp/_expert.py``: EP groups of contiguous ranks of
    ``process_group`` (default: the world), EDP groups strided by ``expert_parallel_size``. A collective over the
    world (``new_group`` for every EP and EDP group, in one order on every rank), so ``process_group`` must hold
    every rank of the world. Use it to give the model's all-to-all the EP group, and pass both groups to
    ``fully_shard(expert_parallel_group=..., expert_data_parallel_group=...)``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    world = len(ranks)
    if not isinstance(expert_parallel_size, int) or isinstance(expert_parallel_size, bool) or expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size={expert_parallel_size!r} must be a positive integer that divides the "
                         f"data-parallel size ({world}); pass e.g. 1, 2 or {world}")
    if world % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} does not divide the data-parallel size {world}: "
                         "the ranks form groups of expert_parallel_size each holding every expert once; pass a "
                         f"divisor of {world}")
    if world != dist.get_world_size():
        raise ValueError(f"expert_parallel_size={expert_parallel_size} with a data-parallel group of {world} of the "
                         f"world's {dist.get_world_size()} ranks: building the expert groups is a collective over the "
                         "world that the other ranks would not join; build the groups on every rank yourself and pass "
                         "expert_parallel_group= and expert_data_parallel_group=")
    me = dist.get_rank()
    ep = edp = None
    for i in range(world // expert_parallel_size):  # every rank creates every group, in the same order
        members = ranks[i * expert_parallel_size:(i + 1) * expert_parallel_size]
        g = dist.new_group(members)
        if me in members:
            ep = g
    for j in range(expert_parallel_size):
        members = ranks[j::expert_parallel_size]
        g = dist.new_group(members)
        if me in members:
            edp = g
    assert ep is not None and edp is not None
    return ep, edp


def resolve(*, dp_group: dist.ProcessGroup, hybrid: bool, expert_parallel_size: Optional[int],
            expert_parallel_group: Optional[dist.ProcessGroup],
            expert_data_parallel_group: Optional[dist.ProcessGroup],
            expert_mesh: Optional[DeviceMesh] = None) -> Optional[ExpertTopology]:
    """Check ``fully_shard``'s expert arguments; the topology, or None when ``EP = 1`` (every parameter dense)."""
    if expert_mesh is not None:
        if expert_parallel_group is not None or expert_data_parallel_group is not None:
            raise ValueError("fully_shard got expert_mesh= and expert groups; pass one of: expert_mesh=, "
                             "expert_parallel_group= with expert_data_parallel_group=, or expert_parallel_size=")
        if not isinstance(expert_mesh, DeviceMesh) or expert_mesh.ndim != 2:
            got = f"a {expert_mesh.ndim}-D mesh" if isinstance(expert_mesh, DeviceMesh) else type(expert_mesh).__name__
            raise ValueError(f"expert_mesh must be a 2-D DeviceMesh (expert_data_parallel, expert_parallel), got {got}; "
                             "build one with init_device_mesh(device_type, (W // EP, EP))")
        if expert_mesh.get_coordinate() is None:
            raise ValueError(f"global rank {dist.get_rank()} is not in expert_mesh {expert_mesh.mesh.tolist()}; every "
                             "rank that calls fully_shard must be part of it")
        expert_data_parallel_group, expert_parallel_group = expert_mesh.get_group(0), expert_mesh.get_group(1)
    given = (expert_parallel_group is not None, expert_data_parallel_group is not None)
    if given[0] != given[1]:
        got, missing = (("expert_parallel_group", "expert_data_parallel_group") if given[0]
                        else ("expert_data_parallel_group", "expert_parallel_group"))
        raise ValueError(f"fully_shard got {got}= without {missing}=; pass both (e.g. from "
                         "megatron_fsdp.expert_parallel_groups(ep)) or neither (expert_parallel_size= builds them)")
    ep_size = expert_parallel_size
    if given[0]:
        got = dist.get_world_size(expert_parallel_group)
        if ep_size is not None and ep_size != got:
            raise ValueError(f"expert_parallel_size={ep_size} but expert_parallel_group has {got} ranks; they must "
                             f"agree: pass expert_parallel_size={got} or drop it")
        ep_size = got
    if ep_size is None or ep_size == 1 and not given[0]:
        return None
    if hybrid:
        raise NotImplementedError(
            f"expert_parallel_size={ep_size} with hybrid sharding (mesh=(replicate, shard)): the expert buckets would "
            "need their own (replicate, shard) split of the expert-data-parallel group and an all-reduce of expert "
            "gradients across replicas, which the engine does not implement; use a flat data-parallel group with "
            "expert parallelism, or HSDP without it")
    if ep_size == 1:
        return None
    if not given[0]:
        if dist.get_process_group_ranks(dp_group) != list(range(dist.get_world_size())):
            raise ValueError(f"expert_parallel_size={ep_size} with a data-parallel group other than the world: "
                             "building the expert groups is a collective over the world; build both groups on every "
                             "rank and pass expert_parallel_group= and expert_data_parallel_group=")
        ep, edp = expert_parallel_groups(ep_size, dp_group)
        return ExpertTopology(ep, edp)
    _check_grid(dp_group, expert_parallel_group, expert_data_parallel_group)
    return ExpertTopology(expert_parallel_group, expert_data_parallel_group)


def _check_grid(dp_group: dist.ProcessGroup, ep_group: dist.ProcessGroup, edp_group: dist.ProcessGroup) -> None:
    """Explicit groups: EP x EDP must tile the DP group as a grid through this rank (a collective over DP)."""
    me = dist.get_rank()
    dp = dist.get_process_group_ranks(dp_group)
    ep = dist.get_process_group_ranks(ep_group)
    edp = dist.get_process_group_ranks(edp_group)
    if len(ep) * len(edp) != len(dp):
        raise ValueError(f"[rank {me}] expert_parallel_group {ep} ({len(ep)} ranks) x expert_data_parallel_group {edp} "
                         f"({len(edp)} ranks) must have as many ranks as the data-parallel group ({len(dp)}); build "
                         "them with megatron_fsdp.expert_parallel_groups(ep)")
    outside = sorted((set(ep) | set(edp)) - set(dp))
    if outside:
        raise ValueError(f"[rank {me}] ranks {outside} of the expert groups are not in the data-parallel group {dp}; "
                         "expert parallelism splits the data-parallel ranks")
    if sorted(set(ep) & set(edp)) != [me]:
        raise ValueError(f"[rank {me}] expert_parallel_group {ep} and expert_data_parallel_group {edp} must meet only in "
                         "this rank: rows and columns of one grid")
    every: List[Any] = [None] * len(dp)
    dist.all_gather_object(every, (sorted(ep), sorted(edp)), group=dp_group)
    eps = {tuple(e) for e, _ in every}
    edps = {tuple(d) for _, d in every}
    covered = sorted(r for g in eps for r in g)
    if covered != sorted(dp) or sorted(r for g in edps for r in g) != sorted(dp):
        raise ValueError(f"[rank {me}] the expert-parallel groups {sorted(eps)} and expert-data-parallel groups "
                         f"{sorted(edps)} of the data-parallel ranks do not partition them; every rank must be in one "
                         "group of each kind: build them with megatron_fsdp.expert_parallel_groups(ep)")


def is_expert_param_name(name: str) -> bool:
    """Whether a parameter name has a segment ``experts`` (megatron-core's and torchtitan's naming)."""
    return "experts" in name.split(".")


def expert_param_ids(module: nn.Module) -> Set[int]:
    """``id`` of every expert parameter of ``module`` ([Note: expert parallelism], Which parameters)."""
    out: Set[int] = set()
    for mname, m in module.named_modules(remove_duplicate=False):
        tagged = bool(getattr(m, "is_expert", False))
        for pn, p in m.named_parameters(recurse=False):
            if tagged or is_expert_param_name(f"{mname}.{pn}" if mname else pn):
                out.add(id(p))
        if tagged:
            out.update(id(p) for p in m.parameters())
    return out


def check_expert_plan(topo: ExpertTopology, dp_group: dist.ProcessGroup,
                      plan: Sequence[Tuple[str, List[Tuple[str, Tuple[int, ...]]], List[Tuple[str, Tuple[int, ...]]]]]
                      ) -> None:
    """Refuse plans the ranks cannot run together; note names for state dicts (a collective over DP).

    ``plan``: per unit in plan order, ``(unit name, dense (name, shape)s, expert (name, shape)s)``.
    Every DP rank must plan the same units with the same dense parameters (they shard and reduce together), and
    each EDP peer the same expert parameters (the same local experts); EP peers must plan expert buckets in the
    same units (the hooks run per unit on every rank).
    """
    me = dist.get_rank()
    world = dist.get_world_size(dp_group)
    every: List[Any] = [None] * world
    dist.all_gather_object(every, (me, topo.ep_rank, topo.edp_rank, list(plan)), group=dp_group)
    mine = list(plan)
    # Every rank checks every rank's plan, so that all raise together (none is left waiting in a collective).
    # An expert-only unit (e.g. each expert a unit) is named after its expert, which differs between EP ranks.
    def skeleton(p: Any) -> List[Any]:
        return [(u if d else "<experts>", d, bool(e)) for u, d, e in p]

    shape = skeleton(every[0][3])
    first_of_ep: Dict[int, Any] = {}
    for rank, ep_rank, _, theirs in every:
        if skeleton(theirs) != shape:
            diff = _first_diff(shape, skeleton(theirs))
            raise ValueError(f"[rank {me}] the dense parameters or the units with experts of rank {rank} differ from "
                             f"rank {every[0][0]}'s ({diff}); every data-parallel rank must build the same model apart "
                             "from its local experts")
        peer = first_of_ep.setdefault(ep_rank, (rank, theirs))
        for (u, _, e_peer), (_, _, e_theirs) in zip(peer[1], theirs):
            if e_peer != e_theirs:  # expert-data-parallel peers hold the same local experts
                n_peer, n_theirs = (sum(_numel(s) for _, s in e) for e in (e_peer, e_theirs))
                raise ValueError(
                    f"[rank {me}] unit {u} holds expert parameters of {n_theirs} elements on rank {rank} "
                    f"({[n for n, _ in e_theirs][:4]}) but {n_peer} on rank {peer[0]} ({[n for n, _ in e_peer][:4]}), "
                    f"its expert-data-parallel peer (expert-parallel rank {ep_rank} of both); the ranks of an "
                    "expert-data-parallel group shard the same local experts: build E/EP experts on every rank, the "
                    "same ones (names and shapes) on ranks with the same expert-parallel rank")
    # Names: the experts of one EP group's ranks must differ (decided on every rank alike, as state dicts are
    # collectives), and the other EP ranks' names are what load_state_dict skips.
    names_of = [(ep_rank, edp_rank, {n for _, _, e in theirs for n, _ in e}) for _, ep_rank, edp_rank, theirs in every]
    topo.names_collide = any(a[2] & b[2] for a in names_of for b in names_of if a[1] == b[1] and a[0] < b[0])
    own = {n for _, _, e in mine for n, _ in e}
    topo.foreign_names = set().union(*(n for _, edp_rank, n in names_of if edp_rank == topo.edp_rank)) - own


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _first_diff(a: List[Any], b: List[Any]) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x[0]!r}: {x[1:]} vs {y[1:]}"
    return f"{len(a)} units vs {len(b)}"


def refuse_colliding_names(topo: Optional[ExpertTopology], what: str) -> None:
    """State dicts need one name per expert ([Note: expert parallelism], Checkpoints)."""
    if topo is not None and topo.names_collide:
        raise NotImplementedError(
            f"{what} with expert parallelism: the ranks of an expert-parallel group give their different local "
            "experts the same parameter names (e.g. experts.0 on every rank), so a checkpoint would hold one of "
            "them under each name. Name every local expert by its global index (e.g. experts.{ep_rank * E/EP + i}); "
            "training is not affected")
