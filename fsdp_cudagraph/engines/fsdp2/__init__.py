"""PyTorch FSDP2: its adapter (``adapter.py``), its address-stable storage (``storage.py``: the user-facing
``keep_unsharded_storage`` and ``use_unsharded_slots``, also exported by ``fsdp_cudagraph``) and its builder
(``build.py``: the one place that calls ``fully_shard``, always with a mesh on the model's device), expert
parallelism (``expert.py``: the dense and expert-data-parallel meshes, checks, the experts' divide factor) and
clipping over both meshes (``clip.py``)."""

from fsdp_cudagraph.engines.fsdp2.storage import (UnshardedSlots, keep_unsharded_storage, release_unsharded_slots,
                                                  release_unsharded_storage, slots_of, use_unsharded_slots)
from fsdp_cudagraph.engines.fsdp2.expert import ExpertLayout, expert_layout, fsdp2_expert_mesh
from fsdp_cudagraph.engines.fsdp2.build import BUILDER, fsdp2_mesh, fsdp2_shard, shard_fsdp2
from fsdp_cudagraph.engines.fsdp2.clip import clip_grad_norm_, grad_norm
from fsdp_cudagraph.engines.fsdp2.adapter import FSDP2Engine

__all__ = ["FSDP2Engine", "BUILDER", "shard_fsdp2", "fsdp2_shard", "fsdp2_mesh", "fsdp2_expert_mesh", "expert_layout",
           "ExpertLayout", "clip_grad_norm_", "grad_norm", "keep_unsharded_storage", "release_unsharded_storage",
           "use_unsharded_slots", "release_unsharded_slots", "UnshardedSlots", "slots_of"]
