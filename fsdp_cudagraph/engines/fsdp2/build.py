"""How the checker, apps and benchmarks shard a model with PyTorch FSDP2: the one place in the repository that calls
``torch.distributed.fsdp.fully_shard``.

:func:`fsdp2_shard` is the one ``fully_shard`` call, always with a mesh on the model's device ([Note: the FSDP2
mesh]); :func:`shard_fsdp2` shards units then the root with it;
:data:`BUILDER` wraps it for the checker (``storage``, ``mixed_precision`` options, see ``checker/check.py``).

[Note: the FSDP2 mesh]
``fully_shard`` without ``mesh=`` builds its default mesh on the machine's accelerator (``_init_default_fully_shard_mesh``
asks ``torch.accelerator``), so on a GPU machine a CPU (Gloo) run would get a CUDA mesh and FSDP2 would move every
parameter to cuda:0 while the data stays on the CPU. Every FSDP2 build passes a mesh whose device type is the
model's: ``--device cpu`` means CPU whatever the machine has.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.engines.build import (EngineBuilder, MakeOptimizer, ShardedRun, UnitSpec, cpu_copy, is_unit,
                                          unit_classes)
from fsdp_cudagraph.engines.registry import register_builder
from fsdp_cudagraph.engines.fsdp2 import expert as _ep
from fsdp_cudagraph.engines.fsdp2.storage import keep_unsharded_storage, use_unsharded_slots

__all__ = ["BUILDER", "shard_fsdp2", "fsdp2_shard", "fsdp2_mesh", "tensor_parallel_mesh", "check_tensor_parallel_mesh", "FSDP2_MIXED_PRECISION", "FSDP2_STORAGE"]


def fsdp2_mesh(device: Union[torch.device, str], group: Any = None) -> Any:
    """A one-dimensional DeviceMesh over ``group``'s ranks (default: the world) whose device type is ``device``'s."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device_type = torch.device(device).type
    if group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device_type)


def fsdp2_shard(module: Union[nn.Module, List[nn.Module]], *, device: Union[torch.device, str, None] = None,
                mesh: Any = None, **fully_shard_kwargs: Any) -> Any:
    """torch's ``fully_shard(module, mesh=...)`` with a mesh on ``device`` (default: the first parameter's device of
    ``module``, or of the first module of a list: one FSDP2 unit of several modules). ``mesh``: one to use instead,
    refused unless its device type is ``device``'s. Returns what ``fully_shard`` returns. [Note: the FSDP2 mesh].
    A module with DTensor (tensor-parallel) parameters needs ``mesh=mesh['dp']`` of its ``(dp, tp)`` mesh, refused
    otherwise ([Note: FSDP2 with DTensor tensor parallelism])."""
    from torch.distributed.fsdp import fully_shard

    if device is None:
        first = module[0] if isinstance(module, (list, tuple)) else module
        p = next(iter(first.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    explicit = mesh is not None
    if mesh is None:
        mesh = fsdp2_mesh(device)
    elif mesh.device_type != device.type:
        raise ValueError(f"mesh.device_type={mesh.device_type!r} is not the model's device type {device.type!r}; FSDP2 "
                         "would move the parameters to the mesh's device: pass a mesh on the model's device, or none")
    tp_mesh = tensor_parallel_mesh(module)
    if tp_mesh is not None:
        check_tensor_parallel_mesh(mesh, tp_mesh, explicit=explicit)
    return fully_shard(module, mesh=mesh, **fully_shard_kwargs)


def _own_parameters(module: Union[nn.Module, List[nn.Module]]) -> List[Tuple[str, torch.Tensor]]:
    """The parameters under ``module`` (or a list of modules) that no inner FSDP2 unit manages yet."""
    from torch.distributed.fsdp import FSDPModule

    out: List[Tuple[str, torch.Tensor]] = []
    stack = list(module) if isinstance(module, (list, tuple)) else [module]
    roots = {id(m) for m in stack}
    while stack:
        m = stack.pop()
        if id(m) not in roots and isinstance(m, FSDPModule):
            continue
        out.extend(m.named_parameters(recurse=False))
        stack.extend(m.children())
    return out


def tensor_parallel_mesh(module: Union[nn.Module, List[nn.Module]]) -> Any:
    """The 1-D mesh of the DTensor (tensor-parallel) parameters under ``module`` that FSDP2 does not manage yet, or
    None when there are none. Refuses DTensors on several meshes or on a mesh of more than one dimension (ValueError).
    [Note: FSDP2 with DTensor tensor parallelism]."""
    meshes = {}
    for name, p in _own_parameters(module):
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            meshes.setdefault(id(mesh), (mesh, name))
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes.values()))[0].ndim != 1:
        found = ", ".join(f"{n}: {m}" for m, n in meshes.values())
        raise ValueError(f"fully_shard of DTensor parameters on {found}: FSDP2 with tensor parallelism here takes "
                         "parameters parallelized over one 1-D mesh (mesh['tp'] of a (dp, tp) DeviceMesh, as "
                         "parallelize_module(block, mesh['tp'], plan) makes them); parallelize every block over the "
                         "same mesh['tp']")
    return next(iter(meshes.values()))[0]


def check_tensor_parallel_mesh(mesh: Any, tp_mesh: Any, *, explicit: bool = True) -> None:
    """Refuse a data-parallel ``mesh`` that does not pair with the tensor-parallel ``tp_mesh`` ([Note: FSDP2 with
    DTensor tensor parallelism]): ValueError naming both meshes, the rule and ``mesh['dp']``."""
    tp_name = (tp_mesh.mesh_dim_names or ("?",))[0]
    fix = (f"pass mesh=mesh['dp'] of the 2-D (dp, {tp_name}) DeviceMesh whose mesh[{tp_name!r}] parallelized the "
           "model")
    if not explicit:
        raise ValueError(f"fully_shard of a model with DTensor parameters on {tp_mesh} (tensor parallelism) without a "
                         "mesh: the default mesh is 1-D over the world and would shard the TP slices over the TP "
                         f"ranks as well; {fix}")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard with the {mesh.ndim}-D mesh {mesh} of a model whose DTensor parameters are on {tp_mesh}: "
            "FSDP2 with tensor parallelism here shards over one data-parallel dimension (HSDP with TP and the "
            f"whole (dp, tp) mesh are not supported); {fix}")
    root, names = mesh._get_root_mesh(), set(mesh.mesh_dim_names or ())
    same_root = root is tp_mesh._get_root_mesh() or root == tp_mesh._get_root_mesh()
    if not same_root or names & set(tp_mesh.mesh_dim_names or ()) or mesh.size() * tp_mesh.size() != root.size():
        raise ValueError(f"fully_shard with mesh {mesh} ({mesh.size()} ranks) of a model whose DTensor parameters are "
                         f"on {tp_mesh} ({tp_mesh.size()} ranks): the data-parallel mesh must be the other dimension "
                         f"of the same root mesh ({root.size()} ranks), so that dp * tp covers it; {fix}")


def shard_fsdp2(model: nn.Module, units: Sequence[nn.Module] = (), *, device: Union[torch.device, str, None] = None,
                mesh: Any = None, expert_parallel_size: int = 1, expert_mesh: Any = None,
                **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` on each of ``units`` in the order given (inner units before the units that contain them, as
    FSDP2 wants nested units sharded bottom-up), then on ``model``, all with one mesh on the model's device.

    ``device``: where the model computes (default: its first parameter's device); ``mesh``: a mesh to use instead
    (its device type must be ``device``'s). Other keyword arguments go to every ``fully_shard`` call
    (``reshard_after_forward``, ``mp_policy``, ...). Returns ``model`` (now an ``FSDPModule``). See
    [Note: the FSDP2 mesh].

    Expert parallelism ([Note: FSDP2 expert parallelism] in ``expert.py``): ``expert_parallel_size=EP`` shards every
    experts module (tagged ``is_expert = True``, holding its ``E/EP`` local experts) first, each with a
    ``fully_shard`` of its own over the expert-data-parallel mesh (``W/EP`` strided ranks) and the gradient divide
    factor ``W``; the units and the root (the dense parameters) over the whole data-parallel mesh as without EP.
    ``expert_mesh``: the 2-D ``(edp, ep)`` mesh to use (default: ``fsdp2_expert_mesh(device, EP)``). Refused with
    ValueError: EP not dividing the world, a model whose experts' ``ep_group`` disagrees with the mesh, experts with
    EP > 1 sharded at ``expert_parallel_size=1``; NotImplementedError: a dense mesh other than 1-D over the world
    (HSDP) with EP. ``model.state_dict()``/``load_state_dict()`` then refuse (the local experts share keys).

    Tensor parallelism: a model whose blocks ``parallelize_module`` made DTensors over ``mesh2d['tp']`` is sharded
    with ``mesh=mesh2d['dp']``; another mesh, none, or EP with it are refused ([Note: FSDP2 with DTensor tensor
    parallelism]).
    """
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    ep = expert_parallel_size
    if (ep != 1 or expert_mesh is not None) and tensor_parallel_mesh(model) is not None:
        raise NotImplementedError(
            f"shard_fsdp2(expert_parallel_size={ep}) of a model with DTensor (tensor-parallel) parameters on "
            f"{tensor_parallel_mesh(model)}: expert parallelism and tensor parallelism under FSDP2 are not composed "
            "here; use one of the two")
    if ep != 1 or expert_mesh is not None:
        expert_mesh = _expert_mesh(device, mesh, ep, expert_mesh)
        ep = expert_mesh["ep"].size()
    experts = _ep.check_expert_groups(model, ep, expert_mesh)
    if mesh is None:
        tp_mesh = tensor_parallel_mesh(model)
        if tp_mesh is not None:
            check_tensor_parallel_mesh(None, tp_mesh, explicit=False)
        mesh = fsdp2_mesh(device)
    if ep > 1:
        for _, m in experts:
            _ep.shard_experts(m, edp_mesh=expert_mesh["edp"], dp_size=mesh.size(), shard=functools.partial(
                fsdp2_shard, device=device), **fully_shard_kwargs)
    for m in units:
        fsdp2_shard(m, device=device, mesh=mesh, **fully_shard_kwargs)
    fsdp2_shard(model, device=device, mesh=mesh, **fully_shard_kwargs)
    if ep > 1:
        layout = _ep.ExpertLayout(ep, mesh, expert_mesh, tuple(n for n, _ in experts))
        model.__dict__[_ep.EXPERT_LAYOUT_ATTR] = layout
        _ep.refuse_state_dicts(model, layout)
    return model


def _expert_mesh(device: Union[torch.device, str], mesh: Any, ep: int, expert_mesh: Any) -> Any:
    """The 2-D (edp, ep) mesh for ``shard_fsdp2``'s expert parallelism, after refusing what it cannot shard."""
    world = dist.get_world_size()
    if mesh is not None and (mesh.ndim != 1 or mesh.size() != world):
        raise NotImplementedError(
            f"expert_parallel_size={ep} with a {mesh.ndim}-D dense mesh of {mesh.size()} ranks (HSDP, or a "
            f"data-parallel group other than the world's {world} ranks): the experts would need their own "
            "(replicate, shard) split of the expert-data-parallel ranks and an all-reduce across replicas, which "
            "this builder does not do; use a 1-D mesh over the world (mesh=None) with expert parallelism, or HSDP "
            "without it")
    if expert_mesh is None:
        return _ep.fsdp2_expert_mesh(device, ep)
    names = tuple(getattr(expert_mesh, "mesh_dim_names", None) or ())
    if expert_mesh.ndim != 2 or names != ("edp", "ep") or expert_mesh.size() != world:
        raise ValueError(f"expert_mesh must be the 2-D ('edp', 'ep') mesh over the world's {world} ranks, got a "
                         f"{expert_mesh.ndim}-D mesh {names} of {expert_mesh.size()} ranks; build it with "
                         "fsdp2_expert_mesh(device, expert_parallel_size)")
    if expert_mesh.device_type != torch.device(device).type:
        raise ValueError(f"expert_mesh.device_type={expert_mesh.device_type!r} is not the model's device type "
                         f"{torch.device(device).type!r}; FSDP2 would move the experts to the mesh's device")
    if ep != 1 and expert_mesh["ep"].size() != ep:
        raise ValueError(f"expert_parallel_size={ep} but expert_mesh's 'ep' dimension has {expert_mesh['ep'].size()} "
                         "ranks; they must agree: drop one of them")
    return expert_mesh


#: Our strategy names -> FSDP2's reshard_after_forward (FSDP2 always shards parameters between steps).
_FSDP2_RESHARD = {"optim_grads_params": True, "optim_grads": False}


#: ``mixed_precision`` option -> FSDP2 MixedPrecisionPolicy arguments (fp32 sharded parameters).
FSDP2_MIXED_PRECISION = {"bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}
FSDP2_STORAGE = ("keep", "slots")


def _build_fsdp2(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                 device: torch.device, sharding_strategy: str, compute_dtype: Optional[torch.dtype],
                 options: Optional[Dict[str, Any]] = None, expert_groups: Any = None) -> ShardedRun:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if expert_groups is not None:
        raise NotImplementedError(
            f"engine='fsdp2' with a model's own expert groups (EP={dist.get_world_size(expert_groups[0])}, e.g. "
            "megatron-core's parallel_state): FSDP2's expert parallelism here is torchtitan's layout "
            "(engine_options expert_parallel_size=EP over experts modules tagged is_expert, on its own (edp, ep) "
            "mesh), which is not wired to groups a model brings (Megatron-LM refuses FSDP2 with expert parallelism "
            "too: '--use-torch-fsdp2 is not supported with expert parallelism'); use engine megatron_fsdp or "
            "nvidia, or expert_parallel_size=1")
    options = options or {}
    storage, mixed = options.get("storage", "keep"), options.get("mixed_precision")
    ep = options.get("expert_parallel_size", 1)
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
    units = [m for m in model.modules() if m is not model and is_unit(m, unit_modules)]
    policy = MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION[mixed]) if mixed else MixedPrecisionPolicy()
    # inner units first, as FSDP2 wants nested units sharded bottom-up
    shard_fsdp2(model, list(reversed(units)), device=device, reshard_after_forward=reshard, mp_policy=policy,
                expert_parallel_size=ep)
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
        final_parameters=lambda: {n: cpu_copy(p.full_tensor()) for n, p in model.named_parameters()},
        precision=f"{precision}, reshard_after_forward={reshard}, {storage_text}",
    )


def _fsdp2_unavailable(device: torch.device) -> Optional[Exception]:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return ImportError(f"this torch ({torch.__version__}) has no torch.distributed.fsdp.fully_shard ({exc})")
    return None


BUILDER = register_builder(EngineBuilder("fsdp2", _build_fsdp2, _fsdp2_unavailable, False, fix="use torch >= 2.11",
                                         options=("storage", "mixed_precision", "expert_parallel_size")))
