"""What a user's model can do to the engine: each either trains like the single-process reference or raises
before any wrong value is used, naming the unit, the rule and the fix (see "What the engine refuses, and
what it trains correctly" in docs/engines.md).

On 2 Gloo ranks, fp32, SGD, against the same model trained in one process on the whole batch (tolerance:
[Note: matching tolerance] in _common.py), for ZeRO-3 with and without double buffering and for no_shard:
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
from tests.engine._common import ATOL, RTOL
from tests.engine._misuse_net import BATCH, HIDDEN, Layer, Net, data as _data

pytestmark = pytest.mark.gloo

WORLD = 2
STEPS = 5
CASES = {
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "no_shard": dict(sharding_strategy="no_shard"),
}


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


# --- backward passes that overlap, gradients that arrive late, modules used across units ------------------------
# Each scenario runs at step MISUSE_STEP of an otherwise normal run. A refused scenario must raise where the
# table says and leave training as if the step had been skipped (after optimizer.zero_grad(), as the error
# asks); an accepted one must train like the reference doing the same.

MISUSE_STEP = 2


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _step_normal(model, net, x, y, seen):
    loss = _loss(model, x, y)
    seen.append("forward")
    loss.backward()
    seen.append("backward")
    return loss


def _step_overlap(model, net, x, y, seen):
    """Two forwards with gradients, then one backward through both (e.g. two augmentations of a batch)."""
    first = _loss(model, x, y)
    second = _loss(model, x, y)
    seen.append("forward")
    (first + second).backward()
    seen.append("backward")
    return first


def _step_stale(model, net, x, y, seen):
    """Backward of the second forward, then of the first."""
    first = _loss(model, x, y)
    second = _loss(model, x, y)
    seen.append("forward")
    second.backward()
    seen.append("backward")
    first.backward()
    seen.append("backward")
    return first


def _step_eval_between(model, net, x, y, seen):
    """A forward, an evaluation under no_grad, then the first forward's backward: allowed."""
    loss = _loss(model, x, y)
    with torch.no_grad():
        model(x)
    seen.append("forward")
    loss.backward()
    seen.append("backward")
    return loss


def _step_root_read(model, net, x, y, seen):
    net.mode = "root_read"
    try:
        return _step_normal(model, net, x, y, seen)
    finally:
        net.mode = "normal"


def _step_borrowed(model, net, x, y, seen):
    object.__setattr__(net.layers[2], "borrowed", net.layers[1].mlp)  # not registered: no sharing error
    try:
        return _step_normal(model, net, x, y, seen)
    finally:
        del net.layers[2].__dict__["borrowed"]


#: name -> (what the misuse step does, whether the engine refuses it)
SCENARIOS = {
    "overlap": (_step_overlap, True),
    "stale": (_step_stale, True),
    "eval_between": (_step_eval_between, False),
    "root_read": (_step_root_read, True),
    "borrowed": (_step_borrowed, True),
    "attn_twice": (_step_normal, False),  # layers.1 applies its attn twice, every step
}


def _scenario_run(model: nn.Module, net: Net, params: Any, *, rank: int, world: int, scenario: str,
                  reference: bool) -> Dict[str, Any]:
    step_fn, refused = SCENARIOS[scenario]
    net.layers[1].attn_twice = scenario == "attn_twice"
    opt = torch.optim.SGD(params, lr=0.05)
    per = BATCH // world
    out: Dict[str, Any] = {"losses": {}, "error": None, "seen": None}
    for step in range(STEPS):
        x, y = _data(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        seen: List[str] = []
        if step == MISUSE_STEP and not (reference and refused):
            try:
                loss = step_fn(model, net, x, y, seen)
            except RuntimeError as exc:
                out["error"], out["seen"] = str(exc), seen
                opt.zero_grad()
                continue
            out["seen"] = seen
        elif step == MISUSE_STEP:
            continue  # the reference skips a step the engine refuses
        else:
            loss = _step_normal(model, net, x, y, seen)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        out["losses"][step] = (total / world).item()
    return out


def _scenario_job(rank: int, world: int) -> Dict[Any, Any]:
    out: Dict[Any, Any] = {}
    for case, kwargs in CASES.items():
        for scenario in SCENARIOS:
            torch.manual_seed(0)
            net = Net()
            ref_net = copy.deepcopy(net)
            model = fully_shard(net, fsdp_unit_modules=[Layer], **kwargs)
            run = _scenario_run(model, net, model.optimizer_parameters(), rank=rank, world=world, scenario=scenario,
                                reference=False)
            run["state"] = model.full_state_dict()
            ref = _scenario_run(ref_net, ref_net, ref_net.parameters(), rank=0, world=1, scenario=scenario,
                                reference=True)
            run["ref"] = dict(ref, state={k: v.detach().clone() for k, v in ref_net.state_dict().items()})
            out[(case, scenario)] = run
    return out


@pytest.fixture(scope="module")
def scenario_runs() -> List[Dict[Any, Any]]:
    return run_gloo(_scenario_job, WORLD)


def _assert_trains_like_reference(run: Dict[str, Any]) -> None:
    ref = run["ref"]
    assert sorted(run["losses"]) == sorted(ref["losses"])
    torch.testing.assert_close(torch.tensor([run["losses"][s] for s in sorted(run["losses"])]),
                               torch.tensor([ref["losses"][s] for s in sorted(ref["losses"])]), rtol=RTOL, atol=ATOL)
    for k in ref["state"]:
        torch.testing.assert_close(run["state"][k], ref["state"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


#: scenario -> (where it must raise: the phases completed before the error, fragments of the message)
REFUSALS = {
    "overlap": (["forward"], ["backward reached the model's output from forward #", "has run since",
                              "Call backward on each output before the next forward"]),
    "stale": (["forward", "backward"], ["backward reached the model's output from forward #", "has run since"]),
    "root_read": (["forward"], ["parameters layers.3.attn.weight (unit layers.3) received gradients after their "
                                "unit's backward had reduced", "optimizer.zero_grad()"]),
    "borrowed": ([], ["submodule layers.1.mlp.0 of FSDP unit layers.1 was called while the unit is",
                      "outside the unit's own forward"]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scenario", list(REFUSALS))
def test_misuse_is_refused_before_the_step_and_training_goes_on(scenario_runs, case, scenario):
    seen, fragments = REFUSALS[scenario]
    for rank, res in enumerate(scenario_runs):
        run = res[(case, scenario)]
        assert run["error"] is not None, f"{case}/{scenario}: nothing was raised (rank {rank})"
        assert run["seen"] == seen, (run["seen"], run["error"])
        assert run["error"].startswith(f"[rank {rank}] megatron_fsdp: "), run["error"]
        for fragment in fragments:
            assert fragment in run["error"], run["error"]
        assert MISUSE_STEP not in run["losses"]
        _assert_trains_like_reference(run)  # the refused step changed nothing; later steps train normally


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scenario", ["eval_between", "attn_twice"])
def test_allowed_uses_train_like_the_reference(scenario_runs, case, scenario):
    for res in scenario_runs:
        run = res[(case, scenario)]
        assert run["error"] is None, run["error"]
        assert run["seen"] == ["forward", "backward"]
        assert len(run["losses"]) == STEPS
        _assert_trains_like_reference(run)


# --- one process: sharing refused at fully_shard, the input cast in detail ---------------------------------------


def test_module_registered_in_two_units_is_refused(one_rank_group):
    torch.manual_seed(0)
    net = Net()
    net.layers[2].borrowed = net.layers[1].attn  # registered: the same module in two units
    with pytest.raises(ValueError, match=r"parameter layers\.2\.borrowed\.weight is shared with unit layers\.1; a "
                                         r"parameter can live in one FSDP unit only"):
        fully_shard(net, fsdp_unit_modules=[Layer])


class _Inputs(nn.Module):
    """Records the dtype of every tensor it receives, by where it came in."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()
        self.seen: Dict[str, torch.dtype] = {}

    def forward(self, x, tokens, pair, *, extra):
        self.seen = {"x": x.dtype, "tokens": tokens.dtype, "pair0": pair[0].dtype, "pair1": pair[1].dtype,
                     "extra.h": extra["h"].dtype, "extra.mask": extra["mask"].dtype,
                     "extra.list0": extra["list"][0].dtype}
        return self.layer(x + pair[0] + extra["h"] + extra["list"][0])


@pytest.mark.parametrize("compute_dtype, expected", [(torch.bfloat16, torch.bfloat16), (None, torch.float32)])
def test_compute_dtype_casts_nested_floating_inputs_only(one_rank_group, compute_dtype, expected):
    torch.manual_seed(0)
    m = _Inputs()
    model = fully_shard(m, fsdp_unit_modules=[Layer], sharding_strategy="optim_grads_params",
                        compute_dtype=compute_dtype)
    x = torch.randn(2, HIDDEN)
    tokens = torch.arange(4)
    out = model(x, tokens, (x.clone(), tokens), extra={"h": x.clone(), "mask": tokens > 1, "list": [x.clone()]})
    assert out.dtype == expected
    floats = {k: expected for k in ("x", "pair0", "extra.h", "extra.list0")}
    assert m.seen == {**floats, "tokens": torch.int64, "pair1": torch.int64, "extra.mask": torch.bool}
    assert x.dtype == torch.float32  # the caller's tensor is not changed in place


class _FillsList(nn.Module):
    """Appends its layer input to a list the caller passes (how vision.py exposes a padded input's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()

    def forward(self, x, out_list, cache):
        out_list.append(x)
        cache["seen"] = x.dtype
        return self.layer(x)


def test_compute_dtype_keeps_containers_the_model_fills(one_rank_group):
    """Casting the root forward's inputs must not hand the model copies of the caller's lists and dicts that hold
    no floating-point tensor: the model's appends would then be lost to the caller (found on a GPU run:
    vision.py's padded-input probe came back empty under compute_dtype=bfloat16)."""
    torch.manual_seed(0)
    model = fully_shard(_FillsList(), fsdp_unit_modules=[Layer], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16)
    filled: list = []
    cache: dict = {}
    model(torch.randn(2, HIDDEN), filled, cache)
    assert len(filled) == 1 and filled[0].dtype == torch.bfloat16
    assert cache == {"seen": torch.bfloat16}
