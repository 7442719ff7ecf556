"""Optimizers that update the main shards without moving their version counters still refresh the weights.

The engine refreshes a unit's compute parameters when its fp32 main shard's version counter moved. torch's
fused Adam (``fused=True``) updates its parameters in place without moving the counter (checked here on the
bare tensor too), and so does any optimizer that writes through ``.data``. Without the engine's optimizer
step post-hook (``megatron_fsdp/_guards.py``) the next forward computed with the weights of before the step:
silently, under no_shard and the optim strategies for every unit, under ZeRO-3 for units whose buffer still
held their data (on the GPU this made the partial-graph alignment matrix differ in 44 of 50 rows with fused
Adam, eager and graphed runs both wrong in different ways).

On 2 Gloo ranks, fp32, for every strategy (ZeRO-3 with and without double buffer): after each of three
steps, every weight a forward computes with (read by forward pre-hooks, as the modules see it) must be
``torch.equal`` to the model's full state after the step.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo
from tests.engine._common import STRATEGY_CASES as STRATEGIES
from tests.engine._misuse_net import Layer, Net, data as _data

pytestmark = pytest.mark.gloo

WORLD = 2


class DataSGD(torch.optim.Optimizer):
    """Plain SGD that writes through ``.data`` (as some hand-written optimizers do): no version counter moves."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS = {
    "data_sgd": lambda params: DataSGD(params, lr=0.05),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
}


def _weights_seen_by_forward(model: nn.Module, net: Net, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Run a forward; return every parameter as the module holding it saw it when it ran."""
    seen: Dict[str, torch.Tensor] = {}
    handles = []
    owners = {"emb": net.emb, "head": net.head, **{f"layers.{i}": layer for i, layer in enumerate(net.layers)}}
    for prefix, module in owners.items():
        def grab(mod: nn.Module, args: Any, prefix: str = prefix) -> None:
            for name, p in mod.named_parameters():
                seen[f"{prefix}.{name}"] = p.detach().clone()
        handles.append(module.register_forward_pre_hook(grab))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    per = 8 // world
    for sname, kwargs in STRATEGIES.items():
        for oname, make in OPTIMIZERS.items():
            torch.manual_seed(0)
            net = Net()
            model = fully_shard(net, fsdp_unit_modules=[Layer], **kwargs)
            opt = make(model.optimizer_parameters())
            rows: List[Dict[str, Any]] = []
            for step in range(3):
                x, y = _data(step)
                x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
                before = {k: v.clone() for k, v in model.full_state_dict().items()}
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                after = model.full_state_dict()
                seen = _weights_seen_by_forward(model, net, x)
                rows.append({
                    "moved": any(not torch.equal(before[k], after[k]) for k in after),
                    "keys_equal": seen.keys() == after.keys(),
                    "stale": sorted(k for k in after if k in seen and not torch.equal(seen[k], after[k])),
                })
            out[f"{sname}/{oname}"] = rows
    return out


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


def test_fused_adam_does_not_move_the_version_counter():
    """The premise: if torch ever moves it, the post-hook is still right, but this note should be updated."""
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    opt.step()
    v = p._version
    opt.step()
    assert p._version == v and not torch.equal(p.detach(), torch.zeros(4))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_forward_after_a_step_computes_with_the_stepped_weights(runs, strategy, optimizer):
    for rank_result in runs:
        for step, row in enumerate(rank_result[f"{strategy}/{optimizer}"]):
            assert row["moved"], f"step {step}: the optimizer moved no weight; the comparison would be vacuous"
            assert row["keys_equal"], f"step {step}: a parameter was not seen by the forward"
            assert row["stale"] == [], f"step {step}: the forward computed with stale weights {row['stale']}"


def _data_write_job(rank: int, world: int) -> Dict[str, Any]:
    """After a step, every main shard written through ``.data`` (no version counter moves, no optimizer hook
    runs): the weights the next forward sees without ``reset_step_state()`` and with it."""
    out: Dict[str, Any] = {}
    per = 8 // world
    for sname, kwargs in STRATEGIES.items():
        for reset in (False, True):
            torch.manual_seed(0)
            net = Net()
            model = fully_shard(net, fsdp_unit_modules=[Layer], **kwargs)
            opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
            x, y = _data(0)
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            _weights_seen_by_forward(model, net, x)  # the compute parameters are installed from the stepped shards
            with torch.no_grad():
                for p in model.optimizer_parameters():
                    p.data.add_(0.5)
            if reset:
                model.reset_step_state()
            after = model.full_state_dict()
            seen = _weights_seen_by_forward(model, net, x)
            out[f"{sname}/{reset}"] = sorted(k for k in after if k in seen and not torch.equal(seen[k], after[k]))
    return out


def test_reset_step_state_takes_a_write_the_engine_could_not_see():
    """``model.reset_step_state()`` after writing the main shards through ``.data`` (or an optimizer graph of one's
    own): every strategy's next forward computes with the written values. Without it the strategies that keep
    compute parameters between steps compute with the old ones (the hazard the call is for: checked, so that the
    comparison is not vacuous)."""
    for res in run_gloo(_data_write_job, WORLD):
        for sname in STRATEGIES:
            assert res[f"{sname}/True"] == [], f"{sname}: the forward after reset_step_state saw {res[f'{sname}/True']}"
        assert any(res[f"{sname}/False"] for sname in STRATEGIES), res
