"""Sharded state dicts for ``torch.distributed.checkpoint`` (DCP): parameters and optimizer state.

[Note: DCP sharding metadata]
A region of a unit (its trainable or its frozen parameters, ``_unit.py``) is one flat buffer split evenly
over the ranks, and each parameter is a contiguous range of it. A rank's slice of one parameter is thus a
contiguous range of the parameter's row-major elements, which splits into at most ``2 * ndim - 1``
hyper-rectangles ("boxes"), each contiguous in memory: a run inside one row of the last dimension, whole
rows, whole planes, ... So every parameter becomes a ``ShardedTensor`` with the parameter's real shape and
one local shard per box, each a view of the rank's fp32 main shard at its true global offsets. Every rank
computes every rank's boxes from the layout, so building the state dict needs no communication. DCP then
saves each box once and reshards on load: a checkpoint saved on N ranks loads on M ranks, into any
strategy, or into the plain unwrapped model (``dcp.load(model.state_dict(), ...)``). Unsharded strategies
(``no_shard``) and one-rank groups hand out plain views, which DCP treats as replicated, as they are.
Optimizer state that has the main shard's shape (Adam's ``exp_avg``, ``exp_avg_sq``; SGD's
``momentum_buffer``) is split per parameter the same way and keyed by the parameter's name; scalar state
(``step``) is stored per parameter as a replicated tensor; hyperparameters travel in ``param_groups``.

``ShardedTensor`` is the DCP type that can hold several uneven boxes per rank (``DTensor`` placements
cannot express them); torch 2.13 marks it deprecated in favour of DTensor and warns (FutureWarning) when
DCP touches one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from . import _collectives as C
from ._state_dict import clean_fqn, mark_stale, persistent_buffers, regions, shard_start

if TYPE_CHECKING:
    from ._flat import FlatLayout
    from ._fully_shard import MegatronFSDP
    from ._unit import FSDPUnit

__all__ = ["boxes", "sharded_state_dict", "load_sharded_state_dict", "optimizer_state_dict",
           "load_optimizer_state_dict"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: Tuple[int, ...], lo: int, hi: int) -> List[Box]:
    """Hyper-rectangles that tile the row-major element range ``[lo, hi)`` of a tensor of ``shape``, in order.

    Each box fixes the leading indices, takes a range along one dimension and the whole of every later
    dimension, so it is contiguous in row-major memory.
    """
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    out: List[Box] = []
    if first == last and (lo % inner or hi - lo < inner):
        return [((first,) + o, (1,) + s) for o, s in boxes(rest, lo - first * inner, hi - first * inner)]
    if lo % inner:
        out += [((first,) + o, (1,) + s) for o, s in boxes(rest, lo % inner, inner)]
        first += 1
    full_end = hi // inner
    if full_end > first:
        out.append(((first,) + (0,) * len(rest), (full_end - first,) + rest))
    if hi % inner:
        out += [((full_end,) + o, (1,) + s) for o, s in boxes(rest, 0, hi % inner)]
    return out


def _ravel(offsets: Tuple[int, ...], shape: Tuple[int, ...]) -> int:
    index = 0
    for o, d in zip(offsets, shape):
        index = index * d + o
    return index


def _chunks(layout: "FlatLayout", world: int) -> List[List[Tuple[int, Box, int]]]:
    """Per parameter of ``layout``: every (rank, box, start in that rank's shard), cached on the layout."""
    cached = getattr(layout, "_dcp_chunks", None)
    if cached is not None:
        return cached
    out = []
    s = layout.shard_numel
    for o, n, shape in zip(layout.offsets, layout.numels, layout.shapes):
        shape = tuple(shape)
        per: List[Tuple[int, Box, int]] = []
        if n:
            for r in range(o // s, (o + n - 1) // s + 1):
                lo, hi = max(o, r * s), min(o + n, (r + 1) * s)
                for box in boxes(shape, lo - o, hi - o):
                    per.append((r, box, o + _ravel(box[0], shape) - r * s))
        out.append(per)
    layout._dcp_chunks = out  # type: ignore[attr-defined]
    return out


def _replicated(engine: "MegatronFSDP") -> bool:
    return not engine.strategy.shards_optimizer or engine.world_size == 1


def _dcp_tensor(engine: "MegatronFSDP", layout: "FlatLayout", local: torch.Tensor, i: int) -> torch.Tensor:
    """Parameter ``i`` of ``layout`` as DCP should see it, backed by ``local`` (this rank's flat of the region)."""
    o, n, shape = layout.offsets[i], layout.numels[i], tuple(layout.shapes[i])
    local = local.detach()
    if _replicated(engine) or n == 0:
        return local[o : o + n].view(shape) if n else local.new_empty(shape)
    chunks = _chunks(layout, engine.world_size)[i]
    if not shape:
        # A 0-dim parameter lives on one rank and has no empty box for the others: hand it out replicated, the
        # owner's value broadcast (the owner's copy is a view, so a load writes the shard).
        owner, _, start = chunks[0]
        value = local[start : start + 1].view(()) if owner == engine.rank else local.new_empty(())
        C.broadcast(value, owner, engine.group, f"the 0-dim parameter {layout.names[i]}")
        return value
    ranks = engine._global_ranks()
    here = str(local.device)
    mds, shards = [], []
    for r, (off, size), start in chunks:
        device = here if r == engine.rank else local.device.type
        md = ShardMetadata(list(off), list(size), f"rank:{ranks[r]}/{device}")
        mds.append(md)
        if r == engine.rank:
            shards.append(Shard(local[start : start + math.prod(size)].view(size), md))
    # A rank without a box of this parameter holds one empty box: DCP's load planner drops ShardedTensors
    # without local shards from its view of the state dict and then mistakes the checkpoint for an old format.
    # The empty box sits just past the end of dimension 0, an offset no real box has (DCP keys chunks by
    # offset, so an empty box at a real box's offset would replace it).
    for r in sorted(set(range(engine.world_size)) - {c[0] for c in chunks}):
        device = here if r == engine.rank else local.device.type
        md = ShardMetadata([shape[0]] + [0] * (len(shape) - 1), [0] * len(shape), f"rank:{ranks[r]}/{device}")
        mds.append(md)
        if r == engine.rank:
            shards.append(Shard(local.new_empty((0,) * len(shape)), md))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(mds, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=engine.group)


def _copy_in(engine: "MegatronFSDP", layout: "FlatLayout", local: torch.Tensor, i: int, value: Any,
             name: str) -> None:
    """Write parameter ``i``'s values from ``value`` (ShardedTensor of our layout, or a full tensor) into ``local``."""
    o, n, shape = layout.offsets[i], layout.numels[i], tuple(layout.shapes[i])
    with torch.no_grad():
        if isinstance(value, ShardedTensor):
            if _replicated(engine):
                raise ValueError(f"{name} is a ShardedTensor, but this model holds it whole; load a state dict made by "
                                 "this model's sharded_state_dict() (fill it with torch.distributed.checkpoint.load)")
            mine = {tuple(box[0]): (box, start) for r, box, start in _chunks(layout, engine.world_size)[i]
                    if r == engine.rank}
            got = [s for s in value.local_shards() if s.tensor.numel()]
            if {tuple(s.metadata.shard_offsets) for s in got} != set(mine):
                raise ValueError(f"{name}: the ShardedTensor's local shards do not match this model's layout on rank "
                                 f"{engine.rank}; fill the dict returned by this model's sharded_state_dict()")
            for s in got:
                (_, size), start = mine[tuple(s.metadata.shard_offsets)]
                target = local[start : start + math.prod(size)]
                if target.data_ptr() != s.tensor.data_ptr():
                    target.copy_(s.tensor.reshape(-1))
            return
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} is {got}; the model expects a tensor of shape {shape}")
        start, length = shard_start(engine, layout), local.numel()
        lo, hi = max(o, start), min(o + n, start + length)
        if lo < hi:
            target = local[lo - start : hi - start]
            src = value.detach().reshape(-1)[lo - o : hi - o]
            if target.data_ptr() != src.data_ptr():
                target.copy_(src)


# ---------------------------------------------------------------------------------------------- model
def sharded_state_dict(engine: "MegatronFSDP") -> Dict[str, Any]:
    """Parameters (fp32, views of the main shards) and persistent buffers, keyed as the unwrapped model."""
    out: Dict[str, Any] = {}
    for u in engine.all_units():
        for layout, local in regions(u):
            for i, n in enumerate(layout.names):
                out[clean_fqn(n)] = _dcp_tensor(engine, layout, local, i)
    for n, b in persistent_buffers(engine.module):
        out[n] = b.detach()
    return out


def load_sharded_state_dict(engine: "MegatronFSDP", state_dict: Dict[str, Any]) -> None:
    """Take values from a dict shaped like ``sharded_state_dict()`` (e.g. after ``dcp.load`` filled it)."""
    expected = {clean_fqn(n) for u in engine.all_units() for layout, _ in regions(u) for n in layout.names}
    expected |= {n for n, _ in persistent_buffers(engine.module)}
    missing = sorted(expected - set(state_dict))
    if missing:
        raise ValueError(f"load_sharded_state_dict: missing keys {missing[:10]}; pass the dict returned by "
                         "sharded_state_dict() after torch.distributed.checkpoint.load filled it")
    for u in engine.all_units():
        for layout, local in regions(u):
            for i, n in enumerate(layout.names):
                _copy_in(engine, layout, local, i, state_dict[clean_fqn(n)], clean_fqn(n))
        mark_stale(u)
    with torch.no_grad():
        for n, b in persistent_buffers(engine.module):
            if state_dict[n].data_ptr() != b.data_ptr():
                b.copy_(state_dict[n])


# ---------------------------------------------------------------------------------------------- optimizer
def _units_of(engine: "MegatronFSDP", optimizer: torch.optim.Optimizer) -> List[List["FSDPUnit"]]:
    by_id = {id(u.main_shard): u for u in engine.all_units()}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        units = []
        for p in g["params"]:
            if id(p) not in by_id:
                raise ValueError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "main shard of this model; build the optimizer over model.optimizer_parameters()")
            units.append(by_id[id(p)])
        groups.append(units)
    return groups


def _init_state(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> None:
    """Create the optimizer's state with one step at learning rate 0 (values unchanged), as DCP needs targets."""
    if all(optimizer.state.get(p) for p in params):
        return
    saved_grads = [p.grad for p in params]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def optimizer_state_dict(engine: "MegatronFSDP", optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the parameters ([Note: DCP sharding metadata]).

    An optimizer without state yet (never stepped) gets it from one step at learning rate 0, which leaves
    the parameters unchanged but counts as a step (Adam's ``step`` becomes 1 until a load replaces it).
    """
    groups = _units_of(engine, optimizer)
    _init_state(optimizer, [u.main_shard for units in groups for u in units])
    state: Dict[str, Dict[str, Any]] = {}
    param_groups = []
    for g, units in zip(optimizer.param_groups, groups):
        for u in units:
            for k, v in optimizer.state[u.main_shard].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(u.main_shard.shape):
                    raise NotImplementedError(
                        f"optimizer state {k!r} of unit {u.name} has shape {tuple(v.shape)}, neither the main shard's "
                        f"{tuple(u.main_shard.shape)} nor a scalar; optimizer_state_dict handles element-wise state "
                        "(Adam, SGD momentum) only")
            for i, n in enumerate(u.layout.names):
                entry = state.setdefault(clean_fqn(n), {})
                for k, v in optimizer.state[u.main_shard].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        entry[k] = _dcp_tensor(engine, u.layout, v, i)
                    elif isinstance(v, torch.Tensor):
                        entry[k] = v.detach().clone()
                    else:
                        entry[k] = v
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = [clean_fqn(n) for u in units for n in u.layout.names]
        param_groups.append(saved)
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state_dict(engine: "MegatronFSDP", optimizer: torch.optim.Optimizer,
                              state_dict: Dict[str, Any]) -> None:
    """Take optimizer state from a dict shaped like ``optimizer_state_dict()`` (e.g. filled by ``dcp.load``)."""
    groups = _units_of(engine, optimizer)
    _init_state(optimizer, [u.main_shard for units in groups for u in units])
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer "
                         f"{len(groups)}; build the optimizer with the same groups")
    for gi, (g, units, saved) in enumerate(zip(optimizer.param_groups, groups, saved_groups)):
        names = {clean_fqn(n) for u in units for n in u.layout.names}
        if set(saved["params"]) != names:
            diff = sorted(set(saved["params"]) ^ names)[:5]
            raise ValueError(f"optimizer param group {gi} covers other parameters than in the checkpoint (e.g. "
                             f"{diff}); build the optimizer with the same groups")
        for k, v in saved.items():
            if k == "params":
                continue
            if isinstance(g.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                g[k].fill_(v)
            else:
                g[k] = v
        for u in units:
            st = optimizer.state[u.main_shard]
            for k in list(st):
                fqns = [clean_fqn(n) for n in u.layout.names]
                try:
                    values = [state_dict["state"][f][k] for f in fqns]
                except KeyError as exc:
                    raise ValueError(f"the optimizer state in the checkpoint lacks {exc} for unit {u.name}; load a "
                                     "checkpoint of the same optimizer type") from None
                v = st[k]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    for i, (f, value) in enumerate(zip(fqns, values)):
                        _copy_in(engine, u.layout, v, i, value, f"state.{f}.{k}")
                elif isinstance(v, torch.Tensor):
                    if any(not torch.equal(torch.as_tensor(x).to(v), torch.as_tensor(values[0]).to(v)) for x in values):
                        raise ValueError(f"optimizer state {k!r} differs between the parameters of unit {u.name} in the "
                                         "checkpoint; this unit plan cannot hold it (shard the model as when saved)")
                    with torch.no_grad():
                        v.copy_(torch.as_tensor(values[0]))
                else:
                    st[k] = values[0]
