"""How the checker, apps and benchmarks shard a model with this project's engine (``megatron_fsdp.fully_shard``).

The double buffer and persistent buffers are on (address-stable ZeRO-3); ``compute_dtype`` is its compute dtype,
main parameters stay fp32. Final parameters: full, gathered on every rank.

Expert parallelism (``expert_groups``, the factory's ``ModelSpec.expert_groups``): the groups go to
``fully_shard(expert_parallel_group=, expert_data_parallel_group=)``, which checks that they tile the ranks as
a grid ([Note: expert parallelism] in ``megatron_fsdp/_expert.py``). The final parameters are then each
rank's full parameters under ``summon_full_params()`` (dense ones and this rank's local experts, gathered over
the expert-data-parallel group), compared rank by rank: ``full_state_dict()`` refuses a model whose EP ranks
give their different local experts one name (megatron-core's ``local_experts.0`` on every EP rank).

Options (``engine_options``): ``keep_compute_shard`` (default False): ``fully_shard(keep_compute_shard=True)``, a
compute-dtype copy of the shards cast once a step instead of at every gather ([Note: cast on gather] in
``megatron_fsdp/_unit.py``).

Tensor parallelism (``tensor_groups``, the factory's ``ModelSpec.tensor_groups``): ``fully_shard(process_group=dp,
tensor_parallel_group=tp)`` ([Note: tensor parallelism] in ``megatron_fsdp/_tensor.py``); the final parameters
are then this rank's TP slice, full over the data-parallel group, compared rank by rank.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.engines.build import EngineBuilder, MakeOptimizer, ShardedRun, UnitSpec, cpu_copy
from fsdp_cudagraph.engines.registry import register_builder

__all__ = ["BUILDER"]


def _build_megatron_fsdp(model: nn.Module, *, unit_modules: Sequence[UnitSpec], make_optimizer: MakeOptimizer,
                         device: torch.device, sharding_strategy: str,
                         compute_dtype: Optional[torch.dtype],
                         expert_groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None,
                         tensor_groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None,
                         options: Optional[Dict[str, Any]] = None) -> ShardedRun:
    from megatron_fsdp import fully_shard

    keep = bool((options or {}).get("keep_compute_shard", False))

    ep = {} if expert_groups is None else dict(expert_parallel_group=expert_groups[0],
                                                 expert_data_parallel_group=expert_groups[1])
    tp = {} if tensor_groups is None else dict(tensor_parallel_group=tensor_groups[0], process_group=tensor_groups[1])
    sharded = fully_shard(model, fsdp_unit_modules=unit_modules, sharding_strategy=sharding_strategy,
                          compute_dtype=compute_dtype, fsdp_double_buffer=True,
                          fsdp_db_use_persist_buf_on_alloc_fail=True, keep_compute_shard=keep, **ep, **tp)

    def final() -> Dict[str, torch.Tensor]:
        if sharded.expert_parallel_group is None:
            # parameters and buffers: the modules' extra state (any object, None for megatron-core's) stays out
            return {k: cpu_copy(v) for k, v in sharded.full_state_dict().items() if not k.endswith("_extra_state")}
        with sharded.summon_full_params():  # dense parameters and this rank's local experts, full
            return {n: cpu_copy(p).clone() for n, p in sharded.module.named_parameters()}

    ep_text = (f", expert parallel {sharded.expert_parallel_size} (experts sharded over the "
               f"{dist.get_world_size(sharded.expert_data_parallel_group)}-rank expert-data-parallel group)"
               if ep else "")
    if tp:
        ep_text += (f", tensor parallel {dist.get_world_size(tensor_groups[0])} (data-parallel group of "
                    f"{dist.get_world_size(tensor_groups[1])})")
    if keep:
        ep_text += ", a compute-dtype copy of the shards kept (cast once a step)"
    return ShardedRun(
        model=sharded, root=sharded.module, optimizer=make_optimizer(sharded.optimizer_parameters()),
        named_parameters=sharded.named_optimizer_parameters, final_parameters=final,
        precision=(f"compute in {sharded.compute_dtype}, fp32 main parameters and gradients, "
                   f"{sharding_strategy}{ep_text}"),
    )


BUILDER = register_builder(EngineBuilder("megatron_fsdp", _build_megatron_fsdp, lambda device: None, True,
                                            options=("keep_compute_shard",), tensor_parallel=True))
