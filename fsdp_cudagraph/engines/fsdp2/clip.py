"""One global gradient norm over an FSDP2 model whose gradients live on several meshes (expert parallelism).

[Note: FSDP2 clipping with experts]
Under :func:`~fsdp_cudagraph.engines.fsdp2.build.shard_fsdp2` with ``expert_parallel_size=EP`` the dense gradients
are DTensors ``Shard(0)`` over the 1-D data-parallel mesh (the world) and the experts' are DTensors ``Shard(0)``
over the expert-data-parallel mesh (``W/EP`` ranks holding the same local experts). torch's ``clip_grad_norm_``
stacks every per-parameter norm into one DTensor op and refuses gradients on different meshes. The norm is
computed honestly instead, each element counted once:

- per mesh, DTensor's own reduction (``torch.nn.utils.get_total_norm`` of that mesh's gradients, a ``Partial``
  DTensor, made whole by ``full_tensor()``): the norm over what that mesh holds, ``Replicate`` dimensions not
  counted twice;
- the dense mesh covers the world: its norm is the dense part of the model;
- the expert mesh of this rank covers this EP rank's local experts only (every rank of an EDP group holds the same
  experts); the ranks of one EP group hold disjoint experts that together are all ``E``, so the experts' part is
  the sum of the EP group's ``norm^p`` (the maximum for ``inf``), one all-reduce over the EP group;
- total ``(dense^p + experts^p)^(1/p)``; every rank gets the same value.

Then every gradient is scaled by ``min(1, max_norm / (total + 1e-6))`` in place (its local shard), as torch does.
Without an expert layout (EP = 1) the function is torch's on one mesh. Tensor parallelism ([Note: FSDP2 with DTensor
tensor parallelism] in ``build.py``) puts the gradients on two meshes of one root: the plain parameters' on
``mesh['dp']`` (replicated over ``tp``), the TP slices' on the whole ``(dp, tp)`` mesh. Each mesh's norm is then
whole (``full_tensor`` over every dimension the mesh has) and the meshes hold disjoint parameters, so the total is
``(sum of the meshes' norm^p)^(1/p)`` (the maximum for ``inf``); torch's ``clip_grad_norm_`` raises there (its
``stack`` of per-parameter norms refuses operands on different meshes). Gradients on several meshes of different
roots without an expert layout are refused (it could not tell whether the meshes hold the same elements).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.engines.fsdp2.expert import expert_layout

__all__ = ["clip_grad_norm_", "grad_norm"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _mesh_norm(grads: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``grads`` (DTensors on one mesh, or plain tensors) as a plain tensor, whole on every rank."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _one_root(meshes: List[Any]) -> bool:
    """Whether ``meshes`` (DeviceMeshes, or None for plain gradients) are all slices of one root mesh."""
    if any(m is None for m in meshes):
        return False
    roots = [m._get_root_mesh() for m in meshes]
    return all(r is roots[0] or r == roots[0] for r in roots)


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type``-norm of every gradient of ``model`` (an FSDP2 root), each element counted once
    ([Note: FSDP2 clipping with experts]). A collective: every rank calls it; all get the same fp32 value."""
    norm_type = float(norm_type)
    layout = expert_layout(model)
    expert_ids = set()
    if layout is not None:
        for name in layout.experts:
            expert_ids |= {id(p) for p in model.get_submodule(name).parameters()}
    by_mesh: Dict[Tuple[bool, int], List[torch.Tensor]] = {}
    meshes: Dict[int, Any] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        mesh = getattr(p.grad, "device_mesh", None)
        meshes[id(mesh)] = mesh
        by_mesh.setdefault((id(p) in expert_ids, id(mesh)), []).append(p.grad)
    dense_meshes = {m for e, m in by_mesh if not e}
    expert_meshes = {m for e, m in by_mesh if e}
    if layout is None and len(dense_meshes) > 1 and _one_root([meshes[m] for m in dense_meshes]):
        # tensor parallelism: the dp mesh and the (dp, tp) mesh of one root hold disjoint parameters, each whole
        norms = [_mesh_norm(gs, norm_type).to(torch.float32) for gs in by_mesh.values()]
        if math.isinf(norm_type):
            return torch.stack(norms).max()
        return torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
    if layout is None and len(dense_meshes) > 1:
        raise NotImplementedError(
            f"fsdp_cudagraph: the gradients of {type(model).__name__} live on {len(dense_meshes)} device meshes and the "
            "model has no expert layout, so it cannot tell whether the meshes hold the same elements; shard experts "
            "with shard_fsdp2(..., expert_parallel_size=...), or clip each mesh's gradients yourself")
    if len(dense_meshes) > 1 or len(expert_meshes) > 1:
        raise NotImplementedError(
            f"fsdp_cudagraph: dense gradients on {len(dense_meshes)} meshes and expert gradients on {len(expert_meshes)}; "
            "shard_fsdp2 puts each kind on one mesh: shard the model with it")
    device = next((_local(g).device for gs in by_mesh.values() for g in gs), torch.device("cpu"))
    parts = {e: _mesh_norm(gs, norm_type).to(device=device, dtype=torch.float32) for (e, _), gs in by_mesh.items()}
    dense = parts.get(False, torch.zeros((), device=device))
    experts = parts.get(True, torch.zeros((), device=device))
    if layout is not None:
        # the EP group's ranks hold disjoint experts: add their parts (every rank joins, with or without experts' grads)
        if math.isinf(norm_type):
            dist.all_reduce(experts, op=dist.ReduceOp.MAX, group=layout.ep_group)
        else:
            experts = experts.pow(norm_type)
            dist.all_reduce(experts, group=layout.ep_group)
            experts = experts.pow(1.0 / norm_type)
    if math.isinf(norm_type):
        return torch.maximum(dense, experts)
    return (dense.pow(norm_type) + experts.pow(norm_type)).pow(1.0 / norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip every gradient of ``model`` (an FSDP2 root, with or without expert parallelism) by one global norm, in
    place, as ``torch.nn.utils.clip_grad_norm_`` does on one mesh; returns the norm before clipping
    (:func:`grad_norm`). A collective: every rank calls it."""
    total = grad_norm(model, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"fsdp_cudagraph: the total norm of order {norm_type} of the gradients is {float(total)}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
