"""Callable selection by tag: a ``cuda_graph_module`` tag counts on the instance as well as on the class."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_cudagraph import CudaGraphConfig
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.graphs.partial import select_modules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


def _model() -> nn.Module:
    return nn.Sequential(Block(), Block())


def test_instance_tags_select_those_instances_only():
    model = _model()
    model[0].attn.cuda_graph_module = "attn"   # what the README's "tag" means for a model one cannot edit
    model[1].mlp.cuda_graph_module = "mlp"
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"])
    assert [n for n, _ in select_modules(adapter_for(model), cfg)] == ["0.attn", "1.mlp"]


def test_class_tags_still_count_and_instance_tags_override():
    class Tagged(nn.Linear):
        cuda_graph_module = "mlp"

    model = nn.Sequential(Tagged(4, 4), Tagged(4, 4))
    model[1].cuda_graph_module = "attn"
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["mlp"])
    assert [n for n, _ in select_modules(adapter_for(model), cfg)] == ["0"]


def test_missing_tag_names_classes_or_instances():
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["attn"])
    with pytest.raises(ValueError, match=r"\['attn'\].*classes or instances"):
        select_modules(adapter_for(_model()), cfg)
