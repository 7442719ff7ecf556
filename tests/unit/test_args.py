"""Graphed calls that mix tensors with constants (``fsdp_cudagraph.capture.args``), without a process group.

Unit tests of flatten / rebuild / signature comparison and of the messages, then the whole path through
``PartialCudaGraphs`` on a plain (unsharded) module: the protocol backend on CPU, and the torch and TE
backends on a GPU (skipped elsewhere, with the reason). What must hold: a replay computes exactly what
eager computes (``torch.equal`` on outputs and gradients), a call that differs from capture runs eagerly
with one warning naming the argument (or raises in strict mode), and what a graph cannot bind is refused
at capture with the argument's name.
"""

from __future__ import annotations

import collections
import enum
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, SignatureChangedWarning
from fsdp_cudagraph.capture.args import check_signature, describe_change, flatten, rebuild, record_call
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON

NO_GPU = "needs a CUDA GPU: the torch and TE backends capture real CUDA graphs"

Pair = collections.namedtuple("Pair", "a b")


class Mode(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"


class Output(collections.OrderedDict):
    """A ModelOutput-like mapping: a dataclass-style constructor taking its fields by name."""

    def __init__(self, hidden=None, aux=None, extra=None):
        super().__init__()
        for k, v in (("hidden", hidden), ("aux", aux), ("extra", extra)):
            if v is not None:
                self[k] = v


def _sig(*args: Any, **kwargs: Any):
    return flatten((args, kwargs))[1]


# ---------------------------------------------------------------------------------------------- unit tests


def test_flatten_rebuild_round_trip_keeps_structure_constants_and_tensor_identity():
    t1, t2, t3 = torch.randn(2), torch.randn(3, requires_grad=True), torch.arange(4)
    obj = (t1, None, True, 3, 2.5, "s", torch.float16, Mode.FULL,
           {"x": [t2, (None, t3)], "p": Pair(t1, 0)}, Output(hidden=t3, aux=7))
    leaves, sig = flatten(obj)
    assert [id(t) for t in leaves] == [id(t1), id(t2), id(t3), id(t1), id(t3)]
    again = rebuild(sig, leaves)
    assert flatten(again)[1] == sig
    assert again[8]["p"] == Pair(t1, 0) and type(again[8]["p"]) is Pair
    assert type(again[9]) is Output and list(again[9].keys()) == ["hidden", "aux"] and again[9]["aux"] == 7
    assert again[1:8] == (None, True, 3, 2.5, "s", torch.float16, Mode.FULL)


@pytest.mark.parametrize(
    "a,b",
    [
        ((True,), (1,)),  # equal in Python, but a layer may test `is True`
        ((1,), (1.0,)),
        ((0.0,), (-0.0,)),
        ((None,), (False,)),
        ((torch.zeros(2, 3),), (torch.zeros(3, 2),)),
        ((torch.zeros(2),), (torch.zeros(2, dtype=torch.float64),)),
        ((torch.zeros(2),), (torch.zeros(2, requires_grad=True),)),
        (((1, 2),), ([1, 2],)),
        (({"a": 1, "b": 2},), ({"b": 2, "a": 1},)),
        ((Mode.FULL,), (Mode.SLIDING,)),
    ],
)
def test_signatures_differ_when_a_layer_could_compute_differently(a, b):
    assert _sig(*a) != _sig(*b)


def test_signatures_equal_for_same_constants_and_tensor_metadata_but_other_values():
    nan = float("nan")
    assert _sig(torch.ones(2, 3), x=(nan, None), y="m") == _sig(torch.zeros(2, 3), x=(float("nan"), None), y="m")


def test_describe_change_names_the_argument():
    names = ["hidden_states", "attention_mask"]
    old = _sig(torch.zeros(2, 4), None, position_embeddings=(torch.zeros(4), torch.zeros(4)), use_cache=False)
    msg = describe_change(old, _sig(torch.zeros(2, 4), None, position_embeddings=(torch.zeros(4), torch.zeros(4)), use_cache=True), names)
    assert msg == "`use_cache` was False (bool) at capture, now True (bool)"
    msg = describe_change(old, _sig(torch.zeros(2, 4), None, position_embeddings=(torch.zeros(4), torch.zeros(5)), use_cache=False), names)
    assert msg.startswith("`position_embeddings[1]` was a tensor of shape (4,)") and "now a tensor of shape (5,)" in msg
    msg = describe_change(old, _sig(torch.zeros(2, 4), torch.zeros(2), position_embeddings=(torch.zeros(4), torch.zeros(4)), use_cache=False), names)
    assert msg.startswith("`attention_mask` was None (NoneType) at capture, now a tensor")
    msg = describe_change(old, _sig(torch.zeros(2, 4), None, position_embeddings=(torch.zeros(4), torch.zeros(4)), use_cache=False, is_causal=False), names)
    assert "new ['is_causal']" in msg


class _Cache:
    """Stands for an object a graph cannot bind (e.g. a KV cache)."""


def test_check_signature_refuses_unbindable_objects_naming_the_argument():
    def forward(hidden_states, past_key_values=None, extras=None):
        return hidden_states

    _, sig = record_call((torch.zeros(2),), {"past_key_values": _Cache(), "extras": [1, {"k": _Cache()}]})
    with pytest.raises(TypeError) as info:
        check_signature("layers.0", sig, forward)
    msg = str(info.value)
    assert "layers.0" in msg and f"`past_key_values` ({_Cache.__module__}._Cache)" in msg and "`extras[1]['k']`" in msg
    assert "use_cache=False" in msg
    _, ok = record_call((torch.zeros(2),), {"past_key_values": None, "extras": [1, {"k": 2.0}]})
    check_signature("layers.0", ok, forward)  # control: constants and tensors pass


def test_record_call_clones_detached_and_keeps_requires_grad():
    x = torch.randn(3, requires_grad=True) * 2  # non-leaf
    m = torch.ones(3)
    leaves, _ = record_call((x,), {"mask": m, "flag": True})
    assert len(leaves) == 2 and leaves[0].is_leaf and leaves[0].requires_grad and not leaves[1].requires_grad
    assert torch.equal(leaves[0], x) and leaves[0].data_ptr() != x.data_ptr()


# ---------------------------------------------------------------------------------------------- through capture


class Attention(nn.Module):
    """Called like a HuggingFace attention: keyword tensors, None, bools, a (cos, sin) tuple, a float."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(h, h)
        self.out_kind = "tuple"

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, use_cache=False, scale=1.0,
                mode=Mode.FULL):
        cos, sin = position_embeddings
        y = torch.tanh(self.qkv(hidden_states)) * scale + cos * sin
        if attention_mask is not None:
            y = y + attention_mask
        if mode is Mode.SLIDING:
            y = y * 0.5
        if use_cache:
            y = y + 1
        aux = y.detach().sum(-1)  # an output that requires no grad
        if self.out_kind == "tuple":
            return y, None, aux
        if self.out_kind == "dict":
            return Output(hidden=y, aux=aux, extra=None)
        return Pair(y, 3)


class Net(nn.Module):
    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.attn = Attention(h)
        self.head = nn.Linear(h, 1)

    def forward(self, x, *, scale=1.0, mask=None, mode=Mode.FULL, use_cache=False):
        cos, sin = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)), torch.sin(torch.arange(x.shape[-1], dtype=x.dtype, device=x.device))
        out = self.attn(hidden_states=x, attention_mask=mask, position_embeddings=(cos, sin), use_cache=use_cache,
                        scale=scale, mode=mode)
        y = out[0] if isinstance(out, tuple) else out["hidden"]
        return self.head(y).square().mean()


def _cfg(strict: bool = False, impl: str = "local") -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl=impl, cuda_graph_module_patterns=["attn"], cuda_graph_num_warmup_iters=2,
                           cuda_graph_strict_signature=strict)


def _loss_and_grads(net: nn.Module, x: torch.Tensor, **kw) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    loss = net(xx, **kw)
    loss.backward()
    return loss.detach(), [xx.grad] + [p.grad.clone() for p in net.parameters()]


def _pair(out_kind: str, device: str, backend: str, strict: bool = False):
    torch.manual_seed(0)
    eager = Net().to(device)
    graphed = Net().to(device)
    graphed.load_state_dict(eager.state_dict())
    eager.attn.out_kind = graphed.attn.out_kind = out_kind
    graphs = PartialCudaGraphs(graphed, _cfg(strict, "transformer_engine" if backend == "te" else "local"), backend=backend)
    return eager, graphed, graphs


def _run_constants_case(device: str, backend: str, out_kind: str) -> Dict[str, Any]:
    eager, graphed, graphs = _pair(out_kind, device, backend)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g).to(device) for _ in range(6)]
    mask = torch.randn(4, 8, generator=g).to(device)
    _loss_and_grads(graphed, xs[0])  # the eager step that records sample args
    report = graphs.capture()
    dispatch = graphed.attn.__dict__["forward"]
    calls = [dict(), dict(), dict(scale=2.0), dict(mask=mask), dict(), dict(mode=Mode.SLIDING)]
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, kw in zip(xs, calls):
            e = _loss_and_grads(eager, x, **kw)
            r = _loss_and_grads(graphed, x, **kw)
            results.append((torch.equal(e[0], r[0]), all(torch.equal(a, b) for a, b in zip(e[1], r[1]))))
    # the output structure of a replay is the module's
    out = graphed.attn(hidden_states=xs[0], position_embeddings=(xs[0][0], xs[0][0]), use_cache=False)
    return {
        "report": report,
        "results": results,
        "replays": dispatch.replays,
        "eager_calls": dispatch.eager_calls,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, SignatureChangedWarning)],
        "out": out,
        "graphs": graphs,
        "graphed": graphed,
    }


@pytest.mark.parametrize("out_kind", ["tuple", "dict", "namedtuple"])
def test_protocol_constants_bound_changes_fall_back_with_one_warning(out_kind):
    r = _run_constants_case("cpu", "protocol", out_kind)
    assert r["report"].callables == ["attn"]
    assert r["results"] == [(True, True)] * 6, r["results"]
    # calls 0, 1, 4 match capture and replay; 2 (scale), 3 (mask) and 5 (mode) differ and run eagerly,
    # plus the direct call below (its position_embeddings have other shapes)
    assert (r["replays"], r["eager_calls"]) == (3, 4)
    assert len(r["warnings"]) == 1, r["warnings"]
    assert "graphed callable attn" in r["warnings"][0] and "`scale` was 1.0 (float) at capture, now 2.0" in r["warnings"][0]
    out = r["out"]
    if out_kind == "tuple":
        assert isinstance(out, tuple) and len(out) == 3 and out[1] is None and isinstance(out[2], torch.Tensor)
    elif out_kind == "dict":
        assert type(out) is Output and list(out) == ["hidden", "aux"]
    else:
        assert type(out) is Pair and out.b == 3
    graphs = r["graphs"]
    graphs.delete()
    assert "forward" not in r["graphed"].attn.__dict__


def test_protocol_replay_output_structure_and_values_match_eager():
    eager, graphed, graphs = _pair("tuple", "cpu", "protocol")
    x = torch.randn(4, 8)
    _loss_and_grads(graphed, x)
    graphs.capture()
    x.requires_grad_(True)  # as at capture (requires_grad is part of the signature)
    pe = (torch.ones(8), torch.zeros(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching call must not warn
        got = graphed.attn(hidden_states=x, attention_mask=None, position_embeddings=pe, use_cache=False, scale=1.0,
                           mode=Mode.FULL)
    want = eager.attn(hidden_states=x, attention_mask=None, position_embeddings=pe, use_cache=False, scale=1.0,
                      mode=Mode.FULL)
    assert graphed.attn.__dict__["forward"].replays == 1
    assert torch.equal(got[0], want[0]) and got[1] is None and torch.equal(got[2], want[2])
    graphs.delete()


def test_protocol_strict_mode_raises_naming_the_argument():
    eager, graphed, graphs = _pair("tuple", "cpu", "protocol", strict=True)
    x = torch.randn(4, 8)
    _loss_and_grads(graphed, x)
    graphs.capture()
    _loss_and_grads(graphed, x)  # control: the captured call replays
    with pytest.raises(ValueError) as info:
        graphed(x.requires_grad_(True), use_cache=True)
    msg = str(info.value)
    assert "graphed callable attn" in msg and "`use_cache` was False (bool) at capture, now True (bool)" in msg
    assert "cuda_graph_strict_signature" in msg
    with pytest.raises(ValueError, match="`hidden_states` was a tensor of shape \\(4, 8\\)"):
        graphed(torch.randn(2, 8, requires_grad=True))
    assert graphed.attn.__dict__["forward"].eager_calls == 0
    graphs.delete()


def test_protocol_other_training_mode_runs_eagerly_without_warning():
    eager, graphed, graphs = _pair("tuple", "cpu", "protocol")
    x = torch.randn(4, 8)
    _loss_and_grads(graphed, x)
    graphs.capture()
    graphed.eval()
    eager.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert torch.equal(graphed(x), eager(x))
    d = graphed.attn.__dict__["forward"]
    assert (d.replays, d.eager_calls) == (0, 1)
    graphs.delete()


class _CacheNet(Net):
    def forward(self, x, **kw):
        cos = torch.ones(x.shape[-1])
        return self.attn(hidden_states=x, position_embeddings=(cos, cos), use_cache=_Cache())[0].sum()


def test_protocol_capture_refuses_unbindable_argument_and_leaves_module_eager():
    torch.manual_seed(0)
    net = _CacheNet()
    graphs = PartialCudaGraphs(net, _cfg(), backend="protocol")
    x = torch.randn(4, 8)
    net(x).backward()  # the recorder never raises mid-step
    with pytest.raises(TypeError, match=rf"graphed callable attn .*`use_cache` \({_Cache.__module__}._Cache\)"):
        graphs.capture()
    assert not graphs.captured and "forward" not in net.attn.__dict__
    assert net.attn._forward_pre_hooks, "the recorder stays until capture succeeds"
    graphs.delete()


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x, buf):
        buf.add_(1)
        return x * self.w + buf


class _InPlaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _InPlace()

    def forward(self, x):
        return self.body(x, torch.zeros(4)).sum()


class _OpaqueOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w, _Cache()


class _OpaqueOutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _OpaqueOut()

    def forward(self, x):
        return self.body(x)[0].sum()


@pytest.mark.parametrize(
    "net_cls,error",
    [
        (_InPlaceNet, r"graphed callable body modifies its argument `buf` in place"),
        (_OpaqueOutNet, rf"graphed callable body returned `output\[1\]` of type {_Cache.__module__}._Cache"),
    ],
)
def test_protocol_capture_refuses_what_replay_would_get_wrong(net_cls, error):
    net = net_cls()
    graphs = PartialCudaGraphs(net, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_module_patterns=["body"]),
                               backend="protocol")
    net(torch.randn(4, requires_grad=True)).backward()
    with pytest.raises(NotImplementedError, match=error):
        graphs.capture()
    assert not graphs.captured and "forward" not in net.body.__dict__
    assert net(torch.ones(4)).item() == (4.0 if net_cls is _OpaqueOutNet else 8.0)  # eager again
    graphs.delete()


# ---------------------------------------------------------------------------------------------- GPU backends


def _gpu_case(backend: str) -> None:
    for out_kind in ("tuple", "dict"):
        r = _run_constants_case("cuda", backend, out_kind)
        assert r["results"] == [(True, True)] * 6, (backend, out_kind, r["results"])
        assert (r["replays"], r["eager_calls"]) == (3, 4)
        assert len(r["warnings"]) == 1 and "`scale`" in r["warnings"][0]
        r["graphs"].delete()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_torch_backend_constants_none_outputs_and_fallback():
    _gpu_case("torch")


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "TE present")
def test_te_backend_constants_none_outputs_and_fallback():
    _gpu_case("te")
