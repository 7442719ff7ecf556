"""Our engine, ``megatron_fsdp``, as the graph layer sees it (see [Note: the engine contract]).

The only module of the library that imports ``megatron_fsdp``: it reads the engine's public surface
(``MegatronFSDP``, its units, ``reset_step_state``, ``simulated_capture``, ``capture_guard``) and the sentinels
its hooks carry, and answers the per-layer questions with them; its static step (item 9) is the engine's own
``megatron_fsdp.graph_contract.StaticStep``, handed over as is. Only this engine has a static step, so only it
runs whole-step graphs. The NVIDIA adapter reads TE's FP8 weights through this module's
:func:`parameter_replay_tensors` and :func:`replay_addresses` (one expansion of a quantized parameter for both).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

import megatron_fsdp
from megatron_fsdp import _fp8, graph_contract

from fsdp_cudagraph.engines.contract import (HOOK_DICTS, PER_LAYER_BUFFERS, EngineAdapter, HookPlan, PerLayerEngine,
                                             ReplayProbe, StaticStepEngine, parameter_slots)
from fsdp_cudagraph.engines.hookplan import adapt, read_sentinel
from fsdp_cudagraph.engines.registry import register_engine

__all__ = ["MegatronFSDPEngine", "ROLE_ATTR", "PLANNED_ROLES", "parameter_ops", "parameter_replay_tensors",
           "replay_addresses"]

#: The ops of a quantized parameter's kind (TE's ``Float8Tensor``, a test's stand-in), None for a plain tensor.
parameter_ops = _fp8.ops_for
#: (name, tensor) of what a GEMM reads of parameter ``name`` by address: itself, or a quantized weight's FP8 bytes,
#: transpose and scale-inverse ([Note: FP8 parameter all-gather]).
parameter_replay_tensors = _fp8.replay_tensors


def replay_addresses(params: Sequence[torch.Tensor], kinds: Sequence[Optional[_fp8.QuantizedOps]]) -> List[int]:
    """The addresses of ``parameter_replay_tensors`` of each of ``params``, in its order; ``kinds``: each one's
    ``parameter_ops``, resolved once by the caller (a probe runs before every replay). Plain parameters only (the
    common case): their data pointers, without the expansion."""
    if not any(kinds):
        return [p.data_ptr() for p in params]
    return [a for p, ops in zip(params, kinds)
            for a in ([p.data_ptr()] if ops is None else [t.data_ptr() for _, t in ops.tensors(p)])]

#: Every hook ``megatron_fsdp`` registers names its role in this attribute.
ROLE_ATTR = "_megatron_fsdp_role"
#: role -> (the hook dict it must sit in, the TE capture-time key it is planned under, how it is called).
#: The two ``register_*`` roles carry sentinels: read_sentinel plans their inner handlers instead.
_PLANNED = {
    "pre_forward": ("_forward_pre_hooks", "forward_pre_hooks", "pre"),
    "post_forward": ("_forward_hooks", "forward_hooks", "post"),
}
PLANNED_ROLES = frozenset(_PLANNED) | {"register_post_backward", "register_pre_backward"}


def plan_hooks(saved: Mapping[str, Mapping[int, Any]]) -> HookPlan:
    """Phase 2 for ``megatron_fsdp``'s hooks (usable without a wrapped model, e.g. on a bare module).

    - a sentinel wrapper (``register_*_backward``) is withheld and its inner handler planned;
    - ``pre_forward`` / ``post_forward`` in their own dict are planned in TE's form;
    - a hook with a role this plan does not run (e.g. a call guard) is the engine's: restored, not run at
      capture, not reported (``engine_only``);
    - everything else, including a planned role in the wrong dict, is unknown: restored and reported.
    """
    plan = HookPlan()
    for dict_name in HOOK_DICTS:
        for hid, hook in saved.get(dict_name, {}).items():
            if read_sentinel(hook, hid, dict_name, plan):
                continue
            role = getattr(hook, ROLE_ATTR, None)
            planned = _PLANNED.get(role)
            if planned is not None and planned[0] == dict_name:
                plan.capture_time[planned[1]][hid] = adapt(hook, planned[2])
            elif role is not None and role not in PLANNED_ROLES:
                plan.engine_only.append((dict_name, hid, hook))
            else:
                plan.unknown.append((dict_name, hid, hook))
    return plan


# The engine's static step is its own object (megatron_fsdp never imports this package, so it cannot subclass the
# ABC): registered here as a virtual subclass, which is what static_step_engine() tests for.
StaticStepEngine.register(graph_contract.StaticStep)


@register_engine
class MegatronFSDPEngine(EngineAdapter, PerLayerEngine):
    """A :class:`megatron_fsdp.MegatronFSDP` model."""

    name = "megatron_fsdp"
    fp8_supported = True
    address_hint = ("Keep the engine's buffers where capture found them (fsdp_double_buffer=True, or sharding_strategy "
                    "'no_shard'/'optim', whose buffers are persistent).")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.engine: megatron_fsdp.MegatronFSDP = model
        #: id(module) -> its unit (None: the root's), filled by the first lookup: a model walk per module, once.
        self._units_by_module: Dict[int, Any] = {}
        self._static_step: Optional[graph_contract.StaticStep] = None

    @classmethod
    def recognizes(cls, model: nn.Module) -> bool:
        return isinstance(model, megatron_fsdp.MegatronFSDP)

    @classmethod
    def wrapper_of(cls, model: nn.Module) -> Optional[str]:
        # A unit's module carries its unit (set by fully_shard); the root's inner module holds unit modules.
        unit = next((u for m in model.modules() if (u := getattr(m, "_megatron_fsdp_unit", None)) is not None), None)
        engine = getattr(unit, "engine", None)
        if isinstance(engine, megatron_fsdp.MegatronFSDP) and any(s is model for s in engine.module.modules()):
            return f"the object fully_shard returned (MegatronFSDP around {type(engine.module).__name__})"
        return None

    @classmethod
    def bare_hook_plan(cls, saved: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
        return plan_hooks(saved)

    # -- 1. units
    @property
    def root(self) -> nn.Module:
        return self.engine.module

    @property
    def rank(self) -> int:
        return self.engine.rank

    def unit_modules(self) -> List[nn.Module]:
        return [u.module for u in self.engine.units]

    def _unit(self, module: nn.Module) -> Any:
        key = id(module)
        if key not in self._units_by_module:
            self._units_by_module[key] = self.engine.unit_of(module)  # walks the model: once per module
        return self._units_by_module[key]

    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        unit = self._unit(module)
        return unit.module if unit is not None else None

    def unit_name(self, unit: nn.Module) -> str:
        return self._unit(unit).name

    def unit_uses_recompute(self, unit: nn.Module) -> bool:
        return self.engine.unit_uses_recompute(self._unit(unit))

    @property
    def num_forward_calls(self) -> int:
        return self.engine.num_forward_calls

    # -- 2. hooks
    def hook_plan(self, hooks: Mapping[str, Mapping[int, Any]]) -> HookPlan:
        return plan_hooks(hooks)

    # -- 3. what must not move
    def check_partial_graphs(self) -> None:
        # [Note: fixed addresses]: a per-layer replay reads the unshard buffers and may write the gradient buffer.
        self.static_step().require_fixed_buffers("a per-layer CUDA graph under megatron_fsdp", PER_LAYER_BUFFERS)

    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        # Parameters by their name in ``module``; then the owning unit's gradient buffer, read live (the engine
        # may rebind ``grad_buffer.tensor``), unless it is allocated on demand (then nothing can be pinned).
        # an FP8 weight as the tensors its GEMMs read: bytes, transpose, scale ([Note: FP8 parameter all-gather])
        out: List[Tuple[str, torch.Tensor]] = [pair for n, p in module.named_parameters()
                                               for pair in parameter_replay_tensors(n, p)]
        unit = self._unit(module)
        gb = unit.grad_buffer if unit is not None else None
        if gb is not None and gb.kind != "dynamic":
            out.append((f"gradient buffer of unit {unit.name}", gb.tensor))
        return out

    def replay_probe(self, module: nn.Module) -> ReplayProbe:
        # Resolved once: where each parameter is registered (read through the dict, so a reassigned parameter is
        # seen) and the owning unit; each call reads data pointers only, as replay_tensors orders them.
        slots = parameter_slots(module)
        unit = self._unit(module)
        kinds = [parameter_ops(d[n]) for d, n in slots]  # the quantized weights' ops, None for plain parameters

        def probe() -> Tuple[int, ...]:
            out = replay_addresses([d[n] for d, n in slots], kinds)
            gb = unit.grad_buffer if unit is not None else None
            if gb is not None and gb.kind != "dynamic":
                out.append(gb.tensor.data_ptr())
            return tuple(out)
        return probe

    # -- 4. capture guard
    def simulated_capture(self) -> ContextManager[None]:
        return megatron_fsdp.simulated_capture()

    # capture_guard: the contract's default (nothing entered). A real capture of a partial graph runs no engine
    # collective, the hooks being outside the graph, and the engine's own checks see torch's capture state.

    # -- 5. step boundary
    def reset(self) -> None:
        self.engine.reset_step_state()

    # -- 9. the static step: the engine's own object ([Note: the static schedule] in megatron_fsdp/graph_contract.py)
    def static_step(self) -> graph_contract.StaticStep:
        if self._static_step is None:
            self._static_step = graph_contract.StaticStep(self.engine)
        return self._static_step

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # -- 6. and 7. fused weight gradients ([Note: fused weight gradients] in megatron_fsdp/_fused_wgrad.py)
    def prepare_capture(self, units: List[nn.Module]) -> None:
        # Until reset() after the capture, the graph maker's backwards reduce nothing into the main gradients
        # (the weight gradients TE writes into the engine's buffer included).
        self.engine.graph_maker_running = True
        for u in self.engine.all_units():
            if u.fused is not None:
                u.fused.forget_captures()

    def replay_notice(self, module: nn.Module) -> Optional[Callable[[], None]]:
        unit = self._unit(module)
        if unit is None or unit.fused is None:
            return None
        fused = unit.fused
        return lambda: fused.note_replay(module)
