"""GPU tests of inference graphs: the reduced benchmark run (``bench_inference.py --quick``) and its verdicts.

On a CUDA GPU (1 GPU; 2 under torchrun when present) the run captures real graphs (torch.cuda.graph, one pool)
and checks, bit for bit: evaluation logits and losses of layer and block scope against eager (exact bucket) and
against eager on the padded batch; greedy decode tokens and logits against eager decode steps; training with
PartialCudaGraphs and interleaved graphed evaluation against training without evaluation. Skipped without CUDA.
"""

import os

import pytest
import torch

from tests.gpu_utils import NO_GPU, ROOT, launcher, run_json

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


def _bench(tmp_path, nproc: int) -> dict:
    script = os.path.join(ROOT, "benchmarks", "bench_inference.py")
    return run_json(launcher(nproc, [script]) + ["--quick"], tmp_path / f"inference-{nproc}gpu.json", tail=4000)


def _assert_verdicts(res: dict) -> None:
    checks = [c for s in ("eval", "decode", "training") for c in res[s]["checks"]]
    failed = [c for c in checks if c["ok"] is False]
    assert res["all_ok"] and not failed, failed
    asserted = [c["check"] for c in checks if c["ok"] is True]
    for scope in ("layer", "block"):
        assert f"eval {scope}: logits and loss at an exact bucket == eager" in asserted
        assert f"eval {scope}: padded batch == eager on the padded batch" in asserted
        assert f"decode {scope}: tokens and logits at an exact bucket == eager decode" in asserted
        assert f"decode {scope}: padded batch == eager decode steps on the padded batch" in asserted
        assert f"training with {scope} evaluation == training without evaluation" in asserted
    scopes = {(r["scope"], r["batch"]) for r in res["eval"]["rows"]}
    assert scopes == {(s, b) for s in ("none", "layer", "block") for b in ("exact", "padded")}
    # both evaluation batches (8 rows, and 5 padded to 8) use bucket 8: one graph, or one per layer
    assert res["eval"]["captures"]["block"]["num_graphs"] == 1
    assert res["eval"]["captures"]["layer"]["num_graphs"] == res["config"]["layers"]


def test_inference_graphs_1gpu(tmp_path):
    res = _bench(tmp_path, 1)
    assert res["world_size"] == 1
    _assert_verdicts(res)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_inference_graphs_2gpu(tmp_path):
    res = _bench(tmp_path, 2)
    assert res["world_size"] == 2
    _assert_verdicts(res)
