"""Engines as the graph layer sees them: the contract, the registry, one adapter module per engine.

The only folder of the library that imports an engine (``megatron_fsdp``, torch FSDP2 internals, megatron-core
objects). ``contract.py`` is the door ([Note: the engine contract]); ``registry.py`` picks the adapter
(``adapter_for``); ``hookplan.py`` holds the hook-plan helpers the adapters share.
"""

from fsdp_cudagraph.engines.contract import (FORWARD_ONLY_BUFFERS, HOOK_DICTS, HOOK_KEYS, PER_LAYER_BUFFERS,
                                             POST_SENTINEL, PRE_SENTINEL, EngineAdapter, HookPlan)
from fsdp_cudagraph.engines.hookplan import adapt, read_sentinel, sentinel_plan
from fsdp_cudagraph.engines.registry import (adapter_for, plan_bare_hooks, register_engine, registered_engines, root_of,
                                             unavailable_engines)

__all__ = ["EngineAdapter", "HookPlan", "HOOK_KEYS", "HOOK_DICTS", "PRE_SENTINEL", "POST_SENTINEL",
           "PER_LAYER_BUFFERS", "FORWARD_ONLY_BUFFERS", "adapter_for", "register_engine", "registered_engines",
           "root_of", "unavailable_engines", "plan_bare_hooks", "read_sentinel", "sentinel_plan", "adapt"]
