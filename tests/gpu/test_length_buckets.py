"""GPU record of length buckets: ``python -m fsdp_cudagraph.apps.vision`` on 1 GPU (and 2 under torchrun), and the
benchmark's smoke run. Skipped without CUDA (and the TE row without TransformerEngine).

The record trains the ViT-style encoder under megatron_fsdp (bf16, ZeRO-3, double buffer) with graphs from
``torch.cuda.make_graphed_callables`` and asserts its verdicts: graphed == eager on the padded bucket
(torch.equal: losses, parameters, logits, input and padded-input gradients; padding once and per call), zero
gradient on padding, eager packed within tolerance (with a perturbed-model control), per-image attention,
several buckets and the overflow fallback. Set FSDP_CUDAGRAPH_RESULTS to keep the JSON.
"""

import os
import sys

import pytest
import torch

from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON
from tests.gpu_utils import NO_GPU, ROOT, run_json

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")


def _assert_record(res: dict, world: int) -> None:
    assert res["all_ok"] and res["world_size"] == world and len(res["ranks"]) == world
    for r in res["ranks"]:
        c = r["checks"]
        assert c["graphed_vs_eager_padded_bitwise"]["ok"] and c["per_call_padding_vs_eager_bitwise"]["ok"]
        assert c["padded_positions_zero_grad"]["ok"] and c["vs_eager_packed_within_tolerance"]["ok"]
        assert c["per_image_attention"]["ok"] and c["buckets"]["eager_overflow_calls"] > 0
        assert [x["bucket"] for x in r["capture"]] == sorted(res["buckets"], reverse=True)


def test_vision_record_torch_backend_1gpu(tmp_path):
    res = run_json([sys.executable, "-m", "fsdp_cudagraph.apps.vision"], tmp_path / "length-buckets-record-1gpu.json")
    _assert_record(res, 1)


@pytest.mark.te
@pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "TE present")
def test_vision_record_te_backend_1gpu(tmp_path):
    res = run_json([sys.executable, "-m", "fsdp_cudagraph.apps.vision", "--backend", "te"],
                   tmp_path / "length-buckets-record-te-1gpu.json")
    _assert_record(res, 1)


@pytest.mark.multigpu
@TWO_GPUS
def test_vision_record_2gpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "fsdp_cudagraph.apps.vision"]
    _assert_record(run_json(cmd, tmp_path / "length-buckets-record-2gpu.json"), 2)


def test_benchmark_smoke_1gpu(tmp_path):
    res = run_json([sys.executable, os.path.join(ROOT, "benchmarks", "bench_length_buckets.py"), "--quick",
                "--buckets", "256", "512", "--warm", "1", "--timed", "3"], tmp_path / "length-buckets-bench-smoke.json")
    assert [r["bucket"] for r in res["rows"]] == [256, 512]
    assert all(r["graph_memory_bytes"] >= 0 and r["capture_seconds"] > 0 for r in res["rows"])
    assert res["runs"]["graphed"]["stats"]["eager_overflow"] == 0
