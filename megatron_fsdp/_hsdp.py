"""Hybrid sharding (HSDP): which groups shard and which replicate, checked once when ``fully_shard`` runs.

[Note: hybrid sharding]
The ``R x S`` data-parallel ranks form a 2-D mesh ``(replicate, shard)``: the ``S`` ranks of one row (the
*shard group*, e.g. the GPUs of one node) shard parameters, gradients and optimizer state among themselves
exactly as the 1-D engine does over its group; the ``R`` ranks of one column (the *replicate group*, e.g. one
GPU per node) hold the same shard. A unit's gradient is reduced in a fixed order:

1. the fold pre-scales each rank's gradient by ``1/(R*S)`` (one scale, over ALL ranks; the collectives
   never average under HSDP, see [Note: averaging in the collective]);
2. reduce-scatter SUM within the shard group (``no_shard``: all-reduce SUM);
3. all-reduce SUM of the reduced shard across the replicate group, in place, before the shard reaches the
   fp32 main gradient (``_PendingReduce.launch`` and ``retire`` in _reduce.py).

Schedule: the engine keeps two reductions in flight instead of one. At a unit's post-backward its
reduce-scatter starts; the previous unit's is waited for (it had this unit's backward to finish in) and its
result launched across replicas, which gives its gradient slot back; the unit before that is retired (its all-reduce has
overlapped this unit's backward). A unit that needs the only gradient slot launches the holder instead of
retiring it; ``no_shard`` all-reduces the gradient buffer itself, so its holder is retired.

So the main gradient on rank ``(r, s)`` is ``sum_r' (sum_s' g[r', s'] / (R*S))[shard s]``: the sums of two
ranks are exact in any order (IEEE addition commutes), which is what makes 2 x 2 on Gloo bit-comparable to
a single-process reference that adds in this grouping. The slow dimension moves, per unit and step, one
all-reduce of ``grad_numel / S`` elements (``2 (R-1)/R`` of that per rank with a ring), instead of the flat
engine's reduce-scatter over all ``R*S`` ranks; the price is ``R`` copies of every shard and of its
optimizer state. The all-reduce is a collective like the others: it passes the capture guard
(``check_not_capturing``) and is issued from the post-backward hooks, outside partial graphs' captures.
Initial values are broadcast over both groups (from mesh position ``(0, 0)``); clipping norms, state dicts and
DCP use the shard group (the replicas hold equal shards); DCP's DTensors sit on the 2-D mesh, placed
``(Replicate(), Shard(0))``, as FSDP2's HSDP saves them.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Topology", "resolve"]


class Topology:
    """The engine's data-parallel layout: the shard group, and the replicate group under HSDP.

    Holds the groups weakly ([Note: the engine does not keep its group alive] in _fully_shard.py).
    """

    def __init__(self, shard_group: dist.ProcessGroup, replicate_group: Optional[dist.ProcessGroup],
                 mesh_ranks: Optional[List[List[int]]]) -> None:
        self._shard: Callable[[], Optional[dist.ProcessGroup]] = weakref.ref(shard_group)
        self._replicate: Callable[[], Optional[dist.ProcessGroup]] = (
            weakref.ref(replicate_group) if replicate_group is not None else (lambda: None))
        #: ranks of the replicate dimension (1: the flat engine)
        self.replicate_size = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        #: this rank's place in the replicate dimension
        self.replicate_rank = dist.get_rank(replicate_group) if replicate_group is not None else 0
        #: global ranks of the 2-D mesh, ``[replicate][shard]`` (None when not hybrid)
        self.mesh_ranks = mesh_ranks

    @property
    def hybrid(self) -> bool:
        return self.replicate_size > 1

    @property
    def shard_group(self) -> dist.ProcessGroup:
        group = self._shard()
        assert group is not None, "the shard group is gone (the engine's group property reports this)"
        return group

    def replicate(self) -> Optional[dist.ProcessGroup]:
        """The replicate group (None when not hybrid, or after ``destroy_process_group``)."""
        return self._replicate() if self.hybrid else None

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D DeviceMesh ``(replicate, shard)`` over the two groups (for DCP's DTensors)."""
        assert self.mesh_ranks is not None
        rep = self._replicate()
        if rep is None:
            raise RuntimeError("megatron_fsdp: the replicate group was destroyed; build DCP state dicts before "
                               "destroy_process_group()")
        return DeviceMesh.from_group([rep, self.shard_group], device_type, mesh=self.mesh_ranks,
                                     mesh_dim_names=("replicate", "shard"))


def resolve(*, process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh],
            replicate_group: Optional[dist.ProcessGroup], shard_group: Optional[dist.ProcessGroup]) -> Topology:
    """Check ``fully_shard``'s group arguments and return the topology (a collective under HSDP given groups)."""
    given = [n for n, v in (("process_group", process_group), ("mesh", mesh), ("replicate_group", replicate_group),
                            ("shard_group", shard_group)) if v is not None]
    if (replicate_group is None) != (shard_group is None):
        raise ValueError(f"fully_shard got {given[-1]} without its partner; hybrid sharding needs both "
                         "replicate_group= and shard_group= (or one 2-D mesh=(replicate, shard))")
    if len(given) > 1 and given != ["replicate_group", "shard_group"]:
        raise ValueError(f"fully_shard got {' and '.join(given)}; pass one of: process_group= (flat), mesh= (1-D "
                         "flat or 2-D (replicate, shard) hybrid), or replicate_group= with shard_group= (hybrid)")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}; build one "
                            "with init_device_mesh(device_type, (replicate, shard))")
        if mesh.ndim == 1:
            return Topology(mesh.get_group(0), None, None)
        if mesh.ndim != 2:
            raise ValueError(f"mesh has {mesh.ndim} dimensions (shape {tuple(mesh.shape)}); fully_shard takes a "
                             "1-D mesh (flat) or a 2-D mesh (replicate, shard) (hybrid sharding)")
        if mesh.get_coordinate() is None:
            raise ValueError(f"global rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()}; every rank "
                             "that calls fully_shard must be part of it")
        ranks = mesh.mesh.tolist()
        rep, shard = mesh.get_group(0), mesh.get_group(1)
        return Topology(shard, rep, ranks) if len(ranks) > 1 else Topology(shard, None, None)
    if shard_group is not None:
        return Topology(shard_group, replicate_group, _mesh_ranks(replicate_group, shard_group))
    return Topology(process_group if process_group is not None else dist.group.WORLD, None, None)


def _mesh_ranks(replicate_group: dist.ProcessGroup, shard_group: dist.ProcessGroup) -> Optional[List[List[int]]]:
    """The global ranks ``[replicate][shard]`` of the mesh two groups form, checked (a collective over replicate)."""
    me = dist.get_rank()
    rep_ranks = dist.get_process_group_ranks(replicate_group)
    shard_ranks = dist.get_process_group_ranks(shard_group)
    if me not in rep_ranks or me not in shard_ranks:
        raise ValueError(f"global rank {me} is not in replicate_group {rep_ranks} and shard_group {shard_ranks}; "
                         "pass the two groups this rank belongs to")
    overlap = sorted(set(rep_ranks) & set(shard_ranks))
    if overlap != [me]:
        raise ValueError(f"replicate_group {rep_ranks} and shard_group {shard_ranks} share ranks {overlap}; they must "
                         f"meet only in this rank ({me}): rows and columns of one (replicate, shard) mesh")
    rows: List[Optional[List[int]]] = [None] * len(rep_ranks)
    dist.all_gather_object(rows, shard_ranks, group=replicate_group)
    col = shard_ranks.index(me)
    for r, (row, member) in enumerate(zip(rows, rep_ranks)):
        assert row is not None
        if len(row) != len(shard_ranks) or row[col] != member:
            raise ValueError(f"[rank {me}] the shard groups of replicate_group {rep_ranks} are {rows}; a (replicate, "
                             f"shard) mesh needs shard groups of one size ({len(shard_ranks)}) with member {r} of "
                             f"the replicate group at position {col} of its shard group (found {row}); build the "
                             "groups from one mesh, e.g. init_device_mesh(device_type, (R, S))")
    if len(rep_ranks) == 1:
        return None
    return [list(row) for row in rows]  # type: ignore[arg-type]


def broadcast_order(topology: Topology) -> List[Tuple[str, Optional[dist.ProcessGroup]]]:
    """Groups to broadcast initial values over, in order, from their rank 0: replicate, then shard."""
    out: List[Tuple[str, Optional[dist.ProcessGroup]]] = []
    if topology.hybrid:
        out.append(("replicate", topology.replicate()))
    out.append(("shard", topology.shard_group))
    return out
