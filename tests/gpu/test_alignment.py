"""GPU tests: bit-exact alignment of eager and graphed training, and the engine on NCCL.

They launch the same entry points a user runs (``python -m fsdp_cudagraph.apps.align``, torchrun for 2 GPUs)
and check their verdicts. Skipped without CUDA (and the TE rows of the matrix without TE, inside align).
"""

import json
import os
import subprocess

import pytest
import torch

from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON
from fsdp_cudagraph.apps.align import matrix
from tests.gpu_utils import NO_GPU, ROOT, gpu_env, graphed_rows, keep, launcher, run_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


def _align(tmp_path, nproc: int, backends: list, *, quick: bool = False) -> dict:
    extra = ["--quick"] if quick else []
    return run_json(launcher(nproc, ["-m", "fsdp_cudagraph.apps.align"]) + ["--backends", *backends] + extra,
                    tmp_path / f"align-{nproc}.json",
                    name=f"align-{nproc}gpu-{'-'.join(backends)}{'-quick' if quick else ''}.json", tail=4000)


# [Note: the quick and the full matrix] `pytest -m gpu` must fit one 10-minute device call with room to spare:
# it runs each alignment matrix in its quick form (seq 100, two scopes, tuple outputs, hooks, the controls); the
# full matrices (minutes each) carry the `matrix` marker instead and run with `pytest -m matrix`.
QUICK_OR_FULL = pytest.mark.parametrize("quick", [pytest.param(True, marks=pytest.mark.gpu, id="quick"),
                                                  pytest.param(False, marks=pytest.mark.matrix, id="full")])
README_CASES = [pytest.param([], marks=pytest.mark.gpu, id="attn+mlp"),
                pytest.param(["--scope"], marks=pytest.mark.gpu, id="layers"),
                pytest.param(["--seq-len", "512"], marks=pytest.mark.matrix, id="seq512")]


@QUICK_OR_FULL
def test_alignment_torch_backend_1gpu(tmp_path, quick):
    res = _align(tmp_path, 1, ["torch"], quick=quick)
    assert res["all_ok"] and all(r["equal"] for r in res["rows"]) and len(res["rows"]) == len(matrix("torch", quick=quick))
    assert all(c["caught"] is not False for c in res["controls"]) and any(c["caught"] for c in res["controls"])


@pytest.mark.te
@pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "TE present")
@QUICK_OR_FULL
def test_alignment_te_backend_1gpu(tmp_path, quick):
    res = _align(tmp_path, 1, ["te"], quick=quick)
    assert res["all_ok"] and len(res["rows"]) == len(matrix("te", quick=quick))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_alignment_2gpu(tmp_path):
    res = _align(tmp_path, 2, ["te", "torch"] if HAS_TE else ["torch"])
    assert res["all_ok"] and res["world_size"] == 2


def _readme_loop(tmp_path, nproc: int, impl: str, extra: list) -> dict:
    script = os.path.join(ROOT, "examples", "readme_loop.py")
    return run_json(launcher(nproc, [script]) + ["--impl", impl, *extra], tmp_path / f"readme-{impl}-{nproc}.json",
                    name=f"readme-loop-{impl}-{nproc}gpu{'-'.join([''] + extra)}.json", tail=4000)


@pytest.mark.parametrize("extra", README_CASES)
def test_readme_loop_default_stream_torch_backend_1gpu(tmp_path, extra):
    assert _readme_loop(tmp_path, 1, "local", extra)["ok"]


@pytest.mark.te
@pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "TE present")
@pytest.mark.parametrize("extra", README_CASES)
def test_readme_loop_default_stream_te_backend_1gpu(tmp_path, extra):
    assert _readme_loop(tmp_path, 1, "transformer_engine", extra)["ok"]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_readme_loop_default_stream_2gpu(tmp_path):
    for impl in (["transformer_engine", "local"] if HAS_TE else ["local"]):
        assert _readme_loop(tmp_path, 2, impl, [])["ok"]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_engine_parity_nccl_2gpu(tmp_path):
    out = tmp_path / "parity.json"
    cmd = launcher(2, [os.path.join(ROOT, "tests", "gpu", "scripts", "engine_parity.py"), str(out)])
    proc = subprocess.run(cmd, cwd=ROOT, env=gpu_env(), capture_output=True, text=True)
    keep(str(out), "engine-parity-2gpu.json")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    bad = {k: v["max_rel_loss_diff"] for k, v in res.items() if k != "reference" and not v["ok"]}
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_nccl_average_equals_prescaled_sum_2gpu(tmp_path):
    """NCCL's AVG gives the pre-scaled SUM's bits (fp32, bf16), and the engine trains bit-identically either way."""
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "nccl_average.py")
    res = run_json(launcher(2, [script]), tmp_path / "avg.json", name="nccl-average-2gpu.json", tail=4000)
    assert res["ok"] and res["world_size"] == 2, res


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_dcp_across_world_sizes_2gpu(tmp_path):
    """Saved at 2 GPUs, loaded (every tensor equal) and saved again at 1, resumed at 2 bit for bit (NCCL)."""
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "dcp_worlds.py")
    for phase, nproc in (("save", 2), ("resave", 1), ("resume", 2)):
        res = run_json(launcher(nproc, [script]) + ["--phase", phase, "--dir", str(tmp_path)], tmp_path / f"{phase}.json",
                       name=f"dcp-worlds-{phase}-{nproc}gpu.json", tail=4000)
        assert res["ok"] and res["world_size"] == nproc, res


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_fsdp2_storage_and_mixed_precision_2gpu(tmp_path):
    """FSDP2 with keep_unsharded_storage or two slots, bf16 or MixedPrecisionPolicy(bf16, fp32), whole layers and
    attn+mlp, graphed with the torch backend: every loss and final parameter equal to plain eager FSDP2."""
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "fsdp2_storage.py")
    res = run_json(launcher(2, [script]), tmp_path / "storage.json", name="fsdp2-storage-2gpu.json", tail=4000)
    assert res["ok"] and res["world_size"] == 2, res
    assert sum("equal" in r for r in res["rows"]) == 8, res["rows"]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_nccl(tmp_path, nproc):
    """Our MoE with expert parallelism (EP=2 and EP=world) under our engine, partial graphs over attn moe_router
    moe_preprocess with the all-to-alls eager between them: graphed ``torch.equal`` to eager for the torch backend
    (split and grouped_mm experts) and, with TE, the TE backend (split and te_grouped); EP against EP=1 within
    [Note: EP tolerance on the GPU]; the controls caught."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "ep_align.py")
    res = run_json(launcher(nproc, [script]), tmp_path / "ep.json", name=f"ep-align-{nproc}gpu.json", tail=4000)
    assert res["ok"] and res["world_size"] == nproc and not res["errors"], res
    graphed, runs = graphed_rows(res)
    assert graphed == runs, res["rows"]  # every graphed run has its row
    assert any(n.endswith("/te/graphed") for n in graphed) == HAS_TE, sorted(graphed)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_expert_parallel(tmp_path, nproc):
    """FSDP2 with expert parallelism (torchtitan's layout), fp32, NCCL, torch backend: EP=2 (and EP=4 on 4 GPUs)
    against FSDP2 at EP=1 within the script's RTOL; graphed (kept storage, slots) equal to eager; the experts'
    divide factor at FSDP2's default caught."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "fsdp2_ep.py")
    res = run_json(launcher(nproc, [script]), tmp_path / "ep.json", name=f"fsdp2-ep-{nproc}gpu.json", tail=4000)
    assert res["ok"] and res["world_size"] == nproc, res
    assert {r["ep"] for r in res["rows"]} == ({2} if nproc == 2 else {2, 4}), res["rows"]  # every EP size ran


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_graphs(tmp_path, nproc):
    """TP=2 under megatron_fsdp on NCCL (1x2 and 2x2): eager within 1e-4 of the TP=1 model, per-layer graphs (torch
    backend, attn+mlp and whole layers, the TP collectives captured) equal to eager bit for bit."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "tp_graphs.py")
    res = run_json(launcher(nproc, [script]), tmp_path / "tp.json", name=f"tp-graphs-{nproc}gpu.json", tail=4000)
    assert res["ok"] and res["world_size"] == nproc, res
