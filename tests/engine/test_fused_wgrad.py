"""Fused weight-gradient accumulation (TE's ``fuse_wgrad_accumulation``) under ``megatron_fsdp``, on Gloo.

TE is not on CPU machines, so :class:`ProtocolLinear` follows TE's protocol the way TE 2.20's ``Linear`` does
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
from tests.engine.test_optimizers import STRATEGIES  # the same five strategies, ZeRO-3 with and without double buffer

pytestmark = pytest.mark.gloo


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, fuse: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        if fuse:  # read at forward time, as TE does
            ctx.main_grad_func = weight.get_main_grad
            ctx.overwrite = getattr(weight, "overwrite_main_grad", False)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.fuse:
            main_grad = ctx.main_grad_func()
            if ctx.overwrite:
                main_grad.copy_(gw)
            else:
                main_grad.add_(gw)
            gw = None
        return gy @ w, gw, g2.sum(0), None


class ProtocolLinear(nn.Module):
    """A linear layer that honours ``fuse_wgrad_accumulation`` as TE's modules do."""

    def __init__(self, i: int, o: int, fuse: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i ** 0.5)
        self.bias = nn.Parameter(torch.randn(o) * 0.1)
        self.fuse_wgrad_accumulation = fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self.fuse_wgrad_accumulation)


class Block(nn.Module):
    def __init__(self, h: int, fuse: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = ProtocolLinear(h, 2 * h, fuse)
        self.fc2 = ProtocolLinear(2 * h, h, fuse)
        self.extra = ProtocolLinear(h, h, fuse)  # skipped at odd steps
        self.use_extra = True
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if self.use_extra:
            y = y + self.extra(y)
        if self.twice:
            y = y + self.extra(y)
        return y


class Net(nn.Module):
    def __init__(self, fuse: bool, h: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(6, h)
        self.layers = nn.ModuleList(Block(h, fuse) for _ in range(3))
        self.head = ProtocolLinear(h, 3, fuse)  # in the root unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        # the head's weight also gets an ordinary gradient through this second use
        return self.head(x) + 0.1 * (x @ self.head.weight.t())


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
