"""fsdp_cudagraph: per-layer (partial) CUDA graphs under the megatron_fsdp sharded data-parallel engine.

The engine's communication lives in module hooks, which graph makers refuse. This package takes the hooks
off the callables it captures, runs the engine's handlers around warmup and capture (never inside a
graph), restores them exactly so that they fire around every replay, and checks before each replay that
the parameters sit where they sat at capture. See :class:`PartialCudaGraphs` and :class:`CudaGraphConfig`.
"""

# Before any process group exists, so that its functions' ``group=group.WORLD`` defaults do not pin the world group
# past destroy_process_group() (an abort at exit): [Note: the engine does not keep its group alive] in
# megatron_fsdp/_fully_shard.py. The engine is imported lazily by some entry points, after init_process_group.
import torch.distributed.nn.functional  # noqa: F401, I001

from fsdp_cudagraph.graphs.full_iteration import FULL_ITERATION_BACKENDS, FullIterationCudaGraph, FullIterationReport
from fsdp_cudagraph.graphs.inference import INFERENCE_BACKENDS, GraphLimitWarning, InferenceCapture, InferenceCudaGraphs
from fsdp_cudagraph.graphs.length_buckets import BucketReplayConflictWarning, LengthArg, LengthBucketGraphs, LengthBucketsReport
from fsdp_cudagraph.graphs.partial import BACKENDS, CaptureReport, PartialCudaGraphs, match_graph_attention
from fsdp_cudagraph.hooks import extract_hooks, hooks_snapshot, restore_hooks
from fsdp_cudagraph.engines.fsdp2.storage import (keep_unsharded_storage, release_unsharded_slots,
                                                  release_unsharded_storage, use_unsharded_slots)
from fsdp_cudagraph.offload.offloader import ActivationOffloader
from fsdp_cudagraph.capture.args import SignatureChangedWarning
from fsdp_cudagraph.capture.attention import ATTENTION_POLICIES, AttentionBackendMatcher
from fsdp_cudagraph.capture.capture_safety import HostSyncError
from fsdp_cudagraph.capture.fp8 import FP8_RECIPES, FP8Recipe
from fsdp_cudagraph.capture.streams import use_side_stream
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON, TE_VERSION
from fsdp_cudagraph.config import (
    CudaGraphConfig,
    CudaGraphImpl,
    CudaGraphModule,
    InferenceCudaGraphScope,
    add_cuda_graph_args,
    config_from_args,
)

__all__ = [
    "PartialCudaGraphs",
    "FullIterationCudaGraph",
    "FullIterationReport",
    "FULL_ITERATION_BACKENDS",
    "InferenceCudaGraphs",
    "InferenceCapture",
    "INFERENCE_BACKENDS",
    "GraphLimitWarning",
    "ActivationOffloader",
    "LengthBucketGraphs",
    "LengthArg",
    "LengthBucketsReport",
    "BucketReplayConflictWarning",
    "HostSyncError",
    "FP8Recipe",
    "FP8_RECIPES",
    "CaptureReport",
    "BACKENDS",
    "SignatureChangedWarning",
    "match_graph_attention",
    "AttentionBackendMatcher",
    "ATTENTION_POLICIES",
    "use_side_stream",
    "CudaGraphConfig",
    "CudaGraphImpl",
    "CudaGraphModule",
    "InferenceCudaGraphScope",
    "add_cuda_graph_args",
    "config_from_args",
    "extract_hooks",
    "restore_hooks",
    "hooks_snapshot",
    "keep_unsharded_storage",
    "release_unsharded_storage",
    "use_unsharded_slots",
    "release_unsharded_slots",
    "HAS_TE",
    "TE_REASON",
    "TE_VERSION",
    "check_alignment",
    "ModelSpec",
    "AlignmentReport",
]

_CHECK_NAMES = ("check_alignment", "ModelSpec", "AlignmentReport")


def __getattr__(name: str):
    # The checker loads on first use, so that `python -m fsdp_cudagraph.check` runs a module not yet imported.
    if name in _CHECK_NAMES:
        from fsdp_cudagraph.checker import check

        return getattr(check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
