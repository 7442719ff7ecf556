"""Two-phase hook extraction: take a module's hooks off for capture, hand TE what it accepts, restore exactly.

[Note: why two phases]
Graph makers refuse modules with hooks, but FSDP's communication lives in hooks. Phase 1 copies every
hook dict of a callable (and the ``*_with_kwargs`` / ``always_called`` flags) into a restore copy that
nothing else touches, and clears the module. Phase 2 reads that copy: a hook that carries one of the
engine's sentinels (``_cuda_graph_backward_pre_handler``, ``_cuda_graph_backward_handler``) only
*registers* a backward handler on tensors, which a capture cannot use, so the wrapper is withheld and its
inner handler goes under TE's ``backward_pre_hooks`` / ``backward_hooks`` keys; the engine's plain
pre-forward / post-forward hooks go under ``forward_pre_hooks`` / ``forward_hooks``, adapted to TE's
``fn(module) -> None`` form. Any other hook is unknown: it is restored like the rest (so it fires around
each replay, outside the graph) and reported, never dropped, but not run at capture time, because its
arguments (the real inputs and outputs) do not exist there.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, List, OrderedDict, Tuple

from torch import nn

__all__ = ["HOOK_KEYS", "ExtractedHooks", "extract_hooks", "restore_hooks", "hooks_snapshot", "fsdp_handlers"]

#: TE's capture_time_hooks keys, in the order TE runs them in a step.
HOOK_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

PRE_SENTINEL = "_cuda_graph_backward_pre_handler"
POST_SENTINEL = "_cuda_graph_backward_handler"


@dataclasses.dataclass
class ExtractedHooks:
    """The hooks taken off one module: the untouched restore copy and the capture-time plan."""

    module: nn.Module
    #: Exact copies of the module's hook dicts and flag dicts (same objects, ids, order).
    saved: Dict[str, "OrderedDict[int, Any]"]
    #: TE-form capture-time hooks: key -> {hook_id: fn(module) -> None}.
    capture_time: Dict[str, Dict[int, Callable[[nn.Module], None]]]
    #: Hooks that were neither FSDP hooks nor sentinel wrappers: restored, reported, not run at capture.
    unknown: List[Tuple[str, int, Any]]
    #: Sentinel wrappers withheld from capture (their inner handlers run instead).
    withheld: List[Tuple[str, int, Any]]


def hooks_snapshot(module: nn.Module) -> Dict[str, List[Tuple[int, Any]]]:
    """A comparable picture of a module's hooks: per dict, the (id, hook object) pairs in order."""
    return {name: list(getattr(module, name).items()) for name in _DICTS + _FLAGS}


def _adapt(fn: Callable[..., Any], kind: str) -> Callable[[nn.Module], None]:
    """Turn an engine hook or inner handler into TE's one-argument form."""
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


def fsdp_handlers(hook_dicts: Dict[str, "OrderedDict[int, Any]"]) -> Tuple[Dict[str, Dict[int, Callable]], List, List]:
    """Phase 2 on a set of hook dicts: (capture-time plan, unknown hooks, withheld wrappers)."""
    plan: Dict[str, Dict[int, Callable]] = {k: {} for k in HOOK_KEYS}
    unknown: List[Tuple[str, int, Any]] = []
    withheld: List[Tuple[str, int, Any]] = []
    for dict_name in _DICTS:
        for hid, hook in hook_dicts.get(dict_name, {}).items():
            pre_handler = getattr(hook, PRE_SENTINEL, None)
            post_handler = getattr(hook, POST_SENTINEL, None)
            role = getattr(hook, "_megatron_fsdp_role", None)
            if pre_handler is not None:
                plan["backward_pre_hooks"][hid] = _adapt(pre_handler, "handler")
                withheld.append((dict_name, hid, hook))
            elif post_handler is not None:
                plan["backward_hooks"][hid] = _adapt(post_handler, "handler")
                withheld.append((dict_name, hid, hook))
            elif role == "pre_forward" and dict_name == "_forward_pre_hooks":
                plan["forward_pre_hooks"][hid] = _adapt(hook, "pre")
            elif role == "post_forward" and dict_name == "_forward_hooks":
                plan["forward_hooks"][hid] = _adapt(hook, "post")
            else:
                unknown.append((dict_name, hid, hook))
    return plan, unknown, withheld


def extract_hooks(module: nn.Module) -> ExtractedHooks:
    """Phase 1 (copy and clear) then phase 2 (reroute) for one callable."""
    saved: Dict[str, "OrderedDict[int, Any]"] = {}
    for name in _DICTS + _FLAGS:
        saved[name] = collections.OrderedDict(getattr(module, name))
    for name in _DICTS + _FLAGS:
        getattr(module, name).clear()
    plan, unknown, withheld = fsdp_handlers(saved)
    return ExtractedHooks(module=module, saved=saved, capture_time=plan, unknown=unknown, withheld=withheld)


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
