"""``apps/llama.py`` and ``benchmarks/bench_engines.py`` on CPU.

The Llama layer's torch math against transformers' own ``LlamaDecoderLayer`` (same weights), the 8B preset's
parameter count against Llama-3-8B's, and the benchmark's CPU smoke (Gloo, tiny shapes, protocol backend): its
columns run end to end, in one process and as torchrun children, and every graphed column trains bit-for-bit
like its engine's eager column (the figures themselves need a GPU); a failing column is recorded and ends its
torchrun child on every rank while the next column runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fsdp_cudagraph.apps.llama import Llama, LlamaConfig, LlamaTorchLayer, llama3_8b_config, rope_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = ["--cpu-smoke", "--warmup", "2", "--steps", "2", "--capture-step", "1"]


def test_llama3_8b_config_has_llama3_8b_parameter_count():
    cfg = llama3_8b_config(layers_impl="torch")
    assert cfg.num_params() == 8_030_261_248  # Meta-Llama-3-8B's published count
    small = LlamaConfig(num_layers=3)
    assert small.num_params() == sum(p.numel() for p in Llama(small).parameters())
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        LlamaConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"\['hidden'\] are not LlamaConfig fields"):
        llama3_8b_config(hidden=8)


def test_llama_torch_layer_equals_transformers_llama_decoder_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=32)
    hc = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=32,
                                  attn_implementation="sdpa")
    ref, ours = LlamaDecoderLayer(hc, layer_idx=0).eval(), LlamaTorchLayer(cfg)
    pairs = [(ours.q, ref.self_attn.q_proj), (ours.k, ref.self_attn.k_proj), (ours.v, ref.self_attn.v_proj),
             (ours.o, ref.self_attn.o_proj), (ours.gate, ref.mlp.gate_proj), (ours.up, ref.mlp.up_proj),
             (ours.down, ref.mlp.down_proj), (ours.input_norm, ref.input_layernorm),
             (ours.post_norm, ref.post_attention_layernorm)]
    with torch.no_grad():
        for a, b in pairs:
            b.weight.copy_(a.weight)
    x = torch.randn(2, 32, 64)
    pos = torch.arange(32)[None].expand(2, -1)
    out = ref(x, position_embeddings=LlamaRotaryEmbedding(hc)(x, pos), attention_mask=None, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    mine = ours(x.transpose(0, 1).contiguous(), rotary_pos_emb=rope_table(cfg)).transpose(0, 1)
    torch.testing.assert_close(mine, out, rtol=0, atol=1e-5)  # causal GQA attention, RoPE, SwiGLU, RMSNorm
    # a rotary table of the other convention (interleaved pairs) would not match
    bad = rope_table(cfg).flip(-1)
    assert not torch.allclose(ours(x.transpose(0, 1).contiguous(), rotary_pos_emb=bad).transpose(0, 1), out,
                              atol=1e-3)


def _rope_dtype_under_fsdp2_mixed_precision(rank: int, world: int) -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fsdp2_shard(layer, mp_policy=policy)
    fsdp2_shard(model, mp_policy=policy)
    seen = []
    model.layers[1].block.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["rotary_pos_emb"].dtype), with_kwargs=True)
    from fsdp_cudagraph.apps.llama import synthetic_batch

    x, _ = synthetic_batch(0, 1, model.cfg, torch.device("cpu"))
    model(x).float().sum().backward()
    return str(seen)


def test_rope_table_stays_fp32_under_fsdp2_mixed_precision():
    # FSDP2's MixedPrecisionPolicy casts a unit's floating inputs to bf16: the table must not be one of them
    from tests.dist_utils import run_gloo

    assert run_gloo(_rope_dtype_under_fsdp2_mixed_precision, 1) == ["[torch.float32]"]


def _smoke(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_engines.py"), *SMOKE, *extra, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "MASTER_PORT": str(29000 + os.getpid() % 500 + (7 if "olmoe" in extra else 0))})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU smoke" in proc.stdout
    return json.loads(out.read_text())


def _check_graphed_equal(record: dict, graphed: list) -> None:
    for c in graphed:
        row = record["columns"][c]
        assert "step_ms" in row, (c, row)
        flags = [v for k, v in row.items() if k.startswith("losses_equal_to_")]
        assert flags == [True], (c, row)
        assert len(row["losses"]) == 4


def test_bench_engines_cpu_smoke_llama_in_one_process(tmp_path):
    r = _smoke(tmp_path, "llama", "--config", "llama8b", "--isolate", "none")
    assert r["world_size"] == 1 and "versions" in r and r["command"].startswith("benchmarks/bench_engines.py")
    cols = r["columns"]
    assert {"ours_eager", "fsdp2_eager"} <= {c for c, v in cols.items() if "step_ms" in v}
    _check_graphed_equal(r, ["ours_partial", "ours_full", "fsdp2_keep_partial"])
    # what cannot run here is skipped with its reason, and its goals are N/A rather than failed
    assert "2+ ranks" in cols["fsdp2_slots_partial"]["skipped"] and "GPU only" in cols["nvidia_eager"]["skipped"]
    na = {g["name"] for g in r["evaluation"]["not_applicable"]}
    assert "NVIDIA partial step / NVIDIA eager" in na
    assert all(g["verdict"] in ("PASS", "NOISE", "FAIL", "MISSING") for g in r["evaluation"]["goals"])
    assert "| ours_eager |" in r["table"]


def test_bench_engines_cpu_smoke_olmoe_megatron_scopes(tmp_path):
    from fsdp_cudagraph.apps import model

    if not hasattr(model, "olmoe_config"):
        pytest.skip("fsdp_cudagraph.apps.model has no olmoe_config yet (the dropless MoE benchmark model)")
    r = _smoke(tmp_path, "olmoe", "--config", "olmoe", "--columns", "ours_eager", "ours_partial", "ours_full",
               "--isolate", "none", "--profile-step", "3")
    _check_graphed_equal(r, ["ours_partial", "ours_full"])
    assert r["columns"]["ours_partial"]["counts"]["model_config"]["num_experts"] == 4
    # --profile-step: the profiled step's host time by operator, in every row
    for c in ("ours_eager", "ours_partial", "ours_full"):
        prof = r["columns"][c]["host_profile"]
        assert prof["total_self_ms"] > 0 and prof["ops"] and "cuda_api" in prof, (c, prof)


def test_bench_engines_cpu_smoke_qwen3moe_expert_parallel(tmp_path):
    """Today's layout beside EP=2 on 2 Gloo ranks (one torchrun, columns in one process): the EP graphed column
    trains like EP eager, the step's bytes by kind show the experts no longer gathered and the tokens exchanged,
    the bytes goal is evaluated, and NVIDIA's EP column is N/A with its reason."""
    out = tmp_path / "qwen3moe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_engines.py"), *SMOKE, "--config", "qwen3moe", "--moe-experts",
           "split", "--columns", "ours_eager", "ours_ep_eager", "ours_ep_partial", "fsdp2_ep_eager", "fsdp2_ep_partial",
           "nvidia_ep_eager",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cols = r["columns"]
    _check_graphed_equal(r, ["ours_ep_partial", "fsdp2_ep_partial"])
    assert cols["fsdp2_ep_eager"]["comm_bytes"]["all_to_all"] > 0
    assert cols["ours_ep_eager"]["counts"]["expert_parallel_size"] == 2
    assert cols["ours_ep_eager"]["counts"]["num_params"] == cols["ours_eager"]["counts"]["num_params"]
    today, ep = cols["ours_eager"]["comm_bytes"], cols["ours_ep_eager"]["comm_bytes"]
    assert today["all_to_all"] == 0 and ep["all_to_all"] > 0
    assert ep["all_gather"] < today["all_gather"] and ep["reduce_scatter"] < today["reduce_scatter"]
    assert "all_to_all_gbps" in r["rates"]
    assert "expert mesh" in cols["nvidia_ep_eager"]["skipped"]
    by = {g["name"]: g for g in r["evaluation"]["goals"]}
    moved = by["ours EP bytes moved per step / today's layout (ours eager)"]["ratio"]
    assert moved == pytest.approx(sum(ep.values()) / sum(today.values()))
    na = {g["name"] for g in r["evaluation"]["not_applicable"]}
    assert "ours EP eager step / NVIDIA EP eager (tokens/s >= 1.2x)" in na


def test_floor_from_bytes_charges_the_exchange_to_the_critical_path():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _perf_goals as g

    rates = {"all_gather_gbps": 100.0, "reduce_scatter_gbps": 50.0, "all_to_all_gbps": 20.0}
    moved = {"all_gather": 2e9, "reduce_scatter": 1e9, "all_reduce": 0, "all_to_all": 1e9}
    f = g.floor_from_bytes_ms(matmul_ms=30.0, optimizer_ms=5.0, moved=moved, rates=rates)
    assert f["all_to_all_ms"] == pytest.approx(50.0) and f["fsdp_comm_ms"] == pytest.approx(40.0)
    assert f["floor_ms"] == pytest.approx(30 + 50 + 5) and f["bound"] == "compute + all-to-all"
    f = g.floor_from_bytes_ms(matmul_ms=1.0, optimizer_ms=5.0, moved={**moved, "all_to_all": 0}, rates=rates)
    assert f["floor_ms"] == pytest.approx(40 + 5) and f["bound"] == "communication (FSDP)"
    with pytest.raises(ValueError, match="all_to_all_gbps"):
        g.floor_from_bytes_ms(matmul_ms=1.0, optimizer_ms=0.0, moved=moved, rates={"all_gather_gbps": 1.0,
                                                                                   "reduce_scatter_gbps": 1.0})


def _record(columns: dict, **config) -> dict:
    base = {"config": "llama8b", "layers": 16, "seq": None, "micro_batch": 1, "layers_impl": "te", "backend": "te",
            "fuse_wgrad": "on", "moe_experts": "grouped_mm", "cpu_smoke": False, "warmup": 3}
    return {"world_size": 2, "config": {**base, **config}, "columns": columns,
            "rates": {"matmul_tflops": 700.0, "copy_gbps": 3000.0, "all_gather_gbps": 100.0,
                      "reduce_scatter_gbps": 100.0}}


def _row(step_ms: float, peak: float) -> dict:
    counts = {"num_params": 4_000_000_000, "root_params": 1_000_000_000, "layer_params": 200_000_000,
              "matmul_params": 3_000_000_000, "num_layers": 16, "hidden_size": 4096, "seq_len": 4096}
    return {"step_ms": step_ms, "step_ms_all": [step_ms] * 11, "peak_memory_gib": peak, "losses": [1.0, 2.0],
            "tokens_per_s_per_gpu": 4096 / step_ms * 1e3, "host_ms": 1.0, "counts": counts}


def test_bench_engines_merge_combines_halves_and_refuses_other_setups(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_engines

    a, b, c, out = (tmp_path / f"{n}.json" for n in "abco")
    a.write_text(json.dumps(_record({"ours_eager": _row(400.0, 50.0), "ours_partial": _row(390.0, 51.0)})))
    b.write_text(json.dumps(_record({"fsdp2_eager": _row(600.0, 55.0), "nvidia_eager": _row(450.0, 60.0)})))
    assert bench_engines.main(["--merge", str(a), str(b), "--out", str(out)]) == 1  # goals of unrun columns: MISSING
    merged = json.loads(out.read_text())
    by = {g["name"]: g for g in merged["evaluation"]["goals"]}
    assert by["ours eager step / FSDP2 eager (tokens/s >= 1.25x)"]["ratio"] == pytest.approx(400 / 600)
    assert by["ours eager step / NVIDIA eager (tokens/s >= 1.25x)"]["verdict"] == "FAIL"  # 400/450 > 0.8
    assert by["ours partial step / ours eager"]["verdict"] == "PASS"
    assert by["FSDP2 keep + partial step / FSDP2 eager"]["verdict"] == "MISSING"
    # the floor from the first record's rates: 2 ranks move 2 x 4e9 x 2 x 1/2 + 4e9 x 4 x 1/2 bytes at 100 GB/s
    assert merged["floor"]["comm_ms"] == pytest.approx((8e9 + 8e9) / 100e9 * 1e3)
    assert merged["columns"]["ours_eager"]["x_floor"] == pytest.approx(400 / merged["floor"]["floor_ms"])
    c.write_text(json.dumps(_record({"fsdp2_eager": _row(600.0, 55.0)}, layers=32)))
    with pytest.raises(ValueError, match=r"'layers': \(16, 32\)"):
        bench_engines.main(["--merge", str(a), str(c)])


def test_bench_engines_records_a_failing_column_and_exits_1(tmp_path):
    # as torchrun children on 2 ranks: each failing rank writes its error and ends its child
    from fsdp_cudagraph.apps import model

    if not hasattr(model, "olmoe_config"):
        pytest.skip("fsdp_cudagraph.apps.model has no olmoe_config yet (the dropless MoE benchmark model)")
    out = tmp_path / "bad.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_engines.py"), *SMOKE, "--config", "olmoe",
           "--moe-experts", "no_such_path", "--columns", "ours_eager", "ours_full", "--nproc-per-node", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "MASTER_PORT": str(29600 + os.getpid() % 300)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert "no_such_path" in r["columns"]["ours_eager"]["error"] and "traceback" in r["columns"]["ours_eager"]
    assert r["columns"]["ours_eager"]["error"].startswith("[rank ")
    assert r["config"]["isolate"] == "process" and r["world_size"] == 2
    full = r["columns"]["ours_full"]  # full-iteration uses grouped_mm experts whatever --moe-experts says
    assert "step_ms" in full and len(full["losses"]) == 4, full
    assert "all_gather_gbps" in r["rates"]  # measured by the first child that got that far, on 2 ranks
    by = {g["name"]: g["verdict"] for g in r["evaluation"]["goals"]}
    assert by["ours full-iteration peak / ours eager peak"] == "MISSING"
