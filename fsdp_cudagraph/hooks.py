"""Two-phase hook extraction: take a module's hooks off for capture, hand TE what it accepts, restore exactly.

[Note: why two phases]
Graph makers refuse modules with hooks, but FSDP's communication lives in hooks. Phase 1 copies every
hook dict of a callable (and the ``*_with_kwargs`` / ``always_called`` flags) into a restore copy that
nothing else touches, and clears the module. Phase 2 reads that copy: a hook that carries one of the
engine's sentinels (``_cuda_graph_backward_pre_handler``, ``_cuda_graph_backward_handler``) only
*registers* a backward handler on tensors, which a capture cannot use, so the wrapper is withheld and its
inner handler goes under TE's ``backward_pre_hooks`` / ``backward_hooks`` keys; the engine's plain
pre-forward / post-forward hooks go under ``forward_pre_hooks`` / ``forward_hooks``, adapted to TE's
``fn(module) -> None`` form (which hooks those are, only the engine knows: its adapter's ``hook_plan`` in
``engines/`` decides, calling the contract's ``read_sentinel`` first). The engine's other hooks (e.g. call
guards) are ``engine_only``. Any other hook is unknown: it is restored like the rest (so it fires around
each replay, outside the graph) and reported, never dropped, but not run at capture time, because its
arguments (the real inputs and outputs) do not exist there.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, OrderedDict, Tuple

from torch import nn

# The sentinels and their reader are part of the engine contract (an adapter calls read_sentinel); re-exported.
from fsdp_cudagraph.engines.contract import HOOK_DICTS, HOOK_KEYS, POST_SENTINEL, PRE_SENTINEL, HookPlan
from fsdp_cudagraph.engines.hookplan import adapt, read_sentinel, sentinel_plan
from fsdp_cudagraph.engines.registry import plan_bare_hooks

__all__ = ["HOOK_KEYS", "HOOK_DICTS", "ExtractedHooks", "extract_hooks", "restore_hooks", "hooks_snapshot", "read_sentinel",
           "sentinel_plan", "adapt", "PRE_SENTINEL", "POST_SENTINEL"]


_DICTS = HOOK_DICTS
_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

@dataclasses.dataclass(kw_only=True)
class ExtractedHooks(HookPlan):
    """The hooks taken off one module: the engine's :class:`HookPlan` of them (``capture_time``, ``withheld``,
    ``unknown``, ``engine_only``) and the untouched restore copy."""

    module: nn.Module
    #: Exact copies of the module's hook dicts and flag dicts (same objects, ids, order).
    saved: Dict[str, "OrderedDict[int, Any]"]


def hooks_snapshot(module: nn.Module) -> Dict[str, List[Tuple[int, Any]]]:
    """A comparable picture of a module's hooks: per dict, the (id, hook object) pairs in order."""
    return {name: list(getattr(module, name).items()) for name in _DICTS + _FLAGS}


def extract_hooks(module: nn.Module, hook_plan: Optional[Callable[[Mapping[str, Mapping[int, Any]]], HookPlan]] = None
                  ) -> ExtractedHooks:
    """Phase 1 (copy and clear) then phase 2 (reroute) for one callable.

    ``hook_plan``: phase 2, e.g. an :class:`EngineAdapter`'s ``hook_plan``. Default: the plan of the registered
    engine that recognises these hooks (``engines.registry.plan_bare_hooks``), else :func:`sentinel_plan`.
    """
    saved: Dict[str, "OrderedDict[int, Any]"] = {}
    for name in _DICTS + _FLAGS:
        saved[name] = collections.OrderedDict(getattr(module, name))
    for name in _DICTS + _FLAGS:
        getattr(module, name).clear()
    plan = hook_plan(saved) if hook_plan is not None else (plan_bare_hooks(saved) or sentinel_plan(saved))
    return ExtractedHooks(module=module, saved=saved, **{f.name: getattr(plan, f.name) for f in dataclasses.fields(HookPlan)})


def restore_hooks(extracted: ExtractedHooks) -> None:
    """Put back exactly what :func:`extract_hooks` took, before any hook registered since (if any)."""
    m = extracted.module
    for name, content in extracted.saved.items():
        live = getattr(m, name)
        later = list(live.items())
        live.clear()
        live.update(content)
        for k, v in later:
            live[k] = v
