"""CPU tests of the NVIDIA adapter over FP8 weights ([Note: NVIDIA's FP8 parameters and replay] in
``fsdp_cudagraph/engines/nvidia/adapter.py``), with stand-ins where TE is needed.

TE's ``Float8Tensor`` needs CUDA, and NVIDIA's ``MegatronFSDP.__init__`` builds CUDA streams: the engine is
``tests/adapters/test_nvidia.py``'s ``build_engine`` (NVIDIA's own hooks on an object built with ``__new__``), and
each FP8 weight is the CPU stand-in of ``tests/engine/_fp8_net.py`` (``Fp8Param``: ``_data``, ``_transpose`` and
``_scale_inv`` as TE's tensor carries them, registered with the FP8 expansion through ``StandInOps``), set on the
units' first linear before the engine is built, as ``quantized_model_init`` builds them. What is checked:

- the replay tensors of an FP8 weight are its bytes, transpose and scale-inverse, named; the probe reads their
  addresses, is unchanged while nothing moved (in-place writes included) and changes when any one of them moves;
- through ``PartialCudaGraphs`` (protocol backend): replays run while nothing moved, and a replay after the bytes,
  the transpose or the scale moved is refused before it runs, naming the weight and the tensor (negative controls);
- what stays refused, each naming the fix: ``keep_fp8_transpose_cache=False``, a strategy other than ZeRO-3, a
  ``transpose_weight_buffer`` (MXFP8), a quantized weight of another layout; ``fp8_param_gather=True`` over bf16
  weights is not refused; an FP8 recipe is let through (``fp8_supported``) only over FP8 weights.
"""

from __future__ import annotations

import types
from typing import Iterator

import pytest
import torch

from fsdp_cudagraph.engines import adapter_for
from megatron_fsdp import _fp8
from tests.adapters.test_nvidia import Net, build_engine, needs_mcore
from tests.engine._fp8_net import Fp8Param, StandInOps

WHAT = {"_data": "FP8 bytes", "_transpose": "transpose", "_scale_inv": "scale_inv"}
SAFE = dict(fsdp_double_buffer=True, keep_fp8_transpose_cache=True)


@pytest.fixture
def standin() -> Iterator[None]:
    remove = _fp8.register_ops(StandInOps())
    try:
        yield
    finally:
        remove()


def fp8_net() -> Net:
    """test_nvidia's Net with every unit's fc1 weight an FP8 stand-in whose transpose exists (kept, as
    keep_fp8_transpose_cache=True keeps TE's after the first backward unshard)."""
    net = Net()
    for layer in net.layers:
        w = Fp8Param(layer.fc1.weight.detach())
        w._transpose = w._data.t().contiguous()
        layer.fc1.weight = w
    return net


@needs_mcore
def test_replay_tensors_and_probe_read_the_bytes_transpose_and_scale(standin):
    e, _ = build_engine(fp8_net(), **SAFE)
    adapter = adapter_for(e)
    adapter.check_partial_graphs()
    unit = e.module.layers[1]
    w = unit.fc1.weight
    got = dict(adapter.replay_tensors(unit))
    assert list(got) == ["fc1.weight (FP8 bytes)", "fc1.weight (transpose)", "fc1.weight (scale_inv)", "fc1.bias",
                         "fc2.weight", "fc2.bias"]
    assert got["fc1.weight (FP8 bytes)"] is w._data and got["fc1.weight (transpose)"] is w._transpose
    assert got["fc1.weight (scale_inv)"] is w._scale_inv and got["fc2.weight"] is unit.fc2.weight
    probe = adapter.replay_probe(unit)
    captured = probe()
    assert captured == tuple(t.data_ptr() for t in got.values())
    w._scale_inv.mul_(2.0)  # the optimizer step's quantization writes in place: nothing moved
    w._transpose.copy_(w._data.t())  # as the backward unshard rewrites it with keep_fp8_transpose_cache=True
    assert probe() == captured
    for attr, what in WHAT.items():
        old = getattr(w, attr)
        setattr(w, attr, old.clone())
        moved = probe()
        assert moved != captured, attr
        assert [n for n, t in adapter.replay_tensors(unit) if t.data_ptr() not in captured] == [f"fc1.weight ({what})"]
        setattr(w, attr, old)
        assert probe() == captured
    w._transpose = None  # what keep_fp8_transpose_cache=False leaves after a release: the set changed
    assert probe() != captured


@needs_mcore
@pytest.mark.parametrize("attr", list(WHAT))
def test_a_replay_after_an_fp8_tensor_moved_is_refused_naming_it(standin, attr):
    """PartialCudaGraphs (protocol backend) over NVIDIA's hooks and FP8 stand-ins: replays run while nothing moved;
    after ``attr`` of layer 1's weight moved, the next replay is refused before it runs, naming it."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    e, rec = build_engine(fp8_net(), **SAFE)
    e.param_and_grad_buffer.parameter_groups = [types.SimpleNamespace(requires_grad=False, params=[])
                                                for _ in rec.bucket]
    e.grad_reduce_pipeline = types.SimpleNamespace(reduce_gradients=lambda *a, **k: None, reset=lambda: None,
                                                   wait_for_previous_grad_reduce=lambda n: None)
    rec.num_buckets, rec.reset = 0, lambda: None
    e.microbatch_count, e.model_auto_sync, e.suggested_RS_queue_capacity = 0, False, 1
    e.dist_index = types.SimpleNamespace(use_hybrid_fsdp=False)
    graphs = PartialCudaGraphs(e, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=1,
                                                  cuda_graph_num_warmup_iters=1), backend="protocol")
    x = torch.randn(2, 4)
    try:
        e.module(x).sum().backward()
        graphs.capture()
        w = e.module.layers[1].fc1.weight
        w._scale_inv.mul_(1.0)
        for _ in range(2):  # replays, nothing moved
            e.module(x).sum().backward()
        setattr(w, attr, getattr(w, attr).clone())
        with pytest.raises(RuntimeError, match=rf"layers\.1 .*parameter fc1\.weight \({WHAT[attr]}\) at") as err:
            e.module(x)
        assert "keep_fp8_transpose_cache=True" in str(err.value)  # the engine's hint
    finally:
        graphs.delete()


@needs_mcore
def test_what_stays_refused_with_fp8_weights(standin):
    e, _ = build_engine(fp8_net(), fsdp_double_buffer=True)  # keep_fp8_transpose_cache=False, the default
    with pytest.raises(ValueError, match=r"keep_fp8_transpose_cache=False.*pass keep_fp8_transpose_cache=True") as err:
        adapter_for(e).check_partial_graphs()
    assert "layers.0.fc1.weight" in str(err.value)

    e, _ = build_engine(fp8_net(), strategy="optim", keep_fp8_transpose_cache=True)
    with pytest.raises(NotImplementedError, match=r"data_parallel_sharding_strategy='optim'.*use 'optim_grads_params'"):
        adapter_for(e).check_partial_graphs()

    e, _ = build_engine(fp8_net(), **SAFE)
    e.param_and_grad_buffer.parameter_groups = [types.SimpleNamespace(transpose_weight_buffer=None),
                                                types.SimpleNamespace(transpose_weight_buffer=object())]
    with pytest.raises(NotImplementedError, match=r"groups \[1\] into a transpose_weight_buffer \(MXFP8"):
        adapter_for(e).check_partial_graphs()

    net = fp8_net()
    net.layers[2].fc2.weight = Fp8Param(net.layers[2].fc2.weight.detach())
    net.layers[2].fc2.weight._rowwise_data = torch.zeros(1)  # MXFP8 / block-scaled / NVFP4 layout, not TE's Float8
    e, _ = build_engine(net, **SAFE)
    with pytest.raises(NotImplementedError, match=r"\['layers\.2\.fc2\.weight \(Fp8Param\)'\] that are not per-tensor"):
        adapter_for(e).check_partial_graphs()


@needs_mcore
def test_fp8_param_gather_over_bf16_weights_is_not_refused_and_fp8_recipes_need_fp8_weights(standin):
    e, _ = build_engine(Net(), fsdp_double_buffer=True, fp8_param_gather=True)
    adapter = adapter_for(e)
    adapter.check_partial_graphs()  # bf16 parameters: gathered in bf16, as without the flag
    assert adapter.fp8_supported is False  # an FP8 recipe over bf16 weights stays refused by PartialCudaGraphs
    e, _ = build_engine(fp8_net(), **SAFE)
    assert adapter_for(e).fp8_supported is True
