"""The dropless MoE layer (``fsdp_cudagraph/apps/moe.py``) on its own, no process group.

- the dropless layer (``split``, ``grouped_mm``) equals the dense toy (every expert on every token, the
  numerical oracle) with the same weights in fp32: output, input gradient and every parameter gradient within
  ``1e-6`` of max(1, the tensor's largest magnitude) (measured on torch 2.13 CPU: at most 2.3e-7, the
  router gradient: 2.9e-6 absolute on values up to 12.6; the output 4.8e-7 absolute on values up to 4.0);
- the expert paths agree with each other (fwd and grads), with and without a shared expert, also when an
  expert receives no token; ``capacity`` equals them when its capacity holds every row and drops rows past
  a smaller one; ``te_grouped`` against ``split`` on CUDA with TE;
- the preprocess: rows grouped by expert in ascending order, stable inside an expert, counts equal a
  bincount, the inverse map undoes the permutation, T*K rows whatever the routing;
- no host sync in the ``grouped_mm`` and ``capacity`` paths: no ``tolist``/``item``/``__bool__``/``cpu`` call in forward and
  backward (counted; ``split`` is the positive control), and on CUDA under ``set_sync_debug_mode("error")``;
  a CUDA-graph capture of the whole block (bf16 experts) replays the eager output;
- ``cuda_graph_unsafe`` says why ``split``/``te_grouped`` cannot be captured and is None for
  ``grouped_mm``/``capacity``/``dense``; fp32 ``grouped_mm`` on CUDA is refused by name; bad config values are refused.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import pytest
import torch

from fsdp_cudagraph.apps.model import GPTConfig, MoEBlock, MoEPreprocess, mixtral_config, olmoe_config, unpermute
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON
from fsdp_cudagraph.config import graph_unsafe_modules

SMALL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, moe_every=1, num_experts=4,
             moe_top_k=2, ffn_hidden_size=48)
PATHS = ["split", "grouped_mm"]


def _block(experts: str, *, seed: int = 0, device: str = "cpu", **kw) -> MoEBlock:
    torch.manual_seed(seed)
    return MoEBlock(GPTConfig(moe_experts=experts, **{**SMALL, **kw})).to(device)


def _run(block: MoEBlock, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients for a dense upstream gradient."""
    x = x.detach().clone().requires_grad_(True)
    out = block(x)
    g = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    out.backward(g)
    res = {"out": out.detach(), "x.grad": x.grad}
    res.update({f"{n}.grad": p.grad for n, p in block.named_parameters()})
    return res


def _x(b: int = 2, s: int = 16, h: int = 32, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed)).to(device)


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The largest difference over every tensor, each scaled by max(1, its largest magnitude): fp32 rounding
    of sums in another order is a few ulp of the values summed, whatever their size."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max().clamp(min=1)).item() for k in a)


@pytest.mark.parametrize("experts", PATHS)
def test_dropless_equals_dense_oracle(experts):
    dense, dropless = _block("dense"), _block(experts)
    assert dense.state_dict().keys() == dropless.state_dict().keys()
    assert all(torch.equal(v, dropless.state_dict()[k]) for k, v in dense.state_dict().items())  # same weights
    ref, got = _run(dense, _x()), _run(dropless, _x())
    assert _max_diff(ref, got) <= 1e-6, _max_diff(ref, got)
    # the oracle check can fail: a different top-k changes the output by far more than the tolerance
    wrong = _block(experts, moe_top_k=1)
    assert _max_diff({"out": ref["out"]}, {"out": _run(wrong, _x())["out"]}) > 1e-3


@pytest.mark.parametrize("shared", [False, True])
def test_split_and_grouped_mm_agree(shared):
    a, b = _block("split", moe_shared_expert=shared), _block("grouped_mm", moe_shared_expert=shared)
    ra, rb = _run(a, _x()), _run(b, _x())
    assert _max_diff(ra, rb) <= 1e-6, _max_diff(ra, rb)
    assert ("shared.fc1.weight.grad" in ra) == shared


def test_capacity_equals_dropless_when_nothing_is_dropped_and_drops_past_capacity():
    """capacity_factor = E makes C = T*K (room for every row): equal to split. Factor 0.5 must drop rows:
    the dropped choices contribute nothing, so the output differs, and an expert's overflow rows get no
    gradient into its weights from those rows."""
    e = SMALL["num_experts"]
    split, roomy = _block("split"), _block("capacity", moe_capacity_factor=float(e))
    ra, rb = _run(split, _x()), _run(roomy, _x())
    assert _max_diff(ra, rb) <= 1e-6, _max_diff(ra, rb)
    tight = _block("capacity", moe_capacity_factor=0.5)
    n = _x().shape[0] * _x().shape[1] * SMALL["moe_top_k"]
    assert tight.experts.capacity(n) == n // e // 2
    assert _max_diff({"out": ra["out"]}, {"out": _run(tight, _x())["out"]}) > 1e-3


def test_an_expert_without_tokens():
    """Routing that never picks expert 3: both paths handle the empty group (and leave its weights' gradient 0)."""
    t, k = 24, SMALL["moe_top_k"]
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(3, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    x = torch.randn(t, SMALL["hidden_size"], generator=gen)
    res = []
    for path in PATHS + ["capacity"]:
        blk = _block(path, moe_capacity_factor=float(SMALL["num_experts"]))
        rows, probs, counts, inverse = blk.preprocess(x, w, ids)
        assert counts[3] == 0 and counts.sum() == t * k
        out = unpermute(blk.experts(rows, counts), probs, inverse, k)
        out.backward(torch.ones_like(out))
        res.append({"out": out.detach(), "w1": blk.experts.w1.grad, "w2": blk.experts.w2.grad})
        assert torch.count_nonzero(blk.experts.w1.grad[3]) == 0 and torch.count_nonzero(blk.experts.w1.grad[:3]) > 0
    assert _max_diff(res[0], res[1]) <= 1e-6 and _max_diff(res[0], res[2]) <= 1e-6


def test_preprocess_permutation():
    cfg = GPTConfig(moe_experts="split", **SMALL)
    pre = MoEPreprocess(cfg)
    t, k, h, e = 24, cfg.moe_top_k, 8, cfg.num_experts
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])  # distinct experts per token, as top-k gives
    w = torch.rand(t, k)
    rows, probs, counts, inverse = pre(x, w, ids)
    assert rows.shape == (t * k, h) and probs.shape == (t * k,) and counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=e))
    expert_of_row = torch.repeat_interleave(torch.arange(e), counts)
    token_of_row = torch.empty(t * k, dtype=torch.int64)
    # each row is a copy of its token, with that token's weight for the expert the row belongs to
    for r in range(t * k):
        matches = [(tok, j) for tok in range(t) for j in range(k)
                   if ids[tok, j] == expert_of_row[r] and torch.equal(x[tok], rows[r])]
        assert len(matches) == 1, r
        token_of_row[r] = matches[0][0]
        assert probs[r] == w[matches[0]]
    for ex in range(e):  # stable: inside one expert the tokens keep their order
        toks = token_of_row[expert_of_row == ex]
        assert torch.equal(toks, toks.sort().values)
    assert torch.equal(rows[inverse], x.repeat_interleave(k, dim=0))  # the inverse map undoes the permutation


@contextlib.contextmanager
def _count_host_reads() -> Iterator[List[str]]:
    """Count Python-level calls that read a tensor's value on the host."""
    seen: List[str] = []
    names = ("tolist", "item", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name, fn):
        def counted(self, *a, **k):
            seen.append(name)
            return fn(self, *a, **k)
        return counted

    try:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, wrap(n, fn))
        yield seen
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


@pytest.mark.parametrize("experts,syncs", [("grouped_mm", False), ("capacity", False), ("split", True)])
def test_grouped_mm_path_reads_nothing_on_the_host(experts, syncs):
    block, x = _block(experts), _x()
    with _count_host_reads() as seen:
        _run(block, x)
    assert bool(seen) == syncs, seen
    if syncs:
        assert "tolist" in seen


def test_capturability_attribute():
    for experts, words in (("split", "counts.tolist()"), ("grouped_mm", None), ("capacity", None), ("dense", None)):
        unsafe = graph_unsafe_modules(_block(experts))
        if words is None:
            assert unsafe == [], unsafe
        else:
            assert unsafe == [("experts", unsafe[0][1])] and words in unsafe[0][1], unsafe


@pytest.mark.parametrize("kw,words", [
    (dict(moe_experts="sparse"), ["moe_experts='sparse'", "'grouped_mm'"]),
    (dict(moe_grouped_mm_dtype="fp16"), ["moe_grouped_mm_dtype='fp16'"]),
    (dict(moe_capacity_factor=0.0), ["moe_capacity_factor=0.0", "> 0"]),
    (dict(moe_experts="dense", moe_shared_expert=True), ["moe_shared_expert=True", "dropless"]),
])
def test_bad_config_refused(kw, words):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**SMALL, **kw})
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_presets():
    o = olmoe_config(num_layers=2, seq_len=128)
    assert (o.hidden_size, o.num_layers, o.num_experts, o.moe_top_k, o.moe_ffn_hidden_size, o.num_heads,
            o.moe_every, o.seq_len, o.moe_experts) == (2048, 2, 64, 8, 1024, 16, 1, 128, "grouped_mm")
    m = mixtral_config(moe_experts="split")
    assert (m.num_experts, m.moe_top_k, m.hidden_size, m.num_layers, m.moe_ffn_hidden_size, m.moe_experts) == (
        8, 2, 1024, 8, 3584, "split")


# ---------------------------------------------------------------------------------------------- CUDA / TE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_grouped_mm_bf16_no_sync_and_fp32_refused():
    block = _block("grouped_mm", device="cuda", moe_grouped_mm_dtype="bfloat16")
    x = _x(device="cuda")
    _run(block, x)  # warm up (lazy initialisation may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(block, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    fp32 = _block("grouped_mm", device="cuda")
    assert "bfloat16" in fp32.experts.cuda_graph_unsafe
    with pytest.raises(NotImplementedError, match="moe_grouped_mm_dtype='bfloat16'"):
        fp32(x)


@needs_cuda
def test_cuda_graph_of_the_whole_block_replays_the_eager_output():
    block = _block("grouped_mm", device="cuda", moe_grouped_mm_dtype="bfloat16")
    x = _x(device="cuda").requires_grad_(True)
    eager = block(x).detach().clone()
    graphed = torch.cuda.make_graphed_callables(block, (x,))
    assert torch.equal(graphed(x).detach(), eager)


@needs_cuda
@pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "needs TransformerEngine")
def test_te_grouped_agrees_with_split():
    torch.backends.cuda.matmul.allow_tf32 = False
    split, te = _block("split", device="cuda"), _block("te_grouped", device="cuda")
    te.load_state_dict({k: v for k, v in split.state_dict().items() if not k.startswith("experts.")}, strict=False)
    with torch.no_grad():
        for e in range(SMALL["num_experts"]):
            getattr(te.experts.fc1, f"weight{e}").copy_(split.experts.w1[e].t())
            getattr(te.experts.fc2, f"weight{e}").copy_(split.experts.w2[e].t())
    assert te.experts.cuda_graph_unsafe and "GroupedLinear" in te.experts.cuda_graph_unsafe
    rs, rt = _run(split, _x(device="cuda")), _run(te, _x(device="cuda"))
    # TE's GEMMs take fp32 operands in TF32 (torch's allow_tf32 does not reach them): on an H100 (TE 2.20.2) the
    # outputs differed by up to 5e-4 on values of order 1, where atol=1e-5 failed. So the bound is relative,
    # ||te - split|| / ||split|| <= 2e-3: TF32 lands near 3e-4, and a wrong expert, weight or permutation
    # gives an error of order 1.
    pairs = {"out": (rs["out"], rt["out"]), "x.grad": (rs["x.grad"], rt["x.grad"])}
    for e in range(SMALL["num_experts"]):
        pairs[f"fc1.weight{e}.grad"] = (rs["experts.w1.grad"][e].t(), getattr(te.experts.fc1, f"weight{e}").grad)
        pairs[f"fc2.weight{e}.grad"] = (rs["experts.w2.grad"][e].t(), getattr(te.experts.fc2, f"weight{e}").grad)
    errors = {k: ((b - a).norm() / a.norm()).item() for k, (a, b) in pairs.items()}
    assert max(errors.values()) <= 2e-3, f"TE GroupedLinear vs split, relative errors: {errors}"
