"""``apps/llama.py`` and ``benchmarks/bench_engines.py`` on CPU.

The Llama layer's torch math against transformers' own ``LlamaDecoderLayer`` (same weights), the 8B preset's
parameter count against Llama-3-8B's, and the benchmark's CPU smoke (Gloo, tiny shapes, protocol backend): its
columns run end to end, in one process and as torchrun children, and every graphed column trains bit-for-bit
like its engine's eager column (the figures themselves need a GPU); a failing column is recorded and ends its
torchrun child on every rank while the next column runs. NVIDIA's expert-parallel columns need a GPU: here their
wiring (the groups, the expert mesh, which parameters NVIDIA takes for experts), their skip reasons and the
verdicts their goals and loss check give on synthetic rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.llama import Llama, LlamaConfig, LlamaTorchLayer, llama3_8b_config, rope_table
from tests.dist_utils import run_gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = ["--cpu-smoke", "--warmup", "2", "--steps", "2", "--capture-step", "1"]
NVIDIA_EP = ["nvidia_ep_eager", "nvidia_ep_partial"]


def _bench():
    if os.path.join(ROOT, "benchmarks") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_engines

    return bench_engines


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
    # ours with the shards' bf16 copy kept ([Note: cast on gather]), side by side: the same losses as ours_eager
    assert "copy of the shards kept" in cols["ours_kept_eager"]["precision"], cols["ours_kept_eager"]["precision"]
    assert cols["ours_kept_eager"]["losses"] == cols["ours_eager"]["losses"]
    assert cols["ours_kept_eager"]["losses_equal_to_ours_eager"] is True


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
           "split", "--columns", "ours_eager", "ours_ep_eager", "ours_ep_groups_eager", "ours_ep_partial",
           "fsdp2_ep_eager", "fsdp2_ep_partial", *NVIDIA_EP, "--out", str(out)]
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
    assert all("GPU only" in cols[c]["skipped"] for c in NVIDIA_EP)
    # FSDP2 EP trains the model ours EP trains: its losses checked against ours ([Note: losses across engines])
    assert [(x["column"], x["verdict"]) for x in r["evaluation"]["loss_checks"]] == [("fsdp2_ep_eager", "AGREE"),
                                                                                  ("ours_ep_groups_eager", "AGREE")]
    # the overlapped expert groups ([Note: overlapped expert groups]) train as one group, bit for bit on Gloo, and move
    # the same rows: the same bytes, in two transfers each way instead of one
    groups = cols["ours_ep_groups_eager"]
    assert groups["losses"] == cols["ours_ep_eager"]["losses"]
    assert groups["comm_bytes"]["all_to_all"] == ep["all_to_all"]
    by = {g["name"]: g for g in r["evaluation"]["goals"]}
    moved = by["ours EP bytes moved per step / today's layout (ours eager)"]["ratio"]
    assert moved == pytest.approx(sum(ep.values()) / sum(today.values()))
    na = {g["name"]: g["why"] for g in r["evaluation"]["not_applicable"]}
    assert "GPU only" in na["ours EP eager step / NVIDIA EP eager (tokens/s >= 1.2x)"]
    assert "GPU only" in na["ours EP eager peak / NVIDIA EP eager peak"]


def test_nvidia_ep_columns_listed_and_skipped_with_their_reason(monkeypatch):
    b = _bench()
    assert b.COLUMNS["qwen3moe"][-2:] == NVIDIA_EP
    assert [b.COLUMN_SPECS[c] for c in NVIDIA_EP] == [("nvidia", {"expert_parallel": True}, "eager"),
                                                     ("nvidia", {"expert_parallel": True}, "partial")]
    assert not [c for cfg in ("llama8b", "olmoe") for c in b.COLUMNS[cfg] if "_ep_" in c]  # no experts to spread
    assert set(NVIDIA_EP) <= set(b.parse(["--config", "qwen3moe", "--columns", *NVIDIA_EP]).columns)
    gpu = torch.device("cuda", 0)  # not_applicable only reads the device's type
    assert "2+ ranks" in b.not_applicable("nvidia_ep_eager", 1, gpu)
    assert "GPU only" in b.not_applicable("nvidia_ep_partial", 2, torch.device("cpu"))
    monkeypatch.setattr(b, "_has_megatron_core", lambda: False)
    why = b.not_applicable("nvidia_ep_eager", 2, gpu)
    assert "megatron-core" in why and "pip install" in why
    assert b.not_applicable("ours_ep_eager", 2, gpu) is None
    monkeypatch.setattr(b, "_has_megatron_core", lambda: True)
    assert b.not_applicable("nvidia_ep_partial", 2, gpu) is None


def _qwen_rows(**rows: dict) -> dict:
    counts = {"num_params": 2_000_000_000, "root_params": 600_000_000, "layer_params": 300_000_000,
              "matmul_params": 500_000_000, "num_layers": 4, "hidden_size": 2048, "seq_len": 4096,
              "attn_hidden": 4096, "expert_parallel_size": 2}
    out = {}
    for c, (step_ms, peak, losses) in rows.items():
        out[c] = {"step_ms": step_ms, "step_ms_all": [step_ms] * 8, "peak_memory_gib": peak, "losses": list(losses),
                  "tokens_per_s_per_gpu": 4096 / step_ms * 1e3, "host_ms": 1.0, "counts": counts}
    return out


def _qwen_assemble(columns: dict, skipped: dict = None) -> dict:
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _engines_report import assemble

    args = argparse.Namespace(config="qwen3moe", micro_batch=1, warmup=3)
    rates = {"matmul_tflops": 800.0, "copy_gbps": 4000.0, "all_gather_gbps": 300.0, "reduce_scatter_gbps": 300.0}
    return assemble(args, 2, rates, columns, skipped or {})


def test_nvidia_ep_goals_and_loss_check_from_measured_columns():
    speed, peak = "ours EP eager step / NVIDIA EP eager (tokens/s >= 1.2x)", "ours EP eager peak / NVIDIA EP eager peak"
    ours = [11.0, 10.9, 10.8]
    drift = [11.0, 10.9 * (1 + 1e-4), 10.8 * (1 - 2e-4)]  # within the drift of two engines on one model
    cols = _qwen_rows(ours_ep_eager=(100.0, 30.0, ours), nvidia_ep_eager=(125.0, 31.0, drift),
                      nvidia_ep_partial=(110.0, 32.0, drift))
    res = _qwen_assemble(cols)
    by = {g["name"]: g for g in res["evaluation"]["goals"]}
    assert by[speed]["ratio"] == pytest.approx(100 / 125) and by[speed]["verdict"] == "PASS"  # 1.25x tokens/s
    assert by[peak]["ratio"] == pytest.approx(30 / 31) and by[peak]["verdict"] == "PASS"
    (check,) = res["evaluation"]["loss_checks"]
    assert (check["column"], check["reference"], check["verdict"]) == ("nvidia_ep_eager", "ours_ep_eager", "AGREE")
    assert check["first_rel_diff"] == 0.0 and check["max_rel_diff"] == pytest.approx(2e-4)
    assert cols["nvidia_ep_partial"]["losses_equal_to_nvidia_ep_eager"] is True
    assert "| nvidia_ep_partial | 110.0 |" in res["table"] and "AGREE" in res["table"]
    # 1.1x its tokens/s and more peak: both goals fail; a first loss off by 1e-3 is another model
    cols = _qwen_rows(ours_ep_eager=(100.0, 33.0, ours), nvidia_ep_eager=(110.0, 31.0, [11.011, 10.9, 10.8]))
    res = _qwen_assemble(cols)
    by = {g["name"]: g for g in res["evaluation"]["goals"]}
    assert by[speed]["verdict"] == "FAIL" and by[peak]["verdict"] == "FAIL"
    assert res["evaluation"]["loss_checks"][0]["verdict"] == "DISAGREE" and res["evaluation"]["failed"]
    # outside the goal by less than the step-time spread of the columns: NOISE
    cols = _qwen_rows(ours_ep_eager=(100.0, 30.0, ours), nvidia_ep_eager=(118.0, 31.0, ours))
    cols["ours_ep_eager"]["step_ms_all"] = [0.0] * 3 + [90.0, 95.0, 100.0, 105.0, 110.0]
    by = {g["name"]: g for g in _qwen_assemble(cols)["evaluation"]["goals"]}
    assert by[speed]["ratio"] > 1 / 1.2 and by[speed]["verdict"] == "NOISE"
    # NVIDIA's column failed (out of memory): MISSING, the run fails; skipped on CPU: N/A with the reason
    cols = _qwen_rows(ours_ep_eager=(100.0, 30.0, ours))
    cols["nvidia_ep_eager"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    res = _qwen_assemble(cols)
    by = {g["name"]: g for g in res["evaluation"]["goals"]}
    assert by[speed]["verdict"] == by[peak]["verdict"] == "MISSING" and res["evaluation"]["failed"]
    assert res["evaluation"]["loss_checks"] == []
    res = _qwen_assemble(_qwen_rows(ours_ep_eager=(100.0, 30.0, ours)), {"nvidia_ep_eager": "GPU only"})
    assert {g["name"]: g["why"] for g in res["evaluation"]["not_applicable"]}[speed] == "GPU only"


def _nvidia_ep_wiring(rank: int, world: int) -> dict:
    """The qwen3moe model of NVIDIA's EP column, built by the benchmark at EP = world, and what the nvidia builder
    hands NVIDIA's fully_shard for it (the engine itself needs CUDA)."""
    from fsdp_cudagraph.engines.nvidia.build import _check_expert_names, _expert_mesh, tag_expert_parameters

    b = _bench()
    args = b.parse(["--cpu-smoke", "--config", "qwen3moe", "--layers", "2", "--isolate", "none"])
    model = b.build_model(args, torch.device("cpu"), ours=False, full=False, ep=world)
    ep_group, edp_group = b.nvidia_expert_groups(model)
    _check_expert_names(model.module, (ep_group, edp_group))
    tagged = tag_expert_parameters(model.module)
    mesh = _expert_mesh(torch.device("cpu"), (ep_group, edp_group))
    ranks = dist.get_process_group_ranks
    out = {"ep": ranks(ep_group), "edp": ranks(edp_group), "tagged": tagged,
           "named_experts": [n for n, _ in model.module.named_parameters() if ".experts." in n],
           "marked": [n for n, p in model.module.named_parameters() if getattr(p, "allreduce", True) is False],
           "mesh_names": list(mesh.mesh_dim_names), "mesh": mesh.mesh.tolist(),
           "mesh_fsdp": ranks(mesh["fsdp"].get_group()),
           "first_expert": float(model.module.layers[0].moe.experts.w1[0, 0, 0])}
    refused = {}
    import megatron_fsdp

    # groups of the same ranks but not the ones the experts exchange over
    for what, groups in (("no groups", None), ("other groups", megatron_fsdp.expert_parallel_groups(world))):
        try:
            b.nvidia_expert_groups(b.Model(**{**model.__dict__, "expert_groups": groups}))
        except ValueError as exc:
            refused[what] = str(exc)
    out["refused"] = refused
    return out


@pytest.mark.gloo
def test_nvidia_ep_column_wiring_on_two_ranks():
    r0, r1 = run_gloo(_nvidia_ep_wiring, 2)
    names = ["layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "layers.1.moe.experts.w1", "layers.1.moe.experts.w2"]
    for rank, r in enumerate((r0, r1)):
        # the model's all-to-all group is the EP group of every rank; experts whole on their rank (EDP of one)
        assert r["ep"] == [0, 1] and r["edp"] == [rank], r
        # what NVIDIA takes for an expert (its name test) is exactly what the model holds per rank, now marked
        assert r["tagged"] == r["named_experts"] == r["marked"] == names, r
        assert r["mesh_names"] == ["fsdp", "tp"] and r["mesh"] == [[rank]] and r["mesh_fsdp"] == [rank], r
        assert "without expert groups" in r["refused"]["no groups"]
        assert "is not Model.expert_groups[0]" in r["refused"]["other groups"]
    assert r0["first_expert"] != r1["first_expert"]  # each rank holds its own experts, not a replica


def test_tag_expert_parameters_refuses_an_expert_module_nvidia_would_not_recognise():
    from torch import nn

    from fsdp_cudagraph.engines.nvidia.build import tag_expert_parameters

    class Experts(nn.Module):
        is_expert = True

        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(2, 3))

    ok = nn.ModuleDict({"experts": Experts(), "router": nn.Linear(3, 2)})
    good = nn.ModuleDict({"moe": ok})
    assert tag_expert_parameters(good) == ["moe.experts.w1"]
    assert good["moe"]["experts"].w1.allreduce is False and not hasattr(good["moe"]["router"].weight, "allreduce")
    assert tag_expert_parameters(nn.Linear(2, 2)) == []  # nothing tagged is_expert: nothing marked
    bad = nn.ModuleDict({"moe": nn.ModuleDict({"ffn": Experts()})})
    with pytest.raises(ValueError, match=r"moe\.ffn\.w1.*'\.experts\.'.*submodule named experts"):
        tag_expert_parameters(bad)


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
