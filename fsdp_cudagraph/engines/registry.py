"""The registry of engines: which adapter answers for a model. The one registry (the checker reads it too).

[Note: one adapter per model]
A graph kind's entry point asks :func:`adapter_for` once and hands the adapter to everything it builds (the
offloader, the selection), so the pieces of one graph kind agree by construction. An adapter may hold state
between their questions (FSDP2's units forwarded at capture time whose backward is pending; the units and
replay probes resolved at capture), and a user may build two graph kinds over one model; so the registry also
hands back the adapter it built before while anything still holds it. The cache is a ``WeakValueDictionary``
keyed on ``id(model)``: the adapter references its model, so a live entry keeps the model (and its id) alive,
and an entry vanishes with the last holder of its adapter. (A ``WeakKeyDictionary`` keyed on the model would
keep every model alive forever: its value, the adapter, holds the key.)

Each engine folder (``megatron_fsdp/``, ``fsdp2/``, ``nvidia/``) registers its adapter when imported, and its
builder (how the checker, apps and benchmarks shard a model with it) with :func:`register_builder`.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from torch import nn

from fsdp_cudagraph.engines.contract import EngineAdapter, HookPlan
from fsdp_cudagraph.engines.plain import PlainModule

__all__ = ["adapter_for", "register_engine", "registered_engines", "root_of", "unavailable_engines", "plan_bare_hooks",
           "register_builder", "engine_builder", "registered_builders"]

if TYPE_CHECKING:
    from fsdp_cudagraph.engines.build import EngineBuilder

_ENGINES: List[type] = []
#: engine name -> how to shard a model with it (``<engine>/build.py``), in registration order.
_BUILDERS: Dict[str, "EngineBuilder"] = {}
_ADAPTERS: "weakref.WeakValueDictionary[int, EngineAdapter]" = weakref.WeakValueDictionary()


def register_engine(cls: type) -> type:
    """Add an :class:`EngineAdapter` subclass to the registry (usable as a class decorator)."""
    if cls not in _ENGINES:
        _ENGINES.append(cls)
    return cls


def register_builder(builder: "EngineBuilder") -> "EngineBuilder":
    """Add an engine's builder (``engines/build.py``'s :class:`EngineBuilder`) under its name; returns it."""
    _BUILDERS[builder.name] = builder
    return builder


def registered_builders() -> Dict[str, "EngineBuilder"]:
    """Engine name -> its builder (the checker's ``--engine`` choices), in registration order."""
    _load_builtin()
    return dict(_BUILDERS)


def engine_builder(name: str, device: Any) -> "EngineBuilder":
    """The builder of engine ``name``, refusing an unknown name (ValueError) or an engine that cannot run on
    ``device`` here (ImportError for a missing package, RuntimeError otherwise), before any work."""
    _load_builtin()
    if name not in _BUILDERS:
        if name in _UNAVAILABLE:  # a built-in engine whose folder failed to import: its reason names the fix
            raise ImportError(f"engine={name!r} cannot be loaded here: {_UNAVAILABLE[name]}")
        raise ValueError(f"engine={name!r} is not one of {sorted(_BUILDERS)}; megatron_fsdp (this project's engine), "
                         "fsdp2 (torch.distributed.fsdp.fully_shard) or nvidia (NVIDIA Megatron-FSDP, megatron-core)")
    builder = _BUILDERS[name]
    why = builder.unavailable(device)
    if why is not None:
        others = ", ".join(n for n in _BUILDERS if n != name)
        raise type(why)(f"engine={name!r} cannot run here: {why}. Fix: {builder.fix}; or check with another "
                        f"engine ({others})")
    return builder


def registered_engines() -> List[type]:
    _load_builtin()
    return list(_ENGINES)


def adapter_for(model: nn.Module) -> EngineAdapter:
    """The adapter of the engine that wraps ``model`` (the same one while anything holds it); for a model no
    engine wraps, the plain-module adapter (``engines/plain.py``).

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
    adapter = PlainModule(model, bare_hook_plan=plan_bare_hooks)
    _ADAPTERS[id(model)] = adapter
    return adapter


def plan_bare_hooks(hooks: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
    """The plan of the first registered engine whose ``bare_hook_plan`` recognises any of these hooks, or None
    (phase 2 of the hook extraction for a module no wrapped model is known for)."""
    for cls in registered_engines():
        plan = cls.bare_hook_plan(hooks)
        if plan is not None and plan.claims_any():
            return plan
    return None


def root_of(model: nn.Module) -> nn.Module:
    """The user's module tree under whatever registered engine wraps ``model`` (``model`` itself if none does)."""
    return adapter_for(model).root


_LOADED = False
#: engine module -> why it could not be imported (a missing optional dependency); see _load_builtin.
_UNAVAILABLE: Dict[str, str] = {}


def unavailable_engines() -> Dict[str, str]:
    """Built-in engine modules that failed to import, with the reason (e.g. a missing optional dependency)."""
    _load_builtin()
    return dict(_UNAVAILABLE)


def _load(name: str) -> None:
    # importlib, not an import statement: an engine folder imports this registry, and the registry must not
    # import it back (tests/unit/test_layout.py forbids the circle). A missing dependency disables one engine only.
    try:
        importlib.import_module(f"fsdp_cudagraph.engines.{name}")
    except ImportError as exc:
        _UNAVAILABLE[name] = f"{type(exc).__name__}: {exc}"


def _load_builtin() -> None:
    """Import the engine folders once (each registers its adapter and its builder)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    # The folders register their adapter and builder on import; one line per engine folder.
    _load("megatron_fsdp")
    _load("fsdp2")
    _load("nvidia")  # imports nothing of megatron: recognises NVIDIA's classes by name
