"""The TE backend's call into TE, checked on CPU against a stand-in at TE's documented signature.

``make_graphed_callables(modules, sample_args, num_warmup_iters=, allow_unused_input=, sample_kwargs=,
capture_time_hooks=)``: TE refuses modules with hooks, expects ``capture_time_hooks`` one entry per callable
(in the callables' order, keys among the four hook kinds), runs each entry's hooks around that callable's
warmup and capture forward/backward, and runs backward with ``torch.autograd.backward`` into ``.grad``.
The stand-in does exactly that (the capture pass inside ``simulated_capture``, so the engine refuses any
collective there) and checks, before each forward and backward, that the callable's FSDP unit was put in
the right state by the hooks TE was handed for *that* callable. Hooks handed out of step (e.g. reversed)
fail there; so does a hook left on a module. Training through it must equal eager training bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

import fsdp_cudagraph.graphs.partial as capture_mod
from fsdp_cudagraph.capture import schedules
from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from megatron_fsdp import TrainingState, fully_shard, simulated_capture
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class OutOfStep(AssertionError):
    pass


class StubTE:
    """TE's make_graphed_callables schedule without graphs; records what it was handed."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: List[Dict[str, Any]] = []

    def _unit(self, module: torch.nn.Module) -> Any:
        first = next(module.parameters())
        return next(u for u in self.engine.all_units() if any(p is first for p in u.params))

    def make_graphed_callables(self, modules, sample_args, *, num_warmup_iters=3, allow_unused_input=False,
                               sample_kwargs=None, capture_time_hooks=None, **_: Any):
        modules = tuple(modules)
        sample_kwargs = sample_kwargs or tuple({} for _ in modules)
        self.calls.append({"num_callables": len(modules), "num_hook_entries": len(capture_time_hooks or []),
                           "clone_param_grads_on_return": _.get("clone_param_grads_on_return")})
        for m in modules:
            if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
                raise RuntimeError("Modules must not have hooks registered at the time they are passed.")
        if len(capture_time_hooks) != len(modules):
            raise ValueError(f"capture_time_hooks has {len(capture_time_hooks)} entries, expected {len(modules)}")
        for h in capture_time_hooks:
            if set(h) - set(HOOK_KINDS):
                raise ValueError(f"Found unexpected keys in capture_time_hooks ({set(h) - set(HOOK_KINDS)}).")

        def expect(i: int, states: tuple, when: str) -> None:
            unit = self._unit(modules[i])
            if not unit.is_root and unit.state not in states:
                raise OutOfStep(f"callable {i}: its unit {unit.name} is {unit.state.name} {when}; the hooks TE was "
                                "handed for this callable do not belong to it")

        # TE's schedule is the protocol backend's driver; the unit's state is checked after each callable's
        # pre-forward and pre-backward hooks (a check appended as the last hook of those keys).
        checked = []
        for i, h in enumerate(capture_time_hooks):
            h = {k: dict(v) for k, v in h.items()}
            h.setdefault("forward_pre_hooks", {})[-2] = lambda _m, i=i: expect(i, (TrainingState.FORWARD,), "at its forward")
            h.setdefault("backward_pre_hooks", {})[-2] = lambda _m, i=i: expect(i, (TrainingState.BACKWARD,), "at its backward")
            checked.append(h)
        schedules.run_te_schedule(modules, sample_args, checked, num_warmup_iters=num_warmup_iters,
                                  region=simulated_capture, sample_kwargs=sample_kwargs,
                                  grad_inputs=lambda i: [p for p in modules[i].parameters()])
        return modules


def _train(scope: List[str], *, graphed: bool, reverse_hooks: bool = False) -> Dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(moe_every=2)
    model = fully_shard(GPT(cfg), fsdp_unit_modules=["TransformerBlock"], sharding_strategy="optim_grads_params",
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    stub = StubTE(model)
    graphs = None
    if graphed:
        capture_mod.require_te = lambda what: stub
        CudaGraphConfig.check_runtime = lambda self: None
        if reverse_hooks:
            real = schedules.capture_te

            def reversed_capture(order: Any, wrappers: Any, hooks: Any, **kwargs: Any) -> None:
                plans = [c.plan for c in order]  # each callable's plan handed to another one, in reverse
                for c, plan in zip(order, reversed(plans)):
                    c.plan = plan
                hooks = [schedules.capture_time_hooks(c) for c in order]
                real(order, wrappers, hooks, **kwargs)

            schedules.capture_te = reversed_capture
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=scope,
                                                          use_megatron_fsdp=True, fsdp_double_buffer=True,
                                                          fsdp_db_use_persist_buf_on_alloc_fail=True), backend="te")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses, error = [], None
    for step in range(5):
        if graphs is not None and step == 2:
            try:
                graphs.capture()
            except OutOfStep as exc:
                error = str(exc)
                break
        x, y = synthetic_batch(step, 4 * world, cfg, torch.device("cpu"))
        loss = loss_fn(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "calls": stub.calls, "error": error}


def _job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for scope in ([], ["attn", "mlp"]):
        key = "+".join(scope) or "layers"
        out[key] = {"eager": _train(scope, graphed=False), "graphed": _train(scope, graphed=True)}
    out["reversed"] = _train(["attn", "mlp"], graphed=True, reverse_hooks=True)
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


@pytest.mark.parametrize("scope", ["layers", "attn+mlp"])
def test_te_gets_one_hook_entry_per_callable_and_trains_like_eager(results, scope):
    for rank in results:
        run = rank[scope]
        assert run["graphed"]["error"] is None
        assert run["graphed"]["calls"] and all(c["num_callables"] == c["num_hook_entries"] > 1 for c in run["graphed"]["calls"])
        assert all(c["clone_param_grads_on_return"] is True for c in run["graphed"]["calls"])  # TE's safe default
        assert len(run["graphed"]["losses"]) == 5
        assert all(torch.equal(a, b) for a, b in zip(run["eager"]["losses"], run["graphed"]["losses"]))


def test_hooks_out_of_step_with_the_callables_are_caught(results):
    for rank in results:
        assert rank["reversed"]["error"] is not None and "do not belong to it" in rank["reversed"]["error"]
