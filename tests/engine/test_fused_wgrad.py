"""Fused weight-gradient accumulation (TE's ``fuse_wgrad_accumulation``) under ``megatron_fsdp``, on Gloo.

TE is not on CPU machines, so ``ProtocolLinear`` (tests/engine/_fused_net.py) follows TE's protocol the way TE
2.20's ``Linear`` does
([Note: fused weight gradients] in ``megatron_fsdp/_fused_wgrad.py``): with ``fuse_wgrad_accumulation=True``
its backward calls ``weight.get_main_grad()`` (the weight has ``__fsdp_param__``), writes the weight gradient
there (overwriting when ``overwrite_main_grad``, else adding) and returns None for the weight. In fp32 the
fused and unfused runs compute the same GEMM, so the main gradients and the trained weights must be
``torch.equal``: with one and two ranks, every strategy, a module skipped at some steps (its gradient must be
zero, not the slot's stale bytes) and a weight that also gets an ordinary gradient. A module run twice in one
forward must raise, naming the weight.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo
from tests.engine._common import STRATEGY_CASES as STRATEGIES  # the five strategies, ZeRO-3 with and without double buffer
from tests.engine._fused_net import Block, Net

pytestmark = pytest.mark.gloo


def _train(rank: int, world: int, fuse: bool, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    net = Net(fuse)
    model = fully_shard(net, fsdp_unit_modules=[Block], **kwargs)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    grads: List[List[torch.Tensor]] = []
    for step in range(4):
        for layer in net.layers:
            layer.use_extra = step % 2 == 0
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, 6, generator=g), torch.randn(8, 5, 3, generator=g)
        per = 8 // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.optimizer_parameters()])
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "state": {k: v.clone() for k, v in model.full_state_dict().items()}}


def _job(rank: int, world: int) -> Dict[str, Any]:
    out = {}
    for name, kwargs in STRATEGIES.items():
        out[name] = (_train(rank, world, False, kwargs), _train(rank, world, True, kwargs))
    return out


def _twice_job(rank: int, world: int) -> str:
    torch.manual_seed(0)
    net = Net(True)
    model = fully_shard(net, fsdp_unit_modules=[Block])
    net.layers[1].twice = True
    try:
        model(torch.randn(2, 5, 6)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request) -> List[Dict[str, Any]]:
    return run_gloo(_job, request.param)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fused_weight_gradients_equal_the_unfused_ones(runs, strategy):
    for rank_result in runs:
        plain, fused = rank_result[strategy]
        assert len(plain["grads"]) == 4
        for step, (a, b) in enumerate(zip(plain["grads"], fused["grads"])):
            assert any(t.abs().sum() > 0 for t in a), f"step {step}: no gradient at all; the comparison is vacuous"
            for i, (ta, tb) in enumerate(zip(a, b)):
                assert torch.equal(ta, tb), f"step {step}: main gradient {i} differs (max {float((ta - tb).abs().max())})"
        for k in plain["state"]:
            assert torch.equal(plain["state"][k], fused["state"][k]), f"trained weight {k} differs"


def test_fused_weight_gradients_mark_the_weights_for_te():
    run = run_gloo(_marks_job, 1)[0]
    assert run == {"fc1.weight": True, "fc1.bias": False, "norm.weight": False, "head.weight": True}


def _marks_job(rank: int, world: int) -> Dict[str, bool]:
    net = Net(True)
    fully_shard(net, fsdp_unit_modules=[Block])
    params = {"fc1.weight": net.layers[0].fc1.weight, "fc1.bias": net.layers[0].fc1.bias,
              "norm.weight": net.layers[0].norm.weight, "head.weight": net.head.weight}
    return {k: bool(getattr(p, "overwrite_main_grad", False)) and hasattr(p, "__fsdp_param__") for k, p in params.items()}


def test_a_module_run_twice_in_one_forward_raises():
    msg = run_gloo(_twice_job, 1)[0]
    assert "layers.1" in msg and "extra.weight" in msg and "fuse_wgrad_accumulation=False" in msg, msg


# ------------------------------------------------------------------ under a (protocol) graph capture
def _graphed_job(rank: int, world: int) -> Dict[str, Any]:
    """Eager against partial graphs on the CPU protocol backend (TE's warmup and capture schedule, hooks
    rerouted, backwards on sample gradients), fused weights in every unit, capture at step 2."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    out: Dict[str, Any] = {}
    for mode in ("eager", "graphed"):
        torch.manual_seed(0)
        net = Net(True)
        model = fully_shard(net, fsdp_unit_modules=[Block], fsdp_double_buffer=True,
                            fsdp_db_use_persist_buf_on_alloc_fail=True)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
        cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[], use_megatron_fsdp=True,
                              fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                              cuda_graph_warmup_steps=2, cuda_graph_num_warmup_iters=2)
        graphs = PartialCudaGraphs(model, cfg, backend="protocol") if mode == "graphed" else None
        grads = []
        for step in range(5):
            if graphs is not None and step == 2:
                graphs.capture()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 3, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.detach().clone() for p in model.optimizer_parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[mode] = grads
    return out


def test_a_capture_leaves_no_warmup_gradient_in_the_main_gradients():
    """The graph maker's warmup and capture backwards write fused weight gradients into the engine's buffer;
    none of it may reach the main gradients of the step that captures (it did, once: the GPU alignment row
    differed from the step after capture)."""
    run = run_gloo(_graphed_job, 1)[0]
    for step, (a, b) in enumerate(zip(run["eager"], run["graphed"])):
        for i, (ta, tb) in enumerate(zip(a, b)):
            assert torch.equal(ta, tb), f"step {step}: main gradient {i} differs after a capture"
