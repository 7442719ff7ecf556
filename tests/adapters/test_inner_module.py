"""Every graph kind refuses, at build, an engine's inner module instead of the engine's wrapper.

Graphs of ``fully_shard(gpt)``'s inner ``gpt`` (or of one of its units) would run without the engine's
gathers and reductions: before the registry refused it, a plain-module reading accepted it and the capture
failed much later ("unit is IDLE, call the unit itself"). One Gloo rank; nothing is captured.

FSDP2 has no such confusion (``fully_shard`` returns the module it was given, re-classed). NVIDIA's
Megatron-FSDP's inner module is refused the same way (``test_nvidia.py``, where its stand-in engine is built).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph, InferenceCudaGraphs, LengthBucketGraphs, PartialCudaGraphs
from fsdp_cudagraph.capture.buckets import Buckets
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn
from fsdp_cudagraph.engines import adapter_for
from fsdp_cudagraph.engines.plain import PlainModule
from megatron_fsdp import fully_shard


@pytest.fixture
def sharded(one_rank_group):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden_size=16, num_heads=2, ffn_hidden_size=32, num_layers=2))
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    return model, gpt


_PARTIAL = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[])
_BUILDS = {
    "PartialCudaGraphs": lambda m: PartialCudaGraphs(m, _PARTIAL, backend="protocol"),
    "LengthBucketGraphs": lambda m: LengthBucketGraphs(m, _PARTIAL, buckets=[8], length_args={"x": 1},
                                                       backend="protocol"),
    "FullIterationCudaGraph": lambda m: FullIterationCudaGraph(
        m, lambda model, x, y: loss_fn(model(x), y), CudaGraphConfig(cuda_graph_impl="full_iteration"),
        backend="protocol"),
    "InferenceCudaGraphs": lambda m: InferenceCudaGraphs(
        m, CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope="block"),
        batch_buckets=Buckets([2]), backend="protocol"),
}


@pytest.mark.parametrize("kind", sorted(_BUILDS))
def test_each_graph_kind_refuses_the_inner_module_at_build(sharded, kind):
    model, gpt = sharded
    for inner, name in ((gpt, "GPT"), (gpt.layers[0], type(gpt.layers[0]).__name__)):
        with pytest.raises(ValueError) as err:
            _BUILDS[kind](inner)
        msg = str(err.value)
        assert "pass the object fully_shard returned (MegatronFSDP around GPT)" in msg, msg
        assert f"not its inner module {name}" in msg, msg


def test_the_wrapper_is_accepted_and_has_one_adapter(sharded):
    model, gpt = sharded
    graphs = PartialCudaGraphs(model, _PARTIAL, backend="protocol")
    assert adapter_for(model) is graphs.engine  # one adapter per model while anything holds it
    graphs.delete()
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert isinstance(adapter_for(plain), PlainModule)  # a module no engine wraps stays a plain module
