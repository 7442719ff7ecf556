"""CPU tests of the NVIDIA Megatron-FSDP adapter (``fsdp_cudagraph.engines.nvidia``).

NVIDIA's ``MegatronFSDP.__init__`` needs CUDA (it builds CUDA streams and buffers), but its hook registration
does not: the tests build the object with ``__new__``, set the attributes ``_register_fsdp_hooks`` reads
(as ``__init__`` sets them: ``module``, ``fsdp_unit_modules``, ``ddp_config``,
``data_parallel_sharding_strategy``, ``enable_fine_grained_param_gather_hook``, ``param_to_name``,
``raw_param``, ``is_param_fsdp_distributed``) and call NVIDIA's own ``_register_fsdp_hooks``, so every hook
recognised here is one NVIDIA's code made. The engine's collectives and buffers are replaced by recorders on
the instance. The double-buffer tests drive NVIDIA's real ``FixedPoolAllocator`` with CPU memory.

Needs megatron-core 0.16.1 (``pip install 'megatron-core==0.16.1'``); without it those tests skip with that
reason. The tests that need no megatron (recognition by class path, version refusal, the collective guard)
run everywhere.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import types
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from fsdp_cudagraph.engines import HOOK_KEYS, adapter_for, registered_engines
from fsdp_cudagraph.engines.plain import PlainModule
from fsdp_cudagraph.engines.nvidia import hooks as nvh
from fsdp_cudagraph.engines.nvidia import adapter as nvm

SKIP_REASON = "NVIDIA Megatron-FSDP (megatron-core 0.16.1) is not installed: pip install 'megatron-core==0.16.1'"
try:
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as nv
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as nv_buffers
    HAS_MCORE = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_MCORE = False
needs_mcore = pytest.mark.skipif(not HAS_MCORE, reason=SKIP_REASON)


class Block(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + x


class Net(nn.Module):
    """Input projection, FSDP units, output head: the head is the last module, as in GPT models."""

    def __init__(self, num_layers: int = 3, head: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.layers = nn.ModuleList([Block() for _ in range(num_layers)])
        self.head = nn.Linear(4, 2) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


class Recorder:
    """Stands in for the engine's all-gather entry point and pipeline; records what the hooks ask for."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: List[Tuple[Any, ...]] = []
        self.prefetches: List[bool] = []
        self.bucket = {p: i for i, (_, p) in enumerate(model.named_parameters())}

    def gather(self, params, prefetch=True, prefetch_order=None, wait_bucket_ready=True, bwd=False):
        self.prefetches.append(prefetch)
        self.calls.append(("gather", tuple(sorted(self.bucket[p] for p in params)), bwd, prefetch_order.name))

    def release_bucket(self, bucket_id, bwd, lazy=False):
        self.calls.append(("release", bucket_id, bwd, lazy))


def build_engine(model: nn.Module, strategy: str = "optim_grads_params", **config: Any):
    """NVIDIA's MegatronFSDP with the attributes __init__ would set, hooks from its own _register_fsdp_hooks."""
    e = nv.MegatronFSDP.__new__(nv.MegatronFSDP)
    nn.Module.__init__(e)
    e.module = model
    e.fsdp_unit_modules = [Block]
    e.ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **config)
    e.data_parallel_sharding_strategy = strategy
    e.enable_fine_grained_param_gather_hook = False
    e.param_to_name = {p: n for n, p in model.named_parameters()}
    e.raw_param = dict(model.named_parameters())
    e.is_param_fsdp_distributed = False
    e._register_fsdp_hooks(model)
    rec = Recorder(model)
    e.all_gather_and_wait_parameters_ready = rec.gather  # the closures call it through ``self``
    e.all_gather_pipeline = rec
    e.param_and_grad_buffer = types.SimpleNamespace(param_to_param_group=rec.bucket, parameter_groups=[])
    return e, rec


def saved_hooks(m: nn.Module) -> Dict[str, Dict[int, Any]]:
    return {d: dict(getattr(m, d)) for d in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                                             "_backward_hooks", "_forward_pre_hooks_with_kwargs")}


def hook_id(m: nn.Module, dict_name: str, local: str) -> int:
    """The id of the hook in ``dict_name`` whose (unwrapped) function NVIDIA named ``local``."""
    for hid, h in getattr(m, dict_name).items():
        fn = h.func if isinstance(h, functools.partial) else h
        if nvh._local_name(fn) == local:
            return hid
    raise AssertionError(f"no {local} in {dict_name}")


# -- recognition ------------------------------------------------------------------------------------------------
def test_registered_and_recognises_by_class_path_without_megatron():
    assert nvm.NvidiaMegatronFSDPEngine in registered_engines()
    standin = type("MegatronFSDP", (nn.Module,), {"__module__": "megatron_fsdp.megatron_fsdp"})()
    assert nvm.NvidiaMegatronFSDPEngine.recognizes(standin)
    wrapper = type("FullyShardedDataParallel", (nn.Module,),
                   {"__module__": "megatron.core.distributed.fsdp.mcore_fsdp_adapter"})()
    wrapper.module = standin
    assert nvm.NvidiaMegatronFSDPEngine.recognizes(wrapper)
    wrapper.module = nn.Linear(2, 2)  # megatron-core's wrapper around something else is not this engine's
    assert not nvm.NvidiaMegatronFSDPEngine.recognizes(wrapper)
    lookalike = type("MegatronFSDP", (nn.Module,), {"__module__": "my_project.fsdp"})()
    assert not nvm.NvidiaMegatronFSDPEngine.recognizes(lookalike)
    from megatron_fsdp import MegatronFSDP as Ours  # this project's engine has the class name, not the path
    assert not nvm.NvidiaMegatronFSDPEngine.recognizes(Ours.__new__(Ours))


def test_recognition_imports_no_megatron():
    code = ("import sys, torch; from fsdp_cudagraph.engines import adapter_for; "
            "assert adapter_for(torch.nn.Linear(2, 2)).name == 'the model'; "
            "print(sorted(k for k in sys.modules if k == 'megatron' or k.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_untested_version_is_refused_with_the_versions():
    nvm.check_version("0.3.1")
    nvm.check_version("0.6.1", "0.19.2")
    with pytest.raises(NotImplementedError) as err:
        nvm.check_version("0.5.0", "0.18.0")
    msg = str(err.value)
    assert "0.5.0" in msg and "megatron-core 0.18.0" in msg and "0.3.1" in msg and "0.6.1" in msg
    # The standalone package's path with no package_info (e.g. a look-alike): version None, refused.
    standin = type("MegatronFSDP", (nn.Module,), {"__module__": "megatron_fsdp.megatron_fsdp"})()
    with pytest.raises(NotImplementedError, match="Megatron-FSDP None"):
        nvm.NvidiaMegatronFSDPEngine(standin)


@needs_mcore
def test_installed_versions_and_adapter_for():
    e, _ = build_engine(Net())
    assert nvm.engine_versions(e) == ("0.3.1", "0.16.1")
    adapter = adapter_for(e)
    assert isinstance(adapter, nvm.NvidiaMegatronFSDPEngine) and adapter.root is e.module
    assert adapter.unit_modules() == list(e.module.layers)
    assert adapter.unit_of(e.module.layers[1].fc2) is e.module.layers[1]
    assert adapter.unit_of(e.module.head) is None


# -- the hook plan ------------------------------------------------------------------------------------------------
@needs_mcore
def test_unit_hooks_planned_in_te_form_and_wrappers_withheld():
    e, rec = build_engine(Net())
    unit = e.module.layers[1]
    hooks = saved_hooks(unit)
    pre = hook_id(unit, "_forward_pre_hooks", "_pre_forward_param_unshard")
    reg = hook_id(unit, "_forward_pre_hooks", "_register_post_backward_hook")
    post = hook_id(unit, "_forward_hooks", "_post_forward")
    wrap = hook_id(unit, "_forward_hooks", "create_custom_backward_hook.<locals>.forward_hook")
    plan = adapter_for(e).hook_plan(hooks)
    assert {k: sorted(v) for k, v in plan.capture_time.items()} == {
        "forward_pre_hooks": [pre], "forward_hooks": [post], "backward_pre_hooks": [wrap], "backward_hooks": [reg]}
    assert sorted((d, hid) for d, hid, _ in plan.withheld) == [("_forward_hooks", wrap), ("_forward_pre_hooks", reg)]
    assert plan.unknown == []
    # Each planned fn runs NVIDIA's handler in TE's form: one argument, returns None.
    ids = tuple(sorted(rec.bucket[p] for p in unit.parameters()))
    for key in HOOK_KEYS:
        for fn in plan.capture_time[key].values():
            assert fn(unit) is None
    assert rec.calls == [("gather", ids, False, "FORWARD_PASS_ORDER")] + [("release", i, False, False) for i in ids] \
        + [("gather", ids, True, "BACKWARD_PASS_ORDER")] + [("release", i, True, False) for i in ids]
    assert unit._training_state == nv.TrainingState.IDLE


@needs_mcore
def test_wrapper_with_another_function_is_unknown():
    """Recognition is by structure: a partial or a closure that only looks like NVIDIA's is not planned."""
    e, _ = build_engine(Net())
    unit = e.module.layers[0]
    reg = unit._forward_pre_hooks[hook_id(unit, "_forward_pre_hooks", "_register_post_backward_hook")]
    wrap = unit._forward_hooks[hook_id(unit, "_forward_hooks", "create_custom_backward_hook.<locals>.forward_hook")]
    handler = nvh._free_var(wrap, "custom_backward_handler")

    def user_hook(module, args, kwargs):
        return None

    def forward_hook(module, args, out):  # same name, closes over the real handler, but not NVIDIA's function
        return handler(module, out)

    fakes = {
        "_forward_pre_hooks": {
            101: functools.partial(user_hook, reg.args[0]),            # another func, NVIDIA's handler
            102: functools.partial(reg.func, user_hook),               # NVIDIA's registrar, another handler
            103: user_hook,
        },
        "_forward_hooks": {104: forward_hook},
    }
    plan = adapter_for(e).hook_plan(fakes)
    assert sorted(hid for _, hid, _ in plan.unknown) == [101, 102, 103, 104]
    assert not any(plan.capture_time.values()) and plan.withheld == []
    # NVIDIA's hooks made by another engine instance are not this engine's.
    other, _ = build_engine(Net())
    plan = adapter_for(e).hook_plan(saved_hooks(other.module.layers[0]))
    assert len(plan.unknown) == 4 and not any(plan.capture_time.values())
    # A hook in the wrong dict is not planned either.
    plan = adapter_for(e).hook_plan({"_forward_hooks": {7: reg}})
    assert [hid for _, hid, _ in plan.unknown] == [7]


@needs_mcore
def test_root_pre_backward_is_engine_only_and_not_planned():
    e, _ = build_engine(Net())
    plan = adapter_for(e).hook_plan(saved_hooks(e.module.head))  # the last module carries the stray root hook
    roots = [h for _, _, h in plan.engine_only]  # the engine's own: restored, not run at capture, not reported
    assert plan.unknown == [] and plan.withheld == []
    assert len(roots) == 1 and nvm.identify_hook(roots[0], e)[0] == "root_pre_backward"
    assert not plan.capture_time["backward_pre_hooks"] and not plan.capture_time["backward_hooks"]
    assert len(plan.capture_time["forward_pre_hooks"]) == 1 and len(plan.capture_time["forward_hooks"]) == 1


@needs_mcore
def test_te_capture_schedule_runs_no_engine_autograd_hook_and_restored_hooks_fire():
    """TE's schedule on NVIDIA's real hooks: hooks off, planned fns around forward and autograd.grad, hooks back."""
    e, rec = build_engine(Net())
    unit = e.module.layers[1]
    adapter = adapter_for(e)
    saved = saved_hooks(unit)
    plan = adapter.hook_plan(saved)
    for d in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs"):
        getattr(unit, d).clear()
    x = torch.randn(2, 4, requires_grad=True)
    with adapter.capture_guard():
        for fn in plan.capture_time["forward_pre_hooks"].values():
            fn(unit)
        out = unit(x)
        for fn in plan.capture_time["forward_hooks"].values():
            fn(unit)
        for fn in plan.capture_time["backward_pre_hooks"].values():
            fn(unit)
        # TE takes gradients with autograd.grad: NVIDIA's post-accumulate-grad hooks (which would reduce-scatter
        # through the fake buffer and fail) do not run, nor does any hook NVIDIA would have put on tensors.
        torch.autograd.grad(out.sum(), [x] + list(unit.parameters()))
        for fn in plan.capture_time["backward_hooks"].values():
            fn(unit)
    at_capture = list(rec.calls)
    assert [c[0] for c in at_capture] == ["gather"] + ["release"] * 4 + ["gather"] + ["release"] * 4
    for d, content in saved.items():
        getattr(unit, d).update(content)
    rec.calls.clear()
    x = torch.randn(2, 4, requires_grad=True)
    out = unit(x)  # eager again: the withheld wrappers act on tensors (the release is on the input's gradient)
    torch.autograd.grad(out.sum(), [x] + list(unit.parameters()))
    kinds = [(c[0], c[2]) for c in rec.calls]
    assert ("gather", True) in kinds and ("release", True) in kinds  # pre- and post-backward fired via autograd


# -- settings -----------------------------------------------------------------------------------------------------
def fixed_pool(model: nn.Module, sizes: List[int] = None):
    """NVIDIA's 0.3.1 FixedPoolAllocator over one bucket per unit (plus a non-unit bucket for the head)."""
    groups = [types.SimpleNamespace(params=list(layer.parameters()), fsdp_unit_id=i, dtype=torch.float32)
              for i, layer in enumerate(model.layers)]
    groups.append(types.SimpleNamespace(params=list(model.head.parameters()), fsdp_unit_id=None, dtype=torch.float32))
    return nv_buffers.FixedPoolAllocator(name="fsdp_params", fsdp_param_groups=groups, size=2)


@needs_mcore
def test_zero3_needs_the_double_buffer():
    e, _ = build_engine(Net())
    e.param_and_grad_buffer.weight_alloc = fixed_pool(e.module)
    with pytest.raises(ValueError, match="fsdp_double_buffer=True") as err:
        adapter_for(e).check_partial_graphs()
    assert "has False" in str(err.value)
    e.ddp_config.fsdp_double_buffer = True
    adapter_for(e).check_partial_graphs()  # 0.3.1 has no fsdp_db_use_persist_buf_on_alloc_fail to ask for
    assert "_fsdp_cudagraph_unpinned_allocate" in e.param_and_grad_buffer.weight_alloc.__dict__
    for strategy in ("no_shard", "optim", "optim_grads"):  # weights in a persistent unsharded buffer
        other, _ = build_engine(Net(), strategy=strategy)
        adapter_for(other).check_partial_graphs()


@needs_mcore
def test_zero3_refuses_a_unit_the_031_pool_does_not_hold():
    model = Net(num_layers=3)
    model.layers[2] = Block(width=4)
    model.layers[2].fc1 = nn.Linear(4, 4, bias=False)  # another size: not double-buffered in 0.3.1
    e, _ = build_engine(model, fsdp_double_buffer=True)
    e.param_and_grad_buffer.weight_alloc = fixed_pool(model)
    with pytest.raises(NotImplementedError, match=r"units \[2\] anew") as err:
        adapter_for(e).check_partial_graphs()
    assert "fsdp_db_use_persist_buf_on_alloc_fail=True" in str(err.value)


def test_zero3_needs_both_options_where_the_engine_has_both():
    """0.6.1's config (the options' real names, stand-in object): both flags, else ValueError naming both."""
    engine = types.SimpleNamespace(ddp_config=types.SimpleNamespace(
        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=False))
    adapter = nvm.NvidiaMegatronFSDPEngine.__new__(nvm.NvidiaMegatronFSDPEngine)
    adapter.engine = engine
    with pytest.raises(ValueError) as err:
        adapter._check_zero3("Megatron-FSDP 0.6.1")
    msg = str(err.value)
    assert "fsdp_double_buffer=True and fsdp_db_use_persist_buf_on_alloc_fail=True" in msg and "True and False" in msg
    engine.ddp_config.fsdp_db_use_persist_buf_on_alloc_fail = True
    adapter._check_zero3("Megatron-FSDP 0.6.1")


@needs_mcore
def test_refuses_engine_hooks_inside_a_unit():
    e, _ = build_engine(Net(head=False), fsdp_double_buffer=True)  # last module is layers.2.fc2: stray root hook
    with pytest.raises(NotImplementedError, match=r"layers\.2\.fc2:root_pre_backward") as err:
        adapter_for(e).check_partial_graphs()
    assert "outside the FSDP units" in str(err.value)


@needs_mcore
@pytest.mark.parametrize("setting", ["fine_grained", "fused_wgrad"])
def test_refuses_unsafe_settings(setting):
    e, _ = build_engine(Net(), strategy="optim")
    if setting == "fine_grained":
        e.enable_fine_grained_param_gather_hook = True
        match = "enable_fine_grained_param_gather_hook"
    else:
        e.module.layers[0].fc1.fuse_wgrad_accumulation = True
        match = r"layers\.0\.fc1.*fuse_wgrad_accumulation=False"
    with pytest.raises(NotImplementedError, match=match):
        adapter_for(e).check_partial_graphs()


# -- the double buffer ---------------------------------------------------------------------------------------------
class CpuMemory:
    """megatron's GlobalMemoryBuffer on CPU: one persistent tensor per name."""

    def __init__(self) -> None:
        self.buffers: Dict[Any, torch.Tensor] = {}

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        n = int(torch.tensor(shape).prod())
        if (name, dtype) not in self.buffers or self.buffers[(name, dtype)].numel() < n:
            self.buffers[(name, dtype)] = torch.empty(n, dtype=dtype)
        return self.buffers[(name, dtype)][:n].view(*shape)


# NVIDIA's order of unshards ("a") and releases ("f") for 3 units, one prefetch ahead: each unit's hook asks for
# its bucket and the next one (the previous one in backward) and all_gather_params allocates them in ascending
# bucket order; a unit is released after its forward (_post_forward) and after its backward
# (_post_backward_release_module), before the next unit's hook runs.
FORWARD = [("a", 0), ("a", 1), ("f", 0), ("a", 2), ("f", 1), ("f", 2)]
BACKWARD = [("a", 1), ("a", 2), ("f", 2), ("a", 0), ("f", 1), ("f", 0)]


def run_schedule(alloc, steps) -> Dict[int, int]:
    slots = {}
    for op, b in steps:
        if op == "a":
            alloc.allocate(bucket_id=b, size=32, dtype=torch.float32, device="cpu")
            slots[b] = alloc.using_buffer[b][0]
        else:
            alloc.free(b)
    return slots


@needs_mcore
def test_031_pool_moves_units_between_forward_and_backward_and_the_pin_stops_it(monkeypatch):
    monkeypatch.setattr(nv_buffers, "get_global_memory_buffer", lambda memory=CpuMemory(): memory)
    model = Net(num_layers=3)
    e, _ = build_engine(model, fsdp_double_buffer=True)
    e.param_and_grad_buffer.weight_alloc = alloc = fixed_pool(model)
    # As released: the lowest free slot, so with an odd number of units every unit's backward slot is the other
    # one than its forward slot (harmless eagerly; a graph layer checking forward addresses would miss it).
    fwd, bwd = run_schedule(alloc, FORWARD), run_schedule(alloc, BACKWARD)
    assert fwd == {0: 0, 1: 1, 2: 0} and bwd == {0: 1, 1: 0, 2: 1}
    assert nvm.pin_double_buffer_slots(e) == 1 and nvm.pin_double_buffer_slots(e) == 1  # idempotent
    for _ in range(2):
        assert run_schedule(alloc, FORWARD) == run_schedule(alloc, BACKWARD) == {0: 0, 1: 1, 2: 0}
    # A unit unshard while the unit two places before still holds the slot: refused, not moved.
    alloc.allocate(bucket_id=0, size=32, dtype=torch.float32, device="cpu")
    alloc.allocate(bucket_id=1, size=32, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match=r"move bucket 2 \(FSDP unit 2, layers\.2\.fc1\.weight\) out of its "
                                           r"planned slot 0, still held by \['bucket 0 \(FSDP unit 0"):
        alloc.allocate(bucket_id=2, size=32, dtype=torch.float32, device="cpu")
    assert alloc.idle_buffer == [] and 2 not in alloc.using_buffer  # the refusal left the pool as it was
    alloc.free(0)
    alloc.free(1)
    # Both slots free: the plan chooses (slot 1 for unit 1), not "the lowest free".
    alloc.allocate(bucket_id=1, size=32, dtype=torch.float32, device="cpu")
    assert alloc.using_buffer[1][0] == 1
    alloc.free(1)
    nvm.unpin_double_buffer_slots(e)
    assert "allocate" not in alloc.__dict__ and run_schedule(alloc, BACKWARD) == {0: 1, 1: 0, 2: 1}  # as released


def test_planned_slot_reads_the_061_allocators():
    """0.6.1 keeps FixedPool offsets in {bucket: (slot, offset)} and MaxPool ones in bucket_alloc_index."""
    groups = [types.SimpleNamespace(fsdp_unit_id=u) for u in (0, 0, 1, 1, None)]
    fixed = types.SimpleNamespace(fsdp_param_groups=groups, fsdp_double_buffer_units=[0, 1], size=2,
                                  fsdp_unit_buckets={0: {0: (-1, 0), 1: (1, 1)}, 1: {2: (-1, 0), 3: (-1, 1)}})
    assert [nvm._planned_entry(fixed, b, torch.bfloat16) for b in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), None]
    maxpool = types.SimpleNamespace(fsdp_param_groups=groups, fsdp_double_buffer_units=[0, 1], size=2,
                                    bucket_alloc_index={0: (-1, 0), 1: (-1, 1), 2: (-1, 0), 3: (-1, 1)})
    assert nvm._planned_entry(maxpool, 3, torch.bfloat16) == (1, torch.bfloat16, 1)
    assert nvm._planned_entry(maxpool, 0, "float8") == (0, torch.uint8, 0)


# -- replay tensors, guard, reset ----------------------------------------------------------------------------------
@needs_mcore
def test_replay_tensors_are_the_compute_parameters_even_when_the_optimizer_params_are_installed():
    e, _ = build_engine(Net())
    unit = e.module.layers[0]
    raw = dict(unit.named_parameters())
    dist = {n: nn.Parameter(p.detach().clone()) for n, p in e.module.named_parameters()}
    e.param_and_grad_buffer.optimizer_named_parameters = list(dist.items())
    for name, p in dist.items():  # what finish_grad_sync's _replace_param_with_distributed_if_needed does
        nv._replace_module_parameter(e.module, name, p)
    got = adapter_for(e).replay_tensors(unit)
    assert [n for n, _ in got] == list(raw) and all(t is raw[n] for n, t in got)


def test_capture_guard_refuses_collectives_and_restores_them():
    original = torch.distributed.all_gather_into_tensor
    adapter = nvm.NvidiaMegatronFSDPEngine.__new__(nvm.NvidiaMegatronFSDPEngine)
    with adapter.capture_guard():
        with adapter.simulated_capture():  # nests
            pass
        with pytest.raises(RuntimeError, match=r"\[rank 0\].*torch\.distributed\.all_gather_into_tensor during a "
                                               r"CUDA graph capture"):
            torch.distributed.all_gather_into_tensor(torch.empty(2), torch.empty(1))
    assert torch.distributed.all_gather_into_tensor is original
    with pytest.raises(ValueError):
        with adapter.capture_guard():
            raise ValueError("a failed capture")
    assert torch.distributed.all_gather_into_tensor is original


@needs_mcore
def test_reset_waits_releases_and_installs_compute_parameters():
    e, _ = build_engine(Net())
    calls = []
    e.grad_reduce_pipeline = types.SimpleNamespace(wait_for_previous_grad_reduce=lambda n: calls.append(("wait", n)))
    e.all_gather_pipeline = types.SimpleNamespace(reset=lambda: calls.append(("reset",)))
    e.is_param_fsdp_distributed = True  # as after finish_grad_sync; the raw parameters go back on the module
    dist = {n: nn.Parameter(p.detach().clone()) for n, p in e.module.named_parameters()}
    e.param_and_grad_buffer.optimizer_named_parameters = list(dist.items())
    for name, p in dist.items():
        nv._replace_module_parameter(e.module, name, p)
    e.module.layers[0]._training_state = nv.TrainingState.FORWARD  # a failed capture mid-forward
    e.module.layers[1]._training_state = nv.TrainingState.PRE_BACKWARD  # as the engine left it: kept
    adapter_for(e).reset()
    assert calls == [("wait", 0), ("reset",)]
    assert all(p is e.raw_param[n] for n, p in e.module.named_parameters())
    assert e.module.layers[0]._training_state == nv.TrainingState.IDLE
    assert e.module.layers[1]._training_state == nv.TrainingState.PRE_BACKWARD


@needs_mcore
def test_one_unit_at_a_time_gathers_without_prefetch_and_restores_the_entry_point():
    # [Note: the engine contract] item 8. NVIDIA's own handlers, run as PyTorch's graph maker needs them (a unit's
    # pre-forward and pre-backward together): prefetch=False inside, NVIDIA's default (True) before and after.
    e, rec = build_engine(Net())
    adapter = adapter_for(e)
    unit = e.module.layers[1]
    plan = adapter.hook_plan(saved_hooks(unit))
    entry = e.__dict__["all_gather_and_wait_parameters_ready"]

    def run_pre_handlers():
        for m in unit.modules():  # idle, as at a step's start (a pre-forward after pre-backward never prefetches)
            m._training_state = nv.TrainingState.IDLE
        for key in ("forward_pre_hooks", "backward_pre_hooks"):
            for fn in plan.capture_time[key].values():
                fn(unit)

    run_pre_handlers()
    with adapter.one_unit_at_a_time():
        run_pre_handlers()
    run_pre_handlers()
    assert rec.prefetches == [True, True, False, False, True, True], rec.prefetches
    assert e.__dict__["all_gather_and_wait_parameters_ready"] is entry
    with pytest.raises(ValueError, match="boom"), adapter.one_unit_at_a_time():  # restored on an error too
        raise ValueError("boom")
    assert e.__dict__["all_gather_and_wait_parameters_ready"] is entry


@needs_mcore
def test_reset_after_a_refused_gather_keeps_the_refusal_visible():
    # The pinned allocator refuses inside NVIDIA's async_bucket_gather, after the pipeline marked the bucket
    # COMMUNICATING and before it recorded an event: the pipeline's reset() then died in a KeyError (2 x H100,
    # torch backend) and hid the refusal. reset() now puts such a bucket back to EMPTY; a real gather stays.
    e, _ = build_engine(Net())
    status = nv_buffers.BucketStatus
    seen = {}
    pipeline = types.SimpleNamespace(
        bucket_status={(1, False): status.COMMUNICATING, (2, False): status.COMMUNICATING, (3, False): status.READY_TO_USE},
        param_gather_event_map={(2, False): ("event", None)})
    pipeline.reset = lambda: seen.update(pipeline.bucket_status)
    freed = []
    pipeline.get_fsdp_buffer = lambda b, bwd: types.SimpleNamespace(free_bucket_storage=lambda: freed.append((b, bwd)))
    e.all_gather_pipeline = pipeline
    e.grad_reduce_pipeline = types.SimpleNamespace(wait_for_previous_grad_reduce=lambda n: None)
    adapter_for(e).reset()
    assert seen == {(1, False): status.EMPTY, (2, False): status.COMMUNICATING, (3, False): status.READY_TO_USE}
    assert freed == [(1, False)]  # memory fetched before a refused collective goes back; a real gather keeps its


# -- through the graph layer ---------------------------------------------------------------------------------------
@needs_mcore
def test_partial_graphs_protocol_capture_with_nvidia_hooks():
    """PartialCudaGraphs (protocol backend) on NVIDIA's real hooks: plan, capture schedule, replay check, delete."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, hooks_snapshot

    e, rec = build_engine(Net(), fsdp_double_buffer=True)
    # What an eager backward and the protocol's backward (autograd.backward, so NVIDIA's post-accumulate-grad
    # hooks fire) need from the engine's buffers: groups that need no gradient handling, pipelines that record.
    e.param_and_grad_buffer.parameter_groups = [types.SimpleNamespace(requires_grad=False, params=[])
                                                for _ in rec.bucket]
    e.grad_reduce_pipeline = types.SimpleNamespace(reduce_gradients=lambda *a, **k: None, reset=lambda: None,
                                                   wait_for_previous_grad_reduce=lambda n: None)
    rec.num_buckets, rec.reset = 0, lambda: rec.calls.append(("reset",))
    e.microbatch_count, e.model_auto_sync, e.suggested_RS_queue_capacity = 0, False, 1
    e.dist_index = types.SimpleNamespace(use_hybrid_fsdp=False)
    before = {n: hooks_snapshot(m) for n, m in e.module.named_modules()}
    graphs = PartialCudaGraphs(e, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=1,
                                                  cuda_graph_num_warmup_iters=1), backend="protocol")
    x = torch.randn(2, 4)
    e.module(x).sum().backward()
    rec.calls.clear()
    report = graphs.capture()
    assert report.callables == ["layers.0", "layers.1", "layers.2"] and report.unknown_hooks == []
    units = [tuple(sorted(rec.bucket[p] for p in u.parameters())) for u in e.module.layers]
    gathers = [(c[1], c[2]) for c in rec.calls if c[0] == "gather"]
    one_pass = [(u, False) for u in units] + [(u, True) for u in reversed(units)]  # TE's schedule
    assert gathers == one_pass * 2  # one warmup iteration, then the capture pass
    assert rec.calls[0] == ("reset",) and rec.calls[-1] == ("reset",)  # reset() before and after
    e.module(x).sum().backward()  # replays, hooks around them
    p = next(e.module.layers[1].parameters())
    p.data = p.data.clone()
    with pytest.raises(RuntimeError, match="captured at"):
        e.module(x)
    graphs.delete()
    assert {n: hooks_snapshot(m) for n, m in e.module.named_modules()} == before


@needs_mcore
def test_the_inner_module_is_refused_naming_the_engine():
    # Graphs of the engine's inner module would bypass its hooks; every graph kind asks adapter_for.
    e, _ = build_engine(Net())
    for inner in (e.module, e.module.layers[0]):
        with pytest.raises(ValueError, match=r"pass NVIDIA's MegatronFSDP around Net .*not its inner module"):
            adapter_for(inner)
    assert isinstance(adapter_for(nn.Sequential(nn.Linear(2, 2))), PlainModule)


def test_tensor_parallel_step_runs_megatron_cores_finalize_first(monkeypatch):
    """[Note: NVIDIA Megatron-FSDP under tensor parallelism]: with TP the optimizer's step first calls megatron-core's
    own ``finalize_model_grads([model])`` (the TP sum of the sequence-parallel gradients), once per step, then the
    step; a megatron-core whose function takes something else first is refused, naming it."""
    fmg = pytest.importorskip("megatron.core.distributed.finalize_model_grads")
    from fsdp_cudagraph.engines.nvidia.build import _finalize_before_step

    calls: List[Tuple[str, Any]] = []

    def finalize_model_grads(model, num_tokens=None):  # the signature megatron-core's has: model chunks first
        calls.append(("finalize", model))

    monkeypatch.setattr(fmg, "finalize_model_grads", finalize_model_grads)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = opt.step
    monkeypatch.setattr(opt, "step", lambda *a, **k: (calls.append(("step", None)), step(*a, **k))[1])
    _finalize_before_step(opt, model)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.step()
    assert calls == [("finalize", [model]), ("step", None)] * 2

    def other(chunks_first_not, model=None):
        pass

    monkeypatch.setattr(fmg, "finalize_model_grads", other)
    with pytest.raises(RuntimeError, match="takes 'chunks_first_not' first"):
        _finalize_before_step(torch.optim.SGD(model.parameters(), lr=0.1), model)
