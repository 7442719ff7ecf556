"""megatron_fsdp: a fully-sharded data-parallel engine in the vocabulary of NVIDIA's Megatron-FSDP.

Flat per-unit parameter and gradient buffers, asynchronous all-gather with prefetch, asynchronous
reduce-scatter, mixed precision with fp32 main parameters and gradients, address-stable double buffering
for CUDA-graph replay, full state dicts and torch.distributed.checkpoint state dicts (model and optimizer,
any world size), hybrid sharding (HSDP: ``fully_shard(mesh=(replicate, shard))``), expert parallelism
(``fully_shard(expert_parallel_size=EP)``: expert buckets sharded over the expert-data-parallel group), tensor
parallelism (``fully_shard(tensor_parallel_size=TP)``: a (dp, tp) grid, FSDP over the data-parallel group only),
global-norm clipping, frozen parameters and activation checkpointing. See :func:`fully_shard`.
"""

#: Which distribution this package is. NVIDIA's standalone ``megatron-fsdp`` has the same import name; the
#: library checks this line before it uses the engine ([Note: one import name, two packages] in
#: fsdp_cudagraph/engines/megatron_fsdp/__init__.py). Keep it on one line, as it is: it is read as text.
__distribution__ = "fsdp-cudagraph"

from ._common import CaptureGuardMode, ShardingStrategy, TrainingState, capture_guard, is_capturing, simulated_capture
from ._dcp import decode_extra_state
from ._expert import expert_parallel_groups
from ._fully_shard import MegatronFSDP, fully_shard
from ._tensor import tensor_parallel_groups
from ._unit import FSDPUnit

__all__ = [
    "fully_shard",
    "expert_parallel_groups",
    "tensor_parallel_groups",
    "MegatronFSDP",
    "FSDPUnit",
    "ShardingStrategy",
    "TrainingState",
    "is_capturing",
    "simulated_capture",
    "CaptureGuardMode",
    "capture_guard",
    "decode_extra_state",
]
