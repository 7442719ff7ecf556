"""Length-bucketed graphs of the ViT-style encoder under megatron_fsdp on 2 Gloo ranks (protocol backend).

One spawned job runs ``fsdp_cudagraph.apps.vision.record`` on each rank (the CPU form of the GPU record): the
encoder trains 8 steps with ZeRO-3 and the double buffer, each rank on its own packed multi-image samples
whose lengths hit different buckets in the same step (and one length past the largest bucket), capture
before step 2. The tests assert on what each rank returns:

- graphed training equals eager training on the same padded bucket bit for bit (losses, final parameters,
  a probe's logits, input gradient and padded-input gradient), padding once in the encoder and padding each
  block's call in the graph layer; two eager runs agree too (the comparison's own control);
- padded positions get exactly zero gradient;
- against eager training on the packed, unpadded input, losses, logits and input gradients agree within
  tolerances measured on this model (``vision.TOLERANCES['cpu']``), and a model whose head differs by
  +-1e-4 falls outside them;
- multi-image samples match each image encoded alone, within a measured tolerance;
- the ranks replayed several buckets and fell back to eager past the largest.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_cudagraph.apps import vision
from tests.dist_utils import run_gloo
from tests.gpu_utils import run_entry

pytestmark = pytest.mark.gloo

BUCKETS = (32, 64, 128)
LENGTHS = (40, 100, 20, 64, 128, 90, 150, 33)  # rank r, step s: LENGTHS[(s + r) % 8]; 150 overflows
PROBE = 21  # the probe's patches: padded to bucket 32 in the encoder


def _rank(rank: int, world: int):
    import warnings

    warnings.simplefilter("ignore")  # the overflow warning is asserted in test_length_buckets.py
    return vision.record(torch.device("cpu"), backend="protocol", cfg=vision.VisionConfig(), buckets=BUCKETS,
                         lengths=LENGTHS, steps=8, capture_step=2, compute_dtype=None, probe_length=PROBE)


@pytest.fixture(scope="module")
def records():
    return run_gloo(_rank, 2)


def test_graphed_training_is_bitwise_eager_on_the_padded_bucket(records):
    for r in records:
        c = r["checks"]
        assert c["eager_repeat_bitwise"]["ok"], c["eager_repeat_bitwise"]
        assert c["graphed_vs_eager_padded_bitwise"] == {
            "ok": True, "losses": True, "first_loss_mismatch": None, "state": True,
            "probe": {"logits": True, "patches_grad": True, "padded_input_grad": True}}


def test_padding_each_call_in_the_graph_layer_is_bitwise_eager_padding_each_call(records):
    for r in records:
        c = r["checks"]["per_call_padding_vs_eager_bitwise"]
        assert c["ok"] and c["probe"] == {"logits": True, "patches_grad": True}, c


def test_padded_positions_get_zero_gradient(records):
    for r in records:
        c = r["checks"]["padded_positions_zero_grad"]
        assert c == {"ok": True, "padded_rows": 32 - PROBE}


def test_against_eager_packed_within_the_measured_tolerance(records):
    tol = vision.TOLERANCES["cpu"]
    for r in records:
        c = r["checks"]["vs_eager_packed_within_tolerance"]
        assert c["ok"], c
        for k, measured in c["measured"].items():
            assert measured <= tol[k]
        # the control: a model whose head bias differs by +-1e-4 is far outside (measured >= 5e-5 on losses)
        assert c["control"]["loss"] > 10 * tol["loss"] and c["control"]["logits"] > 10 * tol["logits"]


def test_multi_image_samples_match_images_alone(records):
    for r in records:
        c = r["checks"]["per_image_attention"]
        assert c["ok"] and c["max_diff"] <= vision.TOLERANCES["cpu"]["per_image"] < c["control_min_diff"], c


def test_ranks_replayed_several_buckets_and_overflowed(records):
    for r in records:
        assert r["checks"]["buckets"]["ok"] and len(r["checks"]["buckets"]["used"]) >= 2
        assert r["checks"]["buckets"]["eager_overflow_calls"] == 2  # one 150-patch step, two blocks
        assert [c["bucket"] for c in r["capture"]] == [128, 64, 32]  # largest first
        assert 0 < r["padding_overhead"] < 1
    # each rank ran its own lengths: in step 2 rank 0 had 20 patches (bucket 32), rank 1 had 64 (bucket 64)
    assert records[0]["stats"] != records[1]["stats"]


def test_the_record_command_runs_on_cpu(tmp_path):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "record.json"
    env = dict(os.environ, PYTHONPATH=root, MASTER_PORT=str(29600 + os.getpid() % 300))
    proc = run_entry([sys.executable, "-m", "fsdp_cudagraph.apps.vision", "--device", "cpu", "--out", str(out)],
                     env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["all_ok"] and res["backend"] == "protocol" and res["world_size"] == 1
    assert "ALL OK" in proc.stdout and res["command"].endswith(f"--out {out}")
