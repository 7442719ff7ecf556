"""GPU: activation offloading, eager and inside partial graphs (TE and torch backends), bit-exact, memory drops.

Runs ``benchmarks/bench_offload.py --quick`` (seq 1024, 4 layers) on one GPU and, where there are two, under
torchrun, and checks its verdicts: every offload row equal to the same mode without offloading (losses per
step and final parameters, ``torch.equal``, all ranks), and the peak activation memory lower by a good part
of what was offloaded. The CPU smoke run of the same script (protocol backend, Gloo) runs everywhere.
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
        # By accounting about 1 - 2/8: of the 8 groups (4 layers x attn, mlp) one reloaded and one prefetched
        # group are resident at the backward peak, beside gradients. Measured (--quick, SDPA math): torch 0.627
        # on 2 H100s (S8 and S9 alike), TE 0.448 on 2 H100s (S9: 0.098 of 0.219 GiB; the small TE model's fixed
        # buffers weigh more); 0.79-0.86 at full size on 1 H100. A run whose offloading frees nothing scores
        # about 0 (the torch backend's graphed rows: 0.07), so the bound sits at 0.35, under the lowest measured.
        assert v["eager_saved_over_offloaded"] >= MIN_EAGER_SAVED_OVER_OFFLOADED, (model, v)
        if model == "te":
            # TE captures every callable into one pool, so what offloading frees is reused by later layers
            # (S2.5: 1.34 of 1.75 GiB offloaded saved). PyTorch's graph maker gives each unit a pool of its own:
            # the graphed torch rows save almost nothing (S2.5: 0.07 of what was offloaded; S8 on 2 GPUs,
            # --quick: -0.02 GiB), which docs/graph-kinds.md ("Memory under graphs, by backend") states.
            assert v["graphed_saved_gib"] > 0, (model, v)
        assert r["rows"]["graphed/offload"]["captured_offload_gib"] > 0


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
