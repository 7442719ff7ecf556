"""Expert parallelism (EP) under PyTorch FSDP2, laid out as torchtitan lays it out.

[Note: FSDP2 expert parallelism]
*Which modules.* An experts module is a module tagged ``is_expert = True`` (the reference GPT's ``Experts``) that
holds only its ``E/EP`` local experts and exchanges the tokens itself (all-to-all over its ``ep_group``, the
process group of its expert-parallel ranks). :func:`expert_modules` finds them (the outermost tagged ones).

*Two meshes.* World ``W`` ranks form a 2-D mesh ``(edp, ep)`` of shape ``(W/EP, EP)``, ``ep`` fastest: the
``ep`` rows are contiguous ranks (``{0,1}, {2,3}`` for W=4, EP=2), the ``edp`` columns strided (``{0,2}, {1,3}``),
the layout of ``megatron_fsdp.expert_parallel_groups`` and torchtitan's ``(efsdp, ep)``. Dense parameters are
``fully_shard``-ed over the whole data-parallel mesh (1-D, ``W`` ranks, as without EP); each experts module gets
a ``fully_shard`` of its own over the ``edp`` mesh (``W/EP`` ranks that hold the same local experts), before the
unit (layer) that contains it, so a MoE layer has two FSDP2 parameter groups: the layer's dense one and the
experts' one, each with its own hooks, all-gather and reduce-scatter.

*Gradient divide factor.* The reference is the same model at ``EP = 1`` on the same global batch: gradient
``(1/W) sum_r dL_r/dtheta`` (each rank's loss a mean over its own tokens). The all-to-all's backward already sums,
into each expert's owner, the token gradients of every rank of its EP group; the reduce-scatter over EDP adds the
``W/EP`` owners of the same expert: ``sum_r dL_r/dtheta_e`` over all ``W`` ranks. So the experts' reduction must
divide by ``W``, not by its own group size ``W/EP`` (FSDP2's default, an average over the mesh it reduces on, would
leave expert gradients ``EP`` times too large). ``set_gradient_divide_factor(W)`` on each experts module, as
torchtitan does (megatron_fsdp: ``1/dp_size``, [Note: expert parallelism] in ``megatron_fsdp/_expert.py``). With a
factor other than the group size FSDP2 reduces with ``ReduceOp.PREMUL_SUM(1/W)``, which Gloo lacks ("Cannot use
ReduceOp.PREMUL_SUM with Gloo"); on a Gloo group the experts also get ``set_force_sum_reduction_for_comms(True)``
(a SUM, then a division by ``W``). Both setters are checked on torch 2.13 (the CPU suite); they predate 2.11 (the
GPU image's; not run here yet): a torch without them is refused with NotImplementedError (:func:`shard_experts`).

*Checks (the model against the mesh).* The experts' ``ep_group`` must be this rank's ``ep`` row of the mesh
(same size, same ranks): otherwise the all-to-all would bring tokens to other ranks than those whose experts
FSDP2 reduces together. A model with EP > 1 experts sharded without ``expert_parallel_size`` is refused: FSDP2 would
shard each rank's *different* local experts as if they were one replicated tensor, and every rank's gathered
``w1`` would mix several EP ranks' experts (seen on torch 2.13: rank 0 gathered ``[its expert 0, rank 1's expert
3]``), silently. HSDP (a 2-D dense mesh) with EP is refused (the experts would need their own replicate dimension
and all-reduce; torchtitan builds ``(dp_replicate, efsdp)`` for it, not done here).

*Clipping* and *checkpoints*: ``clip.py`` and :func:`refuse_state_dicts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertLayout", "expert_layout", "expert_modules", "fsdp2_expert_mesh", "check_expert_groups",
           "shard_experts", "refuse_state_dicts", "EXPERT_LAYOUT_ATTR"]

#: The root module's attribute holding its :class:`ExpertLayout` (set by ``shard_fsdp2(expert_parallel_size=...)``).
EXPERT_LAYOUT_ATTR = "_fsdp_cudagraph_expert_layout"


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How an FSDP2 model with expert parallelism was sharded (read by clipping and the adapter)."""

    expert_parallel_size: int
    #: the dense parameters' mesh: 1-D over the whole data-parallel group (the world)
    dp_mesh: Any
    #: the 2-D ``(edp, ep)`` mesh; ``mesh["edp"]`` shards the experts, ``mesh["ep"]`` is the all-to-all's ranks
    mesh: Any
    #: qualified names of the experts modules, each its own ``fully_shard`` over ``mesh["edp"]``
    experts: Tuple[str, ...]

    @property
    def edp_mesh(self) -> Any:
        return self.mesh["edp"]

    @property
    def ep_group(self) -> Any:
        return self.mesh.get_group("ep")


def expert_layout(model: nn.Module) -> Optional[ExpertLayout]:
    """The :class:`ExpertLayout` ``shard_fsdp2`` recorded on ``model`` (its FSDP2 root), or None (EP = 1)."""
    return model.__dict__.get(EXPERT_LAYOUT_ATTR)


def expert_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of the outermost modules tagged ``is_expert = True``, in module order."""
    out: List[Tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if getattr(m, "is_expert", False) is True and not any(name.startswith(n + ".") for n, _ in out):
            out.append((name, m))
    return out


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def fsdp2_expert_mesh(device: Any, expert_parallel_size: int) -> Any:
    """The 2-D ``(edp, ep)`` DeviceMesh of shape ``(W/EP, EP)`` over the world, on ``device``'s type
    ([Note: FSDP2 expert parallelism]). A collective: every rank calls it. ``mesh.get_group("ep")`` is the group to
    build the model's all-to-all with (or any group of the same ranks, e.g. ``megatron_fsdp.expert_parallel_groups``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not _positive_int(expert_parallel_size):
        raise ValueError(f"expert_parallel_size={expert_parallel_size!r} must be a positive integer that divides the "
                         f"world size ({world}); pass e.g. 1, 2 or {world}")
    if world % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} does not divide the world size {world}: the ranks "
                         "form expert-parallel groups of expert_parallel_size contiguous ranks, each holding every "
                         f"expert once; pass a divisor of {world}")
    return init_device_mesh(torch.device(device).type, (world // expert_parallel_size, expert_parallel_size),
                            mesh_dim_names=("edp", "ep"))


def _ranks(group: Any) -> List[int]:
    return dist.get_process_group_ranks(group)


def check_expert_groups(model: nn.Module, expert_parallel_size: int, mesh: Any = None) -> List[Tuple[str, nn.Module]]:
    """Refuse (ValueError naming the module, both sizes or both rank lists, and the fix) a model whose experts'
    ``ep_group`` is not the mesh's ``ep`` row of this rank; at ``expert_parallel_size=1``, refuse experts that
    exchange tokens over more than one rank. Returns :func:`expert_modules`."""
    experts = expert_modules(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if expert_parallel_size == 1:
        for name, m in experts:
            group = getattr(m, "ep_group", None)
            size = dist.get_world_size(group) if group is not None else 1
            if size > 1:
                raise ValueError(
                    f"[rank {rank}] {name} exchanges tokens over an expert-parallel group of {size} ranks but the "
                    "model is sharded with expert_parallel_size=1: FSDP2 would shard each rank's different local "
                    "experts as if they were one replicated tensor (every rank's gathered weights a mix of several "
                    f"ranks' experts) and average their gradients over the world; pass expert_parallel_size={size} "
                    "(shard_fsdp2(..., expert_parallel_size=...), or engine_options={'expert_parallel_size': ...})")
        return experts
    if not experts:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} but {type(model).__name__} has no module tagged "
                         "is_expert = True: nothing to shard over the expert-data-parallel mesh; build the model with "
                         "expert parallelism (e.g. GPTConfig(expert_parallel_size=...)) or pass expert_parallel_size=1")
    want = mesh["ep"].mesh.flatten().tolist() if mesh is not None else None
    for name, m in experts:
        group = getattr(m, "ep_group", None)
        if group is None and getattr(m, "ep_size", None) == 1:
            raise ValueError(
                f"[rank {rank}] {name} holds every expert (its model was built without expert parallelism) but "
                f"expert_parallel_size={expert_parallel_size}: FSDP2 would shard whole expert stacks over the "
                "expert-data-parallel ranks and divide their gradients for a token exchange that never happens; "
                f"pass expert_parallel_size=1, or build the model with expert parallelism (GPTConfig("
                f"expert_parallel_size={expert_parallel_size}) and GPT(cfg, expert_parallel_group=...))")
        if group is None:
            raise ValueError(
                f"[rank {rank}] {name} (is_expert) has no ep_group, the process group of its all-to-all, so its "
                f"expert-parallel ranks cannot be checked against expert_parallel_size={expert_parallel_size}; give "
                "the experts module its group as ep_group (the reference GPT: GPT(cfg, expert_parallel_group=...))")
        size = dist.get_world_size(group)
        if size != expert_parallel_size:
            raise ValueError(
                f"[rank {rank}] {name} exchanges tokens over {size} ranks but expert_parallel_size="
                f"{expert_parallel_size}: FSDP2 would shard and reduce its experts for another layout than its "
                f"all-to-all; pass expert_parallel_size={size} (or build the model with {expert_parallel_size})")
        if want is not None and _ranks(group) != want:
            raise ValueError(
                f"[rank {rank}] {name}'s ep_group has ranks {_ranks(group)} but the FSDP2 expert mesh's "
                f"expert-parallel row of this rank is {want} (contiguous ranks, the expert-data-parallel columns "
                "strided): the all-to-all and the experts' reduce-scatter must use one layout; build the model with "
                f"fsdp2_expert_mesh(device, {expert_parallel_size}).get_group('ep') or "
                f"megatron_fsdp.expert_parallel_groups({expert_parallel_size})[0]")
    return experts


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # pragma: no cover - a group without a backend name
        return ""


def shard_experts(module: nn.Module, *, edp_mesh: Any, dp_size: int, shard: Any, **fully_shard_kwargs: Any) -> None:
    """``fully_shard`` one experts module over ``edp_mesh`` (``shard``: ``build.fsdp2_shard``) with the gradient
    divide factor ``dp_size`` ([Note: FSDP2 expert parallelism], Gradient divide factor)."""
    shard(module, mesh=edp_mesh, **fully_shard_kwargs)
    missing = [n for n in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms") if not hasattr(module, n)]
    if missing:
        raise NotImplementedError(
            f"fsdp_cudagraph: torch {torch.__version__}'s FSDPModule has no {missing}, which FSDP2 with expert "
            "parallelism needs (the experts' gradients divide by the whole data-parallel size, not their "
            "expert-data-parallel mesh's); use torch 2.11 to 2.13 (the versions checked)")
    module.set_gradient_divide_factor(float(dp_size))
    if edp_mesh.size() > 1 and _backend(edp_mesh.get_group()) == "gloo":
        module.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM: SUM, then divide by dp_size


def _refuse(what: str, layout: ExpertLayout):
    def hook(*_: Any, **__: Any) -> None:
        raise NotImplementedError(
            f"fsdp_cudagraph: {what} of an FSDP2 model with expert_parallel_size={layout.expert_parallel_size}: each "
            f"EP rank's experts ({', '.join(layout.experts[:2])}{', ...' if len(layout.experts) > 2 else ''}) hold "
            "different experts under the same keys (e.g. experts.w1 [E/EP, h, f]) as DTensors over the "
            "expert-data-parallel mesh only, so DCP would store one EP rank's experts under every key and lose "
            "the others. Save the parameters by hand instead: p.full_tensor() per parameter on every rank, then "
            "fsdp_cudagraph.apps.model.merge_expert_state_dicts over the EP ranks (an EP=1 state dict), or train "
            "with megatron_fsdp.fully_shard(..., expert_parallel_size=...) with experts named by global index")
    return hook


def refuse_state_dicts(model: nn.Module, layout: ExpertLayout) -> None:
    """Make ``model.state_dict()`` and ``model.load_state_dict()`` (and so DCP's ``get_model_state_dict`` /
    ``set_model_state_dict`` / ``get_state_dict``) raise NotImplementedError with the reason and the fix.

    Not reached: DCP's ``get_optimizer_state_dict`` alone, which torch builds from the optimizer and the
    parameters' names without calling ``model.state_dict()`` (docs/engines.md says not to save it at EP > 1)."""
    model.register_state_dict_pre_hook(_refuse("state_dict()", layout))
    model.register_load_state_dict_pre_hook(_refuse("load_state_dict()", layout))
