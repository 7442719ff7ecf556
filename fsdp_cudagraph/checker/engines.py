"""The alignment checker's engines: how ``check_alignment`` shards a factory's model under each FSDP engine.

One :class:`EngineBuilder` per engine in :data:`ENGINES`, each answering the same questions, so the checker's
training loop names no engine:

- ``unavailable(device)``: why the engine cannot run here (None: it can), asked before any work, as the
  exception to raise (ImportError: a package is missing; RuntimeError: the machine lacks something);
- ``build(model, unit_modules, make_optimizer, ...)``: the sharded model as a :class:`ShardedRun`, i.e. what
  the loss calls and ``PartialCudaGraphs`` wraps, the user's module (``select_modules`` and
  ``get_submodule`` names are relative to it), the optimizer, the optimizer's parameters by name (the
  gradient recorder reads their ``.grad``) and the final parameters to compare.

Engines:

- ``megatron_fsdp``: this project's engine, ``fully_shard`` with the double buffer and persistent buffers
  (address-stable ZeRO-3); ``compute_dtype`` is its compute dtype, main parameters stay fp32.
- ``fsdp2``: PyTorch's ``torch.distributed.fsdp.fully_shard`` on every unit module, then the root. Options
  (``engine_options``): ``storage`` ``keep`` (default: ``keep_unsharded_storage``, every unit's unsharded
  parameters held) or ``slots`` (``use_unsharded_slots``: two preallocated slots, units alternating, ZeRO-3
  memory; 2+ ranks); ``mixed_precision`` ``None`` (default: the model is cast to ``compute_dtype`` before
  sharding, parameters, gradients and optimizer state in that dtype) or ``bf16`` (fp32 sharded parameters
  and optimizer state, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every unit and
  the root, as FSDP2 and torchtitan train; ``compute_dtype`` must then be None or float32). See
  docs/engines.md, "PyTorch FSDP2".
- ``nvidia``: NVIDIA Megatron-FSDP through megatron-core's bundled copy
  (``megatron.core.distributed.fsdp.src.megatron_fsdp``), ZeRO-3 with ``fsdp_double_buffer`` and, where the
  version has it (0.6.1), ``fsdp_db_use_persist_buf_on_alloc_fail``; the module is cast to ``compute_dtype``
  (NVIDIA computes in the module's dtype) with fp32 main parameters and gradients. NVIDIA's ``fully_shard``
  replaces the optimizer's parameter groups by one group of its main parameters, so the optimizer's
  defaults apply (per-group settings of ``make_optimizer`` are dropped). Needs CUDA and megatron-core.
  Option ``wrapper``: ``fully_shard`` (default, the bundled ``megatron_fsdp.fully_shard``) or ``mcore``
  (megatron-core's ``FullyShardedDataParallel`` with a ``DistributedDataParallelConfig(use_megatron_fsdp=True,
  ...)`` over the same units, for megatron-core models; it builds the same ``MegatronFSDP`` engine, with
  megatron-core's parallel-state groups; the optimizer is wired by NVIDIA's ``fully_shard_optimizer``).

Final parameters: ``megatron_fsdp`` and ``fsdp2`` gather full parameters on every rank; ``nvidia`` gives this
rank's shard of each main parameter (the checker agrees its verdict over ranks, so equal shards on every
rank are equal parameters).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ENGINES", "EngineBuilder", "ShardedRun", "engine_builder", "check_options", "unit_classes", "NVIDIA_PIP"]

#: What installs NVIDIA Megatron-FSDP 0.6.1 (megatron-core's bundled copy), the version checked on a GPU.
NVIDIA_PIP = "pip install 'megatron-core==0.19.2'"

UnitSpec = Union[type, str]
MakeOptimizer = Callable[[List[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass
class ShardedRun:
    """One model sharded by one engine, as the checker's training loop uses it."""

    #: what the loss calls and ``PartialCudaGraphs`` wraps
    model: nn.Module
    #: the user's module: callable names (``select_modules``, ``get_submodule``) are relative to it
    root: nn.Module
    optimizer: torch.optim.Optimizer
    #: ``() -> [(name, parameter)]``: the optimizer's parameters, whose ``.grad`` the recorder reads after backward
    named_parameters: Callable[[], Sequence[Tuple[str, torch.Tensor]]]
    #: ``() -> {name: tensor on the CPU}``: the final parameters, compared rank by rank (a collective: every rank)
    final_parameters: Callable[[], Dict[str, torch.Tensor]]
    #: one line for the report: what runs in which dtype
    precision: str


@dataclasses.dataclass(frozen=True)
class EngineBuilder:
    """How the checker runs under one engine (an entry of :data:`ENGINES`)."""

    name: str
    #: ``(model, *, unit_modules, make_optimizer, device, sharding_strategy, compute_dtype) -> ShardedRun``
    build: Callable[..., ShardedRun]
    #: ``device -> why it cannot run here (ImportError or RuntimeError carrying the reason), or None``
    unavailable: Callable[[torch.device], Optional[Exception]]
    #: ``CudaGraphConfig.use_megatron_fsdp`` (the Megatron-FSDP address-stability flags are checked)
    use_megatron_fsdp: bool
    #: what makes it available, for the refusal
    fix: str = ""
    #: the ``engine_options`` keys ``build`` takes (passed as ``options=``); others are refused
    options: Tuple[str, ...] = ()


def check_options(builder: EngineBuilder, options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``options`` for ``builder``, refusing a key the engine does not take (ValueError naming the keys it does)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(builder.options))
    if unknown:
        takes = f"it takes {list(builder.options)}" if builder.options else "it takes none"
        raise ValueError(f"engine_options {unknown} are not options of engine={builder.name!r} ({takes}); drop them "
                         "or pick the engine they belong to")
    return options


def _is_unit(module: nn.Module, unit_modules: Sequence[UnitSpec]) -> bool:
    """As ``megatron_fsdp.fully_shard`` reads ``fsdp_unit_modules``: an instance of a class, or a class name."""
    return any(type(module).__name__ == s if isinstance(s, str) else isinstance(module, s) for s in unit_modules)


def unit_classes(model: nn.Module, unit_modules: Sequence[UnitSpec], *, engine: str) -> List[type]:
    """The classes of ``model``'s submodules that ``unit_modules`` selects (see :func:`_is_unit`), in module
    order; ValueError naming the classes present when none is selected."""
    if not unit_modules:
        raise ValueError(f"engine={engine!r}: unit_modules is empty; name the FSDP unit class (e.g. your decoder "
                         "layer's class or its class name) in the factory's ModelSpec")
    found: List[type] = []
    for m in model.modules():
        if m is not model and _is_unit(m, unit_modules) and type(m) not in found:
            found.append(type(m))
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"engine={engine!r}: unit_modules={[getattr(s, '__name__', s) for s in unit_modules]} "
                         f"matches no submodule of {type(model).__name__}; its module classes are {present[:20]}; "
                         "name one of those in the factory's ModelSpec")
    return found


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


# ---------------------------------------------------------------------------------------------- megatron_fsdp


def _build_megatron_fsdp(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                         device: torch.device, sharding_strategy: str,
                         compute_dtype: Optional[torch.dtype]) -> ShardedRun:
    from megatron_fsdp import fully_shard

    sharded = fully_shard(model, fsdp_unit_modules=unit_modules, sharding_strategy=sharding_strategy,
                          compute_dtype=compute_dtype, fsdp_double_buffer=True,
                          fsdp_db_use_persist_buf_on_alloc_fail=True)
    return ShardedRun(
        model=sharded, root=sharded.module, optimizer=make_optimizer(sharded.optimizer_parameters()),
        named_parameters=sharded.named_optimizer_parameters,
        final_parameters=lambda: {k: _cpu(v) for k, v in sharded.full_state_dict().items()},
        precision=f"compute in {sharded.compute_dtype}, fp32 main parameters and gradients, {sharding_strategy}",
    )


# ---------------------------------------------------------------------------------------------- PyTorch FSDP2

#: Our strategy names -> FSDP2's reshard_after_forward (FSDP2 always shards parameters between steps).
_FSDP2_RESHARD = {"optim_grads_params": True, "optim_grads": False}


#: ``mixed_precision`` option -> FSDP2 MixedPrecisionPolicy arguments (fp32 sharded parameters).
FSDP2_MIXED_PRECISION = {"bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}
FSDP2_STORAGE = ("keep", "slots")


def _build_fsdp2(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                 device: torch.device, sharding_strategy: str, compute_dtype: Optional[torch.dtype],
                 options: Optional[Dict[str, Any]] = None) -> ShardedRun:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_cudagraph.engines.fsdp2 import keep_unsharded_storage
    from fsdp_cudagraph.engines.fsdp2_slots import use_unsharded_slots

    options = options or {}
    storage, mixed = options.get("storage", "keep"), options.get("mixed_precision")
    if storage not in FSDP2_STORAGE:
        raise ValueError(f"engine_options storage={storage!r} is not one of {FSDP2_STORAGE} (keep: "
                         "keep_unsharded_storage; slots: use_unsharded_slots, the double buffer)")
    if mixed is not None and mixed not in FSDP2_MIXED_PRECISION:
        raise ValueError(f"engine_options mixed_precision={mixed!r} is not None or one of "
                         f"{sorted(FSDP2_MIXED_PRECISION)}")
    if mixed is not None and compute_dtype not in (None, torch.float32):
        raise ValueError(f"engine_options mixed_precision={mixed!r} keeps fp32 sharded parameters and computes in the "
                         f"policy's param_dtype, but compute_dtype={compute_dtype} would cast the model first; pass "
                         "compute_dtype=None (--dtype fp32 or no --dtype) with it")
    if storage == "slots" and dist.get_world_size() < 2:
        raise RuntimeError(f"engine_options storage='slots' needs 2+ ranks (world size {dist.get_world_size()}): "
                           "on one rank FSDP2 copies its all-gather into the outputs' storage directly; use "
                           "storage='keep' on one rank")

    if sharding_strategy not in _FSDP2_RESHARD:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} with engine='fsdp2': FSDP2 shards parameters, gradients and "
            f"optimizer state alike; choose one of {sorted(_FSDP2_RESHARD)} (optim_grads_params: "
            "reshard_after_forward=True, ZeRO-3; optim_grads: reshard_after_forward=False)")
    reshard = _FSDP2_RESHARD[sharding_strategy]
    if compute_dtype is not None and mixed is None:
        model = model.to(compute_dtype)
    unit_classes(model, unit_modules, engine="fsdp2")  # refuses specs that select nothing
    units = [m for m in model.modules() if m is not model and _is_unit(m, unit_modules)]
    # The mesh on the checker's device: FSDP2's default mesh takes the machine's accelerator, which on a GPU
    # machine checking on the CPU (Gloo) would not be the model's device.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION[mixed]) if mixed else MixedPrecisionPolicy()
    for m in reversed(units):  # inner units first, as FSDP2 wants nested units sharded bottom-up
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if storage == "slots":
        use_unsharded_slots(model)
    else:
        keep_unsharded_storage(model)
    # The sharded DTensors the optimizer holds: FSDP2 registers them on the modules between steps, and writes
    # the reduced gradient shard into their .grad at post-backward.
    named = list(model.named_parameters())
    dtype = next(model.parameters()).dtype
    if mixed:
        precision = (f"{dtype} sharded parameters and optimizer state, MixedPrecisionPolicy(param_dtype=bfloat16, "
                     "reduce_dtype=float32)")
    else:
        precision = f"parameters, gradients and optimizer state in {dtype} (model cast before fully_shard)"
    storage_text = "keep_unsharded_storage" if storage == "keep" else "use_unsharded_slots (2 slots)"
    return ShardedRun(
        model=model, root=model, optimizer=make_optimizer([p for _, p in named]),
        named_parameters=lambda: named,
        final_parameters=lambda: {n: _cpu(p.full_tensor()) for n, p in model.named_parameters()},
        precision=f"{precision}, reshard_after_forward={reshard}, {storage_text}",
    )


def _fsdp2_unavailable(device: torch.device) -> Optional[Exception]:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return ImportError(f"this torch ({torch.__version__}) has no torch.distributed.fsdp.fully_shard ({exc})")
    return None


# ---------------------------------------------------------------------------------------------- NVIDIA Megatron-FSDP


def _nvidia_unavailable(device: torch.device) -> Optional[Exception]:
    reasons, missing = [], False
    try:
        from megatron.core.distributed.fsdp.src import megatron_fsdp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a megatron-core that fails at import
        reasons.append(f"megatron-core is not importable ({type(exc).__name__}: {exc})")
        missing = True
    if device.type != "cuda" or not torch.cuda.is_available():
        reasons.append(f"NVIDIA's MegatronFSDP builds CUDA streams and buffers when it is constructed, so it needs a "
                       f"GPU (device {device}, torch.cuda.is_available() == {torch.cuda.is_available()})")
    if not reasons:
        return None
    return (ImportError if missing else RuntimeError)("; ".join(reasons))


#: ``wrapper`` option of engine nvidia: how NVIDIA's ``MegatronFSDP`` is built around the model.
NVIDIA_WRAPPERS = ("fully_shard", "mcore")


def _build_nvidia(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                  device: torch.device, sharding_strategy: str, compute_dtype: Optional[torch.dtype],
                  options: Optional[Dict[str, Any]] = None) -> ShardedRun:
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    wrapper = (options or {}).get("wrapper", "fully_shard")
    if wrapper not in NVIDIA_WRAPPERS:
        raise ValueError(f"engine_options wrapper={wrapper!r} is not one of {NVIDIA_WRAPPERS} (fully_shard: the "
                         "bundled megatron_fsdp.fully_shard; mcore: megatron-core's FullyShardedDataParallel with a "
                         "DistributedDataParallelConfig(use_megatron_fsdp=True), for megatron-core models)")
    # NVIDIA's string unit specs are import paths; ours are class names: hand it the classes.
    classes = unit_classes(model, unit_modules, engine="nvidia")
    if compute_dtype is not None:
        model = model.to(compute_dtype)  # NVIDIA computes in the module's dtype
    if wrapper == "mcore":
        return _build_nvidia_mcore(model, classes=classes, make_optimizer=make_optimizer, device=device,
                                   sharding_strategy=sharding_strategy, compute_dtype=compute_dtype)
    accepted = inspect.signature(mf.fully_shard).parameters
    options: Dict[str, Any] = dict(fsdp_unit_modules=classes, zero_dp_strategy=sharding_strategy, device=device,
                                   overlap_grad_reduce=True, overlap_param_gather=True,
                                   sync_model_each_microbatch=True)
    if sharding_strategy == "optim_grads_params":  # ZeRO-3: unit buckets at stable addresses (docs/engines.md)
        options["fsdp_double_buffer"] = True
        if "fsdp_db_use_persist_buf_on_alloc_fail" in accepted:  # 0.6.1; 0.3.1 has no such option
            options["fsdp_db_use_persist_buf_on_alloc_fail"] = True
    if "mixed_precision_policy" in accepted:  # 0.6.1
        options["mixed_precision_policy"] = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                    main_grads_dtype=torch.float32)
        mains = "fp32 main parameters and gradients"
    else:  # 0.3.1: preserve_fp32_weights (default True) keeps fp32 main weights; gradients as its defaults
        mains = "fp32 main parameters (preserve_fp32_weights), gradients per grad_reduce_in_fp32=False"
    if "expt_device_mesh" in accepted and any(".experts." in n for n, _ in model.named_parameters()):
        # NVIDIA's engine takes a parameter named ``*.experts.*`` for an expert parameter and shards it over the
        # expert data-parallel group, which fully_shard only has from expt_device_mesh. EP = 1: every rank, as
        # the default mesh fully_shard builds for the other parameters (its dimension names).
        from torch.distributed.device_mesh import init_device_mesh

        options["expt_device_mesh"] = init_device_mesh(device.type, (dist.get_world_size(), 1),
                                                       mesh_dim_names=("fsdp", "tp"))
    sharded, optimizer = mf.fully_shard(model, make_optimizer(list(model.parameters())), **options)
    optimizer.state.clear()  # fully_shard_optimizer's eager zero step would start Adam's count at 1
    # fully_shard registered the engine's distributed main parameters on the module and gave them to the
    # optimizer, in module order: name them now (the module gets its compute parameters back at each forward).
    return _nvidia_run(sharded, sharded.module, optimizer, list(sharded.module.named_parameters()),
                       wrapping="megatron-core's fully_shard",
                       precision=(f"module in {compute_dtype or 'its own dtype'}, {mains} (this rank's shards "
                                  f"compared), megatron_fsdp {getattr(mf, '__version__', '?')}, {sharding_strategy}"))


def _nvidia_run(model: nn.Module, root: nn.Module, optimizer: torch.optim.Optimizer,
                named: List[Tuple[str, torch.Tensor]], *, wrapping: str, precision: str) -> ShardedRun:
    """The run of either NVIDIA wrapping, once the optimizer holds the module's distributed main parameters in
    module order (checked: the gradient recorder and the final comparison name them by module name)."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if [id(p) for _, p in named] != [id(p) for p in held]:
        raise RuntimeError(
            f"engine='nvidia': after {wrapping} the optimizer holds {len(held)} parameters that are not the module's "
            f"{len(named)} distributed parameters in module order; this megatron-core is not one the checker "
            f"knows: {NVIDIA_PIP}")

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    return ShardedRun(model=model, root=root, optimizer=optimizer, named_parameters=lambda: named,
                      final_parameters=lambda: {n: _cpu(local(p)) for n, p in named}, precision=precision)


def _build_nvidia_mcore(model: nn.Module, *, classes: Sequence[type], make_optimizer: MakeOptimizer,
                        device: torch.device, sharding_strategy: str,
                        compute_dtype: Optional[torch.dtype]) -> ShardedRun:
    """NVIDIA Megatron-FSDP as megatron-core ships it: ``FullyShardedDataParallel(config, ddp_config, module)``
    builds the same ``MegatronFSDP`` as ``fully_shard`` (same hooks, buffers and double buffer), with its
    process groups from ``megatron.core.parallel_state`` (which the model's builder initialised) and its
    precision from the ``DistributedDataParallelConfig``; NVIDIA's ``fully_shard_optimizer`` wires the optimizer
    (grad sync before ``step``, weights installed after), as ``fully_shard`` does."""
    import dataclasses as _dc

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "cuda_graph_impl"):
        raise ValueError(f"engine_options wrapper='mcore' wraps a megatron-core model (one with a TransformerConfig "
                         f"as .config); {type(model).__name__} has none: use wrapper='fully_shard'")
    fields = {f.name for f in _dc.fields(DistributedDataParallelConfig)}
    ddp: Dict[str, Any] = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=sharding_strategy,
                               overlap_grad_reduce=True, overlap_param_gather=True)
    if sharding_strategy == "optim_grads_params":  # ZeRO-3: unit buckets at stable addresses (docs/engines.md)
        ddp["fsdp_double_buffer"] = True
        if "fsdp_db_use_persist_buf_on_alloc_fail" in fields:
            ddp["fsdp_db_use_persist_buf_on_alloc_fail"] = True
    if "megatron_fsdp_main_params_dtype" in fields:  # 0.19: the mixed-precision policy comes from here
        ddp.update(megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=torch.float32)
        mains = "fp32 main parameters and gradients"
    else:  # 0.16.1 (Megatron-FSDP 0.3.1): preserve_fp32_weights keeps fp32 main weights
        mains = "fp32 main parameters (preserve_fp32_weights), gradients per grad_reduce_in_fp32=False"
    wrapped = FullyShardedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**ddp), module=model,
                                       fsdp_unit_modules=list(classes), device=device)
    user = wrapped.module.module  # FullyShardedDataParallel -> MegatronFSDP -> the model
    named = list(user.named_parameters())
    optimizer = mf.fully_shard_optimizer(make_optimizer([p for _, p in named]))
    optimizer.state.clear()  # fully_shard_optimizer's eager zero step would start Adam's count at 1
    return _nvidia_run(
        wrapped, user, optimizer, named, wrapping="megatron-core's FullyShardedDataParallel (wrapper='mcore')",
        precision=(f"module in {compute_dtype or 'its own dtype'}, {mains} (this rank's shards compared), "
                   f"megatron-core FullyShardedDataParallel (megatron_fsdp {getattr(mf, '__version__', '?')}), "
                   f"{sharding_strategy}"),
    )


ENGINES: Dict[str, EngineBuilder] = {
    "megatron_fsdp": EngineBuilder("megatron_fsdp", _build_megatron_fsdp, lambda device: None, True),
    "fsdp2": EngineBuilder("fsdp2", _build_fsdp2, _fsdp2_unavailable, False, fix="use torch >= 2.11",
                           options=("storage", "mixed_precision")),
    "nvidia": EngineBuilder("nvidia", _build_nvidia, _nvidia_unavailable, True,
                            fix=f"{NVIDIA_PIP} and run on a GPU (--device cuda)", options=("wrapper",)),
}


def engine_builder(name: str, device: torch.device) -> EngineBuilder:
    """The builder of engine ``name``, refusing an unknown name (ValueError) or an engine that cannot run on
    ``device`` here (ImportError for a missing package, RuntimeError otherwise), before any work."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r} is not one of {sorted(ENGINES)}; megatron_fsdp (this project's engine), "
                         "fsdp2 (torch.distributed.fsdp.fully_shard) or nvidia (NVIDIA Megatron-FSDP, megatron-core)")
    builder = ENGINES[name]
    why = builder.unavailable(device)
    if why is not None:
        others = ", ".join(n for n in ENGINES if n != name)
        raise type(why)(f"engine={name!r} cannot run here: {why}. Fix: {builder.fix}; or check with another "
                        f"engine ({others})")
    return builder
