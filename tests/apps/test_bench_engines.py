"""``apps/llama.py`` and ``benchmarks/bench_engines.py`` on CPU.

The Llama layer's torch math against transformers' own ``LlamaDecoderLayer`` (same weights), the 8B preset's
parameter count against Llama-3-8B's, and the benchmark's CPU smoke (Gloo, tiny shapes, protocol backend): its
columns run end to end, in one process and as torchrun children, and every graphed column trains bit-for-bit
like its engine's eager column (the figures themselves need a GPU).
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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
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
        pytest.skip("fsdp_cudagraph.apps.model has no olmoe_config yet (the dropless MoE of issue 35 item 1)")
    r = _smoke(tmp_path, "olmoe", "--config", "olmoe", "--columns", "ours_eager", "ours_partial", "ours_full",
               "--isolate", "none")
    _check_graphed_equal(r, ["ours_partial", "ours_full"])
    assert r["columns"]["ours_partial"]["counts"]["model_config"]["num_experts"] == 4


def test_bench_engines_cpu_smoke_column_in_a_torchrun_child(tmp_path):
    r = _smoke(tmp_path, "child", "--config", "llama8b", "--columns", "ours_eager", "--nproc-per-node", "1")
    assert r["config"]["isolate"] == "process"
    row = r["columns"]["ours_eager"]
    assert "step_ms" in row and len(row["losses"]) == 4, row
