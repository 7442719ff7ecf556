"""Our engine, ``megatron_fsdp``, as the graph layer sees it (see [Note: the engine contract]).

The only module of the graph layer's library that knows ``megatron_fsdp`` by name for partial graphs: it reads
the engine's public surface (``MegatronFSDP``, its units' modules, ``reset_step_state``, ``simulated_capture``)
and the sentinels its hooks carry, and answers the contract's questions with them. The whole-step graph kinds
(full-iteration, inference blocks, optimizer) use ``megatron_fsdp.graph_contract`` directly: only this
engine supports them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

import megatron_fsdp

from fsdp_cudagraph.engines import HOOK_DICTS, EngineAdapter, HookPlan, adapt, read_sentinel, register_engine

__all__ = ["MegatronFSDPEngine", "ROLE_ATTR", "PLANNED_ROLES"]

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


@register_engine
class MegatronFSDPEngine(EngineAdapter):
    """A :class:`megatron_fsdp.MegatronFSDP` model."""

    name = "megatron_fsdp"
    address_hint = "Keep fsdp_double_buffer and fsdp_db_use_persist_buf_on_alloc_fail on."

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.engine: megatron_fsdp.MegatronFSDP = model
        self._units_by_module: Dict[int, Any] = {}

    @classmethod
    def recognizes(cls, model: nn.Module) -> bool:
        return isinstance(model, megatron_fsdp.MegatronFSDP)

    @classmethod
    def plan_bare_hooks(cls, saved: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
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
        unit = self.engine.unit_of(module)
        if unit is not None:
            self._units_by_module[id(unit.module)] = unit
        return unit

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
        e = self.engine
        if not (e.fsdp_double_buffer and e.fsdp_db_use_persist_buf_on_alloc_fail):
            raise ValueError(
                f"partial CUDA graphs under megatron_fsdp need fsdp_double_buffer=True and "
                f"fsdp_db_use_persist_buf_on_alloc_fail=True (the model has {e.fsdp_double_buffer} and "
                f"{e.fsdp_db_use_persist_buf_on_alloc_fail}): replay needs parameters at fixed "
                "addresses; pass both to fully_shard"
            )

    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        # Parameters by their name in ``module``; then the owning unit's gradient buffer, read live (the engine
        # may rebind ``grad_buffer.tensor``), unless it is allocated on demand (then nothing can be pinned).
        out: List[Tuple[str, torch.Tensor]] = list(module.named_parameters())
        unit = self._unit(module)
        gb = unit.grad_buffer if unit is not None else None
        if gb is not None and gb.kind != "dynamic":
            out.append((f"gradient buffer of unit {unit.name}", gb.tensor))
        return out

    # -- 4. capture guard
    def simulated_capture(self) -> ContextManager[None]:
        return megatron_fsdp.simulated_capture()

    def capture_guard(self) -> ContextManager[None]:
        # A real capture of a partial graph runs no engine collective: the hooks are outside the graph. The
        # engine's own checks (is_capturing) see torch's capture state, so nothing more is entered here.
        return contextlib.nullcontext()

    # -- 5. step boundary
    def reset(self) -> None:
        self.engine.reset_step_state()

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
