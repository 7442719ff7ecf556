"""The registry of engines: which adapter answers for a model, one adapter per model.

[Note: one adapter per model]
Partial graphs, their offloader and ``match_graph_attention`` all ask :func:`adapter_for` about the same
model, and an adapter may hold state between their questions (FSDP2's units forwarded at capture time
whose backward is pending; the units and replay probes resolved at capture). So the registry hands back
the adapter it built before while anything still holds it. The cache is a ``WeakValueDictionary`` keyed on
``id(model)``: the adapter references its model, so a live entry keeps the model (and its id) alive, and
an entry vanishes with the last holder of its adapter. (A ``WeakKeyDictionary`` keyed on the model would
keep every model alive forever: its value, the adapter, holds the key.)
"""

from __future__ import annotations

import importlib
import weakref
from typing import Dict, List, Optional

from torch import nn

from fsdp_cudagraph.engines.contract import EngineAdapter

__all__ = ["adapter_for", "register_engine", "registered_engines", "root_of", "unavailable_engines"]

_ENGINES: List[type] = []
_ADAPTERS: "weakref.WeakValueDictionary[int, EngineAdapter]" = weakref.WeakValueDictionary()


def register_engine(cls: type) -> type:
    """Add an :class:`EngineAdapter` subclass to the registry (usable as a class decorator)."""
    if cls not in _ENGINES:
        _ENGINES.append(cls)
    return cls


def registered_engines() -> List[type]:
    _load_builtin()
    return list(_ENGINES)


def adapter_for(model: nn.Module) -> Optional[EngineAdapter]:
    """The adapter of the engine that wraps ``model`` (the same one while anything holds it), or None for a
    model no engine wraps.

    Raises ValueError for a module an engine wraps *inside* its wrapper (a unit's or the root's inner module):
    graphs of it would bypass the engine's hooks; the message names the object to pass.
    """
    cached = _ADAPTERS.get(id(model))
    if cached is not None and cached.model is model:
        return cached
    engines = registered_engines()
    for cls in engines:
        if cls.recognizes(model):
            adapter = cls(model)
            _ADAPTERS[id(model)] = adapter
            return adapter
    for cls in engines:
        wrapper = cls.wrapper_of(model)
        if wrapper is not None:
            raise ValueError(
                f"fsdp_cudagraph: {type(model).__name__} is a module that {cls.name} wraps, not the wrapper: pass "
                f"{wrapper}, not its inner module {type(model).__name__} (graphs of the inner module would run "
                "without the engine's gathers and reductions)")
    return None


def root_of(model: nn.Module) -> nn.Module:
    """The user's module tree under whatever registered engine wraps ``model`` (``model`` itself if none does)."""
    adapter = adapter_for(model)
    return adapter.root if adapter is not None else model


_LOADED = False
#: engine module -> why it could not be imported (a missing optional dependency); see _load_builtin.
_UNAVAILABLE: Dict[str, str] = {}


def unavailable_engines() -> Dict[str, str]:
    """Built-in engine modules that failed to import, with the reason (e.g. a missing optional dependency)."""
    _load_builtin()
    return dict(_UNAVAILABLE)


def _load(name: str) -> None:
    # importlib, not an import statement: an engine module imports this registry, and the registry must not
    # import it back (tests/unit/test_layout.py forbids the circle). A missing dependency disables one engine only.
    try:
        importlib.import_module(f"fsdp_cudagraph.engines.{name}")
    except ImportError as exc:
        _UNAVAILABLE[name] = f"{type(exc).__name__}: {exc}"


def _load_builtin() -> None:
    """Import the engine modules of this folder once (each registers itself)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    # The modules register themselves on import; one line per engine module of this folder.
    _load("megatron_fsdp")
    _load("fsdp2")
    _load("nvidia_megatron_fsdp")  # imports nothing of megatron: recognises NVIDIA's classes by name
