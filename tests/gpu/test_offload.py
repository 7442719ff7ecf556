"""GPU: activation offloading, eager and inside partial graphs (TE and torch backends), bit-exact, memory drops.

Runs ``benchmarks/bench_offload.py --quick`` (seq 1024, 4 layers) on one GPU and, where there are two, under
torchrun, and checks its verdicts: every offload row equal to the same mode without offloading (losses per
step and final parameters, ``torch.equal``, all ranks), the offloaded bytes really copied (planned, and captured
inside the graphs), and, for the model whose activations set the step's peak, that peak lower by a good part of
what was offloaded. The CPU smoke run of the same script (protocol backend, Gloo) runs everywhere.
"""

import os

import pytest
import torch

from tests.gpu_utils import ROOT, launcher, run_json

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_offload.py")
NO_GPU = "needs a CUDA GPU: CUDA graphs, pinned-memory copies and NCCL only exist there (torch.cuda.is_available() == False)"


#: The smallest share of the planned offload that eager training must save (see _check).
MIN_EAGER_SAVED_OVER_OFFLOADED = 0.35


def _run(tmp_path, nproc: int, *flags: str) -> dict:
    out = tmp_path / f"offload-{nproc}{'-'.join(f.strip('-') for f in flags)}.json"
    return run_json(launcher(nproc, [SCRIPT]) + list(flags), out)


def _check(res: dict) -> None:
    assert res["all_bit_exact"]
    for model, r in res["results"].items():
        v = r["verdicts"]
        assert v["bit_exact_eager"] and v["bit_exact_graphed"], (model, v)
        assert r["rows"]["eager/offload"]["planned_offload_gib"] > 0
        assert r["rows"]["graphed/offload"]["captured_offload_gib"] > 0
    # The memory drop, where activations set the step's peak: the torch model. By accounting about 1 - 2/8: of
    # the 8 groups (4 layers x attn, mlp) one reloaded and one prefetched group are resident at the backward
    # peak, beside gradients. Measured (--quick, SDPA math): 0.627 on 2 H100s, 0.56 on 1 and 0.63 on 2 H200s;
    # 0.79-0.86 at full size on 1 H100. A run whose offloading frees nothing scores about 0 (the torch
    # backend's graphed rows: 0.07), so the bound sits at 0.35, under the lowest measured.
    # The small TE model's savings are the benchmark's to report, not this test's to bound: on 1 GPU its step
    # peak is set by a tensor that scales with the per-rank batch and that offloading does not touch (0.399 GiB
    # on an H200 in every 1-GPU row of both models, exactly twice the 2-GPU figure; the loss's logits, by its
    # size), so it saved 0.0; its graphed rows' reserved memory moves with the graph pool's layout (-0.037,
    # -0.002 and +0.117 GiB in three records at 2 GPUs). Full size: benchmarks/bench_offload.py.
    torch_verdicts = res["results"]["torch"]["verdicts"]
    assert torch_verdicts["eager_saved_over_offloaded"] >= MIN_EAGER_SAVED_OVER_OFFLOADED, torch_verdicts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_offload_1gpu(tmp_path):
    # SDPA's math kernel: flash attention's backward is not deterministic, so with it even two runs without
    # offloading differ (seen on an H100: the torch rows failed bit-exactness with --sdpa flash, passed with math).
    _check(_run(tmp_path, 1, "--quick", "--sdpa", "math"))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_offload_2gpu(tmp_path):
    _check(_run(tmp_path, 2, "--quick", "--sdpa", "math"))


@pytest.mark.gloo
def test_bench_offload_cpu_smoke(tmp_path):
    res = _run(tmp_path, 1, "--cpu-smoke")
    assert res["all_bit_exact"] and res["world_size"] == 1
    rows = res["results"]["torch"]["rows"]
    assert rows["eager/offload"]["planned_offload_gib"] > 0 and rows["graphed/offload"]["captured_offload_gib"] > 0
