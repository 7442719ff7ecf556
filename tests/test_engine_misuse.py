"""What a user's model can do to the engine: each either trains like the single-process reference or raises
before any wrong value is used, naming the unit, the rule and the fix (see "What the engine refuses" in
docs/design.md).

On 2 Gloo ranks, fp32, SGD, against the same model trained in one process on the whole batch (tolerance:
[Note: matching tolerance] in test_engine.py), for ZeRO-3 with and without double buffering and for no_shard:
- a unit skipped in some steps (layer drop), a forward with gradients and no backward, an evaluation under
  ``no_grad`` between steps: train like the reference;
- a unit's submodules called from outside the unit (``layer.mlp(layer.attn(x))``) and a unit called twice
  in one forward: refused at the first such call, with no step taken;
- fp32 inputs with ``compute_dtype=torch.bfloat16``: cast on the way in (integer inputs are not).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Set

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo
from tests.test_engine import ATOL, RTOL

pytestmark = pytest.mark.gloo

WORLD = 2
BATCH = 8
STEPS = 5
HIDDEN = 16
CASES = {
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "no_shard": dict(sharding_strategy="no_shard"),
}


class Layer(nn.Module):
    """The FSDP unit: an attention stand-in and an MLP, each a submodule owning parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    """``mode``: how layer 1 is called this step ("normal", "submodules", "twice"); ``skip``: layers left out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(HIDDEN, 1)
        self.mode = "normal"
        self.skip: Set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            if i == 1 and self.mode == "submodules":
                h = h + layer.mlp(torch.tanh(layer.attn(h)))  # the misuse: the unit's hooks never run
            elif i == 1 and self.mode == "twice":
                h = layer(layer(h))
            else:
                h = layer(h)
        return self.head(h)


def _data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def _train(model: nn.Module, net: Net, params: Any, *, rank: int, world: int, skips: Dict[int, Set[int]],
           extra_forward: Optional[int] = None, eval_at: Optional[int] = None) -> List[float]:
    """STEPS SGD steps on this rank's rows; returns the global mean loss of each step."""
    opt = torch.optim.SGD(params, lr=0.05)
    per = BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        net.skip = skips.get(step, set())
        if eval_at == step:
            with torch.no_grad():
                model(x)
        if extra_forward == step:
            model(x).sum()  # a forward with gradients whose graph is dropped: no backward
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append((total / world).item())
    return losses


def _misuse(model: nn.Module, net: Net, mode: str) -> Dict[str, Any]:
    net.mode = mode
    seen: List[str] = []
    try:
        x, _ = _data(0)
        seen.append("forward")
        model(x[:2]).sum().backward()
        seen.append("backward")
        return {"error": None, "seen": seen}
    except RuntimeError as exc:
        return {"error": str(exc), "seen": seen}
    finally:
        net.mode = "normal"


def _job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    skips = {1: {2}, 3: {0, 3}}
    for name, kwargs in CASES.items():
        torch.manual_seed(0)
        net = Net()
        ref_net = copy.deepcopy(net)
        model = fully_shard(net, fsdp_unit_modules=[Layer], **kwargs)
        res: Dict[str, Any] = {}
        res["layer_drop"] = _train(model, net, model.optimizer_parameters(), rank=rank, world=world, skips=skips,
                                   extra_forward=2, eval_at=4)
        res["state"] = model.full_state_dict()
        ref_model = ref_net  # the same steps in one process on the whole batch
        res["ref_layer_drop"] = _train(ref_model, ref_net, ref_net.parameters(), rank=0, world=1, skips=skips,
                                       extra_forward=2, eval_at=4)
        res["ref_state"] = {k: v.detach().clone() for k, v in ref_net.state_dict().items()}
        res["submodules"] = _misuse(model, net, "submodules")
        res["twice"] = _misuse(model, net, "twice")
        # after a refused call, the next normal step trains again (the engine resets what the refusal left)
        x, y = _data(0)
        loss = nn.functional.mse_loss(model(x[:2]), y[:2])
        loss.backward()
        res["after"] = bool(torch.isfinite(loss))
        out[name] = res
    # compute dtype: fp32 inputs meet bf16 weights
    torch.manual_seed(0)
    net = Net()
    model = fully_shard(net, fsdp_unit_modules=[Layer], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16)
    seen_dtypes: List[torch.dtype] = []
    net.layers[0].register_forward_pre_hook(lambda m, a: seen_dtypes.append(a[0].dtype))
    x, y = _data(0)
    try:
        y_hat = model(x)
        out["bf16"] = {"out_dtype": y_hat.dtype, "layer_input_dtype": seen_dtypes[0], "error": None}
    except RuntimeError as exc:
        out["bf16"] = {"error": str(exc)}
    return out


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_drop_extra_forward_and_eval_train_like_the_reference(runs, case):
    for res in runs:
        r = res[case]
        torch.testing.assert_close(torch.tensor(r["layer_drop"]), torch.tensor(r["ref_layer_drop"]), rtol=RTOL, atol=ATOL)
        assert r["state"].keys() == r["ref_state"].keys()
        for k in r["ref_state"]:
            torch.testing.assert_close(r["state"][k], r["ref_state"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_submodule_called_outside_its_unit_is_refused(runs, case):
    for rank, res in enumerate(runs):
        r = res[case]["submodules"]
        assert r["error"] is not None, f"{case}: layers.1.attn ran outside its unit and nothing was raised"
        assert r["seen"] == ["forward"]  # refused inside the forward, before any backward
        msg = r["error"]
        assert f"[rank {rank}]" in msg and "submodule layers.1.attn of FSDP unit layers.1" in msg, msg
        assert "outside the unit's own forward" in msg and "fsdp_unit_modules" in msg, msg
        assert res[case]["after"]


@pytest.mark.parametrize("case", list(CASES))
def test_unit_called_twice_in_one_forward_is_refused(runs, case):
    for res in runs:
        r = res[case]["twice"]
        assert r["error"] is not None and "unit layers.1 entered forward while in state FORWARD_DONE" in r["error"], r
        assert r["seen"] == ["forward"]


def test_compute_dtype_casts_floating_inputs(runs):
    for res in runs:
        r = res["bf16"]
        assert r["error"] is None, r["error"]
        assert r["layer_input_dtype"] == torch.bfloat16 and r["out_dtype"] == torch.bfloat16
