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

*Checkpoints.* Every expert must leave the state dicts under a name and at a place that do not depend on EP,
so that DCP stores each expert once and a checkpoint loads at any world size and any EP. Two ways:

- Per-expert parameters named by their global index (``experts.{e}.w1``): each leaves ``sharded_state_dict()``
  as a DTensor ``Shard(0)`` over a 1-D mesh of the EDP group, under its own name, resharded by DCP like a dense
  parameter. ``state_dict()`` holds the dense parameters and this rank's local experts (gathered over EDP);
  ``load_state_dict`` accepts the other EP ranks' expert keys and skips them.
- Stacked local experts: one parameter holds this rank's ``E/EP`` experts along an expert dim ``d``
  (``experts.w1 [E/EP, h, f]``, EP rank ``q`` holding global experts ``q*E/EP .. (q+1)*E/EP-1``), under the same
  name on every EP rank. Its module declares it: ``stacked_expert_dims = {"w1": 0, "w2": 0}`` (the module's own
  parameter names -> ``d``; a module attribute, like ``is_expert``: an attribute on the parameter would be lost by
  ``to()``/``to_empty()`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``, which swaps the
  parameter's ``__dict__``). With ``EP > 1`` ``state_dict()`` gathers the parameter over EDP and then over EP
  (one all-gather over the EP group per unit region) and returns the global tensor (``[E, h, f]``) under the
  EP=1 key: an EP=k state dict has the EP=1 model's keys and shapes. ``load_state_dict`` takes that global tensor (a local ``[E/EP, ...]`` one is refused) and
  keeps this rank's slice along ``d``, so full state dicts load EP=1 <-> EP=k. In ``sharded_state_dict()`` (and
  ``optimizer_state_dict()``: ``exp_avg`` etc. alike) it is a DTensor of the global shape over the 2-D mesh
  ``(ep, edp)`` of the expert groups (coordinate ``(q, j)``: the rank with EP rank ``q`` and EDP rank ``j``),
  placed ``(Shard(d), Shard(0))``: mesh dimension ``ep`` splits ``d`` into the ``EP`` local blocks (``E/EP``
  divides evenly), then ``edp`` splits dim 0 of that block by ``torch.chunk`` rows (for ``d = 0`` both split dim
  0, EP first: DTensor's order, mesh dimension by mesh dimension). That is exactly what the rank's copy holds:
  like every DTensor of ours it is a redistribution of the gathered flat buffer (the engine's EDP shards are
  element ranges of the unit's flat buffer, not rows: [Note: DCP sharding metadata] in _dcp.py), rows
  ``row_range(E/EP, W/EP, j)`` of this EP rank's experts. Loading redistributes to ``(Shard(d), Replicate())``
  (an all-gather over EDP: this EP rank's experts, never the global tensor) and writes our flat slice. DCP
  reshards between this and any other layout of the global tensor: another EDP size, another EP, EP=1's
  ``Shard(0)`` over the DP group (tests/engine/test_ep_checkpoint.py). At ``EP = 1`` the declaration changes
  nothing (the parameter is dense and whole).

A model whose EP ranks give different experts one name without declaring them stacked (megatron-core's
``local_experts.0``; TE ``GroupedLinear``'s ``weight{i}``, a local index, as the reference GPT's ``te_grouped``
experts have) has its state dicts refused (``NotImplementedError`` naming the colliding parameters and both
fixes: the declaration, or names by global index); training is not affected. ``summon_full_params()`` always
gives this rank's local values.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import _collectives as C

__all__ = ["ExpertTopology", "expert_parallel_groups", "resolve", "is_expert_param_name", "expert_param_ids",
           "STACKED_ATTR", "stacked_expert_dims"]

#: The experts module's declaration of its stacked parameters: ``{parameter name: expert dim}``
#: ([Note: expert parallelism], Checkpoints).
STACKED_ATTR = "stacked_expert_dims"


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
        #: the EP ranks give several experts one name ([Note: expert parallelism], Checkpoints): some such names
        self.colliding_names: List[str] = []
        #: stacked expert parameters (names as the units hold them) -> the dim that indexes the local experts
        self.stacked: Dict[str, int] = {}
        #: ``grid[q][j]``: the global rank with EP rank ``q`` and EDP rank ``j`` (the DCP mesh of stacked experts)
        self.grid: List[List[int]] = []

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

    @property
    def names_collide(self) -> bool:
        return bool(self.colliding_names)

    def global_shape(self, name: str, local_shape: Sequence[int]) -> Tuple[int, ...]:
        """The shape of stacked parameter ``name`` with every EP rank's experts (its expert dim times EP)."""
        d = self.stacked[name]
        return tuple(s * self.ep_size if i == d else s for i, s in enumerate(local_shape))

    def local_experts(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This EP rank's slice of the global value ``full`` of stacked parameter ``name`` (a view)."""
        d = self.stacked[name]
        n = full.shape[d] // self.ep_size
        return full.narrow(d, self.ep_rank * n, n)

    def gather_stacked(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``values`` (this rank's local experts, one per name) with each stacked one replaced by its global value.

        One all-gather over the EP group of the stacked values together: a collective, every EP peer calls it
        with the same names (checked at ``fully_shard``).
        """
        idx = [i for i, n in enumerate(names) if n in self.stacked]
        out = list(values)
        if not idx:
            return out
        local = torch.cat([values[i].detach().reshape(-1) for i in idx])
        every = torch.empty(self.ep_size * local.numel(), dtype=local.dtype, device=local.device)
        work = C.all_gather(every, local, self.ep_group, "a state dict's stacked experts (expert-parallel group)")
        if work is not None:
            work.wait()
        parts = every.view(self.ep_size, -1).split([values[i].numel() for i in idx], dim=1)
        for i, part in zip(idx, parts):
            shape = tuple(values[i].shape)
            out[i] = torch.cat([row.reshape(shape) for row in part], dim=self.stacked[names[i]])
        return out


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


def stacked_expert_dims(module: nn.Module) -> Dict[int, int]:
    """``id`` of every parameter that its module declares stacked -> its expert dim (``STACKED_ATTR``).

    The declaration names the module's own parameters (not a submodule's); a dim may be negative (from the end).
    """
    out: Dict[int, int] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        decl = getattr(m, STACKED_ATTR, None)
        if decl is None:
            continue
        where = f"{type(m).__name__} {mname or '<root>'}"
        if not isinstance(decl, Mapping):
            raise TypeError(f"{where}: {STACKED_ATTR} is a {type(decl).__name__}; declare a dict of the module's own "
                            "parameter names to the dim that indexes the local experts, e.g. {'w1': 0, 'w2': 0}")
        for pn, dim in decl.items():
            p = m._parameters.get(pn) if isinstance(pn, str) else None
            if p is None:
                raise ValueError(f"{where} declares {STACKED_ATTR}[{pn!r}], which is not one of its own parameters "
                                 f"({sorted(k for k, v in m._parameters.items() if v is not None)}); name a parameter "
                                 "registered on this module")
            if not isinstance(dim, int) or isinstance(dim, bool) or not -p.dim() <= dim < p.dim():
                raise ValueError(f"{where} declares {STACKED_ATTR}[{pn!r}] = {dim!r}, but {pn} has shape "
                                 f"{tuple(p.shape)}; give the dim (0 .. {p.dim() - 1}) that indexes the local experts")
            out[id(p)] = dim % p.dim()
    return out


def check_expert_plan(topo: ExpertTopology, dp_group: dist.ProcessGroup,
                      plan: Sequence[Tuple[str, List[Tuple[str, Tuple[int, ...]]], List[Tuple[str, Tuple[int, ...]]]]],
                      stacked: Mapping[str, Tuple[int, Tuple[int, ...]]]) -> None:
    """Refuse plans the ranks cannot run together; note names for state dicts (a collective over DP).

    ``plan``: per unit in plan order, ``(unit name, dense (name, shape)s, expert (name, shape)s)``;
    ``stacked``: the stacked expert parameters, ``name -> (expert dim, local shape)``.
    Every DP rank must plan the same units with the same dense parameters (they shard and reduce together), and
    each EDP peer the same expert parameters (the same local experts); EP peers must plan expert buckets in the
    same units (the hooks run per unit on every rank), and every rank the same stacked parameters (a stacked
    parameter is one tensor split over the EP group).
    """
    me = dist.get_rank()
    world = dist.get_world_size(dp_group)
    every: List[Any] = [None] * world
    dist.all_gather_object(every, (me, topo.ep_rank, topo.edp_rank, list(plan), dict(stacked)), group=dp_group)
    mine = list(plan)
    # Every rank checks every rank's plan, so that all raise together (none is left waiting in a collective).
    # An expert-only unit (e.g. each expert a unit) is named after its expert, which differs between EP ranks.
    def skeleton(p: Any) -> List[Any]:
        return [(u if d else "<experts>", d, bool(e)) for u, d, e in p]

    shape = skeleton(every[0][3])
    first_of_ep: Dict[int, Any] = {}
    for rank, _, _, _, theirs in every:
        if theirs != every[0][4]:
            diff = sorted(set(theirs.items()) ^ set(every[0][4].items()))[:2]
            raise ValueError(
                f"[rank {me}] the stacked expert parameters ({STACKED_ATTR}: name -> (expert dim, local shape)) of "
                f"rank {rank} differ from rank {every[0][0]}'s ({diff}); a stacked parameter holds E/EP experts on "
                "every rank, its EP group's together the whole tensor: build the same experts module on every rank")
    for rank, ep_rank, _, theirs, _ in every:
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
    # Stacked parameters share their name on purpose (the EP group holds one tensor between them).
    names_of = [(ep_rank, edp_rank, {n for _, _, e in theirs for n, _ in e} - set(stacked))
                for _, ep_rank, edp_rank, theirs, _ in every]
    topo.colliding_names = sorted(set().union(*(a[2] & b[2] for a in names_of for b in names_of
                                                if a[1] == b[1] and a[0] < b[0])))
    own = {n for _, _, e in mine for n, _ in e}
    topo.foreign_names = set().union(*(n for _, edp_rank, n in names_of if edp_rank == topo.edp_rank)) - own
    topo.stacked = {n: d for n, (d, _) in stacked.items()}
    topo.grid = [[-1] * topo.edp_size for _ in range(topo.ep_size)]
    for rank, ep_rank, edp_rank, _, _ in every:
        topo.grid[ep_rank][edp_rank] = rank


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
    """State dicts need one name per expert, or a stacked declaration ([Note: expert parallelism], Checkpoints)."""
    if topo is not None and topo.names_collide:
        raise NotImplementedError(
            f"{what} with expert parallelism: the ranks of an expert-parallel group give their different local "
            f"experts the same parameter names ({topo.colliding_names[:3]} on every rank), so a checkpoint would "
            "hold one of them under each name. If such a parameter stacks the local experts along one dim (e.g. "
            f"w1 [E/EP, h, f]), declare it on its module: {STACKED_ATTR} = {{'w1': 0}} (the state dicts then hold the "
            "global [E, h, f] tensor); otherwise name every local expert by its global index (e.g. "
            "experts.{ep_rank * E/EP + i}). Checkpoints only: training is not affected")
