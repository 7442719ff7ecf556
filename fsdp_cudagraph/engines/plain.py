"""The adapter for a module no engine wraps: no units, its parameters as replay tensors, nothing to guard.

``registry.adapter_for`` answers with it for any module no registered engine recognises, so every graph kind
talks to one adapter whatever the model is, and none of them keeps a "no engine" branch. It is a
:class:`PerLayerEngine` (per-layer graphs of a plain module work as before: the module's own parameters must
not move between capture and replay) and has no static step (whole-step graphs refuse it, naming it).

Hazards: a plain module has no units, so ``cuda_graph_modules=[]`` (graph the units) selects nothing and is
refused by the selection; its hooks are read by the registered engines' bare plans (a module an engine's
hooks sit on without its wrapper), else only the sentinels are planned.
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from fsdp_cudagraph.engines.contract import EngineAdapter, HookPlan, PerLayerEngine, ReplayProbe, parameter_slots
from fsdp_cudagraph.engines.hookplan import sentinel_plan

__all__ = ["PlainModule"]


class PlainModule(EngineAdapter, PerLayerEngine):
    """A module without an engine: the graph layer's questions answered by the module alone."""

    name = "the model"
    fp8_supported = True
    address_hint = ""

    def __init__(self, model: nn.Module, *,
                 bare_hook_plan: Callable[[Mapping[str, Mapping[int, Any]]], Optional[HookPlan]] = lambda _: None
                 ) -> None:
        super().__init__(model)
        #: The registered engines' reading of hooks on a bare module (``registry.plan_bare_hooks``), handed in by
        #: the registry, which imports this module (so this module cannot import it back).
        self._bare_hook_plan = bare_hook_plan

    @classmethod
    def recognizes(cls, model: nn.Module) -> bool:
        # Never picked from the registry's list: adapter_for falls back to it once no engine claims the model.
        return False

    @property
    def root(self) -> nn.Module:
        return self.model

    # -- 1. units: none
    def unit_modules(self) -> List[nn.Module]:
        return []

    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        return None

    # -- 2. hooks: a registered engine's bare plan when one claims them, else the sentinels only
    def hook_plan(self, hooks: Mapping[str, Mapping[int, Any]]) -> HookPlan:
        return self._bare_hook_plan(hooks) or sentinel_plan(hooks)

    # -- 3. what must not move: the module's own parameters
    def check_partial_graphs(self) -> None:
        """Nothing to refuse: no engine buffers, no engine settings."""

    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        return list(module.named_parameters())

    def replay_probe(self, module: nn.Module) -> ReplayProbe:
        # Resolved once: where each parameter is registered; each call reads data pointers only.
        slots = parameter_slots(module)

        def probe() -> Tuple[int, ...]:
            return tuple(d[n].data_ptr() for d, n in slots)
        return probe
