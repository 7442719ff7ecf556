"""Activation offloading on CPU, one process: the host pool, group recording and plan, the copy's fidelity,
the hazards it refuses, the validation rules, and captures on the protocol backend and a TE stand-in.

On CPU the "host" copy is a copy into pool tensors (not pinned); what these tests show is the bookkeeping:
which tensors leave, which buffers they use, that they come back bit for bit with their layout, and that
nothing is allocated while a (simulated) capture is under way.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_cudagraph.graphs.partial as capture_mod
import fsdp_cudagraph.offload.host_copies as copy_mod
from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
from fsdp_cudagraph.offload.offloader import ActivationOffloader, HostBufferPool, OffloadState, select_offload_modules
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_cudagraph.capture.state import simulated_capture  # the graph layer's capture flag, which offloading reads

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- the pool


def test_pool_reuses_buffers_in_the_same_order_and_stops_growing():
    pool = HostBufferPool(pin_memory=False)
    orders = []
    for _ in range(4):
        pool.reset()
        bufs = [pool.acquire((n,), torch.uint8) for n in (64, 64, 128, 64)]
        orders.append([b.data_ptr() for b in bufs])
        for b in reversed(bufs):  # backward releases in reverse; reset() must restore the allocation order
            pool.release(b)
    assert pool.num_allocations == 4 and pool.allocated_bytes == 64 * 3 + 128
    assert pool.num_acquires == 16 and pool.num_in_use == 0
    assert all(o == orders[0] for o in orders)
    assert len(set(orders[0])) == 4  # distinct buffers within an iteration


def test_pool_refuses_to_allocate_under_capture_and_catches_a_double_release():
    pool = HostBufferPool(pin_memory=False)
    a = pool.acquire((32,), torch.uint8)
    pool.release(a)
    with simulated_capture():
        assert pool.acquire((32,), torch.uint8) is a  # a free buffer may be handed out
        with pytest.raises(RuntimeError, match="being captured"):
            pool.acquire((32,), torch.uint8)  # a new one may not
    pool.release(a)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(a)
    pool.clear()
    pool.release(a)  # after clear(): outstanding copies may still die; a no-op


# ---------------------------------------------------------------------------------------------- training helpers


def _gpt(**kw: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**kw))


def _train(model: nn.Module, steps: int, *, graphs: Optional[PartialCudaGraphs] = None, capture_at: int = -1,
           on_step: Any = None) -> List[torch.Tensor]:
    cfg = model.cfg
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if graphs is not None and step == capture_at:
            graphs.capture()
        x, y = synthetic_batch(step, 4, cfg, CPU)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step)
    return losses


def _equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_params(m1: nn.Module, m2: nn.Module) -> bool:
    s1, s2 = m1.state_dict(), m2.state_dict()
    return s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


# ---------------------------------------------------------------------------------------------- recording and plan


def test_one_eager_iteration_records_the_groups_then_the_fraction_keeps_the_last_on_the_device():
    base = _gpt()
    base_losses = _train(base, 5)
    model = _gpt()
    off = ActivationOffloader(model, modules=["attn", "mlp"], fraction=0.5, min_offload_bytes=0)
    seen: Dict[int, Any] = {}

    def on_step(step: int) -> None:
        seen[step] = ([(r.name, r.index, r.graphed_in, r.offload) for r in off.records], off.planned,
                      off.pool.num_allocations)

    losses = _train(model, 5, on_step=on_step)
    names = [f"layers.{i}.{k}" for i in range(4) for k in ("attn", "mlp")]
    assert seen[0][0] == [(n, 0, None, True) for n in names] and not seen[0][1]  # recorded, all offloaded
    assert seen[1][1] and [r[3] for r in seen[1][0]] == [True] * 4 + [False] * 4  # 0.5: last 4 stay on the device
    assert all(r.total_bytes > 0 for r in off.records)
    assert off.planned_bytes == sum(r.total_bytes for r in off.records[:4])
    assert seen[1][2] == seen[4][2] == seen[0][2]  # no growth after the recorded iteration
    assert off.pool.num_in_use == 0  # every copy went back after its backward
    assert _equal(losses, base_losses) and _same_params(model, base)  # offloading is a copy


def test_eager_groups_get_the_same_host_buffers_in_the_same_order_every_iteration():
    model = _gpt()
    off = ActivationOffloader(model, modules=["mlp"], min_offload_bytes=0)
    per_step: Dict[int, List[int]] = {}
    step_box = [0]
    real = off.pool.acquire

    def spy(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        buf = real(shape, dtype)
        per_step.setdefault(step_box[0], []).append(buf.data_ptr())
        return buf

    off.pool.acquire = spy
    _train(model, 4, on_step=lambda s: step_box.__setitem__(0, s + 1))
    assert len(per_step[0]) > 4 and per_step[1] == per_step[2] == per_step[3] == per_step[0]


class _GeluMLP(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.hidden: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.hidden = weakref.ref(h)  # gelu saves h for backward
        return self.fc2(F.gelu(h))


def test_an_offloaded_activation_is_freed_after_its_group_and_comes_back_for_backward():
    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), _GeluMLP())
        off = ActivationOffloader(net, modules=["mlp"], min_offload_bytes=0) if offload else None
        x = torch.randn(4, 8)
        out = net(x)
        alive = net[1].hidden() is not None
        out.square().sum().backward()
        results[offload] = (alive, [p.grad.clone() for p in net.parameters()])
        if off is not None:
            assert off.records[0].total_bytes >= 4 * 64 * 4  # h went to the host
            off.delete()
    assert results[False][0] and not results[True][0]  # autograd held h; with offloading only the host copy does
    assert all(torch.equal(a, b) for a, b in zip(results[False][1], results[True][1]))


class _SeeSaved(torch.autograd.Function):
    """Saves its input and reports, in backward, the layout it gets back."""

    log: List[tuple] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        _SeeSaved.log.append(("fwd", x.size(), x.stride(), x.storage_offset()))
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _SeeSaved.log.append(("bwd", x.size(), x.stride(), x.storage_offset()))
        return g * 2 + x * 0


class _QKV(nn.Module):
    cuda_graph_module = "attn"

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.lin(x).view(2, 5, 3, 8).permute(2, 0, 1, 3).unbind(0)  # strided views of one storage
        return _SeeSaved.apply(q) + _SeeSaved.apply(k) + _SeeSaved.apply(v)


def test_saved_views_come_back_with_their_strides_and_share_one_copy():
    net = nn.Sequential(nn.Linear(8, 8), _QKV())
    off = ActivationOffloader(net, modules=["attn"], min_offload_bytes=0)
    _SeeSaved.log.clear()
    net(torch.randn(2, 5, 8)).sum().backward()
    fwd = [e[1:] for e in _SeeSaved.log if e[0] == "fwd"]
    bwd = [e[1:] for e in _SeeSaved.log if e[0] == "bwd"]
    assert sorted(fwd) == sorted(bwd) and len(fwd) == 3
    assert all(s != torch.empty(z).stride() for z, s, _ in fwd)  # the views really were non-contiguous
    qkv_bytes = 2 * 5 * 24 * 4
    assert off.records[0].nbytes.count(qkv_bytes) == 1  # q, k and v: one copy of their storage


class _InPlace(nn.Module):
    cuda_graph_module = "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.5
        z = y.sin()  # saves y
        y.add_(1.0)  # ... then writes it: autograd's version check would refuse this in backward
        return z


def test_in_place_write_to_a_saved_tensor_inside_the_group_is_refused():
    net = nn.Sequential(nn.Linear(4, 4), _InPlace())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        net(torch.randn(3, 4)).sum().backward()  # the control: autograd refuses it without offloading
    ActivationOffloader(net, modules=["mlp"], min_offload_bytes=0)
    with pytest.raises(RuntimeError, match="modified in place later in the same forward"):
        net(torch.randn(3, 4))


class _ExpOut(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).exp()  # exp saves its result: the module's output


def test_a_saved_output_stays_on_the_device_and_its_copy_is_dropped():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _ExpOut())
    x = torch.randn(3, 4)
    net(x).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    off = ActivationOffloader(net, modules=["mlp"], min_offload_bytes=0)
    out = net(x)
    rec = off.records[0]
    assert rec.dropped_bytes == out.numel() * 4 and off.pool.num_in_use == len(rec.nbytes) - 1
    out.sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, net.parameters()))
    out = net(x)  # a forward whose graph is dropped without backward frees its saved output (no hidden cycle)
    dead = weakref.ref(out)
    del out
    assert dead() is None


def test_small_copies_parameters_and_other_devices_stay():
    model = _gpt()
    off = ActivationOffloader(model, modules=["attn", "mlp"])  # default threshold: 1 MiB, more than any copy here
    _train(model, 2)
    assert off.records and all(r.total_bytes == 0 and not r.offload for r in off.records)
    assert off.pool.num_allocations == 0


# ---------------------------------------------------------------------------------------------- validation


def test_config_rules_name_both_inputs():
    cases = [
        (dict(cuda_graph_impl="full_iteration", activation_offload_modules=["attn"]), ["full_iteration", "attn"]),
        (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=0, activation_offload_modules=["mlp"]),
         ["cuda_graph_warmup_steps >= 1", "activation_offload_modules=['mlp']"]),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "moe_router"],
              activation_offload_modules=["moe"]), ["'moe'", "moe_router", "graph boundary"]),
        (dict(activation_offload_modules=["attn"], activation_offload_fraction=0.0), ["(0, 1]"]),
        (dict(activation_offload_modules=["attn"], activation_offload_fraction=1.5), ["(0, 1]"]),
        (dict(activation_offload_fraction=0.5), ["would be ignored"]),
        (dict(activation_offload_modules=["attn"], activation_offload_module_patterns=["layers.*"]), ["exclusive"]),
        (dict(activation_offload_modules=["attn"], activation_offload_min_bytes=-1), ["min_bytes=-1"]),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError) as info:
            CudaGraphConfig(**kwargs)
        assert all(w in str(info.value) for w in words), (kwargs, str(info.value))
    with pytest.raises(TypeError):
        CudaGraphConfig(activation_offload_modules=["attn"], activation_offload_fraction="half")
    with pytest.raises(ValueError, match="unknown activation_offload_modules entry"):
        CudaGraphConfig(activation_offload_modules=["attention"])
    ok = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["moe"], activation_offload_modules=["moe_router"])
    assert ok.activation_offload_modules == ["moe_router"]  # inside the graphed block: allowed


def test_selection_errors():
    model = _gpt()
    with pytest.raises(ValueError, match="nested"):
        select_offload_modules(model, patterns=["layers.0", "layers.0.attn"])
    with pytest.raises(ValueError, match=r"includes \['moe'\]"):
        select_offload_modules(model, modules=["moe"])
    with pytest.raises(ValueError, match="match no submodule"):
        select_offload_modules(model, patterns=["blocks.*"])
    with pytest.raises(ValueError, match="both are empty"):
        select_offload_modules(model)
    assert [n for n, _ in select_offload_modules(model, patterns=["MLP"])] == [f"layers.{i}.mlp" for i in range(4)]


def test_boundary_rule_refuses_an_offloaded_module_that_contains_a_graphed_callable():
    model = _gpt()
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["attn"], activation_offload_module_patterns=["layers.?"])
    with pytest.raises(ValueError) as info:
        PartialCudaGraphs(model, cfg, backend="protocol")
    assert "'layers.0'" in str(info.value) and "'layers.0.attn'" in str(info.value)
    assert "forward" not in model.layers[0].__dict__  # nothing was installed


# ---------------------------------------------------------------------------------------------- captures


def _scope(graph: List[str]) -> Dict[str, List[str]]:
    # "layers" stands for whole layers, selected by pattern (a plain module has no FSDP units to graph)
    return {"cuda_graph_module_patterns": ["layers.?"]} if graph == ["layers"] else {"cuda_graph_modules": graph}


def _protocol_graphs(model: nn.Module, graph: List[str], offload: List[str], **kw: Any) -> PartialCudaGraphs:
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_warmup_steps=2, activation_offload_modules=offload,
                          activation_offload_min_bytes=0, **_scope(graph), **kw)
    return PartialCudaGraphs(model, cfg, backend="protocol")


@pytest.mark.parametrize("graph,offload", [(["attn", "mlp"], ["attn", "mlp"]), (["layers"], ["attn"]), (["attn"], ["mlp"])])
def test_protocol_capture_reserves_buffers_replays_them_and_trains_like_without_offloading(graph, offload, monkeypatch):
    base = _gpt()
    base_cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_warmup_steps=2, **_scope(graph))
    base_losses = _train(base, 6, graphs=PartialCudaGraphs(base, base_cfg, backend="protocol"), capture_at=2)
    model = _gpt()
    graphs = _protocol_graphs(model, graph, offload)
    off = graphs.offload
    allocations: Dict[int, int] = {}
    acquires: Dict[int, int] = {}
    used: List[int] = []  # host buffers the copies of the current step wrote
    per_step: Dict[int, List[int]] = {}
    real = off.pool.acquire

    class _LoggedCopy(copy_mod._Copy):
        def __init__(self, host: torch.Tensor, *args: Any) -> None:
            super().__init__(host, *args)
            used.append(host.data_ptr())

    monkeypatch.setattr(copy_mod, "_Copy", _LoggedCopy)

    def spy(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        if off.state is OffloadState.CAPTURE:  # reservations come before; captured groups take those
            raise AssertionError("a host buffer was acquired during capture")
        return real(shape, dtype)

    off.pool.acquire = spy

    def on_step(step: int) -> None:
        allocations[step], acquires[step] = off.pool.num_allocations, off.pool.num_acquires
        per_step[step] = list(used)
        used.clear()

    losses = _train(model, 6, graphs=graphs, capture_at=2, on_step=on_step)
    inside = [r for r in off.records if r.graphed_in is not None]
    assert _equal(losses, base_losses) and _same_params(model, base)
    if graph == ["attn"]:  # the offloaded mlp lies outside the graphs: nothing is graph-owned
        assert not inside and off.captured_bytes == 0
        assert acquires[5] - acquires[3] == 2 * (acquires[3] - acquires[2]) > 0  # the eager pool, each step alike
    else:
        assert inside and all(r.captured for r in inside) and off.captured_bytes > 0
        owned = sorted(b.data_ptr() for r in inside for bufs in r.captured.values() for b in bufs)
        # the protocol's replays run the groups in Python: the graph-owned buffers, in the same order each step
        assert per_step[3] == per_step[4] == per_step[5] and sorted(per_step[3]) == owned
        assert acquires[5] == acquires[3]  # replays take nothing from the eager pool
    assert allocations[2] == allocations[5]  # capture and replays allocate nothing more
    graphs.delete()
    assert off.state is OffloadState.DELETED and graphs.offload is None
    assert all("forward" not in m.__dict__ for m in model.modules())  # modules as before


def test_capture_needs_a_recorded_iteration_and_refuses_sizes_it_did_not_record():
    model = _gpt()
    off = ActivationOffloader(model, modules=["mlp"], graphed=[("layers.0", model.layers[0])], min_offload_bytes=0)
    with pytest.raises(RuntimeError, match="no eager iteration was recorded"):
        with off.graph_maker():
            pass
    assert off.state is OffloadState.EAGER
    model2 = _gpt()
    off2 = ActivationOffloader(model2, modules=["mlp"], graphed=[("layers.0.mlp", model2.layers[0].mlp)], min_offload_bytes=0)
    _train(model2, 1)
    with off2.graph_maker(), simulated_capture(), pytest.raises(RuntimeError, match="did not"):
        model2.layers[0].mlp(torch.randn(4, 16, 64))  # seq 16 instead of 32: sizes never recorded
    with simulated_capture(), pytest.raises(RuntimeError, match="does not drive"):
        model2.layers[0].mlp(torch.randn(4, 32, 64))  # a capture the graph layer does not drive


class _StubTE:
    """TE's schedule (warmup with pre/post warmup hooks, then capture in simulated_capture), recording states."""

    def __init__(self) -> None:
        self.kwargs: Dict[str, Any] = {}
        self.states: List[str] = []
        self.offloader: Optional[ActivationOffloader] = None

    def _call(self, m: nn.Module, args: Any) -> None:
        self.states.append(self.offloader.state.value if self.offloader is not None else "-")
        out = m(*args)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    def make_graphed_callables(self, modules, sample_args, *, num_warmup_iters=3, pre_warmup_hook=None,
                               post_warmup_hook=None, **kwargs: Any):
        self.kwargs = dict(kwargs, pre_warmup_hook=pre_warmup_hook, post_warmup_hook=post_warmup_hook)
        if pre_warmup_hook is not None:
            pre_warmup_hook()
        for _ in range(num_warmup_iters):
            for m, args in zip(modules, sample_args):
                self._call(m, args)
        if post_warmup_hook is not None:
            post_warmup_hook()
        with simulated_capture():
            for m, args in zip(modules, sample_args):
                self._call(m, args)
        return modules


def test_te_backend_gets_the_warmup_hooks_and_offloads_only_for_capture(monkeypatch):
    stub = _StubTE()
    monkeypatch.setattr(capture_mod, "require_te", lambda what: stub)
    monkeypatch.setattr(CudaGraphConfig, "check_runtime", lambda self: None)
    model = _gpt()
    cfg = CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=["mlp"], cuda_graph_warmup_steps=1,
                          activation_offload_modules=["mlp"], activation_offload_min_bytes=0)
    graphs = PartialCudaGraphs(model, cfg)
    stub.offloader = graphs.offload
    _train(model, 1)
    before = graphs.offload.pool.num_acquires
    graphs.capture()
    assert stub.kwargs["pre_warmup_hook"] == graphs.offload.pre_warmup_hook
    assert stub.kwargs["post_warmup_hook"] == graphs.offload.post_warmup_hook
    assert set(stub.states[:-4]) == {"warmup"} and stub.states[-4:] == ["capture"] * 4
    reserved = sum(len(r.nbytes) for r in graphs.offload.records)
    assert graphs.offload.pool.num_acquires - before == reserved  # only the reservations; warmup copied nothing
    assert graphs.offload.captured_bytes > 0
    graphs.delete()
    stub2 = _StubTE()
    monkeypatch.setattr(capture_mod, "require_te", lambda what: stub2)
    plain = PartialCudaGraphs(_gpt(), CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=["mlp"]))
    _train(plain.root, 1)
    plain.capture()
    assert stub2.kwargs["pre_warmup_hook"] is None and stub2.kwargs["post_warmup_hook"] is None  # off: no new kwargs


def test_delete_restores_the_forward_and_refuses_while_graphs_hold_it():
    model = _gpt()
    graphs = _protocol_graphs(model, ["mlp"], ["mlp"])
    _train(model, 2, graphs=graphs, capture_at=1)
    with pytest.raises(RuntimeError, match="delete the graphs first"):
        graphs.offload.delete()
    graphs.delete()
    assert all("forward" not in m.__dict__ for m in model.modules())
    own = lambda x: x  # noqa: E731 - a module with an instance-level forward of its own keeps it
    mlp = model.layers[0].mlp
    mlp.forward = own
    off = ActivationOffloader(model, module_patterns=["layers.0.mlp"])
    assert mlp.forward is not own
    off.delete()
    assert mlp.__dict__["forward"] is own


def test_command_line_flags_reach_the_config():
    import argparse

    from fsdp_cudagraph import add_cuda_graph_args, config_from_args

    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    args = parser.parse_args(["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp",
                              "--activation-offload-modules", "mlp", "--activation-offload-fraction", "0.75",
                              "--activation-offload-min-bytes", "4096"])
    cfg = config_from_args(args)
    assert cfg.activation_offload_modules == ["mlp"] and cfg.activation_offload_fraction == 0.75
    assert cfg.activation_offload_min_bytes == 4096 and cfg.activation_offload_module_patterns == []
    default = config_from_args(parser.parse_args([]))
    assert default.activation_offload_modules == [] and default.activation_offload_fraction == 1.0


def test_backward_prefetches_the_group_it_needs_next(monkeypatch):
    model = _gpt()
    off = ActivationOffloader(model, modules=["attn", "mlp"], min_offload_bytes=0)
    _train(model, 1)  # the recorded iteration
    log: List[tuple] = []
    real_reload, real_unpack = copy_mod._Group._start_reload, copy_mod._Group.unpack

    def reload(self: Any) -> None:
        log.append(("reload", self.record.name))
        real_reload(self)

    def unpack(self: Any, s: Any) -> torch.Tensor:
        if not self.unpacked:
            log.append(("unpack", self.record.name))
        return real_unpack(self, s)

    monkeypatch.setattr(copy_mod._Group, "_start_reload", reload)
    monkeypatch.setattr(copy_mod._Group, "unpack", unpack)
    x, y = synthetic_batch(1, 4, model.cfg, CPU)
    loss_fn(model(x), y).backward()
    backward_order = [f"layers.{i}.{k}" for i in reversed(range(4)) for k in ("mlp", "attn")]
    assert [n for e, n in log if e == "reload"] == backward_order  # each group reloaded once, in backward order
    for name in backward_order[1:]:  # ... and, but for the first, before its own first unpack
        assert log.index(("reload", name)) < log.index(("unpack", name))
    assert off.pool.num_in_use == 0


def test_a_second_offloader_on_the_same_modules_is_refused():
    model = _gpt()
    first = ActivationOffloader(model, modules=["mlp"])
    with pytest.raises(ValueError, match="already offloaded"):
        PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["mlp"],
                                                 activation_offload_modules=["mlp"]), backend="protocol")
    first.delete()
    ActivationOffloader(model, module_patterns=["layers.*.mlp"]).delete()
