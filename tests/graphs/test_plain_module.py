"""Graph kinds over a module no engine wraps: its adapter (``engines/plain.py``), no process group, no GPU.

The plain-module adapter answers the per-layer questions from the module alone (no units, its parameters as
replay tensors); graph kinds hold no "no engine" branch. Also: ``capture()`` after ``delete()`` names the real fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph, PartialCudaGraphs
from fsdp_cudagraph.engines.contract import PerLayerEngine, StaticStepEngine
from fsdp_cudagraph.engines.plain import PlainModule
from fsdp_cudagraph.engines.registry import adapter_for


class Block(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _cfg(**kw) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["mlp"], **kw)


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 4)).sum().backward()


def test_the_plain_adapter_answers_from_the_module():
    model = _model()
    adapter = adapter_for(model)
    assert isinstance(adapter, PlainModule) and isinstance(adapter, PerLayerEngine)
    assert not isinstance(adapter.static_step(), StaticStepEngine)
    assert adapter.root is model and adapter.unit_modules() == [] and adapter.unit_of(model[0]) is None
    assert [n for n, _ in adapter.replay_tensors(model[0])] == ["fc.weight", "fc.bias"]
    assert adapter.replay_probe(model[0])() == tuple(p.data_ptr() for p in model[0].parameters())


def test_partial_graphs_of_a_plain_module_check_addresses_through_the_probe():
    model = _model()
    graphs = PartialCudaGraphs(model, _cfg(), backend="protocol")
    _step(model)
    graphs.capture()
    _step(model)  # replays: nothing moved
    model[1].fc.weight.data = model[1].fc.weight.data.clone()  # moves a parameter a replay reads
    with pytest.raises(RuntimeError, match=r"graphed callable 1 \(unit -\) would replay with parameter fc.weight at"):
        _step(model)
    graphs.delete()


def test_whole_layers_need_units():
    with pytest.raises(ValueError, match=r"cuda_graph_modules=\[\] \(whole layers\) needs a sharded model"):
        PartialCudaGraphs(_model(), CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[]), backend="protocol")


def test_a_whole_step_graph_names_the_plain_module_and_itself():
    with pytest.raises(NotImplementedError, match="FullIterationCudaGraph needs an engine with a static step; the model "
                                                  "has none"):
        FullIterationCudaGraph(_model(), lambda m, x: m(x).sum(), CudaGraphConfig(cuda_graph_impl="full_iteration"),
                               backend="protocol")


@pytest.mark.parametrize("captured", [True, False])
def test_capture_after_delete_names_the_fix(captured):
    model = _model()
    graphs = PartialCudaGraphs(model, _cfg(), backend="protocol")
    _step(model)
    if captured:
        graphs.capture()
    graphs.delete()
    _step(model)  # eager steps ran: the old message ("run at least one eager training step") was wrong
    with pytest.raises(RuntimeError, match=r"capture\(\) after delete\(\).*build a new PartialCudaGraphs"):
        graphs.capture()
