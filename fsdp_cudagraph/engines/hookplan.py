"""Hook-plan helpers every adapter shares: the sentinel reader, TE's one-argument form, bare-module plans.

Phase 2 of the hook extraction in ``fsdp_cudagraph.hooks`` (see [Note: why two phases] there): an adapter's
``hook_plan`` calls :func:`read_sentinel` first for each hook, and :func:`adapt` to put an engine hook in TE's
``fn(module) -> None`` form. ``registry.plan_bare_hooks`` is phase 2 for a module no wrapped model is known for.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from fsdp_cudagraph.engines.contract import HOOK_DICTS, POST_SENTINEL, PRE_SENTINEL, HookPlan

__all__ = ["adapt", "read_sentinel", "sentinel_plan"]


def adapt(fn: Callable[..., Any], kind: str) -> Callable[[nn.Module], None]:
    """Turn an engine hook (``kind`` ``"pre"`` or ``"post"``) or inner handler (``"handler"``) into TE's form."""
    if kind == "handler":
        def run(module: nn.Module) -> None:
            fn(module)
    elif kind == "pre":
        def run(module: nn.Module) -> None:
            fn(module, ())
    else:
        def run(module: nn.Module) -> None:
            fn(module, (), None)
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def read_sentinel(hook: Any, hid: int, dict_name: str, plan: HookPlan) -> bool:
    """The reusable half of phase 2: plan a sentinel wrapper's inner handler and withhold the wrapper.

    Returns whether ``hook`` carried a sentinel. An engine's ``hook_plan`` calls it first for each hook and reads
    its own hooks (e.g. a role attribute) only when it returns False.
    """
    pre_handler = getattr(hook, PRE_SENTINEL, None)
    post_handler = getattr(hook, POST_SENTINEL, None)
    if pre_handler is not None:
        plan.capture_time["backward_pre_hooks"][hid] = adapt(pre_handler, "handler")
    elif post_handler is not None:
        plan.capture_time["backward_hooks"][hid] = adapt(post_handler, "handler")
    else:
        return False
    plan.withheld.append((dict_name, hid, hook))
    return True


def sentinel_plan(hook_dicts: Mapping[str, Mapping[int, Any]]) -> HookPlan:
    """Phase 2 knowing no engine: sentinel wrappers are planned, every other hook is unknown."""
    plan = HookPlan()
    for dict_name in HOOK_DICTS:
        for hid, hook in hook_dicts.get(dict_name, {}).items():
            if not read_sentinel(hook, hid, dict_name, plan):
                plan.unknown.append((dict_name, hid, hook))
    return plan
