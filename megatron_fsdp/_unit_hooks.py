"""The module hooks of one FSDP unit: the four phase hooks with their sentinels, and the call guard.

Each factory closes over one :class:`~megatron_fsdp._unit.FSDPUnit` and calls its phase handlers
(``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``); the hooks themselves only decide
when, and carry the attributes a graph layer reads ([Note: hook sentinels]). ``_grad_tensors`` is shared
with the root wrapper, which hooks the model's outputs the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import _guards
from ._common import COMPUTING, TrainingState, Unit

__all__ = ["make_unit_hooks", "make_call_guard"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs the unit's post-backward handler.

    Its backward runs once the gradients of the unit's inputs exist; autograd runs AccumulateGrad nodes
    first (highest priority), so the unit's parameter gradients are in ``param.grad`` by then.
    """

    @staticmethod
    def forward(ctx: Any, unit: Unit, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        ctx.unit.post_backward()
        return (None,) + grads


def _grad_tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(obj, dict):
        return [t for t in obj.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    return []


def make_unit_hooks(unit: Unit) -> Tuple[Callable, Callable, Callable, Callable]:
    """The unit's four module hooks, in registration order: two forward-pre hooks, two forward hooks.

    [Note: hook sentinels]
    The hooks that register backward handlers carry the inner handler as an attribute, so a graph layer
    can run the handler itself around a captured backward while leaving the registration out:
    ``_cuda_graph_backward_handler`` on the forward-pre hook that wraps inputs (post-backward: reduce
    and reshard), ``_cuda_graph_backward_pre_handler`` on the forward hook that hooks outputs
    (pre-backward: unshard). ``_megatron_fsdp_role`` names every hook for readers and tests.
    """

    def fsdp_pre_forward(module: nn.Module, args: Tuple[Any, ...]) -> None:
        unit.pre_forward()

    def fsdp_register_post_backward(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        if not torch.is_grad_enabled():
            return None
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not idx and not keys:
            return None  # the final callback reduces this unit instead
        wrapped = _PostBackward.apply(unit, *[args[i] for i in idx], *[kwargs[k] for k in keys])
        new_args = list(args)
        for j, i in enumerate(idx):
            new_args[i] = wrapped[j]
        new_kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            new_kwargs[k] = wrapped[len(idx) + j]
        return tuple(new_args), new_kwargs

    def fsdp_post_forward(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        unit.post_forward()

    def fsdp_register_pre_backward(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled() or unit.state is TrainingState.BACKWARD:
            return None  # no backward, or a recomputed forward inside the unit's backward ([Note: recompute])
        tensors = _grad_tensors(output)
        if len(tensors) == 1:
            tensors[0].register_hook(_pre_backward_tensor_hook(unit))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, _pre_backward_tensor_hook(unit), mode="any")
        return None

    fsdp_pre_forward._megatron_fsdp_role = "pre_forward"  # type: ignore[attr-defined]
    fsdp_register_post_backward._megatron_fsdp_role = "register_post_backward"  # type: ignore[attr-defined]
    fsdp_register_post_backward._cuda_graph_backward_handler = unit.post_backward  # type: ignore[attr-defined]
    fsdp_post_forward._megatron_fsdp_role = "post_forward"  # type: ignore[attr-defined]
    fsdp_register_pre_backward._megatron_fsdp_role = "register_pre_backward"  # type: ignore[attr-defined]
    fsdp_register_pre_backward._cuda_graph_backward_pre_handler = unit.pre_backward  # type: ignore[attr-defined]
    for h in (fsdp_pre_forward, fsdp_register_post_backward, fsdp_post_forward, fsdp_register_pre_backward):
        h._megatron_fsdp_unit = unit  # type: ignore[attr-defined]
    return fsdp_pre_forward, fsdp_register_post_backward, fsdp_post_forward, fsdp_register_pre_backward


def make_call_guard(unit: Unit, name: str) -> Callable[..., None]:
    """A forward-pre hook for a submodule of ``unit`` that owns parameters: refuse calls outside the unit.

    [Note: calls outside the unit] A unit's parameters hold its values only between the unit's own
    pre-forward and post-forward (and again in its backward): before, they are NaN placeholders or views
    into a double-buffer slot that another unit's data may occupy. A model that calls ``layer.mlp(x)``
    instead of ``layer(x)`` would compute with those bytes, silently. This hook costs one attribute read
    per call; it is engine-owned (``_megatron_fsdp_role = "call_guard"``), so graph layers restore it
    without running it at capture, and at a replay the unit is in forward, where the call is legal.
    """
    engine = unit.engine

    def megatron_fsdp_call_guard(module: nn.Module, args: Tuple[Any, ...]) -> None:
        if unit.state not in COMPUTING:
            raise RuntimeError(
                f"[rank {engine.rank}] megatron_fsdp: submodule {name} of FSDP unit {unit.name} was called while "
                f"the unit is {unit.state.name}, i.e. outside the unit's own forward: its parameters are only "
                f"gathered between the unit's pre-forward and post-forward, so this call would compute with stale "
                f"or placeholder values. Call the unit itself ({unit.name or 'the unit'}(...)), which runs this "
                f"submodule inside it; or, if the model needs {name} on its own, make {name} an FSDP unit of its "
                "own (add its class to fsdp_unit_modules) or leave it out of the unit"
            )

    megatron_fsdp_call_guard._megatron_fsdp_role = "call_guard"  # type: ignore[attr-defined]
    megatron_fsdp_call_guard._megatron_fsdp_unit = unit  # type: ignore[attr-defined]
    return megatron_fsdp_call_guard


def _pre_backward_tensor_hook(unit: Unit) -> Callable[[Any], None]:
    engine = unit.engine
    forward_index = engine.num_grad_forwards  # [Note: one backward per forward] in _guards.py

    def hook(_grad: Any) -> None:
        if forward_index != engine.num_grad_forwards:
            raise _guards.stale_backward_error(engine, forward_index, f"the output of unit {unit.name}")
        unit.pre_backward()

    return hook
