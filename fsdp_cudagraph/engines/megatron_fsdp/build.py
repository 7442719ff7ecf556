"""How the checker, apps and benchmarks shard a model with this project's engine (``megatron_fsdp.fully_shard``).

The double buffer and persistent buffers are on (address-stable ZeRO-3); ``compute_dtype`` is its compute dtype,
main parameters stay fp32. Final parameters: full, gathered on every rank.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from fsdp_cudagraph.engines.build import EngineBuilder, MakeOptimizer, ShardedRun, UnitSpec, cpu_copy
from fsdp_cudagraph.engines.registry import register_builder

__all__ = ["BUILDER"]


def _build_megatron_fsdp(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                         device: torch.device, sharding_strategy: str,
                         compute_dtype: Optional[torch.dtype]) -> ShardedRun:
    from megatron_fsdp import fully_shard

    sharded = fully_shard(model, fsdp_unit_modules=unit_modules, sharding_strategy=sharding_strategy,
                          compute_dtype=compute_dtype, fsdp_double_buffer=True,
                          fsdp_db_use_persist_buf_on_alloc_fail=True)
    return ShardedRun(
        model=sharded, root=sharded.module, optimizer=make_optimizer(sharded.optimizer_parameters()),
        named_parameters=sharded.named_optimizer_parameters,
        # parameters and buffers: the modules' extra state (any object, None for megatron-core's) stays out
        final_parameters=lambda: {k: cpu_copy(v) for k, v in sharded.full_state_dict().items()
                                  if not k.endswith("_extra_state")},
        precision=f"compute in {sharded.compute_dtype}, fp32 main parameters and gradients, {sharding_strategy}",
    )


BUILDER = register_builder(EngineBuilder("megatron_fsdp", _build_megatron_fsdp, lambda device: None, True))
