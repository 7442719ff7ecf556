"""The pre-replay address check costs the same per layer at any depth.

One Gloo rank, ``megatron_fsdp`` with the double buffer, whole-layer partial graphs on the protocol backend.
Each graphed layer's check (its forward-pre hook) is called directly, as ``nn.Module.__call__`` calls it before
a replay, and the work it does is counted, not timed: the calls to ``nn.Module.named_modules`` and
``nn.Module.modules`` (a walk calls ``named_modules`` once per module it visits, so the count is the number of
modules walked) and to the engine's unit lookup. Before the replay probe each check walked the whole model
(``MegatronFSDP.unit_of`` rebuilt a name map per call): the work per layer grew with the depth.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import pytest
import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from megatron_fsdp import MegatronFSDP, fully_shard


@contextlib.contextmanager
def _counting() -> Iterator[Dict[str, int]]:
    """Count model walks (``named_modules``/``modules``, on any module) and unit lookups in the block."""
    counts = {"named_modules": 0, "modules": 0, "unit_of": 0}
    saved = {"named_modules": nn.Module.named_modules, "modules": nn.Module.modules, "unit_of": MegatronFSDP.unit_of}

    def counted(name, cls):
        fn = saved[name]

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)
        setattr(cls, name, wrapper)

    counted("named_modules", nn.Module)
    counted("modules", nn.Module)
    counted("unit_of", MegatronFSDP)
    try:
        yield counts
    finally:
        nn.Module.named_modules = saved["named_modules"]
        nn.Module.modules = saved["modules"]
        MegatronFSDP.unit_of = saved["unit_of"]


def _captured(num_layers: int):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden_size=16, num_heads=2, ffn_hidden_size=32, num_layers=num_layers)
    gpt = GPT(cfg)
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[]),
                               backend="protocol")
    x, y = synthetic_batch(0, 2, cfg, torch.device("cpu"))
    loss_fn(model(x), y).backward()
    graphs.capture()
    return model, graphs


def _checks(graphs: PartialCudaGraphs) -> List:
    """Each graphed callable's pre-replay address check, as registered on its module."""
    out = []
    for c, h in zip(graphs._order, graphs._checks):
        out.append((c.module, c.module._forward_pre_hooks[h.id]))
    return out


def _work_per_step(num_layers: int) -> Dict[str, int]:
    model, graphs = _captured(num_layers)
    checks = _checks(graphs)
    assert len(checks) == num_layers
    with _counting() as counts:
        for module, check in checks:
            check(module, ())
    graphs.delete()
    return counts


def test_the_address_check_costs_the_same_per_layer_at_any_depth(one_rank_group):
    shallow, deep = _work_per_step(8), _work_per_step(64)
    per_layer_8, per_layer_64 = sum(shallow.values()) / 8, sum(deep.values()) / 64
    assert per_layer_64 <= 2 * per_layer_8, (shallow, deep)
    # What the probe achieves: no walk and no unit lookup at all on the replay path.
    assert deep == {"named_modules": 0, "modules": 0, "unit_of": 0}, deep


def test_a_moved_parameter_is_still_refused(one_rank_group):
    model, graphs = _captured(2)
    (module, check), _ = _checks(graphs)
    check(module, ())  # unchanged: passes
    weight = next(module.parameters())
    saved = weight.data
    weight.data = weight.data.clone()  # the engine's buffer no longer backs it
    with pytest.raises(RuntimeError, match=r"graphed callable layers\.0 \(unit layers\.0\) would replay with parameter"):
        check(module, ())
    weight.data = saved
    check(module, ())
    graphs.delete()
