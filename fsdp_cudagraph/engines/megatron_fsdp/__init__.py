"""This project's engine, ``megatron_fsdp``: its adapter (``adapter.py``) and its builder (``build.py``)."""

from fsdp_cudagraph.engines.megatron_fsdp.build import BUILDER
from fsdp_cudagraph.engines.megatron_fsdp.adapter import MegatronFSDPEngine, PLANNED_ROLES, ROLE_ATTR, plan_hooks

__all__ = ["BUILDER", "MegatronFSDPEngine", "PLANNED_ROLES", "ROLE_ATTR", "plan_hooks"]
