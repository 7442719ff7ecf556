"""``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a megatron_fsdp model is never silent
([Note: compute parameters hold no gradient] in ``megatron_fsdp/_clip.py``).

The module's parameters are compute buffers whose gradients the engine reduces into its sharded fp32 main
gradients. Before, their ``.grad`` was None after backward, so torch's clipping returned a norm of 0 and
clipped nothing. Now each trainable compute parameter's ``.grad`` is a sentinel after backward and torch's
norm, clip and value-clip over ``model.parameters()`` raise, naming ``model.clip_grad_norm_(max_norm)``,
without touching the main gradients. On 2 Gloo ranks, for ZeRO-3 (with and without double buffering) and
no_shard:
- every torch entry point over ``model.parameters()`` raises with the fix in its message, and the main
  gradients are bit-for-bit what they were;
- a run that calls (and catches) torch's clipping before ``model.clip_grad_norm_`` in every step, with a
  skipped unit, two micro-batches and an evaluation under ``no_grad`` between steps, trains bit-for-bit like a
  run that never called it (the sentinels come and go without touching training);
- ``model.zero_grad()`` (both ways; ``set_to_none`` unbinds them) clears the main gradients as
  ``optimizer.zero_grad()`` does (training with either is bit-for-bit the same), and state dicts and DCP
  state dicts work while the sentinels are bound; ``clip_grad_value_`` over ``model.optimizer_parameters()`` (the advertised fix for value
  clipping) clamps the main gradients element by element.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Set, Tuple

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard, graph_contract
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
STEPS = 4
MAX_NORM = 0.05
CASES = {
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
    "no_shard": dict(sharding_strategy="no_shard"),
}
FIX = "model.clip_grad_norm_(max_norm)"
BATCH, HIDDEN = 8, 16


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    """Four units between a root embedding and head; ``skip``: units left out this step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(HIDDEN, 1)
        self.skip: Set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = layer(h)
        return self.head(h)


def data(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def _build(kwargs: Dict[str, Any]):
    torch.manual_seed(0)
    net = Net()
    return net, fully_shard(net, fsdp_unit_modules=[Layer], **kwargs)


def _backward(model: nn.Module, rank: int, step: int, micro: int = 1) -> None:
    x, y = data(step)
    per = BATCH // WORLD
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    half = per // micro
    for m in range(micro):
        sl = slice(m * half, (m + 1) * half)
        (nn.functional.mse_loss(model(x[sl]), y[sl]) / micro).backward()


def _main_grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad.as_subclass(torch.Tensor).clone() for p in model.optimizer_parameters()]


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001  (without the sentinels: .grad is None)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _train(model: nn.Module, net: Net, rank: int, *, call_torch: bool, zero: str = "optimizer") -> Dict[str, Any]:
    """STEPS steps of SGD with model.clip_grad_norm_; ``call_torch``: torch's clipping first, every step;
    ``zero``: how gradients are cleared after the step (``optimizer``, ``optimizer_in_place``, ``model``,
    ``model_in_place``: ``set_to_none`` True or False)."""
    opt = torch.optim.SGD(model.optimizer_parameters(), lr=0.5)
    norms, errors = [], []
    for step in range(STEPS):
        if step == 2:
            with torch.no_grad():
                model(data(step)[0])  # an evaluation between steps: the sentinels stay bound through it
        net.skip = {2} if step == 1 else set()  # a unit without gradients this step
        _backward(model, rank, step, micro=2 if step == 3 else 1)
        if call_torch:
            errors.append(_error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        norms.append(model.clip_grad_norm_(MAX_NORM))
        opt.step()
        if zero.startswith("optimizer"):
            opt.zero_grad(set_to_none=zero == "optimizer")
        else:
            model.zero_grad(set_to_none=zero == "model")
    net.skip = set()
    return dict(norms=norms, errors=errors, state=model.state_dict())


def _job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for case, kwargs in CASES.items():
        res: Dict[str, Any] = {}
        net, model = _build(kwargs)
        _backward(model, rank, 0)
        before = _main_grads(model)
        params = list(model.parameters())
        grads = [p.grad for p in params if p.requires_grad]
        res["all_bound"] = len(grads) > 0 and all(g is not None for g in grads)
        res["errors"] = {
            "clip_grad_norm_": _error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)),
            "clip_grad_norm_ foreach": _error(
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)),
            "clip_grad_norm_ inf": _error(
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=float("inf"))),
            "clip_grad_value_": _error(lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)),
            "get_total_norm": _error(
                lambda: torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])),
            "a layer's parameters": _error(
                lambda: torch.nn.utils.clip_grad_norm_(net.layers[1].parameters(), MAX_NORM)),
            "grad arithmetic": _error(lambda: params[0].grad.abs().max()),
        }
        res["main_grads_untouched"] = all(torch.equal(a, b) for a, b in zip(before, _main_grads(model)))
        # What still works while the sentinels are bound.
        res["state_dict"] = sorted(model.state_dict())
        res["sharded_state_dict"] = sorted(model.sharded_state_dict())
        res["still_bound"] = all(p.grad is not None for p in params if p.requires_grad)
        torch.nn.utils.clip_grad_value_(model.optimizer_parameters(), 1e-3)
        res["value_clip"] = all(torch.equal(torch.clamp(a, -1e-3, 1e-3), b) for a, b in zip(before, _main_grads(model)))
        model.zero_grad(set_to_none=False)
        res["still_bound_after_zero"] = all(p.grad is not None for p in params if p.requires_grad)
        # model.zero_grad() reaches the main gradients, as optimizer.zero_grad() does (before: it left them)
        res["zero_grad_zeroes_main"] = all(p.grad is not None and not p.grad.as_subclass(torch.Tensor).any()
                                           for p in model.optimizer_parameters())
        model.zero_grad()
        res["zero_grad_unbinds"] = all(p.grad is None for p in model.parameters())
        res["zero_grad_drops_main"] = all(p.grad is None for p in model.optimizer_parameters())
        # After a replayed static step (full-iteration graph: no Python ran), as after an eager backward.
        _backward(model, rank, 1)
        step = graph_contract.StaticStep(model)
        step.end_static_step(bound=step.grads_bound())
        res["after_static_step"] = _error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        # Training: with torch's (refused) clipping in every step against a run without it.
        net, model = _build(kwargs)
        res["with_torch"] = _train(model, net, rank, call_torch=True)
        net, model = _build(kwargs)
        res["without_torch"] = _train(model, net, rank, call_torch=False)
        for zero in ("model", "model_in_place", "optimizer_in_place"):  # model.zero_grad() instead of the optimizer's
            net, model = _build(kwargs)
            res["zero_" + zero] = _train(model, net, rank, call_torch=False, zero=zero)
        out[case] = res
    return out


@functools.lru_cache(maxsize=None)
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_clipping_over_model_parameters_raises_and_leaves_the_main_gradients(case):
    for rank_result in runs():
        res = rank_result[case]
        assert res["all_bound"]
        for what, msg in res["errors"].items():
            assert FIX in msg and "holds no gradient" in msg, (what, msg)
        assert "clip_grad_value_(model.optimizer_parameters(), clip_value)" in res["errors"]["clip_grad_value_"]
        assert res["main_grads_untouched"]
        assert FIX in res["after_static_step"], res["after_static_step"]


@pytest.mark.parametrize("case", list(CASES))
def test_what_still_works_while_the_compute_gradients_are_sentinels(case):
    for rank_result in runs():
        res = rank_result[case]
        assert res["state_dict"] and res["sharded_state_dict"]
        assert res["still_bound"] and res["still_bound_after_zero"]  # the sentinels outlive both
        assert res["value_clip"]
        assert res["zero_grad_zeroes_main"]
        assert res["zero_grad_unbinds"] and res["zero_grad_drops_main"]


@pytest.mark.parametrize("case", list(CASES))
def test_training_with_a_refused_torch_clip_equals_training_without_it(case):
    for rank_result in runs():
        res = rank_result[case]
        with_torch, without = res["with_torch"], res["without_torch"]
        assert len(with_torch["errors"]) == STEPS
        assert all(FIX in e for e in with_torch["errors"]), with_torch["errors"]
        assert max(n.item() for n in without["norms"]) > MAX_NORM  # model.clip_grad_norm_ clips: not vacuous
        for a, b in zip(with_torch["norms"], without["norms"]):
            assert torch.equal(a, b)
        assert with_torch["state"].keys() == without["state"].keys()
        for k, v in with_torch["state"].items():
            assert torch.equal(v, without["state"][k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_model_zero_grad_clears_the_main_gradients_like_the_optimizer(case):
    # Before: model.zero_grad() never reached the main-gradient shards (not module parameters), so every
    # step's gradient was added to the last one's, with no error.
    for rank_result in runs():
        res = rank_result[case]
        for zero, reference in (("model", res["without_torch"]), ("model_in_place", res["zero_optimizer_in_place"])):
            run = res["zero_" + zero]
            for a, b in zip(run["norms"], reference["norms"]):
                assert torch.equal(a, b), zero
            for k, v in run["state"].items():
                assert torch.equal(v, reference["state"][k]), (zero, k)
