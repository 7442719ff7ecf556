"""NVIDIA Megatron-FSDP (megatron-core's bundled copy): its adapter (``adapter.py``), the reading of its hooks
(``hooks.py``) and its builder (``build.py``). Importing it imports nothing of megatron."""

from fsdp_cudagraph.engines.nvidia.build import BUILDER, NVIDIA_PIP
from fsdp_cudagraph.engines.nvidia.adapter import NvidiaMegatronFSDPEngine

__all__ = ["BUILDER", "NVIDIA_PIP", "NvidiaMegatronFSDPEngine"]
