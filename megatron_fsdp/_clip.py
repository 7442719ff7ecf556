"""Gradient clipping over the sharded fp32 main gradients, the guard that refuses per-rank norms, and the
sentinel gradients of the compute parameters that refuse clipping over ``model.parameters()``.

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

[Note: compute parameters hold no gradient]
``model.parameters()`` yields the compute parameters (views into the units' unshard buffers, see [Note:
parameter views] in ``_unit.py``). Their ``.grad`` is folded into the unit's gradient buffer and reduced at the
unit's post-backward, then cleared: the model's gradient lives in the fp32 main-gradient shards only. So
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, the usual spelling, would find no gradient,
return a norm of 0, clip nothing, and training would drift from the clipped run with no error. Making it
compute the right norm would need ``.grad`` tensors of the parameters' full shapes that are really slices of
rank shards, with torch's per-tensor norms and their ``vector_norm`` rerouted to one collective: not honest
tensors, and not the bits of ``model.clip_grad_norm_`` (torch combines per-tensor norms; the engine sums
p-th powers of whole shards before one all-reduce). Instead, at the end of every backward each trainable
compute parameter without a gradient gets a sentinel ``.grad`` (:class:`_NoGradient`: a zero-stride expand of
one zero of the parameter's shape, dtype and device, made once per parameter) whose every use raises, naming
``model.clip_grad_norm_(max_norm)``: ``clip_grad_norm_``, ``clip_grad_value_`` and ``get_total_norm`` over
``model.parameters()`` fail instead of being silent, as does any other read of those gradients. Left alone:
attribute reads (shape, dtype, ``grad_fn``), ``copy.deepcopy``, ``model.zero_grad()`` (``set_to_none``
unbinds it; ``set_to_none=False`` passes over it: zeroing has no values to zero), and code that only moves
``.grad`` around (graph makers save, clear and restore it). The next forward with gradients unbinds the
sentinels before any backward can accumulate into them (AccumulateGrad would fail on a sentinel), and the
engine's own checks for left-over gradients skip them. Costs: one ``.grad`` assignment per trainable
parameter per backward and one per forward with gradients.

For the same reason ``model.zero_grad()`` alone would clear nothing that matters: the main-gradient shards are
not module parameters, so ``nn.Module.zero_grad`` never sees them, and a user who zeroes through the model
instead of the optimizer would accumulate every step's gradient into the next with no error.
:meth:`MegatronFSDP.zero_grad` (in ``_fully_shard.py``) clears them too, as ``optimizer.zero_grad()`` over
``optimizer_parameters()`` does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _collectives as C
from ._common import Engine, Unit

__all__ = ["clip_grad_norm_", "guard_local_norms", "total_grad_norm", "make_no_gradients", "bind_no_gradient",
           "unbind_no_gradient", "holds_gradient"]

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


class _NoGradient(torch.Tensor):
    """A compute parameter's ``.grad`` after backward: no values; every use raises ([Note: compute parameters hold
    no gradient])."""

    _megatron_fsdp_param_name: str = "?"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Tuple[type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if getattr(func, "__name__", None) == "__get__" or func in _PASS:  # attributes, deepcopy, hash
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func in _SKIP:  # model.zero_grad(set_to_none=False): nothing to zero
            return args[0] if isinstance(args[0], torch.Tensor) else None
        sentinel = next((a for a in _flat_args(args) if isinstance(a, _NoGradient)), None)
        name = sentinel._megatron_fsdp_param_name if sentinel is not None else "?"
        what = getattr(func, "__name__", repr(func))
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(
            f"[rank {rank}] megatron_fsdp: {what} was called on the .grad of compute parameter {name}, which holds "
            "no gradient: the engine reduced it into the sharded fp32 main gradients, so a norm or a clip over "
            "model.parameters() would see nothing (torch.nn.utils.clip_grad_norm_ would return 0 and clip "
            "nothing). Clip with model.clip_grad_norm_(max_norm) (the global norm over all ranks, on every rank), "
            "read the norm with model.total_grad_norm(), clip by value with torch.nn.utils.clip_grad_value_("
            "model.optimizer_parameters(), clip_value), and read gradients from "
            "model.optimizer_parameters()[i].grad"
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"<megatron_fsdp: no gradient for compute parameter {self._megatron_fsdp_param_name}; see model.optimizer_parameters()>"


_PASS = {torch.Tensor.__deepcopy__, torch.Tensor.__hash__}
_SKIP = {torch.Tensor.requires_grad_, torch.Tensor.detach_, torch.Tensor.zero_, torch._foreach_zero_}


def make_no_gradients(unit: Unit) -> List[torch.Tensor]:
    """Sentinels for the unit's trainable compute parameters (their current shape, dtype and device), as
    ``unit.params``: views of one zero per dtype, so a unit costs one element, made once, outside any capture."""
    zeros: Dict[torch.dtype, torch.Tensor] = {}
    made = []
    for n, p in zip(unit.layout.names, unit.params):
        if p.dtype not in zeros:
            zeros[p.dtype] = torch.zeros((), dtype=p.dtype, device=p.device)
        s = zeros[p.dtype].expand(p.shape).as_subclass(_NoGradient)
        s._megatron_fsdp_param_name = n
        made.append(s)
    return made


def bind_no_gradient(engine: Engine) -> None:
    """End of backward: every trainable compute parameter without ``.grad`` gets its sentinel."""
    for u in engine.all_units():
        for p, s in zip(u.params, u.no_gradients):
            if p.grad is None:
                p.grad = s


def unbind_no_gradient(engine: Engine) -> None:
    """Before a forward with gradients: clear the sentinels, so that the backward accumulates into nothing."""
    for u in engine.all_units():
        for p in u.params:
            if type(p.grad) is _NoGradient:
                p.grad = None


def holds_gradient(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` is a gradient (not None, not the sentinel)."""
    return p.grad is not None and type(p.grad) is not _NoGradient


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
    dev = engine.device
    inf = math.isinf(norm_type)
    if getattr(engine, "tp_topology", None) is not None:
        total = _tensor_parallel_norm(engine, norm_type, inf)
        return total if inf else total.pow(1.0 / norm_type)

    def local_part(expert: bool) -> torch.Tensor:
        grads = [u._main_grad_data for u in engine.all_units()
                 if u.grad_numel and u.main_shard.grad is not None and u.is_expert == expert]
        if not grads:
            return torch.zeros(1, dtype=torch.float32, device=dev)
        if inf:
            part = torch.stack([g.abs().max() for g in grads]).max()
        else:
            part = torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum()
        return part.to(torch.float32).reshape(1)

    local = local_part(False)
    sharded = engine.strategy.shards_optimizer
    topo = engine.expert_topology
    if topo is not None:
        # [Note: expert parallelism] in _expert.py, Clipping: sharded, every element is held once in the DP group;
        # no_shard holds the experts once per EP group.
        expert = local_part(True)
        if not sharded:
            expert = _reduce_local(engine, expert, inf, topo.ep_group, topo.ep_size, "expert gradient norms")
        local = torch.maximum(local, expert) if inf else local + expert
    if sharded and engine.world_size > 1:
        local = _reduce_local(engine, local, inf, engine.group, engine.world_size, "gradient norms")
    total = local[0]
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def _tensor_parallel_norm(engine: Engine, norm_type: float, inf: bool) -> torch.Tensor:
    """The p-th power of the norm (the maximum for inf) over the (dp, tp) grid ([Note: tensor parallelism] in
    _tensor.py, Clipping): each shard split at the end of its unit's replicated range; both parts summed over DP,
    the TP shards' part over TP too, the replicated part counted once."""
    from ._state_dict import shard_start  # _state_dict imports this module's users; a local import keeps it a leaf

    rep: List[torch.Tensor] = []
    shd: List[torch.Tensor] = []
    for u in engine.all_units():
        if not u.grad_numel or u.main_shard.grad is None:
            continue
        g = u._main_grad_data
        cut = min(max(u.tp_replicated_numel - shard_start(engine, u.layout, u), 0), g.numel())
        if cut:
            rep.append(g[:cut])
        if cut < g.numel():
            shd.append(g[cut:])

    def part(grads: List[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=engine.device)
        if inf:
            return torch.stack([g.abs().max() for g in grads]).max().to(torch.float32)
        return torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum().to(torch.float32)

    topo = engine.tp_topology
    sharded = engine.strategy.shards_optimizer and engine.world_size > 1
    if inf:
        local = torch.maximum(part(rep), part(shd)).reshape(1)
        if sharded:
            local = _reduce_local(engine, local, True, engine.group, engine.world_size, "gradient norms")
        return _reduce_local(engine, local, True, topo.tp_group, topo.tp_size, "gradient norms over TP")[0]
    local = torch.stack([part(rep), part(shd)])
    if sharded:
        local = _reduce_local(engine, local, False, engine.group, engine.world_size, "gradient norms")
    shards = _reduce_local(engine, local[1:].clone(), False, topo.tp_group, topo.tp_size,
                           "tensor-parallel shards' gradient norms")
    return local[0] + shards[0]


def _reduce_local(engine: Engine, local: torch.Tensor, inf: bool, group: Any, size: int, what: str) -> torch.Tensor:
    """Sum (or, for the inf norm, the maximum) of ``local`` over ``group``'s ``size`` ranks, on every rank."""
    if inf:
        # A max over ranks through the engine's all-gather (the SUM all-reduce cannot take a max).
        every = torch.empty(size, dtype=torch.float32, device=local.device)
        work = C.all_gather(every, local, group, f"the local inf-norms of the {what}")
        if work is not None:
            work.wait()
        return every.max().reshape(1)
    work = C.all_reduce(local, group, f"the local {what}")
    if work is not None:
        work.wait()
    return local


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
