"""Stream handling and TE attention-backend matching, on CPU with stand-ins for CUDA streams and TE.

- ``_streams``: building PartialCudaGraphs (te/torch backends) moves a thread that sits on the legacy default
  CUDA stream to a side stream, before the eager steps that precede capture; it leaves a user's own stream
  alone; graphs built after default-stream steps are refused at capture on torch < 2.13, with the fix.
  The stand-in records set_stream/wait_stream calls, so these tests fail if the stream handling is removed.
- ``_attention``: a stand-in for TE's selector/cache/DotProductAttention that, like TE with cuDNN <= 9.15,
  picks another backend under capture for a key length that is not a multiple of 128. The matcher makes
  calls inside graphed callables pick the capture choice (``match_graph``), leaves other calls alone, reports
  the difference, refuses with ``error``, and gives TE its selector back.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List

import pytest
import torch
from torch import nn

import fsdp_cudagraph.capture.attention as attention_mod
import fsdp_cudagraph.capture.streams as streams_mod
from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, match_graph_attention
from fsdp_cudagraph.capture.attention import AttentionBackendMatcher, TEAttention


# ---------------------------------------------------------------------------------------------- CUDA stand-in


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_on: List[str] = []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited_on.append(other.name)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeCuda:
    """The five torch.cuda functions ``_streams`` uses, over one device whose default stream is 'legacy'."""

    def __init__(self) -> None:
        self.legacy = FakeStream("legacy")
        self.current = self.legacy
        self.created: List[FakeStream] = []

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int = 0) -> FakeStream:
        return self.current

    def default_stream(self, index: int = 0) -> FakeStream:
        return self.legacy

    def Stream(self, index: int = 0) -> FakeStream:  # noqa: N802 - mirrors torch.cuda.Stream
        s = FakeStream(f"side{len(self.created)}")
        self.created.append(s)
        return s

    def set_stream(self, stream: FakeStream) -> None:
        self.current = stream


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(streams_mod, "_cuda", fake)
    monkeypatch.setattr(streams_mod, "_side_streams", {})
    return fake


def test_use_side_stream_leaves_the_legacy_stream_once_and_orders_after_it(fake_cuda):
    side = streams_mod.use_side_stream()
    assert fake_cuda.current is side and side is not fake_cuda.legacy
    assert side.waited_on == ["legacy"]  # work already queued on the default stream stays before
    assert streams_mod.use_side_stream() is side and len(fake_cuda.created) == 1  # idempotent
    assert not streams_mod.on_legacy_default_stream()


def test_use_side_stream_keeps_a_users_own_stream(fake_cuda):
    mine = FakeStream("mine")
    fake_cuda.current = mine
    assert streams_mod.use_side_stream() is mine and fake_cuda.created == []


def test_no_cuda_no_stream(monkeypatch):
    class NoCuda(FakeCuda):
        def is_available(self) -> bool:
            return False

    monkeypatch.setattr(streams_mod, "_cuda", NoCuda())
    assert streams_mod.use_side_stream() is None and not streams_mod.on_legacy_default_stream()


def test_legacy_stream_hazard_names_the_cause_and_fix(monkeypatch):
    assert streams_mod.legacy_stream_hazard(steps_before_side_stream=0) is None
    monkeypatch.setattr(streams_mod, "has_stale_stream_override", lambda: False)
    msg = streams_mod.legacy_stream_hazard(steps_before_side_stream=3)
    assert "3 forward pass(es) on the default CUDA stream" in msg
    assert "build PartialCudaGraphs before the first training step" in msg and "use_side_stream()" in msg
    monkeypatch.setattr(streams_mod, "has_stale_stream_override", lambda: True)
    assert streams_mod.legacy_stream_hazard(steps_before_side_stream=3) is None  # torch >= 2.13 rewrites them


# ---------------------------------------------------------------------------------------------- TE stand-in


@dataclasses.dataclass(eq=True)
class FakeParams:
    seq: int
    cuda_graph: bool = False


class FakeUtils:
    """TE's selector as it behaves with cuDNN <= 9.15: no fused attention under capture unless seq % 128 == 0."""

    def __init__(self) -> None:
        self.calls: List[FakeParams] = []

    def get_attention_backend(self, params: FakeParams) -> tuple:
        self.calls.append(params)
        fused = not (params.cuda_graph and params.seq % 128)
        return (False, None, fused, 1 if fused else None, not fused, [False, fused, True])


class FakeDPAModule:
    def __init__(self) -> None:
        self._attention_backends = {"attention_params": None, "use_fused_attention": None,
                                    "backend_selection_requires_update": False}


class FakeDPA(nn.Module):
    """Selects like TE's DotProductAttention (cached per params) and computes differently per backend."""

    capturing = False

    def __init__(self, ns: "TEAttention") -> None:
        super().__init__()
        self.ns = ns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = self.ns.dpa_module._attention_backends
        params = FakeParams(seq=x.shape[1], cuda_graph=FakeDPA.capturing)
        if cache["attention_params"] != params:
            cache["attention_params"] = params
            cache["backend_selection_requires_update"] = True
        if cache["backend_selection_requires_update"]:
            cache["use_fused_attention"] = self.ns.utils.get_attention_backend(params)[2]
            cache["backend_selection_requires_update"] = False
        # Two kernels, two results: a stand-in for cuDNN vs unfused numerics.
        return x * (1.0 if cache["use_fused_attention"] else 1.5)


class Layer(nn.Module):
    def __init__(self, ns: TEAttention) -> None:
        super().__init__()
        self.attn = FakeDPA(ns)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.attn(x))


class Net(nn.Module):
    def __init__(self, ns: TEAttention) -> None:
        super().__init__()
        self.graphed = Layer(ns)
        self.eager = Layer(ns)  # not selected: must keep TE's own choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.eager(self.graphed(x))


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> TEAttention:
    ns = TEAttention(utils=FakeUtils(), dpa_module=FakeDPAModule(), dpa_class=FakeDPA)
    monkeypatch.setattr(attention_mod, "te_attention_namespace", lambda: ns)
    FakeDPA.capturing = False
    return ns


def _fused_flags(net: Net, x: torch.Tensor) -> List[bool]:
    """Which backend each FakeDPA used, in call order, observed through their outputs."""
    seen: List[bool] = []
    hooks = [m.register_forward_hook(lambda m, a, o: seen.append(torch.equal(o, a[0]))) for m in (net.graphed.attn, net.eager.attn)]
    net(x)
    for h in hooks:
        h.remove()
    return seen


def test_without_matcher_eager_and_capture_pick_different_backends(fake_te):
    # The hazard itself, on the stand-in: seq 100 runs fused eagerly and unfused under capture.
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    assert _fused_flags(net, x) == [True, True]
    FakeDPA.capturing = True
    assert _fused_flags(net, x) == [False, False]


def test_match_graph_aligns_only_the_watched_callables(fake_te):
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    m = AttentionBackendMatcher({"graphed": net.graphed}, force=True, te=fake_te)
    assert fake_te.utils.get_attention_backend == m._select
    for _ in range(2):  # cached selections must not leak between watched and unwatched calls
        assert _fused_flags(net, x) == [False, True]
    assert m.mismatches() == {"graphed": {"eager": "FusedAttention (sub-backend 1)",
                                          "graph": "UnfusedDotProductAttention",
                                          "eager_used": "UnfusedDotProductAttention"}}
    m.uninstall()
    assert fake_te.utils.get_attention_backend.__func__ is FakeUtils.get_attention_backend
    assert _fused_flags(net, x) == [True, True]  # TE's own choice again


def test_matcher_reports_nothing_where_the_backend_is_graph_safe(fake_te):
    net, x = Net(fake_te), torch.randn(2, 128, 8)
    m = AttentionBackendMatcher({"graphed": net.graphed}, force=True, te=fake_te)
    assert _fused_flags(net, x) == [True, True]
    assert m.selections["graphed"]["graph"].startswith("FusedAttention") and m.mismatches() == {}
    m.uninstall()


def test_warn_policy_keeps_te_eager_choice(fake_te):
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    m = AttentionBackendMatcher({"graphed": net.graphed}, force=False, te=fake_te)
    assert _fused_flags(net, x) == [True, True]
    assert "graphed" in m.mismatches()
    m.uninstall()


def test_matchers_stack_and_out_of_order_uninstall_is_a_pass_through(fake_te):
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    a = AttentionBackendMatcher({"graphed": net.graphed}, force=True, te=fake_te)
    b = AttentionBackendMatcher({"eager": net.eager}, force=True, te=fake_te)
    assert _fused_flags(net, x) == [False, False]
    a.uninstall()  # b still wraps a: a must turn into a pass-through, b keeps working
    assert _fused_flags(net, x) == [True, False]
    b.uninstall()
    assert _fused_flags(net, x) == [True, True]


def _config() -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", cuda_graph_module_patterns=["graphed"], cuda_graph_warmup_steps=1)


@pytest.mark.parametrize("policy", ["match_graph", "warn", "error"])
def test_partial_graphs_apply_the_attention_policy(fake_te, policy, caplog):
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    graphs = PartialCudaGraphs(net, _config(), backend="protocol", attention_backend=policy)
    flags = _fused_flags(net, x)  # an eager step before capture
    assert flags == ([False, True] if policy == "match_graph" else [True, True])
    if policy == "error":
        with pytest.raises(RuntimeError, match=r"graphed: eager FusedAttention.*under capture UnfusedDotProductAttention"):
            graphs.capture()
        assert graphs.captured is False
        graphs.delete()
        assert fake_te.utils.get_attention_backend.__func__ is FakeUtils.get_attention_backend
        return
    with caplog.at_level(logging.WARNING, logger="fsdp_cudagraph.graphs.partial"):
        report = graphs.capture()
    assert "different backend eagerly than in the graph" in caplog.text and "pad the sequence" in caplog.text
    assert report.attention_backends["graphed"]["graph"] == "UnfusedDotProductAttention"
    assert fake_te.utils.get_attention_backend.__func__ is FakeUtils.get_attention_backend  # given back
    graphs.delete()


def test_partial_graphs_reject_an_unknown_policy():
    with pytest.raises(ValueError, match=r"attention_backend='fast' is not one of"):
        PartialCudaGraphs(nn.Linear(2, 2), _config(), backend="protocol", attention_backend="fast")


def test_match_graph_attention_for_an_eager_baseline(fake_te):
    net, x = Net(fake_te), torch.randn(2, 100, 8)
    m = match_graph_attention(net, _config())
    assert _fused_flags(net, x) == [False, True]
    m.uninstall()
    assert _fused_flags(net, x) == [True, True]


# ---------------------------------------------------------------------------------------------- streams x graphs


class TinyTE:
    """A stand-in for TE's graph maker that records the stream it ran on and runs each forward once."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.streams: List[Any] = []

    def make_graphed_callables(self, modules, sample_args, *, num_warmup_iters=3, allow_unused_input=False,
                               sample_kwargs=None, capture_time_hooks=None, **_: Any):
        self.streams.append(self.fake.current)
        for m, args, kwargs in zip(modules, sample_args, sample_kwargs or [{}] * len(modules)):
            assert not (m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks)
            m(*args, **kwargs)  # a warmup forward; the 'graph' is the module itself
        return modules


def test_partial_graphs_move_the_thread_off_the_default_stream_before_eager_steps(fake_cuda, monkeypatch):
    import fsdp_cudagraph.graphs.partial as capture_mod

    te = TinyTE(fake_cuda)
    monkeypatch.setattr(capture_mod, "require_te", lambda what: te)
    monkeypatch.setattr(CudaGraphConfig, "check_runtime", lambda self: None)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    cfg = CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_module_patterns=["0"])
    assert fake_cuda.current is fake_cuda.legacy
    graphs = PartialCudaGraphs(net, cfg, backend="te")
    side = fake_cuda.current
    assert side is not fake_cuda.legacy and side.waited_on == ["legacy"]  # before the first eager step
    net(torch.randn(2, 4)).sum().backward()
    graphs.capture()
    assert te.streams == [side]  # captured from the side stream, never from the legacy one
    graphs.delete()
    assert fake_cuda.current is side  # stays: a later capture must find its nodes on a capturable stream


def test_protocol_backend_leaves_streams_alone(fake_cuda):
    net = nn.Sequential(nn.Linear(4, 4))
    PartialCudaGraphs(net, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_module_patterns=["0"]),
                      backend="protocol").delete()
    assert fake_cuda.current is fake_cuda.legacy


def test_graph_backend_choice_and_refusals():
    graph_backend = streams_mod.graph_backend
    allowed = ("torch", "protocol")
    assert graph_backend(None, torch.device("cpu"), allowed) == "protocol"
    assert graph_backend(None, torch.device("cuda", 0), allowed) == "torch"
    assert graph_backend("protocol", torch.device("cuda", 0), allowed) == "protocol"
    with pytest.raises(ValueError, match=r"backend='te' is not one of \('torch', 'protocol'\); TransformerEngine "
                                         r"captures per-layer graphs only"):
        graph_backend("te", torch.device("cpu"), allowed)
    with pytest.raises(ValueError, match=r"backend='cuda' is not one of \('torch', 'protocol'\); 'cuda' is now "
                                         r"spelled 'torch'"):
        graph_backend("cuda", torch.device("cuda", 0), allowed)
    with pytest.raises(ValueError, match=r"backend='torch' needs a model on a CUDA device, this one is on cpu; use "
                                         r"backend='protocol' on CPU"):
        graph_backend("torch", torch.device("cpu"), allowed)
