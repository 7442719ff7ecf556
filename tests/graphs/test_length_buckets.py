"""Length buckets without a process group: helpers, call padding, and LengthBucketGraphs on a plain encoder.

The graphs use the protocol backend (the capture schedule without CUDA graphs), so what is checked here is
the mechanism around the graphs: bucket selection, padding of the length arguments and cutting of the outputs,
segment ids and the block-diagonal mask, the eager fallbacks (past the largest bucket; a replay that would
overwrite a pending replay's pool), refusals at capture, and delete(). The distributed runs under
megatron_fsdp are in test_length_buckets_gloo.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fsdp_cudagraph.apps.vision as vision
from fsdp_cudagraph import BucketReplayConflictWarning, CudaGraphConfig, LengthArg, LengthBucketGraphs, hooks_snapshot
from fsdp_cudagraph.capture.buckets import BucketOverflowWarning, Buckets
from fsdp_cudagraph.graphs.length_buckets import LengthSpec as _LengthSpec, unpad_output as _unpad_output
from fsdp_cudagraph.graphs.length_buckets import block_diagonal_mask, segment_ids_from_cu_seqlens
from fsdp_cudagraph.apps.vision import LENGTH_ARGS, VisionBlock, VisionConfig, VisionEncoder, synthetic_images

CPU = torch.device("cpu")
CFG = VisionConfig(patch_dim=12, hidden_size=32, num_layers=2, num_heads=2, max_patches_per_image=64)


def _config(strict: bool = False) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", cuda_graph_module_patterns=["blocks.[0-9]"],
                           cuda_graph_strict_signature=strict, cuda_graph_num_warmup_iters=1)


def _encoders():
    torch.manual_seed(0)
    enc = VisionEncoder(CFG)
    return enc, copy.deepcopy(enc)


def _graphed(buckets=(16, 32), strict: bool = False, length: int = 20):
    enc, ref = _encoders()
    graphs = LengthBucketGraphs(enc, _config(strict), buckets=buckets, length_args=LENGTH_ARGS, backend="protocol")
    patches, cu, _ = synthetic_images(length, 0, 0, CFG, CPU)
    enc(patches, cu).sum().backward()  # the eager step that records each block's call
    enc.zero_grad(set_to_none=True)
    graphs.capture()
    return enc, ref, graphs


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pad_blocks_eagerly(enc: VisionEncoder, buckets) -> None:
    vision._pad_each_block(enc, Buckets(buckets))


# ---------------------------------------------------------------------------------------------- helpers


def test_segment_ids_and_block_diagonal_mask():
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    seg = segment_ids_from_cu_seqlens(cu, 9)
    assert seg.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and seg.dtype == torch.int64
    padded = torch.cat([seg, torch.full((3,), -1)])
    mask = block_diagonal_mask(padded)
    expected = torch.zeros(12, 12, dtype=torch.bool)
    for a, b in [(0, 3), (3, 5), (5, 9), (9, 12)]:  # three images, then the padding as a segment of its own
        expected[a:b, a:b] = True
    assert torch.equal(mask, expected)
    assert not mask[:9, 9:].any() and not mask[9:, :9].any()  # no real token sees padding, nor the reverse
    assert mask.any(dim=1).all()  # every row attends somewhere: no NaN from a fully masked row


@pytest.mark.parametrize("cu", [[1, 3, 9], [0, 3, 8], [0, 5, 3, 9]], ids=["start", "end", "decreasing"])
def test_bad_cu_seqlens_are_refused(cu):
    with pytest.raises(ValueError, match="must start at 0, never decrease and end at the number of tokens"):
        segment_ids_from_cu_seqlens(torch.tensor(cu), 9)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        segment_ids_from_cu_seqlens(torch.tensor([0.0, 9.0]), 9)


def test_length_spec_pads_cuts_and_checks_calls():
    spec = _LengthSpec("blocks.0", VisionBlock(CFG).forward, LENGTH_ARGS, output_dim=0)
    x, seg = torch.randn(5, 32), torch.tensor([0, 0, 1, 1, 1])
    assert spec.length((x, seg), {}) == 5 and spec.length((x,), {"segment_ids": seg}) == 5
    (px,), kw = spec.resize((x,), {"segment_ids": seg}, 8)  # a positional and a keyword length argument
    assert list(kw) == ["segment_ids"] and px.shape == (8, 32)
    assert torch.equal(px[:5], x) and torch.equal(px[5:], torch.zeros(3, 32))
    assert kw["segment_ids"].tolist() == [0, 0, 1, 1, 1, -1, -1, -1]
    (cx, cseg), _ = spec.resize((x, seg), {}, 3)  # sample args of a smaller bucket are cut
    assert torch.equal(cx, x[:3]) and cseg.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="`segment_ids` has length 4 along dim 0 but `x` has 5"):
        spec.length((x, seg[:4]), {})
    with pytest.raises(ValueError, match="without any of its length arguments"):
        spec.length((), {})
    with pytest.raises(TypeError, match="length argument `x` is a list"):
        spec.length(([1, 2],), {})


def test_unpad_output_cuts_every_tensor_of_the_structure():
    t = torch.arange(8.0).view(4, 2)
    assert torch.equal(_unpad_output(t, 3, 0), t[:3])
    out = _unpad_output((t, None, {"a": t.t()}), 2, 0)
    assert torch.equal(out[0], t[:2]) and out[1] is None and torch.equal(out[2]["a"], t.t()[:2])


def test_bucket_and_length_arg_arguments():
    enc, _ = _encoders()
    g = LengthBucketGraphs(enc, _config(), buckets=300, length_args={"x": 0}, backend="protocol")
    assert g.buckets.sizes == (64, 128, 256, 300) and g.length_args == {"x": LengthArg(0, 0)}
    g.delete()
    g = LengthBucketGraphs(enc, _config(), buckets=[8, 4], length_args=LENGTH_ARGS, backend="protocol")
    assert g.buckets.sizes == (4, 8)
    g.delete()
    with pytest.raises(ValueError, match="length_args is empty"):
        LengthBucketGraphs(enc, _config(), buckets=8, length_args={}, backend="protocol")
    with pytest.raises(TypeError, match="must be a dimension"):
        LengthBucketGraphs(enc, _config(), buckets=8, length_args={"x": "0"}, backend="protocol")
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        LengthBucketGraphs(enc, _config(), buckets=8, length_args={"x": 0}, backend="cuda")
    assert hooks_snapshot(enc.blocks[0]) == hooks_snapshot(VisionBlock(CFG))  # the refused ones left no hooks


# ---------------------------------------------------------------------------------------------- replay


def test_replay_pads_to_the_smallest_bucket_and_matches_eager_padding():
    enc, ref, graphs = _graphed()
    _pad_blocks_eagerly(ref, (16, 32))
    patches, cu, _ = synthetic_images(20, 1, 0, CFG, CPU)
    p1, p2 = patches.clone().requires_grad_(), patches.clone().requires_grad_()
    out, expected = enc(p1, cu), ref(p2, cu)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(out, expected) and torch.equal(p1.grad, p2.grad) and _grads(enc).keys() == _grads(ref).keys()
    assert all(torch.equal(a, b) for a, b in zip(_grads(enc).values(), _grads(ref).values()))
    # 20 patches: both blocks ran bucket 32, 12 padded tokens each
    assert graphs.stats[32] == {"calls": 2, "real_tokens": 40, "padded_tokens": 24} and graphs.stats[16]["calls"] == 0
    assert graphs.padding_overhead() == pytest.approx(24 / 40)
    per_bucket = graphs._dispatchers["blocks.0"].per_bucket
    assert per_bucket[32].replays == 1 and per_bucket[16].replays == 0


def test_prepadded_calls_replay_without_copies_and_padding_gets_zero_gradient():
    enc, ref, graphs = _graphed()
    patches, cu, _ = synthetic_images(13, 2, 0, CFG, CPU)
    outs = []
    for model in (enc, ref):
        seen = []
        model(patches, cu, 16, seen).sum().backward()
        outs.append(seen[0].grad)
    assert graphs.stats[16] == {"calls": 2, "real_tokens": 32, "padded_tokens": 0}  # called at the bucket length
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][13:] == 0).all() and (outs[0][:13] != 0).any()


def test_past_the_largest_bucket_runs_eagerly_with_one_warning():
    enc, ref, graphs = _graphed()
    patches, cu, _ = synthetic_images(40, 3, 0, CFG, CPU)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a, b = enc(patches, cu), enc(patches, cu)
    overflow = [x for x in w if issubclass(x.category, BucketOverflowWarning)]
    assert len(overflow) == 1 and "size 40 exceeds the largest bucket 32" in str(overflow[0].message)
    assert torch.equal(a, ref(patches, cu)) and torch.equal(b, a)  # eager, unpadded
    assert graphs.stats["eager_overflow"] == 4 and graphs.stats[32]["calls"] == 0
    strict, _, _ = _graphed(strict=True)
    with pytest.raises(ValueError, match="size 40 exceeds the largest bucket 32 .* refused in strict mode"):
        strict(patches, cu)


def test_a_replay_that_would_overwrite_a_pending_replay_runs_eagerly():
    enc, ref, graphs = _graphed()
    plain = copy.deepcopy(ref)
    _pad_blocks_eagerly(ref, (16, 32))
    long_, lcu, _ = synthetic_images(20, 4, 0, CFG, CPU)
    short, scu, _ = synthetic_images(12, 5, 0, CFG, CPU)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first = enc(long_, lcu)  # bucket 32: pending until its backward
        second = enc(short, scu)  # bucket 16 shares the pool of each block: eager instead
        third = enc(short, scu)  # and again (warned once)
        (first.sum() + second.sum()).backward()
    conflicts = [x for x in w if issubclass(x.category, BucketReplayConflictWarning)]
    assert len(conflicts) == 1 and "still awaits its backward" in str(conflicts[0].message)
    assert graphs.stats["eager_conflict"] == 4 and graphs.stats[32]["calls"] == 2 and graphs.stats[16]["calls"] == 0
    assert torch.equal(first, ref(long_, lcu))  # replayed (padded to 32)
    assert torch.equal(second, plain(short, scu)) and torch.equal(third, second)  # eager, as called
    del third
    enc(short, scu).sum().backward()  # all backwards done: replays again
    assert graphs.stats[16]["calls"] == 2
    out = enc(short, scu)  # a graph freed without backward is not pending
    del out
    enc(short, scu)
    assert graphs.stats[16]["calls"] == 6 and graphs.stats["eager_conflict"] == 4
    held = enc(short, scu)  # the same bucket twice before a backward would overwrite its saved activations too
    with torch.no_grad():
        enc(short, scu)
    assert graphs.stats["eager_conflict"] == 6
    del held
    strict, _, _ = _graphed(strict=True)
    kept = strict(long_, lcu)
    with pytest.raises(RuntimeError, match="still awaits its backward"):
        strict(short, scu)
    del kept


def test_capture_refusals_leave_the_modules_untouched():
    enc, _ = _encoders()
    before = [hooks_snapshot(b) for b in enc.blocks]
    graphs = LengthBucketGraphs(enc, _config(), buckets=(16,), length_args=LENGTH_ARGS, backend="protocol")
    with pytest.raises(RuntimeError, match="did not run in an eager step"):
        graphs.capture()
    graphs.delete()
    graphs = LengthBucketGraphs(enc, _config(), buckets=(16,), length_args={"hidden": 0}, backend="protocol")
    patches, cu, _ = synthetic_images(10, 0, 0, CFG, CPU)
    enc(patches, cu)
    with pytest.raises(ValueError, match=r"name no argument of blocks.0's recorded call \(its forward takes \['x', 'segment_ids'\]\)"):
        graphs.capture()
    graphs.delete()

    class Pooled(VisionBlock):  # returns one vector per call: its length does not vary
        def forward(self, x, segment_ids):
            return super().forward(x, segment_ids).sum(0, keepdim=True)

    for b in enc.blocks:
        b.__class__ = Pooled
    graphs = LengthBucketGraphs(enc, _config(), buckets=(16, 32), length_args=LENGTH_ARGS, backend="protocol")
    enc.blocks[0](torch.randn(10, 32), torch.zeros(10, dtype=torch.long))
    enc.blocks[1](torch.randn(10, 32), torch.zeros(10, dtype=torch.long))
    with pytest.raises(NotImplementedError, match=r"returned `output` of shape \(1, 32\) for bucket 32"):
        graphs.capture()
    assert [hooks_snapshot(b) for b in enc.blocks] == before
    assert all("forward" not in b.__dict__ for b in enc.blocks)


def test_delete_restores_eager_modules():
    enc, ref, graphs = _graphed()
    assert all(type(b.__dict__.get("forward")).__name__ == "_LengthDispatcher" for b in enc.blocks)
    with pytest.raises(RuntimeError, match="already called"):
        graphs.capture()
    graphs.delete()
    assert all("forward" not in b.__dict__ for b in enc.blocks)
    assert [hooks_snapshot(b) for b in enc.blocks] == [hooks_snapshot(b) for b in ref.blocks]
    patches, cu, _ = synthetic_images(20, 6, 0, CFG, CPU)
    assert torch.equal(enc(patches, cu), ref(patches, cu))  # eager, unpadded again


class _FakeCuda:
    """Enough of torch.cuda for ``_streams``: a legacy default stream, side streams, the current one."""

    class Stream:
        def __init__(self, index: int = 0) -> None:
            self.waited = []

        def wait_stream(self, other) -> None:
            self.waited.append(other)

    def __init__(self) -> None:
        self.legacy = self.current = self.Stream()

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int = 0):
        return self.current

    def default_stream(self, index: int = 0):
        return self.legacy

    def set_stream(self, stream) -> None:
        self.current = stream


@pytest.mark.parametrize("backend", ["torch", "protocol"])
def test_building_moves_the_thread_off_the_legacy_default_stream(monkeypatch, backend):
    import fsdp_cudagraph.capture.streams as streams_mod

    fake = _FakeCuda()
    monkeypatch.setattr(streams_mod, "_cuda", fake)
    monkeypatch.setattr(streams_mod, "_side_streams", {})
    monkeypatch.setattr(CudaGraphConfig, "check_runtime", lambda self: None)  # checked at build, as PartialCudaGraphs
    enc, _ = _encoders()
    graphs = LengthBucketGraphs(enc, _config(), buckets=(8,), length_args={"x": 0}, backend=backend)
    if backend == "torch":  # before the eager steps that precede capture, as PartialCudaGraphs does
        assert fake.current is not fake.legacy and fake.current.waited == [fake.legacy]
    else:  # the protocol backend captures nothing
        assert fake.current is fake.legacy
    graphs.delete()


# ---------------------------------------------------------------------------------------------- memory pools


def _stub_graph_makers(monkeypatch):
    """torch's and TE's graph makers at their signatures, without graphs: record each call's callables, sample
    shapes and pool, run the callables eagerly (what the wrappers need to learn their outputs)."""
    import fsdp_cudagraph.graphs.partial as capture_mod

    calls = []
    handles = iter(range(1000))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(handles)))
    monkeypatch.setattr(CudaGraphConfig, "check_runtime", lambda self: None)

    def torch_maker(callables, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
        calls.append(([c.callable_name for c in callables], [a[0].shape[0] for a in sample_args], pool))
        for c, a in zip(callables, sample_args):
            c(*a)
        return callables

    class StubTE:
        @staticmethod
        def make_graphed_callables(modules, sample_args, *, num_warmup_iters=3, allow_unused_input=False,
                                   sample_kwargs=None, clone_param_grads_on_return=True, capture_time_hooks=None,
                                   pool=None):
            return torch_maker(modules, sample_args, pool=pool)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", torch_maker)
    monkeypatch.setattr(capture_mod, "require_te", lambda what: StubTE)
    return calls


@pytest.mark.parametrize("backend", ["torch", "te"])
def test_buckets_share_pools_largest_first(monkeypatch, backend):
    calls = _stub_graph_makers(monkeypatch)
    enc, _ = _encoders()
    graphs = LengthBucketGraphs(enc, _config(), buckets=(8, 16, 32), length_args=LENGTH_ARGS, backend=backend)
    patches, cu, _ = synthetic_images(20, 0, 0, CFG, CPU)
    enc(patches, cu).sum().backward()
    report = graphs.capture()
    assert [r.bucket for r in report.buckets] == [32, 16, 8]
    if backend == "torch":  # one call per callable (no FSDP units here), each callable's pool shared by its buckets
        assert [(c[0], c[1]) for c in calls] == [([f"blocks.{i}"], [b]) for b in (32, 16, 8) for i in (0, 1)]
        pools = {name[0]: {c[2] for c in calls if c[0] == name} for name, _, _ in calls}
        assert pools == {"blocks.0": {("pool", 0)}, "blocks.1": {("pool", 1)}} and report.num_pools == 2
    else:  # TE captures every callable of a bucket in one call, one pool for all
        assert [(c[0], c[1]) for c in calls] == [(["blocks.0", "blocks.1"], [b, b]) for b in (32, 16, 8)]
        assert {c[2] for c in calls} == {("pool", 0)} and report.num_pools == 1
    graphs.delete()


def test_torch_pools_follow_the_capture_calls_of_fsdp_units():
    # torch captures consecutive callables of one FSDP unit in one make_graphed_callables call: they share a
    # pool; the next unit gets its own (a pool across calls would be unsafe, see [Note: length buckets]).
    enc, _ = _encoders()
    graphs = LengthBucketGraphs(enc, _config(), buckets=(8,), length_args={"x": 0}, backend="protocol")
    units = {"blocks.0.ln1": "u0", "blocks.0.qkv": "u0", "blocks.1.ln1": "u1", "head": None, "ln_f": None}

    class Engine:
        def unit_of(self, module):
            return units[next(n for n, m in enc.named_modules() if m is module)]

    graphs.engine, graphs._modules = Engine(), {n: enc.get_submodule(n) for n in units}
    assert graphs._pool_keys(list(units)) == {"blocks.0.ln1": "blocks.0.ln1", "blocks.0.qkv": "blocks.0.ln1",
                                              "blocks.1.ln1": "blocks.1.ln1", "head": "head", "ln_f": "ln_f"}
    graphs.backend = "te"
    assert set(graphs._pool_keys(list(units)).values()) == {"all"}
    graphs.delete()


# ---------------------------------------------------------------------------------------------- attention


def test_multi_image_samples_match_images_encoded_separately():
    # Tolerance: per_image_check over 40 packs (10 seeds x 4 lengths) of VisionConfig() measured at most
    # 9.5e-7 (features up to ~4, fp32); TOLERANCES['cpu']['per_image'] = 4e-6. Attention across images (the
    # PR's graph path) differs by at least 0.068 on the same packs.
    tol = vision.TOLERANCES["cpu"]["per_image"]
    res = vision.per_image_check(VisionConfig(), CPU, totals=(20, 77, 120), seeds=(0, 1))
    assert res["max_diff"] <= tol < res["control_min_diff"]
    assert res["control_min_diff"] > 1000 * tol
