"""GPU: HuggingFace Llama and Qwen2 under megatron_fsdp with TE/torch partial graphs, bit-exact, and the checker.

Runs ``benchmarks/hf_models.py`` (the script of the GPU record) with fewer steps and a smaller model, on one
GPU and, where there are two, under torchrun, and checks its verdicts: every graphed row equal to eager
(losses per step and final parameters, ``torch.equal``), two eager runs equal (determinism control), and the
checker EQUAL on passing models and naming the callable on the perturbed and Python-state models.
Skipped without CUDA or transformers (the TE rows skip inside the script without TE).
"""

import os

import pytest
import torch

from tests.gpu_utils import NO_GPU, ROOT, launcher, run_json

from fsdp_cudagraph.apps.hf_models import HAS_TRANSFORMERS, TRANSFORMERS_REASON

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU),
    pytest.mark.skipif(not HAS_TRANSFORMERS, reason=TRANSFORMERS_REASON or "ok"),
]
QUICK = ["--steps", "8", "--skip", "4", "--hidden", "128", "--ffn", "344", "--layers", "2", "--heads", "4",
         "--kv-heads", "2"]


def _run(tmp_path, nproc: int) -> dict:
    script = os.path.join(ROOT, "benchmarks", "hf_models.py")
    return run_json(launcher(nproc, [script]) + QUICK, tmp_path / f"hf-{nproc}gpu.json")


def _check(res: dict) -> None:
    assert res["all_ok"]
    assert all(res["eager_repeat_equal"].values())
    backends = {r["backend"] for r in res["rows"]}
    assert "torch" in backends
    assert len(res["rows"]) == 2 * 3 * len(backends) and all(r["equal"] for r in res["rows"])
    assert all(c["as_expected"] for c in res["checker"]) and len(res["checker"]) == 5 * len(backends)


def test_hf_models_1gpu(tmp_path):
    _check(_run(tmp_path, 1))


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_hf_models_2gpu(tmp_path):
    _check(_run(tmp_path, 2))
