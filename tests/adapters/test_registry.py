"""The engine contract as our engine (engines/megatron_fsdp/adapter.py) and a toy engine answer it; the moved apps' aliases.

No process group for the hook-plan tests; one Gloo rank for the adapter over a sharded model.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, LengthBucketGraphs, PartialCudaGraphs, extract_hooks, hooks_snapshot, restore_hooks
from fsdp_cudagraph.apps.model import GPT, GPTConfig
import fsdp_cudagraph.engines.registry as registry
from fsdp_cudagraph.engines import (HOOK_DICTS, EngineAdapter, HookPlan, adapt, adapter_for, read_sentinel, register_engine,
                                    registered_engines, root_of, unavailable_engines)
from fsdp_cudagraph.engines.contract import PerLayerEngine
from fsdp_cudagraph.engines.plain import PlainModule
from fsdp_cudagraph.engines.megatron_fsdp import MegatronFSDPEngine, plan_hooks
from megatron_fsdp import fully_shard


def _hooked():
    m = nn.Linear(4, 4)

    def pre_forward(mod, args):
        pass

    def call_guard(mod, args):  # a role the adapter does not plan (another branch adds such hooks)
        raise AssertionError("an engine-only hook must not run at capture")

    def user_pre(mod, args):
        pass

    def misplaced(mod, args, out):
        pass

    pre_forward._megatron_fsdp_role = "pre_forward"
    call_guard._megatron_fsdp_role = "call_guard"
    misplaced._megatron_fsdp_role = "pre_forward"  # a planned role in the wrong dict: not the engine's
    ids = {
        "pre_forward": m.register_forward_pre_hook(pre_forward).id,
        "call_guard": m.register_forward_pre_hook(call_guard).id,
        "user_pre": m.register_forward_pre_hook(user_pre).id,
        "misplaced": m.register_forward_hook(misplaced).id,
    }
    return m, ids


def test_registry_holds_our_engine():
    assert MegatronFSDPEngine in registered_engines()
    assert "megatron_fsdp" not in unavailable_engines()
    plain = nn.Linear(2, 2)
    assert isinstance(adapter_for(plain), PlainModule) and root_of(plain) is plain


def test_unplanned_roles_are_engine_only_not_unknown():
    m, ids = _hooked()
    before = hooks_snapshot(m)
    ex = extract_hooks(m)  # no adapter: the registered engine that recognises the hooks plans them
    assert list(ex.capture_time["forward_pre_hooks"]) == [ids["pre_forward"]]
    assert [(d, hid) for d, hid, _ in ex.engine_only] == [("_forward_pre_hooks", ids["call_guard"])]
    assert [(d, hid) for d, hid, _ in ex.unknown] == [("_forward_pre_hooks", ids["user_pre"]),
                                                       ("_forward_hooks", ids["misplaced"])]
    assert hooks_snapshot(m) != before  # taken off for capture ...
    restore_hooks(ex)
    assert hooks_snapshot(m) == before  # ... and put back exactly, the engine-only hook included


def test_adapter_plan_matches_the_bare_plan():
    m, _ = _hooked()
    saved = {name: dict(getattr(m, name)) for name in ("_forward_pre_hooks", "_forward_hooks")}
    a, b = plan_hooks(saved), MegatronFSDPEngine.bare_hook_plan(saved)
    assert (a.unknown, a.engine_only, list(a.capture_time["forward_pre_hooks"])) == \
        (b.unknown, b.engine_only, list(b.capture_time["forward_pre_hooks"]))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, hidden_size=16, num_heads=2, ffn_hidden_size=32, num_layers=2))


def test_adapter_answers_for_a_sharded_model(one_rank_group):
    gpt = _gpt()
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    a = adapter_for(model)
    assert isinstance(a, MegatronFSDPEngine) and a.root is gpt and root_of(model) is gpt
    assert a.unit_modules() == list(gpt.layers)
    sub = next(iter(gpt.layers[1].children()))
    assert a.unit_of(sub) is gpt.layers[1] and a.unit_of(gpt.layers[1]) is gpt.layers[1]
    assert a.unit_name(gpt.layers[1]) == "layers.1"
    names = [n for n, _ in a.replay_tensors(gpt.layers[1])]
    assert names[-1] == "gradient buffer of unit layers.1" and names[:-1] == [n for n, _ in gpt.layers[1].named_parameters()]
    a.check_partial_graphs()  # address-stable settings: no refusal


def test_one_double_buffer_refusal_for_every_per_layer_kind(one_rank_group):
    gpt = _gpt()
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], fsdp_double_buffer=False,
                        fsdp_db_use_persist_buf_on_alloc_fail=False)
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[])
    messages = []
    for build in (lambda: PartialCudaGraphs(model, cfg, backend="protocol"),
                  lambda: LengthBucketGraphs(model, cfg, buckets=[8], length_args={"x": 1}, backend="protocol")):
        with pytest.raises(ValueError) as err:
            build()
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "fsdp_double_buffer=True" in messages[0]
    assert "fsdp_double_buffer=False and fsdp_db_use_persist_buf_on_alloc_fail=False" in messages[0]
    assert "needs the parameters and gradients at fixed addresses" in messages[0]


# ---------------------------------------------------------------------------------- a second engine, through the contract
class _Wrapper(nn.Module):
    """A toy 'engine' wrapper: its per-unit hooks carry ``_toy_role``, which only its adapter understands."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner
        self.calls = {"pre": 0}
        for layer in inner:
            def pre(mod, args):
                self.calls["pre"] += 1
            pre._toy_role = "pre"
            layer.register_forward_pre_hook(pre)

    def forward(self, x):
        return self.module(x)


class _ToyEngine(EngineAdapter, PerLayerEngine):
    name = "toy"
    resets = 0

    @classmethod
    def recognizes(cls, model):
        return isinstance(model, _Wrapper)

    @property
    def root(self):
        return self.model.module

    def unit_modules(self):
        return list(self.root)

    def unit_of(self, module):
        return next((u for u in self.root if any(m is module for m in u.modules())), None)

    def hook_plan(self, hooks):
        plan = HookPlan()
        for d in HOOK_DICTS:
            for hid, hook in hooks.get(d, {}).items():
                if getattr(hook, "_toy_role", None) == "pre" and d == "_forward_pre_hooks":
                    plan.capture_time["forward_pre_hooks"][hid] = adapt(hook, "pre")
                elif not read_sentinel(hook, hid, d, plan):
                    plan.unknown.append((d, hid, hook))
        return plan

    def check_partial_graphs(self):
        pass

    def replay_tensors(self, module):
        return list(module.named_parameters())

    def reset(self):
        type(self).resets += 1


@pytest.fixture
def toy_engine():
    register_engine(_ToyEngine)
    try:
        yield _ToyEngine
    finally:
        registry._ENGINES.remove(_ToyEngine)


def test_partial_graphs_speak_to_any_engine_through_the_contract(toy_engine):
    # No graph-kind code knows the toy engine: units, hook plan and reset come from its adapter alone.
    torch.manual_seed(0)
    model = _Wrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[]), backend="protocol")
    assert [c.module for c in graphs.callables] == list(model.module)
    model(torch.randn(2, 4)).sum().backward()
    before, resets = model.calls["pre"], toy_engine.resets
    report = graphs.capture()
    assert report.unknown_hooks == []  # the toy role was planned by its adapter, not reported as the user's
    # the planned pre hook ran around each warmup and capture pass of both layers
    assert model.calls["pre"] - before == 2 * (graphs.config.cuda_graph_num_warmup_iters + 1)
    assert toy_engine.resets - resets == 2  # before and after capture
    model(torch.randn(2, 4)).sum().backward()  # replays with the hooks restored around them
    graphs.delete()


def test_whole_step_kinds_name_an_engine_without_a_static_step(toy_engine):
    # An engine without a StaticStepEngine is refused with NotImplementedError naming the engine and the graph kind.
    from fsdp_cudagraph import FullIterationCudaGraph, InferenceCudaGraphs
    from fsdp_cudagraph.capture.buckets import Buckets
    model = _Wrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(NotImplementedError, match="FullIterationCudaGraph needs an engine with a static step; toy has "
                                                  "none; use megatron_fsdp.fully_shard or partial graphs"):
        FullIterationCudaGraph(model, lambda m, x: m(x).sum(), CudaGraphConfig(cuda_graph_impl="full_iteration"),
                               backend="protocol")
    with pytest.raises(NotImplementedError, match="inference_cuda_graph_scope='block' needs an engine with a static step"):
        InferenceCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope="block"),
                            batch_buckets=Buckets([2]), backend="protocol")
