"""NVIDIA's Megatron-FSDP, as released, as an engine of the graph layer (see [Note: the engine contract]).

NVIDIA's engine (class ``MegatronFSDP``; megatron-core wraps it in ``FullyShardedDataParallel``) is reached
only through objects the user built: this module imports nothing of megatron. Its import name clashes with
this project's ``megatron_fsdp``, so use it through megatron-core's bundled copy,
``megatron.core.distributed.fsdp.src.megatron_fsdp``.

The engine's classes and hooks are read in ``hooks.py`` ([Note: NVIDIA Megatron-FSDP internals
relied on]); this module holds the adapter, the version check, the double buffer's slot pin and the capture guard.

[Note: NVIDIA's double buffer and replay]
With ``fsdp_double_buffer``, ZeRO-3 (``optim_grads_params``) buckets of the units of one size live in two
slots of a ``FixedPoolAllocator`` (or ``MaxPoolAllocator``): persistent, named buffers. Which slot a bucket
gets is decided at each unshard: 0.3.1 takes the lowest free slot (with an odd number of units, each unit's
backward slot is the other one than its forward slot: unit k's backward hook allocates unit k-1 first),
0.6.1 remembers the slot of the first allocation and moves the bucket to the other one when that slot is
busy. A graph captured with a unit in one slot and replayed with it in the
other reads the wrong weights, and the backward graph's weights are not seen by a forward address check.
:func:`pin_double_buffer_slots` makes the slot a fixed function of the plan: a double-buffered unit's
bucket always takes slot (its position among double-buffered units) % 2, which is free whenever units run
in module order one prefetch ahead (the engine releases a unit before prefetching the one two places on);
if it is not free, the allocation raises RuntimeError instead of moving the bucket. Parameters then sit
at one address per unit in forward and in backward, which the graph layer's replay address check on the
parameters (:meth:`NvidiaMegatronFSDPEngine.replay_tensors`) verifies before every replay. Units outside
the double-buffered group need ``fsdp_db_use_persist_buf_on_alloc_fail`` (0.6.1; a persistent buffer per
bucket); 0.3.1 has no such option and allocates them anew at each unshard, so it is refused.

[Note: NVIDIA's FP8 parameters and replay]
A model whose TE layers were built under ``quantized_model_init`` holds ``Float8Tensor`` weights (per-tensor
scaling: current or delayed), and NVIDIA's engine gathers them as bytes: a parameter group of such weights has
dtype "float8" whatever ``fp8_param_gather`` says (that flag only quantizes parameters initialised on the meta
device). What a replay reads of such a weight, from Megatron-FSDP 0.6.1's ``param_and_grad_buffer.py``,
``megatron_fsdp.py`` and ``mixed_precision.py`` (0.3.1's are the same in these points) and TE 2.20's
``tensor/float8_tensor.py``, ``tensor/storage/float8_tensor_storage.py`` and ``tensor/utils.py``:

- ``_data``, the FP8 bytes: ``DataParallelBuffer.fetch_bucket(set_param_data=True)`` points it
  (``fp8_set_raw_data``) into the unit's bucket of the weight buffer, a slot of ``weight_alloc``: double-buffered
  and pinned like a bf16 unit's ([Note: NVIDIA's double buffer and replay]), in forward and in backward.
- ``_scale_inv``: the weight's own tensor, written in place when the optimizer step quantizes the main shards
  (``fp8_quantize`` -> TE's ``cast_master_weights_to_fp8``: ``multi_tensor_compute_scale_and_scale_inv`` into
  ``_scale_inv.view(1)``), outside any graph.
- ``_transpose``, the column-wise copy TE's dgrad GEMM reads on Hopper: not gathered. After the backward
  all-gather, ``all_gather_and_wait_parameters_ready(bwd=True)`` writes it from ``_data`` on the device
  (``fp8_create_transpose_cache`` -> TE's ``post_all_gather_processing`` -> ``_create_transpose``:
  ``fp8_transpose(_data, out=_transpose)``), in the pre-backward hook, outside the graph. With
  ``keep_fp8_transpose_cache=False`` (the default) every release drops it (``fp8_discard_transpose_cache``:
  ``_transpose = None``), so each backward writes a new tensor wherever the allocator puts it: a backward graph
  would read the capture's freed copy, and the pre-replay check, which runs before the forward, cannot see it (no
  transpose exists then). Refused. With ``keep_fp8_transpose_cache=True`` the tensor is kept and rewritten in
  place at every backward unshard, before the backward replay reads it; TE's forward may rewrite it too when TE
  marked it stale (0.3.1's quantization resets the caches), again in place and from the same bytes.
- ``raw_param`` maps each name to the ``Float8Tensor`` itself (the module's compute parameter), as for bf16.

So each of the three tensors stays where capture found it, and :meth:`NvidiaMegatronFSDPEngine.replay_tensors`
names them (the same expansion as ``megatron_fsdp``'s: a tensor subclass's own ``data_ptr()`` says nothing of the
bytes its GEMMs read), so a replay after any of them moved is refused before it runs. Refused too, naming the fix:
a ``transpose_weight_buffer`` (MXFP8 weights: column-wise bytes gathered into their own buffer, per-block scales
the check does not read), quantized weights of another layout (block scaling, NVFP4: ``_rowwise_data``), and
FP8 weights under a strategy other than ``optim_grads_params`` (not checked: no double buffer there). On Blackwell
TE reads no transpose (``is_non_tn_fp8_gemm_supported``); the check then covers the bytes and the scale.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from fsdp_cudagraph.engines.contract import (HOOK_DICTS, EngineAdapter, HookPlan, PerLayerEngine, ReplayProbe,
                                             parameter_slots)
from fsdp_cudagraph.engines.hookplan import read_sentinel
from fsdp_cudagraph.engines.megatron_fsdp.adapter import parameter_ops, parameter_replay_tensors, replay_addresses
from fsdp_cudagraph.engines.nvidia.hooks import (_PLANS, _engine_of, _is_engine, _is_mcore_wrapper, _local_name,
                                                 _owner, _te_form, identify_hook)
from fsdp_cudagraph.engines.registry import register_engine

__all__ = ["NvidiaMegatronFSDPEngine", "TESTED_VERSIONS", "check_version", "identify_hook",
           "pin_double_buffer_slots", "unpin_double_buffer_slots"]

#: Megatron-FSDP versions whose hook structure and allocators were checked (see the note above and
#: [Note: NVIDIA Megatron-FSDP internals relied on] in hooks.py).
TESTED_VERSIONS: Dict[str, str] = {
    "0.3.1": "bundled in megatron-core 0.16.1 (run on CPU)",
    "0.6.1": "bundled in megatron-core 0.19.2 and released as megatron-fsdp 0.6.1 (source read)",
}
_DICTS = HOOK_DICTS


# -- versions -------------------------------------------------------------------------------------------
def _package_version(package: str) -> Optional[str]:
    """``package.package_info.__version__`` of an imported package (None where it has none)."""
    if package not in sys.modules:
        return None
    try:
        info = importlib.import_module(package + ".package_info")
    except ImportError:
        return None
    return getattr(info, "__version__", None)


def engine_versions(engine: Any) -> Tuple[Optional[str], Optional[str]]:
    """(Megatron-FSDP version, megatron-core version or None) of the package ``engine``'s class comes from."""
    package = type(engine).__module__.rpartition(".")[0]
    fsdp = _package_version(package)
    mcore = _package_version("megatron.core") if package.startswith("megatron.core.") else None
    return fsdp, mcore


def check_version(fsdp_version: Optional[str], mcore_version: Optional[str] = None) -> None:
    """Refuse a Megatron-FSDP whose hooks and allocators were not checked (NotImplementedError)."""
    if fsdp_version in TESTED_VERSIONS:
        return
    where = f" (bundled in megatron-core {mcore_version})" if mcore_version else ""
    tested = "; ".join(f"{v}, {how}" for v, how in TESTED_VERSIONS.items())
    raise NotImplementedError(
        f"fsdp_cudagraph: NVIDIA Megatron-FSDP {fsdp_version}{where} is not a version the adapter was checked "
        f"against (tested: {tested}). Partial graphs recognise its hooks by structure, which changes between "
        "releases: install megatron-core 0.16.1 or 0.19.2 (or megatron-fsdp 0.6.1), or report the version")


# -- the double buffer ----------------------------------------------------------------------------------
def _forget_refused_gathers(pipeline: Any) -> None:
    """Put back to EMPTY each bucket NVIDIA's all-gather pipeline marked COMMUNICATING without starting a
    gather (no event recorded), and free whatever memory it got.

    A refused pinned allocation leaves such a bucket, because the pipeline marks the bucket before it asks for
    memory. So does a collective refused inside a capture guard, after the memory was fetched. The pipeline's
    own ``reset`` would wait on the missing event (KeyError) and hide the refusal's message. Every allocator
    of NVIDIA's engine frees a bucket it does not hold as a no-op.
    """
    status, events = getattr(pipeline, "bucket_status", None), getattr(pipeline, "param_gather_event_map", None)
    if not isinstance(status, dict) or not isinstance(events, dict):
        return
    for key, value in list(status.items()):
        if getattr(value, "name", None) == "COMMUNICATING" and key not in events:
            if hasattr(pipeline, "get_fsdp_buffer"):
                bucket_id, transpose = key
                pipeline.get_fsdp_buffer(bucket_id, transpose).free_bucket_storage()
            status[key] = type(value).EMPTY


_PIN_ATTR = "_fsdp_cudagraph_unpinned_allocate"
#: Attributes that mark a quantized parameter (TE's Float8Tensor: _data, _scale_inv; MXFP8, block-scaled and
#: NVFP4 weights: _rowwise_data, _columnwise_data), for one TE has not registered with the FP8 expansion.
_QUANTIZED_ATTRS = ("_data", "_scale_inv", "_rowwise_data", "_columnwise_data")


def _compute_parameter(p: torch.Tensor, raw: Mapping[str, torch.Tensor], optimizer_names: Mapping[int, str]
                       ) -> torch.Tensor:
    """The compute ("raw") parameter behind ``p``: after ``finish_grad_sync`` the module holds the optimizer's
    DTensors, which map back to the engine's ``raw_param`` by name; any other parameter is itself."""
    full = optimizer_names.get(id(p))
    return raw[full] if full is not None and full in raw else p


def _pinned_allocators(engine: Any) -> List[Any]:
    buffer = getattr(engine, "param_and_grad_buffer", None)
    out = []
    for attr in ("weight_alloc", "transpose_weight_alloc"):
        alloc = getattr(buffer, attr, None)
        if alloc is not None and hasattr(alloc, "fsdp_double_buffer_units") and hasattr(alloc, "idle_buffer"):
            out.append(alloc)
    return out


def _planned_entry(alloc: Any, bucket_id: int, dtype: Any) -> Optional[Tuple[Any, ...]]:
    """The idle-pool entry ``bucket_id`` is pinned to, None if its unit is not double-buffered."""
    unit_id = alloc.fsdp_param_groups[bucket_id].fsdp_unit_id
    units = sorted(u for u in alloc.fsdp_double_buffer_units if u is not None)
    if unit_id not in units:
        return None
    slot = units.index(unit_id) % alloc.size
    index = getattr(alloc, "bucket_alloc_index", None)
    if index is not None:  # 0.6.1 MaxPoolAllocator: (slot, dtype, offset)
        offset = index[bucket_id][1]
        return slot, (torch.uint8 if dtype == "float8" else dtype), offset
    buckets = alloc.fsdp_unit_buckets[unit_id]
    offset = buckets[bucket_id][1] if isinstance(buckets, dict) else buckets.index(bucket_id)  # 0.6.1 / 0.3.1
    return slot, offset


def _describe(alloc: Any, bucket_id: int, names: Mapping[int, str]) -> str:
    unit = alloc.fsdp_param_groups[bucket_id].fsdp_unit_id
    return f"bucket {bucket_id} (FSDP unit {unit}, {names.get(bucket_id, '?')})"


def pin_double_buffer_slots(model: nn.Module) -> int:
    """Give each double-buffered bucket of NVIDIA's engine one fixed slot; refuse to move it (RuntimeError).

    See [Note: NVIDIA's double buffer and replay]. Idempotent; :func:`unpin_double_buffer_slots` undoes it.
    Returns the number of allocators pinned (0 without a double buffer). The allocators' ``allocate`` is
    replaced on the instance (nothing of the installed package changes).
    """
    engine = _engine_of(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    param_name = {id(p): n for n, p in engine.module.named_parameters()}
    allocators = _pinned_allocators(engine)
    for alloc in allocators:
        if _PIN_ATTR in alloc.__dict__:
            continue
        names = {b: param_name.get(id(g.params[0]), "?") if getattr(g, "params", None) else "?"
                 for b, g in enumerate(alloc.fsdp_param_groups)}
        original = alloc.allocate

        def allocate(bucket_id: int, size: int, dtype: Any, device: Any, *args: Any, _alloc: Any = alloc,
                     _original: Any = original, _names: Dict[int, str] = names, **kwargs: Any) -> Any:
            entry = _planned_entry(_alloc, bucket_id, dtype)
            if entry is None or bucket_id in _alloc.using_buffer:
                return _original(bucket_id, size, dtype, device, *args, **kwargs)
            if entry not in _alloc.idle_buffer:
                holders = [_describe(_alloc, b, _names) for b, e in _alloc.using_buffer.items() if e == entry]
                raise RuntimeError(
                    f"[rank {rank}] fsdp_cudagraph: NVIDIA Megatron-FSDP's double buffer "
                    f"({getattr(_alloc, 'name', '?')}) would move {_describe(_alloc, bucket_id, _names)} out of its "
                    f"planned slot {entry[0]}, still held by {holders or 'another bucket'}; a CUDA graph captured "
                    f"with this unit in slot {entry[0]} would replay on another unit's weights. A unit was "
                    "all-gathered before the unit two places before it released the slot: keep the FSDP units in "
                    "module (forward) order with one prefetch ahead and no activation recomputation of graphed "
                    "units, or delete() the graphs and call unpin_double_buffer_slots to train eagerly")
            others = [e for e in _alloc.idle_buffer if e != entry and e[1:] == entry[1:]]
            for e in others:  # the only free slot of this offset is the planned one while the call runs
                _alloc.idle_buffer.remove(e)
            try:
                bucket = _original(bucket_id, size, dtype, device, *args, **kwargs)
            finally:
                _alloc.idle_buffer.extend(others)
            assert _alloc.using_buffer.get(bucket_id) == entry, (bucket_id, entry, _alloc.using_buffer)
            return bucket

        alloc.__dict__[_PIN_ATTR] = original
        alloc.allocate = allocate
    return len(allocators)


def unpin_double_buffer_slots(model: nn.Module) -> None:
    """Undo :func:`pin_double_buffer_slots`: the allocators choose slots as released again."""
    for alloc in _pinned_allocators(_engine_of(model)):
        if _PIN_ATTR in alloc.__dict__:
            del alloc.__dict__["allocate"]
            del alloc.__dict__[_PIN_ATTR]


# -- the capture guard ----------------------------------------------------------------------------------
#: The torch.distributed functions NVIDIA's engine calls through the module at call time.
_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "reduce_scatter",
                "broadcast", "barrier")
_guard_lock = threading.Lock()
_guard_depth = 0


@contextlib.contextmanager
def _refuse_collectives(rank: int, what: str) -> Iterator[None]:
    """torch.distributed's collectives raise RuntimeError inside (restored in ``finally``; nests)."""
    global _guard_depth
    dist = torch.distributed
    with _guard_lock:
        _guard_depth += 1
        saved = {}
        if _guard_depth == 1:
            for name in _COLLECTIVES:
                if hasattr(dist, name):
                    saved[name] = getattr(dist, name)
                    setattr(dist, name, _refusing(name, rank, what))
    try:
        yield
    finally:
        with _guard_lock:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            _guard_depth -= 1


def _refusing(name: str, rank: int, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"[rank {rank}] fsdp_cudagraph: NVIDIA Megatron-FSDP called torch.distributed.{name} during {what}; "
            "collectives must stay outside CUDA graphs (the engine's hooks run around the capture, not in it). "
            "A hook of the engine ran inside the captured module: see check_partial_graphs' refusals")
    refuse.__name__ = name
    return refuse


@register_engine
class NvidiaMegatronFSDPEngine(EngineAdapter, PerLayerEngine):
    """A model wrapped by NVIDIA's Megatron-FSDP: its ``MegatronFSDP``, or megatron-core's
    ``FullyShardedDataParallel`` around one.

    Units are the instances of the engine's ``fsdp_unit_modules`` not nested in another (the modules its
    ``_register_fsdp_hooks`` gives unit hooks), in module order. Construction refuses an untested version;
    :meth:`check_partial_graphs` refuses unsafe settings and pins the double buffer's slots.
    """

    name = "NVIDIA Megatron-FSDP"
    address_hint = ("Keep fsdp_double_buffer=True (and fsdp_db_use_persist_buf_on_alloc_fail=True on 0.6.1), "
                    "keep_fp8_transpose_cache=True with FP8 weights, and the double buffer's slot pin "
                    "(pin_double_buffer_slots) in force.")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.engine = _engine_of(model)
        self.fsdp_version, self.mcore_version = engine_versions(self.engine)
        check_version(self.fsdp_version, self.mcore_version)

    @classmethod
    def recognizes(cls, model: nn.Module) -> bool:
        # By class path: imports nothing, so megatron stays unloaded unless the user loaded it.
        return _is_engine(model) or (_is_mcore_wrapper(model) and _is_engine(getattr(model, "module", None)))

    @classmethod
    def wrapper_of(cls, model: nn.Module) -> Optional[str]:
        # The engine keeps no pointer on its inner modules; its hooks' closures hold it (``self``), so the first
        # hook of ``_register_fsdp_hooks`` found in ``model`` names the engine.
        for m in model.modules():
            for d in _DICTS:
                for hook in getattr(m, d).values():
                    engine = _owner(hook) if _local_name(hook) is not None else None
                    if engine is not None and _is_engine(engine) and any(s is model for s in engine.module.modules()):
                        return (f"NVIDIA's MegatronFSDP around {type(engine.module).__name__} (or megatron-core's "
                                "FullyShardedDataParallel around it)")
        return None

    @property
    def root(self) -> nn.Module:
        return self.engine.module

    # -- units ------------------------------------------------------------------------------------
    def _unit_classes(self) -> Tuple[type, ...]:
        return tuple(c for c in getattr(self.engine, "fsdp_unit_modules", ()) if isinstance(c, type))

    def unit_modules(self) -> List[nn.Module]:
        classes, units = self._unit_classes(), []
        if not classes:
            return units
        for m in self.root.modules():
            if isinstance(m, classes) and not any(any(s is m for s in u.modules()) for u in units):
                units.append(m)
        return units

    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        for unit in self.unit_modules():
            if any(s is module for s in unit.modules()):
                return unit
        return None

    # -- hooks ------------------------------------------------------------------------------------
    def hook_plan(self, hooks: Mapping[str, Mapping[int, Any]]) -> HookPlan:
        plan = HookPlan()
        for dict_name in _DICTS:
            for hid, hook in hooks.get(dict_name, {}).items():
                if read_sentinel(hook, hid, dict_name, plan):  # the contract's sentinel wrappers (NVIDIA sets none)
                    continue
                found = identify_hook(hook, self.engine)
                expected = _PLANS.get(found[0]) if found is not None else None
                if expected is None or expected[0] != dict_name:
                    plan.unknown.append((dict_name, hid, hook))
                    continue
                role, fn = found
                _, key, kind = expected
                if key is not None:
                    plan.capture_time[key][hid] = _te_form(fn, kind)
                if role in ("pre_backward", "post_backward"):
                    plan.withheld.append((dict_name, hid, hook))
                elif role == "root_pre_backward":  # the engine's own, run by nothing at capture
                    plan.engine_only.append((dict_name, hid, hook))
        return plan

    # -- what must not move -----------------------------------------------------------------------
    def _strategy(self) -> str:
        e = self.engine
        return str(getattr(e, "data_parallel_sharding_strategy", None) or e.ddp_config.data_parallel_sharding_strategy)

    def check_partial_graphs(self) -> None:
        """Refuse settings under which replay could read moved or stale memory; then pin the double buffer."""
        e, cfg = self.engine, self.engine.ddp_config
        version = f"Megatron-FSDP {self.fsdp_version}"
        fine = [n for n in ("enable_fine_grained_param_gather_hook", "enable_fine_grained_param_gather_backward_hook")
                if getattr(e, n, False)]
        if fine:
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} was built with {fine}=True, which hooks every submodule, so the "
                "engine's all-gathers would run inside the captured layers; build it without fine-grained "
                "parameter gathering (fully_shard_model(enable_fine_grained_param_gather=False))")
        self._check_fp8_parameters(version)
        index = getattr(e, "dist_index", None)
        if getattr(index, "use_hybrid_fsdp", False):
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} runs hybrid FSDP (outer_dp_sharding_strategy="
                f"{getattr(cfg, 'outer_dp_sharding_strategy', '?')!r}), which partial graphs were not checked "
                "with; use plain FSDP (no dp_outer_dim / hybrid_fsdp_group)")
        fused = [f"{self.unit_name(u)}.{n}" for u in self.unit_modules() for n, m in u.named_modules()
                 if getattr(m, "fuse_wgrad_accumulation", False)]
        if fused:
            raise NotImplementedError(
                f"fsdp_cudagraph: modules {fused[:4]} fuse weight-gradient accumulation into main_grad "
                "(fuse_wgrad_accumulation=True); under NVIDIA Megatron-FSDP main_grad is allocated per bucket at "
                "each backward, so a graph would write a stale address: set fuse_wgrad_accumulation=False "
                "(gradient_accumulation_fusion=False in megatron-core)")
        inside = self._hooks_inside_units()
        if inside:
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} put its hooks {inside[:4]} on modules inside FSDP units; inside a "
                "graphed layer they would run in the capture and never at replay. _register_fsdp_hooks attaches "
                "its root pre-backward hook to the last module named_modules() yields: end the model with a "
                "module outside the FSDP units (a final norm or output head, as GPT models do)")
        if self._strategy() == "optim_grads_params":
            self._check_zero3(version)
        pin_double_buffer_slots(self.engine)

    def _quantized_parameters(self) -> List[Tuple[str, torch.Tensor]]:
        """(name, parameter) of the engine's compute parameters that are quantized (TE's FP8 weights)."""
        raw = getattr(self.engine, "raw_param", None) or dict(self.root.named_parameters())
        return [(n, p) for n, p in raw.items()
                if parameter_ops(p) is not None or any(hasattr(p, a) for a in _QUANTIZED_ATTRS)]

    @property
    def fp8_supported(self) -> bool:  # type: ignore[override]
        """An FP8 recipe under per-layer graphs: only over FP8 weights the engine gathers as bytes, whose every
        tensor the replay check reads ([Note: NVIDIA's FP8 parameters and replay]; `torch.equal` on one GPU). bf16
        weights that TE quantizes in forward stay refused here, as the contract's default says."""
        return bool(self._quantized_parameters())

    def _check_fp8_parameters(self, version: str) -> None:
        """[Note: NVIDIA's FP8 parameters and replay]: refuse what the replay check does not cover."""
        e, cfg = self.engine, self.engine.ddp_config
        groups = getattr(getattr(e, "param_and_grad_buffer", None), "parameter_groups", ())
        columnwise = [i for i, g in enumerate(groups) if getattr(g, "transpose_weight_buffer", None) is not None]
        if columnwise:
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} gathers parameter groups {columnwise[:4]} into a transpose_weight_buffer "
                "(MXFP8 weights): their column-wise bytes and per-block scales are tensors the replay check does not "
                "read; build the FP8 layers with a per-tensor recipe (Float8CurrentScaling or DelayedScaling under "
                "quantized_model_init), or without quantized_model_init (bf16 weights)")
        quantized = self._quantized_parameters()
        if not quantized:  # fp8_param_gather=True over bf16 parameters gathers bf16, as without it
            return
        other = [f"{n} ({type(p).__name__})" for n, p in quantized
                 if parameter_ops(p) is None or hasattr(p, "_rowwise_data")
                 or not all(hasattr(p, a) for a in ("_data", "_scale_inv"))]
        if other:
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} holds quantized parameters {other[:4]} that are not per-tensor FP8 "
                "weights (TE's Float8Tensor: _data, _transpose, _scale_inv), the only layout the replay check reads; "
                "build them under quantized_model_init with Float8CurrentScaling or DelayedScaling, or without it")
        names = [n for n, _ in quantized]
        strategy = self._strategy()
        if strategy != "optim_grads_params":
            raise NotImplementedError(
                f"fsdp_cudagraph: {version} gathers FP8 weights {names[:3]} as bytes with "
                f"data_parallel_sharding_strategy={strategy!r}; partial graphs over FP8 weights were checked with "
                "'optim_grads_params' only (double-buffered slots, transposes written by the backward unshard): use "
                "'optim_grads_params' with fsdp_double_buffer=True, or build the layers without quantized_model_init")
        if not getattr(cfg, "keep_fp8_transpose_cache", False):
            raise ValueError(
                f"fsdp_cudagraph: {version} with FP8 weights {names[:3]} and keep_fp8_transpose_cache="
                f"{getattr(cfg, 'keep_fp8_transpose_cache', None)}: the engine drops each weight's transpose when it "
                "releases the unit and writes a new one at the next backward unshard, wherever the allocator puts "
                "it, so a backward graph would read the capture's freed copy (and no check before the forward can "
                "see it); pass keep_fp8_transpose_cache=True to fully_shard (or set it in "
                "DistributedDataParallelConfig): the transpose is then kept and rewritten in place")

    def _check_zero3(self, version: str) -> None:
        cfg = self.engine.ddp_config
        double = bool(getattr(cfg, "fsdp_double_buffer", False))
        has_persist = hasattr(cfg, "fsdp_db_use_persist_buf_on_alloc_fail")
        persist = bool(getattr(cfg, "fsdp_db_use_persist_buf_on_alloc_fail", False))
        if has_persist and not (double and persist):
            raise ValueError(
                f"fsdp_cudagraph: partial CUDA graphs under {version} with data_parallel_sharding_strategy="
                f"'optim_grads_params' need fsdp_double_buffer=True and fsdp_db_use_persist_buf_on_alloc_fail="
                f"True (the model has {double} and {persist}): replay reads parameters at the addresses of "
                "capture, and without them unshard buffers are allocated anew; pass both to fully_shard_model "
                "(or set both in DistributedDataParallelConfig)")
        if not double:
            raise ValueError(
                f"fsdp_cudagraph: partial CUDA graphs under {version} with data_parallel_sharding_strategy="
                "'optim_grads_params' need fsdp_double_buffer=True (the model has False): without it unshard "
                "buffers are allocated anew at every all-gather; set it in DistributedDataParallelConfig")
        if not has_persist:  # 0.3.1: units outside the double-buffered group are allocated anew at each unshard
            alloc = getattr(self.engine.param_and_grad_buffer, "weight_alloc", None)
            pooled = set(getattr(alloc, "fsdp_double_buffer_units", ()))
            outside = sorted({g.fsdp_unit_id for g in getattr(alloc, "fsdp_param_groups", ())
                              if g.fsdp_unit_id not in (None, -1) and g.fsdp_unit_id not in pooled})
            if outside:
                raise NotImplementedError(
                    f"fsdp_cudagraph: {version} double-buffers only FSDP units of one size and allocates units "
                    f"{outside} anew at every unshard, and has no fsdp_db_use_persist_buf_on_alloc_fail; make all "
                    "units the same size, or use megatron-core 0.19.2 (Megatron-FSDP 0.6.1) with "
                    "fsdp_db_use_persist_buf_on_alloc_fail=True")

    def _hooks_inside_units(self) -> List[str]:
        out = []
        for unit in self.unit_modules():
            base = self.unit_name(unit)
            for name, m in unit.named_modules():
                if m is unit:
                    continue
                for d in _DICTS:
                    for hook in getattr(m, d).values():
                        found = identify_hook(hook, self.engine)
                        if found is not None:
                            out.append(f"{base}.{name}:{found[0]}")
        return out

    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        # The module's compute ("raw") parameters, whose .data the engine points into the unshard buffer; after
        # finish_grad_sync the module holds the optimizer's DTensors instead, so map those back by name. An FP8
        # weight is the tensors its GEMMs read: bytes, transpose, scale ([Note: NVIDIA's FP8 parameters and replay]).
        raw = getattr(self.engine, "raw_param", None) or {}
        dist = self._optimizer_names()
        out: List[Tuple[str, torch.Tensor]] = []
        for name, p in module.named_parameters():
            out.extend(parameter_replay_tensors(name, _compute_parameter(p, raw, dist)))
        return out

    def replay_probe(self, module: nn.Module) -> ReplayProbe:
        # Resolved once: where each parameter is registered, the optimizer's DTensors by id (created with the
        # engine, they do not change) and each compute parameter's kind; each call maps what is registered now, as
        # replay_tensors does, and reads data pointers only.
        slots, dist, engine = parameter_slots(module), self._optimizer_names(), self.engine
        raw0 = getattr(engine, "raw_param", None) or {}
        kinds = [parameter_ops(_compute_parameter(d[n], raw0, dist)) for d, n in slots]

        def probe() -> Tuple[int, ...]:
            raw = getattr(engine, "raw_param", None) or {}
            return tuple(replay_addresses([_compute_parameter(d[n], raw, dist) for d, n in slots], kinds))
        return probe

    def _optimizer_names(self) -> Dict[int, str]:
        return {id(p): n for n, p in getattr(getattr(self.engine, "param_and_grad_buffer", None),
                                              "optimizer_named_parameters", ())}

    # -- capture guard ----------------------------------------------------------------------------
    def capture_guard(self) -> ContextManager[None]:
        return _refuse_collectives(self.rank, "a CUDA graph capture")

    def simulated_capture(self) -> ContextManager[None]:
        return _refuse_collectives(self.rank, "a (simulated) capture")

    # -- step boundary ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Wait for in-flight all-gathers and reductions, release every unit's bucket, put the compute
        parameters back on the modules (capture calls the layers directly, not ``MegatronFSDP.forward``).

        Training states are left as the engine's own hooks set them (a capture pass leaves them as an eager
        step does), except a unit left mid-forward by a failed capture, which goes back to idle.
        """
        e = self.engine
        reduce = getattr(e, "grad_reduce_pipeline", None)
        if reduce is not None:
            reduce.wait_for_previous_grad_reduce(0)
        gather = getattr(e, "all_gather_pipeline", None)
        if gather is not None:
            _forget_refused_gathers(gather)
            gather.reset()
        e._replace_param_with_raw_if_needed()
        states = getattr(sys.modules.get(type(e).__module__), "TrainingState", None)
        if states is not None:
            for unit in self.unit_modules():
                if getattr(unit, "_training_state", None) == states.FORWARD:
                    unit._training_state = states.IDLE

    @contextlib.contextmanager
    def one_unit_at_a_time(self) -> Iterator[None]:
        """NVIDIA's handlers all-gather without prefetching inside ([Note: the engine contract] item 8).

        Its pre-forward handler prefetches the next unit and its pre-backward handler the one before. Run
        together for unit k, as PyTorch's graph maker needs, they would hold units k-1, k and k+1: three
        buckets for the double buffer's two slots (on 2 H100s the pinned allocator refused unit k-1). The
        entry point the closures call through ``self`` is shadowed on the instance with one that passes
        ``prefetch=False``, and restored on exit.
        """
        e, name = self.engine, "all_gather_and_wait_parameters_ready"
        gather = getattr(e, name, None)
        signature = inspect.signature(gather) if gather is not None else None
        if signature is None or "prefetch" not in signature.parameters:
            yield
            return
        own = e.__dict__.get(name)

        def without_prefetch(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["prefetch"] = False
            return gather(*bound.args, **bound.kwargs)

        e.__dict__[name] = without_prefetch
        try:
            yield
        finally:
            if own is None:
                e.__dict__.pop(name, None)
            else:
                e.__dict__[name] = own
