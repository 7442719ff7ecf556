"""Gradient clipping over the sharded fp32 main gradients, and the guard that refuses per-rank norms.

[Note: local norms]
Each rank holds one shard of every unit's fp32 main gradient (``main_shard.grad``). The norm of a shard is
this rank's share only: ``torch.nn.utils.clip_grad_norm_(model.optimizer_parameters(), 1.0)`` would clip
every rank by a different, too small norm, and the ranks' main parameters would drift apart from what
unsharded training computes, with no error. ``model.clip_grad_norm_`` sums the ranks' shares (an
all-reduce of the p-th powers, or the maximum for the inf norm) and scales every shard by the same
coefficient. For the sharded strategies on more than one rank, ``main_shard.grad`` is an alias of the main
gradient whose norms (``torch.linalg.vector_norm``, ``torch._foreach_norm``, ``torch.norm``,
``Tensor.norm``, ``torch.linalg.norm``: everything ``clip_grad_norm_`` and ``get_total_norm`` use) raise
with the fix; every other operation runs unchanged on the plain tensor, so optimizers are unaffected. A
deliberately local norm stays possible: ``grad.as_subclass(torch.Tensor).norm()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import _collectives as C
from ._common import Engine, Unit

__all__ = ["clip_grad_norm_", "guard_local_norms", "total_grad_norm"]

_NORMS = {torch._foreach_norm, torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm}


class _MainGradShard(torch.Tensor):
    """One rank's shard of a unit's main gradient, as optimizers see it: norms refused ([Note: local norms])."""

    _megatron_fsdp_unit_name: str = "?"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Tuple[type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if func in _NORMS:
            shard = next((a for a in _flat_args(args) if isinstance(a, _MainGradShard)), None)
            unit = shard._megatron_fsdp_unit_name if shard is not None else "?"
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(
                f"[rank {rank}] megatron_fsdp: a norm of the main gradient of unit {unit} was requested, but that "
                "tensor is this rank's shard, so its norm is this rank's share only (torch.nn.utils.clip_grad_norm_ "
                "over model.optimizer_parameters() would clip each rank by a different norm). Call "
                "model.clip_grad_norm_(max_norm) to clip by the global norm, or model.total_grad_norm() to read it; "
                "for a deliberately local norm use grad.as_subclass(torch.Tensor)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _flat_args(args: Tuple[Any, ...]) -> Any:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def guard_local_norms(main_grad: torch.Tensor, unit: Unit) -> torch.Tensor:
    """An alias of ``main_grad`` (same storage) whose norms raise; see [Note: local norms]."""
    alias = main_grad.as_subclass(_MainGradShard)
    alias._megatron_fsdp_unit_name = unit.name
    return alias


def total_grad_norm(engine: Engine, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient (all ranks' main-gradient shards together), on every rank.

    A collective over the data-parallel group: call it on every rank. Units without a gradient yet count
    as zero. Returns an fp32 scalar tensor on the model's device.
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type={norm_type} must be positive or inf; use 2.0 (Euclidean) or float('inf')")
    grads = [u._main_grad_data for u in engine.all_units() if u.grad_numel and u.main_shard.grad is not None]
    dev = engine.device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=dev)
    else:
        local = (torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum()
                 if grads else torch.zeros((), device=dev))
    local = local.to(torch.float32).reshape(1)
    if engine.strategy.shards_optimizer and engine.world_size > 1:
        if math.isinf(norm_type):
            # A max over ranks through the engine's all-gather (the SUM all-reduce cannot take a max).
            every = torch.empty(engine.world_size, dtype=torch.float32, device=dev)
            work = C.all_gather(every, local, engine.group, "the local inf-norms of the gradients")
            if work is not None:
                work.wait()
            local = every.max().reshape(1)
        else:
            work = C.all_reduce(local, engine.group, "the local gradient norms")
            if work is not None:
                work.wait()
    total = local[0]
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_grad_norm_(engine: Engine, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every rank's main-gradient shard so the global gradient norm is at most ``max_norm``.

    What ``torch.nn.utils.clip_grad_norm_`` does for an unsharded model, with the norm taken over all ranks:
    coefficient ``max_norm / (norm + 1e-6)`` clamped to 1, applied to every shard. Returns the total norm
    (before clipping). Call it on every rank between ``backward`` and ``optimizer.step()``.
    """
    total = total_grad_norm(engine, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"[rank {engine.rank}] megatron_fsdp: the total norm of order {float(norm_type)} of the gradients is "
            f"{total.item()}; clipping would make them meaningless. Pass error_if_nonfinite=False to clip anyway, "
            "or find the non-finite gradient (e.g. lower the learning rate, or use a loss scaler)"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    grads = [u._main_grad_data for u in engine.all_units() if u.grad_numel and u.main_shard.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
