"""How the checker, apps and benchmarks shard a model with NVIDIA Megatron-FSDP (megatron-core's bundled copy).

ZeRO-3 with ``fsdp_double_buffer`` and, where the version has it (0.6.1), ``fsdp_db_use_persist_buf_on_alloc_fail``;
the module is cast to ``compute_dtype`` with fp32 main parameters and gradients. Option ``wrapper``:
``fully_shard`` (default) or ``mcore`` (megatron-core's ``FullyShardedDataParallel``). Needs CUDA and
megatron-core (:data:`NVIDIA_PIP`). Final parameters: this rank's shard of each main parameter.

Expert parallelism (``expert_groups``, the factory's ``ModelSpec.expert_groups``): NVIDIA's engine takes a
parameter whose name contains ``.experts.`` for an expert parameter (``is_expert_parameter`` in its
``param_and_grad_buffer.py``, 0.3.1 and 0.6.1; ``allreduce=False``, megatron-core's mark at EP > 1, only makes it
require an expert group) and shards it over the ``dp_shard`` dimension of its expert device mesh.
``fully_shard``: that mesh is built
from the expert-data-parallel group (``expt_device_mesh``, dimensions ``("fsdp", "tp")`` as ``fully_shard``'s
default mesh, the expert tensor-parallel dimension of size 1), as megatron-core's adapter builds it;
``mcore``: ``FullyShardedDataParallel`` builds it itself from ``megatron.core.parallel_state``, so the groups
must be parallel_state's (checked).

Models other than megatron-core's (the reference GPT, whose ``Experts`` module carries ``is_expert = True`` and is
named ``experts``): :func:`tag_expert_parameters` gives the parameters of every ``is_expert`` module megatron-core's
own mark, ``allreduce = False`` (megatron-core sets it on its expert parameters at EP > 1; NVIDIA's engine then
refuses to run without an expert group, and its ``broadcast_params`` uses the expert-data-parallel group for them),
and refuses an ``is_expert`` parameter whose name lacks ``.experts.``: NVIDIA would shard it as a dense one.

Tensor parallelism (``tensor_groups``, the factory's ``ModelSpec.tensor_groups``; [Note: NVIDIA Megatron-FSDP under
tensor parallelism]): wrapper ``mcore`` only, with the groups of megatron-core's parallel state (checked); wrapper
``fully_shard`` is refused (``NotImplementedError``).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.engines.build import EngineBuilder, MakeOptimizer, ShardedRun, UnitSpec, cpu_copy, unit_classes
from fsdp_cudagraph.engines.registry import register_builder

__all__ = ["BUILDER", "NVIDIA_PIP", "NVIDIA_WRAPPERS", "tag_expert_parameters"]

#: What installs NVIDIA Megatron-FSDP 0.6.1 (megatron-core's bundled copy), the version checked on a GPU.
NVIDIA_PIP = "pip install 'megatron-core==0.19.2'"


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


ExpertGroups = Tuple[dist.ProcessGroup, dist.ProcessGroup]
#: ``(tensor-parallel group, data-parallel group)`` of this rank (``ModelSpec.tensor_groups``)
TensorGroups = Tuple[dist.ProcessGroup, dist.ProcessGroup]


def _check_expert_names(model: nn.Module, expert_groups: ExpertGroups) -> None:
    """NVIDIA's engine knows an expert parameter only by ``.experts.`` in its name: refuse a model with expert
    groups that has no such parameter (its local experts would be sharded over every rank as if replicated)."""
    if not any(".experts." in n for n, _ in model.named_parameters()):
        ep = dist.get_world_size(expert_groups[0])
        raise ValueError(
            f"engine='nvidia' with expert parallelism (expert_groups, EP={ep}): no parameter name of "
            f"{type(model).__name__} contains '.experts.', NVIDIA Megatron-FSDP's test for an expert parameter, so "
            "it would shard the local experts over every rank as if they were replicated; hold the experts in a "
            "submodule named experts (megatron-core's mlp.experts), or use engine megatron_fsdp (which also takes "
            "an is_expert = True module tag)")


def tag_expert_parameters(model: nn.Module) -> List[str]:
    """Mark the parameters of every module tagged ``is_expert = True`` as megatron-core marks its expert parameters
    (``allreduce = False``) and return their names, in module order (empty for a model without such modules,
    e.g. megatron-core's, whose parameters carry the mark already).

    NVIDIA's engine takes a parameter for an expert parameter by its name (``.experts.``) and shards it over the
    expert mesh; the mark makes it refuse to run without one. A parameter of an ``is_expert`` module whose name
    lacks ``.experts.`` is refused (ValueError): NVIDIA would shard that rank-local expert over every rank as if
    it were replicated."""
    tagged: List[str] = []
    seen = set()
    for mname, module in model.named_modules():
        if getattr(module, "is_expert", False) is not True:
            continue
        for pname, p in module.named_parameters(prefix=mname):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if ".experts." not in pname:  # NVIDIA's own test, on the name it will see
                raise ValueError(
                    f"{pname}: a parameter of {type(module).__name__} (is_expert = True) whose name does not contain "
                    "'.experts.', NVIDIA Megatron-FSDP's test for an expert parameter, so it would shard this "
                    "rank's local experts over every rank as if they were replicated; hold the experts in a "
                    "submodule named experts (as the reference GPT's moe.experts and megatron-core's mlp.experts)")
            p.allreduce = False
            tagged.append(pname)
    return tagged


def _expert_mesh(device: torch.device, expert_groups: ExpertGroups) -> Any:
    """The expert device mesh of NVIDIA's ``fully_shard``: ``("fsdp", "tp")`` over this rank's expert-data-parallel
    ranks and a trivial expert tensor-parallel dimension, from existing groups (``DeviceMesh.from_group``, as
    megatron-core's ``FullyShardedDataParallel`` builds its own)."""
    from torch.distributed.device_mesh import DeviceMesh

    edp = dist.get_process_group_ranks(expert_groups[1])
    return DeviceMesh.from_group([expert_groups[1], _single_rank_group()], device.type, mesh=[[r] for r in edp],
                                 mesh_dim_names=("fsdp", "tp"))


#: id(world group) -> (weak reference to it, this rank's one-rank group): built once per world, not per build
_SINGLE_RANK: Dict[int, Tuple[Any, dist.ProcessGroup]] = {}


def _single_rank_group() -> dist.ProcessGroup:
    world = dist.group.WORLD
    hit = _SINGLE_RANK.get(id(world))
    if hit is not None and hit[0]() is world:
        return hit[1]
    me, single = dist.get_rank(), None
    for r in range(dist.get_world_size()):  # every rank creates every group, in one order (a collective)
        g = dist.new_group([r])
        if r == me:
            single = g
    assert single is not None
    _SINGLE_RANK.clear()
    _SINGLE_RANK[id(world)] = (weakref.ref(world), single)
    return single


def _build_nvidia(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                  device: torch.device, sharding_strategy: str, compute_dtype: Optional[torch.dtype],
                  options: Optional[Dict[str, Any]] = None,
                  expert_groups: Optional[ExpertGroups] = None,
                  tensor_groups: Optional[TensorGroups] = None) -> ShardedRun:
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    wrapper = (options or {}).get("wrapper", "fully_shard")
    if wrapper not in NVIDIA_WRAPPERS:
        raise ValueError(f"engine_options wrapper={wrapper!r} is not one of {NVIDIA_WRAPPERS} (fully_shard: the "
                         "bundled megatron_fsdp.fully_shard; mcore: megatron-core's FullyShardedDataParallel with a "
                         "DistributedDataParallelConfig(use_megatron_fsdp=True), for megatron-core models)")
    if tensor_groups is not None and wrapper != "mcore":
        raise NotImplementedError(
            f"engine='nvidia' wrapper={wrapper!r} with tensor parallelism (tensor_groups, TP="
            f"{dist.get_world_size(tensor_groups[0])}): the checker's fully_shard build shards over one mesh of all "
            "ranks (no (data-parallel, tensor-parallel) device mesh) and nothing sums the sequence-parallel "
            "parameters' gradients over TP (megatron-core's finalize_model_grads), so the TP ranks' different slices "
            "would be sharded as one data-parallel model; use engine_options wrapper='mcore' (megatron-core's "
            "FullyShardedDataParallel, which takes both groups from parallel_state) or engine='megatron_fsdp'")
    # NVIDIA's string unit specs are import paths; ours are class names: hand it the classes.
    classes = unit_classes(model, unit_modules, engine="nvidia")
    if expert_groups is not None:
        _check_expert_names(model, expert_groups)
    if compute_dtype is not None:
        model = model.to(compute_dtype)  # NVIDIA computes in the module's dtype
    if expert_groups is not None:
        tag_expert_parameters(model)  # after the cast, on the parameters NVIDIA will see
    if wrapper == "mcore":
        return _build_nvidia_mcore(model, classes=classes, make_optimizer=make_optimizer, device=device,
                                   sharding_strategy=sharding_strategy, compute_dtype=compute_dtype,
                                   expert_groups=expert_groups, tensor_groups=tensor_groups)
    accepted = inspect.signature(mf.fully_shard).parameters
    if expert_groups is not None and "expt_device_mesh" not in accepted:
        raise NotImplementedError(
            f"engine='nvidia' wrapper='fully_shard' with expert parallelism: this megatron_fsdp "
            f"({getattr(mf, '__version__', '?')}) fully_shard takes no expt_device_mesh, so it cannot shard experts "
            f"over the expert-data-parallel group; {NVIDIA_PIP}, or use wrapper='mcore'")
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
    if expert_groups is not None:
        options["expt_device_mesh"] = _expert_mesh(device, expert_groups)
        mains += f", expert parallel {dist.get_world_size(expert_groups[0])} (expt_device_mesh)"
    elif "expt_device_mesh" in accepted and any(".experts." in n for n, _ in model.named_parameters()):
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
                      final_parameters=lambda: {n: cpu_copy(local(p)) for n, p in named}, precision=precision)


def _check_parallel_state(what: str, groups: Sequence[dist.ProcessGroup], labels: Sequence[str],
                          getters: Sequence[Callable[[Any], dist.ProcessGroup]], init: str, use: str,
                          fix: str) -> List[List[int]]:
    """wrapper='mcore': ``FullyShardedDataParallel`` (and ``finalize_model_grads``) take their groups from
    megatron-core's parallel state; refuse ``groups`` (``what``) whose ranks are not those ``getters`` return
    (the model's collectives and the engine's would disagree). Returns the ranks of ``groups``."""
    from megatron.core import parallel_state as ps

    ranks = dist.get_process_group_ranks
    ours = [ranks(g) for g in groups]
    if not ps.model_parallel_is_initialized():
        raise ValueError(f"engine_options wrapper='mcore' with {what}: megatron-core's parallel state is not "
                         "initialised; FullyShardedDataParallel reads its groups from there: call "
                         f"parallel_state.initialize_model_parallel({init}) first")
    theirs = [ranks(get(ps)) for get in getters]
    if ours != theirs:
        def named(rs: List[List[int]]) -> str:
            return ", ".join(f"{label} {r}" for label, r in zip(labels, rs))
        raise ValueError(f"[rank {dist.get_rank()}] engine_options wrapper='mcore': {what} ({named(ours)}) are not "
                         f"megatron-core's parallel-state groups ({named(theirs)}), which {use}; pass {fix}")
    return ours


def _check_parallel_state_groups(expert_groups: ExpertGroups) -> None:
    """wrapper='mcore' with EP: the expert groups must be parallel_state's (:func:`_check_parallel_state`)."""
    _check_parallel_state(
        "expert_groups", expert_groups, ("EP", "EDP"),
        (lambda ps: ps.get_expert_model_parallel_group(), lambda ps: ps.get_expert_data_parallel_group()),
        "expert_model_parallel_size=EP", "FullyShardedDataParallel shards the experts with",
        "parallel_state.get_expert_model_parallel_group() and get_expert_data_parallel_group()")


def _check_parallel_state_tensor_groups(model: nn.Module, tensor_groups: TensorGroups) -> None:
    """wrapper='mcore' with TP: ``FullyShardedDataParallel`` takes its (data-parallel, tensor-parallel) mesh and
    ``finalize_model_grads`` its TP group from megatron-core's parallel state; refuse groups of other ranks
    (:func:`_check_parallel_state`), and a model built without sequence parallelism ([Note: NVIDIA Megatron-FSDP
    under tensor parallelism])."""
    ours = _check_parallel_state(
        "tensor_groups", tensor_groups, ("TP", "DP"),
        (lambda ps: ps.get_tensor_model_parallel_group(),
         lambda ps: ps.get_data_parallel_group(with_context_parallel=True)),
        "tensor_model_parallel_size=TP", "FullyShardedDataParallel shards with and finalize_model_grads sums over",
        "parallel_state.get_tensor_model_parallel_group() and get_data_parallel_group()")
    if not getattr(model.config, "sequence_parallel", False):
        raise NotImplementedError(
            f"engine_options wrapper='mcore' with tensor_groups (TP={len(ours[0])}) and TransformerConfig."
            "sequence_parallel=False: only the sequence-parallel layout is checked here (its norms' gradients are "
            "summed over TP by megatron-core's finalize_model_grads); build the model with sequence_parallel=True")


# [Note: NVIDIA Megatron-FSDP under tensor parallelism]
# What megatron-core's FullyShardedDataParallel does at TP > 1 (read in 0.16.1's mcore_fsdp_adapter.py and bundled
# megatron_fsdp 0.3.1):
# - Sharding: a 2-D DeviceMesh ("dp_cp", "tp") from parallel_state's data-parallel (with context parallel) and
#   tensor-parallel groups; FSDP shards, gathers and reduce-scatters over "dp_cp" only, as our engine does over its
#   process group. A `tensor_model_parallel` parameter (megatron-core's tag, with `partition_dim`) becomes a DTensor
#   Shard(partition_dim) over "tp"; a TP-duplicated one (`_tp_duplicated`: TE linears without a parallel mode, the
#   MoE router) Replicate over "tp", broadcast from TP rank 0 when its distributed parameter is made.
# - Not done by the engine: the TP sum of the gradients of replicated parameters tagged `sequence_parallel` (the
#   norms; each TP rank's gradient covers only its positions). Megatron-LM does it in `finalize_model_grads` ->
#   `_allreduce_non_tensor_model_parallel_grads` (alias `_allreduce_layernorm_grads`), after
#   `finish_grad_sync`: with `ddp_config.use_megatron_fsdp` it all-reduces each such parameter's main-gradient
#   DTensor's local shard (a view of NVIDIA's main-gradient buffer) over the TP group. Every TP rank holds the same
#   DP shard of a replicated parameter, and the DP reduce-scatter is linear, so that is the sum over TP of the
#   mean over DP. The run here calls megatron-core's own `finalize_model_grads([wrapped])` before each optimizer
#   step (where Megatron-LM's training step calls it, `config.finalize_model_grads_func`, before
#   `optimizer.step()`); NVIDIA's optimizer step then calls `finish_grad_sync` again, which finds no reduction
#   pending and re-attaches the same buffer views, so the sum stays. Without it the norms' gradients stay
#   partial: the TP ranks' copies of one norm drift apart.
# - Clipping (not used by the checker, whose optimizer is plain Adam): megatron-core's optimizer takes a gradient
#   into the norm on every TP rank when its parameter is `tensor_model_parallel` and on TP rank 0 only otherwise
#   (`param_is_not_tensor_parallel_duplicate`, in `get_main_grads_for_grad_norm`); `get_grad_norm_fp32` sums the
#   p-th powers of the local shards over the DTensors' data-parallel group, then over the model-parallel group:
#   each element once, as our engine counts ([Note: tensor parallelism] in megatron_fsdp/_tensor.py, "Clipping").
# - NVIDIA's bundled `fully_shard` takes `device_mesh`, `dp_shard_dim` and `tp_dim` but the checker's build of it
#   passes no mesh (one dimension of all ranks) and has no hook for the TP sum: refused at TP > 1.
def _finalize_before_step(optimizer: torch.optim.Optimizer, wrapped: nn.Module) -> None:
    """Make ``optimizer.step()`` first call megatron-core's ``finalize_model_grads([wrapped])`` (the TP sum of the
    sequence-parallel gradients, [Note: NVIDIA Megatron-FSDP under tensor parallelism])."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    first = next(iter(inspect.signature(finalize_model_grads).parameters), None)
    if first != "model":
        raise RuntimeError(f"megatron-core's finalize_model_grads takes {first!r} first, not the list of model "
                           f"chunks this run passes; this megatron-core is not one the checker knows: {NVIDIA_PIP}")
    step = optimizer.step

    def finalized_step(*args: Any, **kwargs: Any) -> Any:
        finalize_model_grads([wrapped])
        return step(*args, **kwargs)

    optimizer.step = finalized_step  # type: ignore[method-assign]


def _build_nvidia_mcore(model: nn.Module, *, classes: Sequence[type], make_optimizer: MakeOptimizer,
                        device: torch.device, sharding_strategy: str,
                        compute_dtype: Optional[torch.dtype], expert_groups: Optional[ExpertGroups] = None,
                        tensor_groups: Optional[TensorGroups] = None) -> ShardedRun:
    """NVIDIA Megatron-FSDP as megatron-core ships it: ``FullyShardedDataParallel(config, ddp_config, module)``
    builds the same ``MegatronFSDP`` as ``fully_shard`` (same hooks, buffers and double buffer), with its
    process groups from ``megatron.core.parallel_state`` (which the model's builder initialised; with expert
    parallelism its expert device mesh too, from the expert-data-parallel group) and its precision from the
    ``DistributedDataParallelConfig``; NVIDIA's ``fully_shard_optimizer`` wires the optimizer (grad sync before
    ``step``, weights installed after), as ``fully_shard`` does. With ``tensor_groups`` (parallel_state's, checked)
    each step first calls megatron-core's ``finalize_model_grads`` ([Note: NVIDIA Megatron-FSDP under tensor
    parallelism])."""
    import dataclasses as _dc

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "cuda_graph_impl"):
        raise ValueError(f"engine_options wrapper='mcore' wraps a megatron-core model (one with a TransformerConfig "
                         f"as .config); {type(model).__name__} has none: use wrapper='fully_shard'")
    if expert_groups is not None:
        _check_parallel_state_groups(expert_groups)
    if tensor_groups is not None:
        _check_parallel_state_tensor_groups(model, tensor_groups)

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf
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
    parallel = f", expert parallel {dist.get_world_size(expert_groups[0])}" if expert_groups else ""
    if tensor_groups is not None:
        _finalize_before_step(optimizer, wrapped)
        parallel += (f", tensor parallel {dist.get_world_size(tensor_groups[0])} (data-parallel group of "
                     f"{dist.get_world_size(tensor_groups[1])}; finalize_model_grads before each step)")
    return _nvidia_run(
        wrapped, user, optimizer, named, wrapping="megatron-core's FullyShardedDataParallel (wrapper='mcore')",
        precision=(f"module in {compute_dtype or 'its own dtype'}, {mains} (this rank's shards compared), "
                   f"megatron-core FullyShardedDataParallel (megatron_fsdp {getattr(mf, '__version__', '?')}), "
                   f"{sharding_strategy}{parallel}"),
    )


BUILDER = register_builder(EngineBuilder("nvidia", _build_nvidia, _nvidia_unavailable, True,
                                         fix=f"{NVIDIA_PIP} and run on a GPU (--device cuda)", options=("wrapper",),
                                         tensor_parallel=True))
