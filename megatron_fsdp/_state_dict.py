"""Full state dicts of a sharded model, the module-level state-dict guard, and ``summon_full_params``.

[Note: state dict keys and values]
``MegatronFSDP.state_dict()`` is the nn.Module API with the unwrapped model's keys (``layers.0.attn.qkv.weight``,
not ``module.layers.0...``; a ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module.`` segment is dropped,
as the wrapper's own state dict does) and full fp32 values: every parameter gathered from the main shards
(trainable and frozen), plus the persistent buffers, plus each module's extra state ([Note: extra state]). It is a collective (an all-gather per unit): call it
on every rank. ``load_state_dict`` takes the same form and writes each rank's own slice into its shards; it
needs no communication. Both read and write the fp32 main shards only, never the compute views (see
[Note: parameters outside forward] in ``_unit.py``).

The module-level ``state_dict()``/``load_state_dict()`` of the wrapped model or any of its submodules would
read or write those compute views, so hooks on every module that owns a sharded parameter refuse them with
the fix, except inside ``model.summon_full_params()``, where the parameters are full fp32 copies.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from . import _collectives as C
from . import _expert
from ._common import COMPUTING, Engine, Unit

if TYPE_CHECKING:
    from ._flat import FlatLayout

__all__ = ["clean_fqn", "full_state_dict", "load_full_state_dict", "persistent_buffers", "extra_state_modules",
           "guard_module_state_dicts", "summon_full_params"]

_CHECKPOINT_SEGMENT = "_checkpoint_wrapped_module."
#: nn.Module's key suffix for a module's extra state (``torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX``).
EXTRA_STATE = "_extra_state"


def clean_fqn(name: str) -> str:
    """The key the unwrapped model's own ``state_dict()`` uses for ``name`` (checkpoint wrappers removed)."""
    return name.replace(_CHECKPOINT_SEGMENT, "")


def persistent_buffers(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(key, buffer) for every buffer that ``module.state_dict()`` would include."""
    for mname, m in module.named_modules(remove_duplicate=False):  # a shared module's buffers under every name
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield clean_fqn(f"{mname}.{bname}" if mname else bname), b


def extra_state_modules(module: nn.Module, *, loading: bool = False) -> Iterator[Tuple[str, nn.Module]]:
    """[Note: extra state]
    (key, module) for every module whose ``state_dict()`` carries ``<prefix>_extra_state``: its class overrides
    ``get_extra_state`` (``loading=True``: ``set_extra_state``, the modules ``load_state_dict`` hands it to), as
    ``nn.Module`` decides. TransformerEngine keeps FP8 scaling state there (delayed scaling's amax history and
    scales, as a uint8 tensor of pickled bytes); without it a resumed FP8 run restarts its scales from 1 and
    its losses leave the uninterrupted run's. The engine's state dicts read it with ``get_extra_state()`` and
    load it with ``set_extra_state()`` on the module itself (module-level ``state_dict()`` is refused on modules
    that own sharded parameters), so it travels as the module gives it: the same value on every rank for TE's
    reduced amaxes; a module whose extra state differs per rank must be saved per rank by other means.
    """
    base = nn.Module.set_extra_state if loading else nn.Module.get_extra_state
    attr = "set_extra_state" if loading else "get_extra_state"
    for mname, m in module.named_modules(remove_duplicate=False):  # under every name, as nn.Module gives it
        if getattr(type(m), attr, base) is not base:
            yield clean_fqn(f"{mname}.{EXTRA_STATE}" if mname else EXTRA_STATE), m


def regions(u: Unit) -> List[Tuple["FlatLayout", torch.Tensor]]:
    """The unit's (layout, this rank's fp32 shard) pairs: trainable region, then frozen region."""
    return [(u.layout, u.main_shard.detach()), (u.frozen_layout, u.frozen_shard)]


def shard_start(engine: Engine, layout: "FlatLayout", unit: Optional[Unit] = None) -> int:
    """Where this rank's shard of a region starts in the region's flat layout (of ``unit``: an expert bucket
    is sharded over its own group; default the engine's group)."""
    rank = unit.shard_rank if unit is not None else engine.rank
    return rank * layout.shard_numel if engine.strategy.shards_optimizer else 0


def gather_region(engine: Engine, layout: "FlatLayout", local: torch.Tensor, unit: Optional[Unit] = None
                  ) -> torch.Tensor:
    """The full fp32 flat of one region of ``unit`` (a collective over the unit's group for the sharded strategies;
    default the engine's group)."""
    if not engine.strategy.shards_optimizer or layout.total_numel == 0:
        return local
    full = torch.empty(layout.total_numel, dtype=local.dtype, device=local.device)
    group = unit.group if unit is not None else engine.group
    work = C.all_gather(full, local, group, "a state dict's main shards")
    if work is not None:
        work.wait()
    return full


def full_state_dict(engine: Engine) -> Dict[str, torch.Tensor]:
    """Gathered fp32 parameters and the persistent buffers, keys as the unwrapped model's, on every rank."""
    topo = engine.expert_topology
    _expert.refuse_colliding_names(topo, "state_dict()")
    out: Dict[str, torch.Tensor] = collections.OrderedDict()
    for u in engine.all_units():
        for layout, local in regions(u):
            full = gather_region(engine, layout, local, u)
            views = layout.views(full)
            if u.is_expert and topo is not None:  # stacked experts: every EP rank's ([Note: expert parallelism])
                views = topo.gather_stacked(layout.names, views)
            for n, v in zip(layout.names, views):
                out[clean_fqn(n)] = v.clone()
    for name, first in engine.tied_names.items():  # the same tensor, as nn.Module gives ([Note: tied parameters])
        out[name] = out[first]
    for n, b in persistent_buffers(engine.module):
        out[n] = b.detach().clone()
    for n, m in extra_state_modules(engine.module):
        out[n] = m.get_extra_state()
    return out


def load_full_state_dict(engine: Engine, state_dict: Mapping[str, Any], *,
                         strict: bool = True) -> Tuple[List[str], List[str]]:
    """Write full values (keys as the unwrapped model's) into this rank's shards and the buffers.

    No communication: each rank copies its own slice of every parameter. Returns (missing, unexpected)
    keys; with ``strict`` a mismatch raises before anything is written.
    """
    targets: Dict[str, Tuple[Any, ...]] = {}
    for u in engine.all_units():
        for layout, local in regions(u):
            for n, o, numel, shape in zip(layout.names, layout.offsets, layout.numels, layout.shapes):
                targets[clean_fqn(n)] = (u, layout, local, o, numel, shape)
    topo = engine.expert_topology
    _expert.refuse_colliding_names(topo, "load_state_dict()")
    # A stacked expert parameter is loaded from its global value, of which this EP rank takes its experts.
    stacked = {clean_fqn(n): n for n in (topo.stacked if topo is not None else ())}
    buffers = dict(persistent_buffers(engine.module))
    extras = list(extra_state_modules(engine.module, loading=True))
    tied = engine.tied_names
    expected = set(targets) | set(tied) | set(buffers) | {n for n, _ in extras}
    # the other EP ranks' experts: expected in a whole model's dict, skipped ([Note: expert parallelism])
    foreign = engine.expert_topology.foreign_names if engine.expert_topology is not None else set()
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected - foreign)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for MegatronFSDP: missing keys {missing[:10]}, unexpected keys "
            f"{unexpected[:10]} (keys are the unwrapped model's, e.g. from model.state_dict()); pass strict=False "
            "to load a subset"
        )
    for name, value in state_dict.items():
        first = tied.get(name, name)
        target = targets.get(first)
        want = target[5] if target is not None else (buffers[name].shape if name in buffers else None)
        hint = "load a state dict of the same model"
        if first in stacked:
            want = topo.global_shape(stacked[first], want)
            hint = (f"{first} stacks the experts of every expert-parallel rank (the model's {_expert.STACKED_ATTR}): "
                    "pass the global tensor, as state_dict() gives it at any expert_parallel_size; this rank takes "
                    "its own experts")
        if want is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want)):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"load_state_dict: {name} is {got}, the model expects shape {tuple(want)}; {hint}")
    values = _tied_values(state_dict, targets, tied)
    for name in stacked:
        if name in values:
            values[name] = topo.local_experts(stacked[name], values[name])
    with torch.no_grad():
        for name, (u, layout, local, o, numel, _) in targets.items():
            if name not in values:
                continue
            start, length = shard_start(engine, layout, u), local.numel()
            lo, hi = max(o, start), min(o + numel, start + length)
            if lo < hi:
                src = values[name].detach().reshape(-1)[lo - o : hi - o]
                local[lo - start : hi - start].copy_(src)
            u.mark_stale()
        for name, b in buffers.items():
            if name in state_dict:
                b.copy_(state_dict[name])
    for name, m in extras:
        if name in state_dict:
            m.set_extra_state(state_dict[name])
    return missing, unexpected


def _tied_values(state_dict: Mapping[str, Any], targets: Mapping[str, Any],
                 tied: Mapping[str, str]) -> Dict[str, torch.Tensor]:
    """The value of every parameter that ``state_dict`` names, under the name its unit holds it by.

    A tied parameter takes its value from whichever of its names are present; names of one parameter that
    carry different values are refused ([Note: tied parameters] in _fully_shard.py).
    """
    values = {n: state_dict[n] for n in targets if n in state_dict}
    source = {n: n for n in values}
    for name, first in tied.items():
        if name not in state_dict:
            continue
        value = state_dict[name]
        if first not in values:
            values[first], source[first] = value, name
        elif value is not values[first] and not torch.equal(
                value.detach().to(values[first].device, values[first].dtype), values[first].detach()):
            raise ValueError(
                f"load_state_dict: {source[first]} and {name} name one tied parameter but hold different values; "
                f"a tied parameter has one value: give both keys the same tensor, or drop {name} and load with "
                "strict=False"
            )
    return values


# ---------------------------------------------------------------------------------------------- module guard
def guard_module_state_dicts(engine: Engine) -> List[Any]:
    """Refuse module-level state_dict/load_state_dict on modules that own sharded parameters."""
    ref = weakref.ref(engine)
    owned = {id(p) for u in engine.all_units() for p in u.all_params}
    handles = []
    for m in engine.module.modules():
        if any(p is not None and id(p) in owned for p in m._parameters.values()):
            handles.append(m.register_state_dict_pre_hook(_refuse_save(ref)))
            register = getattr(m, "register_load_state_dict_pre_hook", None) or m._register_load_state_dict_pre_hook
            handles.append(register(_refuse_load(ref)))
    return handles


def _message(engine: Engine, module: nn.Module, what: str, fix: str) -> str:
    return (
        f"[rank {engine.rank}] megatron_fsdp: {type(module).__name__}.{what}() would use the compute views of "
        "sharded parameters, which outside forward hold no meaningful values (freed, or another unit's). "
        f"{fix}"
    )


def _refuse_save(ref: "weakref.ref") -> Any:
    def fsdp_state_dict_guard(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        engine = ref()
        if engine is not None and not engine._summoned:
            raise RuntimeError(_message(
                engine, module, "state_dict",
                "Call state_dict() on the MegatronFSDP wrapper (full fp32 values, unwrapped keys; a collective), or "
                "read inside `with model.summon_full_params():`",
            ))

    return fsdp_state_dict_guard


def _refuse_load(ref: "weakref.ref") -> Any:
    def fsdp_load_state_dict_guard(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        engine = ref()
        if engine is not None and not engine._summoned:
            raise RuntimeError(_message(
                engine, module, "load_state_dict",
                "Call load_state_dict() on the MegatronFSDP wrapper (it writes the fp32 main shards), or "
                "load_sharded_state_dict() after torch.distributed.checkpoint.load",
            ))

    return fsdp_load_state_dict_guard


# ---------------------------------------------------------------------------------------------- summon
@contextlib.contextmanager
def summon_full_params(engine: Engine, *, writeback: bool = False) -> Iterator[None]:
    """Inside the block, every module parameter is a full fp32 copy of its current value.

    A collective (an all-gather per unit) on entry: enter it on every rank, between steps (not inside
    forward or backward). The parameters' dtype inside is fp32 whatever the compute dtype. With
    ``writeback=True``, values changed inside are written back to the main shards on a normal exit (each
    rank writes its own slice, so make the same change on every rank). On exit the parameters point at
    their compute views again (the same addresses as before: captured graphs stay valid).
    """
    fp8 = [u.name for u in engine.all_units() if u.fp8 is not None]
    if fp8:
        raise RuntimeError(
            f"[rank {engine.rank}] megatron_fsdp: summon_full_params() with FP8 weights (units {fp8[:3]}): an FP8 "
            "weight's values are bytes with a scale, not a tensor a full fp32 copy can stand in for; read values "
            "with model.state_dict() (the fp32 main shards, gathered) or the sharded state dict")
    busy = [u.name for u in engine.all_units() if u.state in COMPUTING]
    if busy or engine._summoned:
        raise RuntimeError(
            f"[rank {engine.rank}] megatron_fsdp: summon_full_params() entered while units {busy} are mid-step"
            f"{' or inside another summon_full_params()' if engine._summoned else ''}; enter it between steps"
        )
    engine.reset_step_state()  # waits for in-flight collectives; the compute views are rebuilt before use
    fulls = []
    for u in engine.all_units():
        flats = [gather_region(engine, layout, local, u).clone() for layout, local in regions(u)]
        fulls.append((u, flats))
    saved = [(p, p.data) for u in engine.all_units() for p in u.all_params]
    with torch.no_grad():
        for u, flats in fulls:
            views = [v for (layout, _), flat in zip(regions(u), flats) for v in layout.views(flat)]
            for p, v in zip(u.all_params, views):
                p.data = v
    engine._summoned = True
    ok = False
    try:
        yield
        ok = True
    finally:
        engine._summoned = False
        with torch.no_grad():
            for p, d in saved:
                p.data = d
            if writeback and ok:
                for u, flats in fulls:
                    for (layout, local), flat in zip(regions(u), flats):
                        start = shard_start(engine, layout, u)
                        local.copy_(flat[start : start + local.numel()])
                    u.mark_stale()
