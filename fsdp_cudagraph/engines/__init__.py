"""Engines as the graph layer sees them: the contract, the registry, one folder per engine.

The only folder of the library that imports an engine (``megatron_fsdp``, torch FSDP2 internals, megatron-core
objects). ``contract.py`` is the door ([Note: the engine contract]): :class:`EngineAdapter` and the two roles an
engine may implement, :class:`PerLayerEngine` and :class:`StaticStepEngine`. ``registry.py`` picks the adapter
(``adapter_for``: always one; ``plain.py``'s for an unwrapped module) and the builder (``engine_builder``).
``hookplan.py`` holds the hook-plan helpers the adapters share; ``build.py`` the builders' shared types. Each engine
folder (``megatron_fsdp/``, ``fsdp2/``, ``nvidia/``) holds its adapter and its builder; ``fsdp2/storage.py`` the
user-facing storage options (``keep_unsharded_storage``, ``use_unsharded_slots``, exported by ``fsdp_cudagraph``).
"""

from fsdp_cudagraph.engines.contract import (FORWARD_ONLY_BUFFERS, HOOK_DICTS, HOOK_KEYS, PER_LAYER_BUFFERS,
                                             POST_SENTINEL, PRE_SENTINEL, EngineAdapter, HookPlan, PerLayerEngine,
                                             StaticStepEngine, per_layer_engine, static_step_engine)
from fsdp_cudagraph.engines.hookplan import adapt, read_sentinel, sentinel_plan
from fsdp_cudagraph.engines.plain import PlainModule
from fsdp_cudagraph.engines.registry import (adapter_for, engine_builder, plan_bare_hooks, register_builder,
                                             register_engine, registered_builders, registered_engines, root_of,
                                             unavailable_engines)

__all__ = ["EngineAdapter", "PerLayerEngine", "StaticStepEngine", "per_layer_engine", "static_step_engine",
           "PlainModule", "HookPlan", "HOOK_KEYS", "HOOK_DICTS", "PRE_SENTINEL", "POST_SENTINEL", "PER_LAYER_BUFFERS",
           "FORWARD_ONLY_BUFFERS", "adapter_for", "register_engine", "registered_engines", "root_of",
           "unavailable_engines", "register_builder", "engine_builder", "registered_builders", "plan_bare_hooks",
           "read_sentinel", "sentinel_plan", "adapt"]
