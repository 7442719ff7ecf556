"""Sharded state dicts for ``torch.distributed.checkpoint`` (DCP): parameters and optimizer state, as DTensors.

[Note: DCP sharding metadata]
Every parameter (and every element-wise optimizer state tensor: Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``) leaves as a ``DTensor`` of the parameter's real shape, placed ``Shard(0)`` over a 1-D
``DeviceMesh`` of the engine's process group (under HSDP the 2-D ``(replicate, shard)`` mesh, placed
``(Replicate(), Shard(0))``: [Note: hybrid sharding] in _hsdp.py): rank ``r`` holds rows ``[r*c, (r+1)*c)`` with
``c = ceil(dim0 / world)`` (``torch.chunk``'s split, the one FSDP2 and torchtitan save). 0-dim parameters
leave ``Replicate()``. Keys are the unwrapped model's, as in ``model.state_dict()``. Under expert parallelism an
expert parameter is placed the same way over its expert-data-parallel group, and a stacked one (its module's
``stacked_expert_dims``) leaves with its global shape over the 2-D ``(ep, edp)`` mesh ([Note: expert parallelism]
in _expert.py, Checkpoints). Under tensor parallelism a TP shard's key names its TP rank (``{name}@tp{r}of{TP}``:
[Note: tensor parallelism] in _tensor.py).

Our flat per-unit shards do not split along dim 0: a rank owns a contiguous element range of the unit's
flat buffer, which cuts parameters mid-row and puts a parameter's rows on other ranks than ``Shard(0)``
would. We redistribute at save and load time rather than change the flat layout (see "Why redistribute
instead of padding the flat layout" under "DCP" in docs/engines.md): building the state dict all-gathers each
region of a unit once (as ``state_dict()`` does) and copies out this rank's rows of every parameter; loading
takes each DTensor's full value (``full_tensor()``, an all-gather) and writes this rank's flat slice. Both are
collectives: call them on every rank, in the same order. The dict holds copies, so after ``dcp.load`` fills it,
``load_sharded_state_dict`` (and ``load_optimizer_state_dict``) must be called to write the values back.

Each module's extra state ([Note: extra state] in _state_dict.py: TE's FP8 scaling state) leaves as ``bytes``
(:func:`encode_extra_state`: a tag, then ``torch.save`` of what ``get_extra_state()`` returned), which DCP stores
as an object, not as a tensor: DCP reads a plain tensor in place into the target's tensor and refuses another
size, and TE's extra state of a model that has not run FP8 yet is an empty tensor (the "Size mismatch ...
_extra_state" of TransformerEngine issue 1860, under FSDP2). ``load_sharded_state_dict`` decodes it and hands it
to ``set_extra_state``. A checkpoint written before extra state was saved lacks those keys: load it with
``DefaultLoadPlanner(allow_partial_load=True)``; the modules then keep their own state.

DCP then reshards on load like any DTensor checkpoint: N ranks to M ranks, any strategy, into the plain
unwrapped model (``dcp.load(model.state_dict(), ...)``), or into the same architecture under PyTorch FSDP2
(``fully_shard``), and back. Scalar optimizer state (``step``) is a plain tensor per parameter, and
hyperparameters travel in ``param_groups`` with the parameters' names: the layout
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives FSDP2 users.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._common import Engine, Unit
from ._expert import refuse_colliding_names
from ._tensor import dcp_key, foreign_tp_keys
from ._state_dict import clean_fqn, extra_state_modules, gather_region, persistent_buffers, regions, shard_start

if TYPE_CHECKING:
    from ._flat import FlatLayout

__all__ = ["row_range", "sharded_state_dict", "load_sharded_state_dict", "optimizer_state_dict",
           "load_optimizer_state_dict", "encode_extra_state", "decode_extra_state"]

#: The first bytes of an encoded extra state (:func:`encode_extra_state`).
_EXTRA_TAG = b"megatron_fsdp.extra_state.v1\0"


def encode_extra_state(value: Any) -> bytes:
    """A module's extra state as ``bytes`` for DCP: a tag, then ``torch.save(value)`` (a tensor moves to the CPU)."""
    buf = io.BytesIO()
    torch.save(value.detach().cpu() if isinstance(value, torch.Tensor) else value, buf)
    return _EXTRA_TAG + buf.getvalue()


def decode_extra_state(value: Any) -> Any:
    """What :func:`encode_extra_state` encoded (loaded with ``weights_only=True``: tensors, containers, numbers,
    strings, bytes); any other value (a state dict filled by hand) is returned as it is."""
    if isinstance(value, (bytes, bytearray)) and bytes(value[:len(_EXTRA_TAG)]) == _EXTRA_TAG:
        return torch.load(io.BytesIO(bytes(value[len(_EXTRA_TAG):])), weights_only=True)
    return value


def row_range(dim0: int, world: int, rank: int) -> Tuple[int, int]:
    """The rows ``[lo, hi)`` of dimension 0 that ``Shard(0)`` gives ``rank`` of ``world`` (``torch.chunk``'s split)."""
    per = -(-dim0 // world) if dim0 else 0
    lo = min(rank * per, dim0)
    return lo, min(lo + per, dim0)


def mesh_of(engine: Engine, device: torch.device, unit: Optional[Unit] = None) -> DeviceMesh:
    """A 1-D DeviceMesh over the engine's process group, or under HSDP the 2-D ``(replicate, shard)`` mesh, or for
    an expert bucket a 1-D mesh over the expert-data-parallel group (built once per device type)."""
    meshes = engine.__dict__.setdefault("_dcp_meshes", {})
    expert = unit is not None and unit.is_expert
    key = (device.type, expert)
    if key not in meshes:
        hsdp = engine.hsdp
        if expert:
            meshes[key] = DeviceMesh.from_group(unit.group, device.type)
        else:
            meshes[key] = (hsdp.device_mesh(device.type) if hsdp.hybrid
                           else DeviceMesh.from_group(engine.group, device.type))
    return meshes[key]


def expert_mesh_of(engine: Engine, device: torch.device) -> DeviceMesh:
    """The 2-D mesh ``(ep, edp)`` of the data-parallel ranks, built once per device type from the expert groups:
    coordinate ``(q, j)`` is the rank with EP rank ``q`` and EDP rank ``j`` (the mesh of stacked experts)."""
    meshes = engine.__dict__.setdefault("_dcp_meshes", {})
    key = (device.type, "stacked")
    if key not in meshes:
        topo = engine.expert_topology
        meshes[key] = DeviceMesh.from_group([topo.ep_group, topo.edp_group], device.type, mesh=topo.grid,
                                            mesh_dim_names=("ep", "edp"))
    return meshes[key]


def _stacked_placements(dim: int) -> List[Any]:
    """A stacked expert parameter over ``(ep, edp)``: the expert dim split over EP (each EP rank's ``E/EP``
    experts), then dim 0 of that over EDP as for any expert parameter ([Note: expert parallelism] in _expert.py).
    For ``dim = 0`` both split dim 0, EP first: DTensor's order, mesh dimension by mesh dimension."""
    return [Shard(dim), Shard(0)]


def _stacked_dtensor(engine: Engine, name: str, full: torch.Tensor, unit: Unit) -> DTensor:
    """Stacked parameter ``name`` (``full``: this EP rank's experts, the same on its EDP group) as a DTensor of the
    global shape holding a copy of our rows."""
    topo = engine.expert_topology
    dim = topo.stacked[name]
    shape = topo.global_shape(name, full.shape)
    lo, hi = row_range(full.shape[0], unit.shard_size, unit.shard_rank)
    local = full.detach()[lo:hi].clone()
    return DTensor.from_local(local, expert_mesh_of(engine, full.device), _stacked_placements(dim), run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def _placements(engine: Engine, inner: Any, unit: Optional[Unit] = None) -> List[Any]:
    """``inner`` over the shard dimension; under HSDP, ``Replicate()`` over the replicate dimension before it."""
    return [Replicate(), inner] if engine.hsdp.hybrid and not (unit is not None and unit.is_expert) else [inner]


def _dtensor(engine: Engine, full: torch.Tensor, unit: Optional[Unit] = None) -> DTensor:
    """``full`` (this parameter's whole value, the same on every rank of the unit's group) as a DTensor holding a
    copy of our rows."""
    mesh = mesh_of(engine, full.device, unit)
    shape = tuple(full.shape)
    if not shape:
        return DTensor.from_local(full.detach().clone(), mesh, _placements(engine, Replicate(), unit), run_check=False)
    size, rank = (unit.shard_size, unit.shard_rank) if unit is not None else (engine.world_size, engine.rank)
    lo, hi = row_range(shape[0], size, rank)
    local = full.detach()[lo:hi].clone()
    return DTensor.from_local(local, mesh, _placements(engine, Shard(0), unit), run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def _region_dtensors(engine: Engine, layout: "FlatLayout", local: torch.Tensor, unit: Optional[Unit] = None
                     ) -> List[DTensor]:
    """Every parameter of one region as a DTensor (a collective: one all-gather of the region)."""
    full = gather_region(engine, layout, local.detach(), unit)
    stacked = _stacked_names(engine, unit)
    return [_stacked_dtensor(engine, n, v, unit) if n in stacked else _dtensor(engine, v, unit)
            for n, v in zip(layout.names, layout.views(full))]


def _stacked_names(engine: Engine, unit: Optional[Unit]) -> Dict[str, int]:
    """The stacked expert parameters (name -> expert dim) if ``unit`` is an expert bucket, else none."""
    topo = engine.expert_topology
    return topo.stacked if topo is not None and unit is not None and unit.is_expert else {}


def _local_experts(engine: Engine, value: Any, name: str, shape: Tuple[int, ...], what: str) -> torch.Tensor:
    """This EP rank's experts (``shape``) of stacked parameter ``name`` from ``value``: a DTensor of the global shape
    (ours, or any other: collected whole) or the global tensor. A collective for a DTensor."""
    topo = engine.expert_topology
    dim = topo.stacked[name]
    want = topo.global_shape(name, shape)
    if isinstance(value, DTensor):
        mesh = expert_mesh_of(engine, value.device)
        if (value.device_mesh == mesh and tuple(value.placements) == tuple(_stacked_placements(dim))
                and tuple(value.shape) == want):
            # all-gather over EDP only: this EP rank's experts, never the global tensor
            return value.redistribute(mesh, [Shard(dim), Replicate()]).to_local()
        if value.device_mesh.size() != engine.dp_world_size:
            raise ValueError(f"{what} is a DTensor over a mesh of {value.device_mesh.size()} ranks, this model runs on "
                             f"{engine.dp_world_size}; fill the dict returned by this model's sharded_state_dict() "
                             "(torch.distributed.checkpoint.load reshards)")
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} is {got}; the model expects the global tensor of shape {want} (the experts of every "
                         f"expert-parallel rank: {clean_fqn(name)} is declared stacked), of which this rank takes its "
                         "own; load a state dict of the same model")
    return topo.local_experts(name, value)


def _full_value(engine: Engine, value: Any, shape: Tuple[int, ...], name: str, unit: Optional[Unit] = None
                ) -> torch.Tensor:
    """The whole value of ``value`` (a DTensor, collected from all ranks, or a plain tensor), checked against ``shape``."""
    if isinstance(value, DTensor):
        want = unit.shard_size if unit is not None and unit.is_expert else engine.dp_world_size
        if value.device_mesh.size() != want:
            raise ValueError(f"{name} is a DTensor over a mesh of {value.device_mesh.size()} ranks, this model "
                             f"{'shards it over' if want != engine.dp_world_size else 'runs on'} {want}; fill the dict "
                             "returned by this model's sharded_state_dict() (torch.distributed.checkpoint.load "
                             "reshards)")
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} is {got}; the model expects a tensor of shape {shape}; load a state dict of the "
                         "same model")
    return value


def _copy_in(engine: Engine, layout: "FlatLayout", local: torch.Tensor, i: int, value: Any,
             name: str, unit: Optional[Unit] = None) -> None:
    """Write parameter ``i``'s values from ``value`` (a DTensor or a full tensor) into ``local``, this rank's flat."""
    o, n, shape = layout.offsets[i], layout.numels[i], tuple(layout.shapes[i])
    if layout.names[i] in _stacked_names(engine, unit):
        full = _local_experts(engine, value, layout.names[i], shape, name)
    else:
        full = _full_value(engine, value, shape, name, unit)
    start, length = shard_start(engine, layout, unit), local.numel()
    lo, hi = max(o, start), min(o + n, start + length)
    if lo < hi:
        with torch.no_grad():
            local[lo - start : hi - start].copy_(full.detach().reshape(-1)[lo - o : hi - o])


# ---------------------------------------------------------------------------------------------- model
def sharded_state_dict(engine: Engine) -> Dict[str, Any]:
    """Parameters (fp32 DTensors, copies of this rank's rows) and persistent buffers, keyed as the unwrapped model.

    A collective (an all-gather per region): call it on every rank ([Note: DCP sharding metadata]).
    """
    refuse_colliding_names(engine.expert_topology, "sharded_state_dict()")
    out: Dict[str, Any] = {}
    for u in engine.all_units():
        for layout, local in regions(u):
            for n, value in zip(layout.names, _region_dtensors(engine, layout, local, u)):
                out[dcp_key(engine.tp_topology, clean_fqn(n))] = value
    for name, first in engine.tied_names.items():  # the same DTensor under every name ([Note: tied parameters])
        out[dcp_key(engine.tp_topology, name)] = out[dcp_key(engine.tp_topology, first)]
    for n, b in persistent_buffers(engine.module):
        out[n] = b.detach()
    for n, m in extra_state_modules(engine.module):
        out[n] = encode_extra_state(m.get_extra_state())
    return out


def load_sharded_state_dict(engine: Engine, state_dict: Dict[str, Any]) -> None:
    """Take values from a dict shaped like ``sharded_state_dict()`` (e.g. after ``dcp.load`` filled it).

    A collective (an all-gather per DTensor): call it on every rank. Plain full tensors are accepted too.
    """
    refuse_colliding_names(engine.expert_topology, "load_sharded_state_dict()")
    # A tied parameter is read from its first name, or from another of its names when the first is absent.
    topo = engine.tp_topology
    key = {n: n for n in state_dict}
    for name, first in engine.tied_names.items():
        name, first = dcp_key(topo, name), dcp_key(topo, first)
        if name in state_dict and first not in key:
            key[first] = name
    expected = {dcp_key(topo, clean_fqn(n)) for u in engine.all_units() for layout, _ in regions(u) for n in layout.names}
    expected |= {n for n, _ in persistent_buffers(engine.module)}
    extras = list(extra_state_modules(engine.module, loading=True))
    expected |= {n for n, _ in extras}
    missing = sorted(expected - set(key))
    foreign = foreign_tp_keys(topo, list(state_dict))
    if foreign or (missing and topo is not None and any("@tp" in m for m in missing)):
        raise ValueError(
            f"load_sharded_state_dict: the dict holds tensor-parallel keys of another layout ({foreign[:3]}) or lacks "
            f"this rank's ({[m for m in missing if '@tp' in m][:3]}); a checkpoint with TP shards loads at the "
            f"same tensor_parallel_size ({engine.tensor_parallel_size} here), at any data-parallel size. To change "
            "TP, load it at its own TP, merge the TP ranks' state_dict()s (fsdp_cudagraph.apps.tp."
            "merge_tp_state_dicts) and slice them for the new TP (slice_tp_state_dict)")
    if missing:
        raise ValueError(f"load_sharded_state_dict: missing keys {missing[:10]}; pass the dict returned by "
                         "sharded_state_dict() after torch.distributed.checkpoint.load filled it")
    for u in engine.all_units():
        for layout, local in regions(u):
            for i, n in enumerate(layout.names):
                k = key[dcp_key(topo, clean_fqn(n))]
                _copy_in(engine, layout, local, i, state_dict[k], k, u)
        u.mark_stale()
    with torch.no_grad():
        for n, b in persistent_buffers(engine.module):
            if state_dict[n].data_ptr() != b.data_ptr():
                b.copy_(state_dict[n])
    for n, m in extras:
        m.set_extra_state(decode_extra_state(state_dict[n]))


# ---------------------------------------------------------------------------------------------- optimizer
def _units_of(engine: Engine, optimizer: torch.optim.Optimizer) -> List[List[Unit]]:
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


def optimizer_state_dict(engine: Engine, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the parameters ([Note: DCP sharding metadata]).

    An optimizer without state yet (never stepped) gets it from one step at learning rate 0, which leaves
    the parameters unchanged but counts as a step (Adam's ``step`` becomes 1 until a load replaces it).
    """
    refuse_colliding_names(engine.expert_topology, "optimizer_state_dict()")
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
            entries = [state.setdefault(dcp_key(engine.tp_topology, clean_fqn(n)), {}) for n in u.layout.names]
            for k, v in optimizer.state[u.main_shard].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    for entry, value in zip(entries, _region_dtensors(engine, u.layout, v, u)):
                        entry[k] = value
                else:
                    for entry in entries:
                        entry[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = [clean_fqn(n) for u in units for n in u.layout.names]
        param_groups.append(saved)
    return {"state": state, "param_groups": param_groups}


def _expert_names(engine: Engine) -> set:
    """Every expert parameter name of the model: this rank's (tagged, at any EP) and the other EP ranks'."""
    topo = engine.expert_topology
    foreign = {clean_fqn(n) for n in topo.foreign_names} if topo is not None else set()
    return set(engine.expert_param_names) | foreign


def load_optimizer_state_dict(engine: Engine, optimizer: torch.optim.Optimizer,
                              state_dict: Dict[str, Any]) -> None:
    """Take optimizer state from a dict shaped like ``optimizer_state_dict()`` (e.g. filled by ``dcp.load``)."""
    refuse_colliding_names(engine.expert_topology, "load_optimizer_state_dict()")
    groups = _units_of(engine, optimizer)
    _init_state(optimizer, [u.main_shard for units in groups for u in units])
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer "
                         f"{len(groups)}; build the optimizer with the same groups")
    for gi, (g, units, saved) in enumerate(zip(optimizer.param_groups, groups, saved_groups)):
        names = {clean_fqn(n) for u in units for n in u.layout.names}
        # DCP keeps one rank's list, whose experts are that rank's (at EP > 1 another EP rank's may differ, and a
        # checkpoint may come from another EP): compare the dense names only ([Note: expert parallelism] in
        # _expert.py); a missing expert's state is refused below.
        experts = _expert_names(engine)
        if set(saved["params"]) - experts != names - experts:
            diff = sorted((set(saved["params"]) ^ names) - experts)[:5]
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
                    values = [state_dict["state"][dcp_key(engine.tp_topology, f)][k] for f in fqns]
                except KeyError as exc:
                    raise ValueError(f"the optimizer state in the checkpoint lacks {exc} for unit {u.name}; load a "
                                     "checkpoint of the same optimizer type") from None
                v = st[k]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    for i, (f, value) in enumerate(zip(fqns, values)):
                        _copy_in(engine, u.layout, v, i, value, f"state.{f}.{k}", u)
                elif isinstance(v, torch.Tensor):
                    if any(not torch.equal(torch.as_tensor(x).to(v), torch.as_tensor(values[0]).to(v)) for x in values):
                        raise ValueError(f"optimizer state {k!r} differs between the parameters of unit {u.name} in the "
                                         "checkpoint; this unit plan cannot hold it (shard the model as when saved)")
                    with torch.no_grad():
                        v.copy_(torch.as_tensor(values[0]))
                else:
                    st[k] = values[0]
