"""``bench_engines.py --config mcore70b`` (megatron-core's GPTModel under TP, ours against NVIDIA Megatron-FSDP) on
CPU: the 70B slice's shape, the loss check across the engines, the goals' verdicts, and the CPU smoke of the ours
columns on 2 Gloo ranks (TP 2) with the NVIDIA columns reported as not run."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _engines_mcore  # noqa: E402
import _engines_report  # noqa: E402
from fsdp_cudagraph.apps.mcore_gpt import MCoreShape  # noqa: E402
from tests.benchmarks._smoke import bench_engines_smoke  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    base = dict(config="mcore70b", micro_batch=1, warmup=3, tensor_parallel=None, cpu_smoke=False, layers=4, seq=None)
    return argparse.Namespace(**{**base, **kw})


def test_mcore70b_shape_is_the_llama3_70b_slice():
    s = _engines_mcore.shape(_args(), 4)
    assert (s.hidden_size, s.ffn_hidden_size, s.num_heads, s.num_query_groups, s.vocab_size) == (
        8192, 28672, 64, 8, 128256)
    assert s.swiglu and s.normalization == "RMSNorm" and not s.tie_embeddings and s.tensor_parallel_size == 4
    assert (s.seq_len, s.micro_batch_size, s.num_layers) == (4096, 1, 4)
    assert _engines_mcore.shape(_args(seq=8192), 2).seq_len == 8192
    # q 8192x8192, k and v 8192x1024, o 8192x8192, three 8192x28672 SwiGLU matrices; a TP rank's slice
    llama = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672
    assert _engines_mcore.layer_numel(_args(), 4) == llama // 4
    with pytest.raises(ValueError, match=r"--tensor-parallel 1 on 4 rank\(s\).*2\+ TP ranks"):
        _engines_mcore.tensor_parallel_size(_args(tensor_parallel=1), 4)
    with pytest.raises(ValueError, match="num_query_groups=3 does not divide num_heads=64"):
        MCoreShape(num_heads=64, hidden_size=8192, num_query_groups=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=16 does not divide num_query_groups=8"):
        MCoreShape(num_heads=64, hidden_size=8192, num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
                   seq_len=4096, tensor_parallel_size=16)


def _row(step_ms: float, losses) -> dict:
    counts = {"num_params": 5_000_000_000, "rank_params": 1_500_000_000, "root_params": 500_000_000,
              "layer_params": 856_000_000, "matmul_params": 4.5e9, "num_layers": 4, "hidden_size": 8192,
              "seq_len": 4096, "attn_hidden": 8192, "tensor_parallel_size": 4}
    return {"step_ms": step_ms, "step_ms_all": [step_ms] * 11, "peak_memory_gib": 80.0, "losses": list(losses),
            "tokens_per_s_per_gpu": 4096 / 4 / step_ms * 1e3, "host_ms": 1.0, "counts": counts}


RATES = {"matmul_tflops": 700.0, "copy_gbps": 3000.0, "all_gather_gbps": 100.0, "reduce_scatter_gbps": 100.0}


def test_mcore_goals_and_nvidia_first_loss_bit_equal():
    ours = [11.0, 10.5, 10.0]
    cols = {"ours_mcore_tp_eager": _row(1000.0, ours), "ours_mcore_tp_partial": _row(990.0, ours),
            "nvidia_mcore_tp_eager": _row(1150.0, [11.0, 10.5001, 10.0]),
            "nvidia_mcore_tp_partial": _row(1160.0, [11.0, 10.5001, 10.0])}
    out = _engines_report.assemble(_args(), 4, RATES, cols, {})
    by = {g["name"]: g for g in out["evaluation"]["goals"]}
    vs = by["ours mcore TP eager step / NVIDIA mcore TP eager (tokens/s per GPU >= 1.1x)"]
    assert vs["ratio"] == pytest.approx(1000 / 1150) and vs["verdict"] == "PASS"
    assert by["ours mcore TP + partial step / ours mcore TP eager (never slower)"]["verdict"] == "PASS"
    assert by["NVIDIA mcore TP + partial step / NVIDIA mcore TP eager (never slower)"]["verdict"] == "FAIL"
    check, = out["evaluation"]["loss_checks"]
    assert (check["column"], check["first_rtol"], check["verdict"]) == ("nvidia_mcore_tp_eager", 0.0, "AGREE")
    # a first loss 1e-7 off, inside the other NVIDIA columns' bound, is not equal: the same model must start alike
    cols["nvidia_mcore_tp_eager"]["losses"][0] = 11.0 * (1 + 1e-7)
    out = _engines_report.assemble(_args(), 4, RATES, cols, {})
    assert out["evaluation"]["loss_checks"][0]["verdict"] == "DISAGREE" and out["evaluation"]["failed"]
    assert "| equal; <= 2e-03 | - | DISAGREE |" in out["table"]
    # NVIDIA not run: its goals N/A with the reason, ours' partial goal still judged
    why = _engines_mcore.NVIDIA_CPU_REASON
    skipped = {"nvidia_mcore_tp_eager": why, "nvidia_mcore_tp_partial": why}
    cols = {"ours_mcore_tp_eager": _row(1000.0, ours), "ours_mcore_tp_partial": _row(1100.0, ours),
            **{c: {"skipped": why} for c in skipped}}
    ev = _engines_report.assemble(_args(), 4, RATES, cols, skipped)["evaluation"]
    assert [g["verdict"] for g in ev["goals"]] == ["FAIL"]
    assert {g["name"]: g["why"] for g in ev["not_applicable"]} == {
        "ours mcore TP eager step / NVIDIA mcore TP eager (tokens/s per GPU >= 1.1x)": why,
        "NVIDIA mcore TP + partial step / NVIDIA mcore TP eager (never slower)": why}
    # the partial column missing: MISSING, which fails the run
    del cols["ours_mcore_tp_partial"]
    ev = _engines_report.assemble(_args(), 4, RATES, cols, skipped)["evaluation"]
    assert [g["verdict"] for g in ev["goals"]] == ["MISSING"] and ev["failed"]


@pytest.mark.gloo
def test_bench_engines_cpu_smoke_mcore70b(tmp_path):
    """TP 2 on 2 Gloo ranks: ours trains megatron-core's GPTModel eagerly and with partial graphs over attn_mlp
    (the same losses, changing step to step), the sequence-parallel collectives counted as TP bytes; NVIDIA's
    columns are not run, with the reason."""
    r = bench_engines_smoke(tmp_path, "mcore70b", "--config", "mcore70b", timeout=300)
    cols = r["columns"]
    eager, partial = cols["ours_mcore_tp_eager"], cols["ours_mcore_tp_partial"]
    assert len(eager["losses"]) == 4 and all(v == v and abs(v) < 1e3 for v in eager["losses"])
    assert len(set(eager["losses"])) > 1  # the optimizer steps change the model
    assert partial["losses"][0] == eager["losses"][0]  # bit for bit
    assert partial["losses_equal_to_ours_mcore_tp_eager"] is True
    counts = eager["counts"]
    assert counts["tensor_parallel_size"] == 2 and counts["rank_params"] < counts["num_params"]
    assert counts["layout"]["model"] == "GPTModel" and counts["model_config"]["swiglu"] is True
    assert eager["tokens_per_gpu_per_step"] == 16 / 2
    moved = eager["comm_bytes"]
    assert moved["tp_all_gather"] > 0 and moved["tp_reduce_scatter"] > 0 and moved["all_gather"] == 0  # DP 1
    for c in ("nvidia_mcore_tp_eager", "nvidia_mcore_tp_partial"):
        assert cols[c]["skipped"].startswith("not run: needs a GPU") and "CUDA streams" in cols[c]["skipped"]
    ev = r["evaluation"]
    assert [g["name"] for g in ev["goals"]] == ["ours mcore TP + partial step / ours mcore TP eager (never slower)"]
    assert sorted(g["num"] for g in ev["not_applicable"]) == ["nvidia_mcore_tp_partial", "ours_mcore_tp_eager"]
