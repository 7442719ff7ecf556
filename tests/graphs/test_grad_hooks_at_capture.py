"""Parameters' post-accumulate-grad hooks do not fire during a graph maker's warmup and capture, and fire at
every replay ([Note: post-accumulate-grad hooks at capture] in fsdp_cudagraph/capture/schedules.py).

TE's graph maker (and the protocol backend, which follows it) runs its backwards with
``torch.autograd.backward``, so AccumulateGrad and its hooks run. NVIDIA Megatron-FSDP reduces from such a
hook; the stand-in here does what it does: move ``.grad`` into a ``main_grad`` the optimizer reads and clear
``.grad``. Warmup gradients (from uninitialised output gradients in TE, ones here) must not reach
``main_grad``: training through capture must equal eager training bit for bit, and the hook must have fired
exactly once per parameter per step, capture included in none.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

STEPS, CAPTURE_AT = 5, 2


class Block(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(graphed: bool) -> Dict[str, object]:
    torch.manual_seed(0)
    net = Net()
    fired: List[int] = []
    params = list(net.parameters())
    for p in params:
        p.main_grad = torch.zeros_like(p)

        def take(param: torch.Tensor) -> None:  # what NVIDIA's _process_post_backward_gradients does, in short
            param.main_grad.add_(param.grad)
            param.grad = None
            fired.append(1)

        p.register_post_accumulate_grad_hook(take)
    graphs = None
    if graphed:
        graphs = PartialCudaGraphs(net, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["mlp"]),
                                   backend="protocol")
    fired_per_step, losses = [], []
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            before = len(fired)
            graphs.capture()
            assert len(fired) == before, f"{len(fired) - before} post-accumulate-grad hooks fired during capture"
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        n0 = len(fired)
        loss = net(x).square().mean()
        loss.backward()
        fired_per_step.append(len(fired) - n0)
        with torch.no_grad():
            for p in params:
                p.add_(p.main_grad, alpha=-0.1)
                p.main_grad.zero_()
        losses.append(loss.detach().clone())
    return {"losses": losses, "params": [p.detach().clone() for p in params], "fired": fired_per_step,
            "num_params": len(params)}


def test_post_accumulate_grad_hooks_fire_at_replay_not_at_capture():
    eager, graphed = _train(False), _train(True)
    assert graphed["fired"] == [graphed["num_params"]] * STEPS, graphed["fired"]
    assert all(torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(eager["params"], graphed["params"]))
