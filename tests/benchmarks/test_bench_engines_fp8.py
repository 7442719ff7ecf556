"""``bench_engines.py --config llama8b_fp8`` on CPU: the FP8 benchmark's plumbing (the figures need a GPU and TE).

Its bf16 columns run end to end on Gloo with gradient accumulation (``--micro-batches``); TE's FP8 columns and
torchao's float8 column are reported as not applicable with their reasons, and their goals as N/A; the verdicts
those goals give, and which eager column a graphed FP8 column is compared with bit for bit, are checked on
synthetic rows; the argument refusals name the rule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import pytest
import torch

from tests.benchmarks.test_bench_engines import ROOT, _bench, _smoke

TE_FP8 = ["ours_fp8_delayed_eager", "ours_fp8_current_eager", "ours_fp8_block_eager", "ours_fp8_partial",
          "ours_fp8_full", "nvidia_fp8_eager", "ours_fp8_gather_eager", "ours_fp8_gather_partial",
          "nvidia_fp8_gather_eager", "ours_fp8_attention_eager", "ours_fp8_attention_kept_eager",
          "ours_fp8_attention_partial", "nvidia_fp8_attention_eager", "ours_fp8_gather_attention_eager"]


def test_fp8_config_cpu_smoke_with_gradient_accumulation(tmp_path):
    r = _smoke(tmp_path, "fp8", "--config", "llama8b_fp8", "--isolate", "none", "--micro-batches", "3")
    cols = r["columns"]
    assert set(cols) == set(_bench().COLUMNS["llama8b_fp8"])
    ran = {c for c, v in cols.items() if "step_ms" in v}
    assert ran == {"ours_eager", "ours_kept_eager", "fsdp2_torch_eager"}, \
        {c: v.get("skipped", v.get("error")) for c, v in cols.items()}
    for c in ran:  # three micro-batches of one sequence a step
        assert cols[c]["micro_batches"] == 3 and cols[c]["tokens_per_gpu_per_step"] == 3 * 16
    # one model, one seed, the same batches: the two engines' first losses agree (fp32 on CPU)
    assert cols["ours_eager"]["losses"][0] == pytest.approx(cols["fsdp2_torch_eager"]["losses"][0], rel=1e-6)
    for c in TE_FP8:
        assert "CUDA GPU" in cols[c]["skipped"], c
    assert "CUDA only" in cols["fsdp2_float8_eager"]["skipped"]
    # every FP8 goal compares a column that needs a GPU: not applicable here, with its reason, not a failure; the
    # one goal of two bf16 columns (the kept bf16 shards against ours_eager) is evaluated, on the same bits
    fp8_goals = [g for g in sys.modules["_perf_goals"].ENGINE_GOALS if g.config == "llama8b_fp8"]
    assert [g["name"] for g in r["evaluation"]["goals"]] == ["ours bf16 shards kept: eager step / ours eager "
                                                             "(never slower)"]
    assert len(r["evaluation"]["not_applicable"]) == len(fp8_goals) - 1 == 21
    assert cols["ours_kept_eager"]["losses"] == cols["ours_eager"]["losses"]
    assert "torch layers" in cols["fsdp2_torch_eager"]["precision"]


def _rows(**rows) -> dict:
    counts = {"num_params": 8_030_261_248, "root_params": 1_050_673_152, "layer_params": 218_112_000,
              "matmul_params": 6_979_321_856, "num_layers": 32, "hidden_size": 4096, "seq_len": 8192,
              "attn_hidden": 4096}
    out = {}
    for c, (step_ms, peak, gathered, losses) in rows.items():
        out[c] = {"step_ms": step_ms, "step_ms_all": [step_ms] * 8, "peak_memory_gib": peak, "losses": list(losses),
                  "tokens_per_s_per_gpu": 8192 / step_ms * 1e3, "host_ms": 1.0, "counts": counts,
                  "comm_bytes": {"all_gather": gathered, "reduce_scatter": 2 * gathered}}
    return out


def _assemble(columns: dict, recipe: str = "current") -> dict:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _engines_report import assemble

    args = argparse.Namespace(config="llama8b_fp8", micro_batch=1, micro_batches=1, warmup=3, fp8_recipe=recipe)
    rates = {"matmul_tflops": 800.0, "copy_gbps": 4000.0, "all_gather_gbps": 300.0, "reduce_scatter_gbps": 300.0}
    return assemble(args, 4, rates, columns, {})


def test_fp8_goals_from_measured_columns():
    losses = [11.0, 10.9, 10.8]
    cols = _rows(ours_eager=(1000.0, 80.0, 8e9, losses), ours_fp8_current_eager=(700.0, 78.0, 8e9, losses),
                 ours_fp8_delayed_eager=(760.0, 78.0, 8e9, losses),
                 ours_fp8_partial=(690.0, 79.0, 8e9, losses), ours_fp8_full=(720.0, 79.0, 8e9, [11.0, 10.9, 10.7]),
                 nvidia_fp8_eager=(800.0, 85.0, 8e9, losses), fsdp2_float8_eager=(950.0, 70.0, 4e9, losses),
                 ours_fp8_gather_eager=(690.0, 82.0, 4.2e9, losses),
                 ours_fp8_gather_partial=(695.0, 82.0, 4.2e9, [11.0, 10.9, 10.7]),
                 nvidia_fp8_gather_eager=(740.0, 90.0, 4.2e9, losses),
                 ours_fp8_attention_eager=(680.0, 78.0, 8e9, losses),
                 ours_fp8_attention_partial=(685.0, 78.0, 8e9, losses),
                 nvidia_fp8_attention_eager=(760.0, 85.0, 8e9, [11.0, 10.9, 10.7]),
                 ours_fp8_gather_attention_eager=(700.0, 81.0, 4.2e9, losses))
    res = _assemble(cols)
    by = {g["name"]: g for g in res["evaluation"]["goals"]}

    def verdict(start: str) -> str:
        (name,) = [n for n in by if n.startswith(start)]
        return by[name]["verdict"]

    assert verdict("ours FP8 (current) eager step / ours bf16") == "PASS"  # 1.43x tokens/s
    # each recipe's eager column against bf16: delayed at 1.32x fails; block was not run: MISSING
    assert verdict("ours FP8 (delayed) eager step / ours bf16") == "FAIL"
    assert verdict("ours FP8 (block) eager step / ours bf16") == "MISSING"
    assert verdict("ours FP8 (current) eager step / NVIDIA") == "PASS"  # 1.14x
    assert verdict("ours FP8 (current) eager step / FSDP2") == "PASS"  # 1.36x
    assert verdict("ours FP8 + partial") == "PASS" and verdict("ours FP8 whole-step") == "FAIL"
    # the FP8 all-gather column: 0.525x the bf16 bytes passes, a peak above bf16's fails, and its graphed column
    # is checked against it (losses differ here: not bit for bit)
    assert by["ours FP8 weights gathered as FP8: all-gather bytes / ours bf16"]["ratio"] == pytest.approx(0.525)
    assert verdict("ours FP8 weights gathered as FP8: all-gather bytes") == "PASS"
    assert verdict("ours FP8 weights gathered as FP8: eager peak") == "FAIL"  # 82 GiB against 80
    assert verdict("ours FP8 weights gathered as FP8: eager step / NVIDIA FP8 eager") == "PASS"  # 1.16x
    assert verdict("ours FP8 weights gathered as FP8: eager step / NVIDIA's") == "FAIL"  # 1.07x
    assert cols["ours_fp8_gather_partial"]["losses_equal_to_ours_fp8_gather_eager"] is False
    # the graphed FP8 columns are compared bit for bit with the eager column of their recipe
    assert cols["ours_fp8_partial"]["losses_equal_to_ours_fp8_current_eager"] is True
    # FP8 attention: 1.47x bf16 and 1.12x NVIDIA's under the same recipe pass; its graphed column is 0.7% slower
    # (fails "never slower") and is compared bit for bit with its own eager column
    assert verdict("ours FP8 (delayed) with FP8 attention") == "PASS"
    assert verdict("ours FP8 with FP8 attention, eager step / NVIDIA") == "PASS"
    assert verdict("ours FP8 with FP8 attention + partial") == "FAIL"
    assert cols["ours_fp8_attention_partial"]["losses_equal_to_ours_fp8_attention_eager"] is True
    # both together: 1.43x bf16 passes, 1.086x NVIDIA's with FP8 attention fails
    assert verdict("ours FP8 weights gathered as FP8 + FP8 attention: eager step / ours bf16") == "PASS"
    assert verdict("ours FP8 weights gathered as FP8 + FP8 attention: eager step / NVIDIA") == "FAIL"
    assert cols["ours_fp8_full"]["losses_equal_to_ours_fp8_current_eager"] is False
    blk = _rows(ours_fp8_block_eager=(700.0, 78.0, 8e9, losses), ours_fp8_partial=(690.0, 79.0, 8e9, losses))
    _assemble(blk, recipe="block")
    assert blk["ours_fp8_partial"]["losses_equal_to_ours_fp8_block_eager"] is True
    # a missing column is MISSING and fails the run
    del cols["nvidia_fp8_eager"]
    res = _assemble(cols)
    assert res["evaluation"]["failed"]
    assert any(g["verdict"] == "MISSING" for g in res["evaluation"]["goals"])


def test_fp8_arguments_refused_with_the_rule():
    b = _bench()
    with pytest.raises(SystemExit):
        b.parse(["--config", "llama8b_fp8", "--fp8-recipe", "delayed"])  # the whole-step column refuses delayed
    args = b.parse(["--config", "llama8b_fp8", "--fp8-recipe", "delayed", "--columns", "ours_fp8_partial"])
    assert args.fp8_recipe == "delayed"
    with pytest.raises(SystemExit):
        b.parse(["--config", "llama8b_fp8", "--micro-batches", "0"])
    import _engines_fp8

    assert _engines_fp8.recipe_of("ours_fp8_block_eager", args) == "block"
    assert _engines_fp8.recipe_of("nvidia_fp8_eager", args) == "delayed"
    assert _engines_fp8.recipe_of("ours_eager", args) is None and _engines_fp8.recipe_of("fsdp2_float8_eager", args) is None
    # the FP8 attention columns: delayed scaling whatever --fp8-recipe says (the recipe TE runs it with on Hopper)
    current = b.parse(["--config", "llama8b_fp8", "--columns", "ours_fp8_attention_eager", "nvidia_fp8_eager"])
    assert [_engines_fp8.recipe_of(c, current) for c in _engines_fp8.FP8_ATTENTION] == ["delayed"] * 4
    assert _engines_fp8.recipe_of("nvidia_fp8_eager", current) == "current"


def test_fp8_weights_with_fp8_attention_column():
    """ours_fp8_gather_attention_eager: current-scaled FP8 weights with FP8 attention, which TE runs on Hopper only
    with NVTE_DPA_FP8_RECIPE=DelayedScaling in the column's own process; refused in a shared process without it."""
    b = _bench()
    import _engines_fp8

    args = b.parse(["--config", "llama8b_fp8", "--fp8-recipe", "delayed", "--columns", "ours_fp8_gather_attention_eager"])
    col = "ours_fp8_gather_attention_eager"
    assert _engines_fp8.recipe_of(col, args) == "current"  # the FP8 weights' recipe, whatever --fp8-recipe says
    recipe = _engines_fp8.make_recipe(col, args)
    assert recipe.name == "current" and recipe.dot_product_attention is True
    assert _engines_fp8.column_env(col) == {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}
    assert all(_engines_fp8.column_env(c) == {} for c in _engines_fp8.FP8_COLUMNS if c != col)
    assert _engines_fp8.layer_overrides(col) == _engines_fp8.layer_overrides("ours_fp8_gather_eager") != {}
    assert "CUDA GPU" in _engines_fp8.not_applicable(col, torch.device("cpu"), args)


def test_fp8_weights_with_fp8_attention_checked_with_the_column_env(monkeypatch):
    """On a GPU (stood in for): the FP8-attention rules are checked with NVTE_DPA_FP8_RECIPE=DelayedScaling, the
    environment the column's own process gets, whatever this process has; a shared process without it is refused;
    a cuDNN TE runs below what deterministic FP8 attention needs is refused with the library's reason."""
    from fsdp_cudagraph.capture import fp8 as fp8_mod, te as te_mod

    b = _bench()
    import _engines_fp8

    col = "ours_fp8_gather_attention_eager"
    monkeypatch.setattr(te_mod, "HAS_TE", True)
    monkeypatch.setattr(te_mod, "require_te", lambda what: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_mod, "check_fp8_device", lambda *a: None)
    monkeypatch.setattr(fp8_mod, "attention_deterministic", lambda: True)
    monkeypatch.delenv("NVTE_DPA_FP8_RECIPE", raising=False)
    cuda = torch.device("cuda")
    isolated = b.parse(["--config", "llama8b_fp8", "--layers-impl", "te", "--columns", col])
    shared = b.parse(["--config", "llama8b_fp8", "--layers-impl", "te", "--isolate", "none", "--columns", col])
    monkeypatch.setattr(te_mod, "te_cudnn_version", lambda: (9, 19, 0))
    assert _engines_fp8.not_applicable(col, cuda, isolated) is None  # current scaling on Hopper: with the column env
    assert "NVTE_DPA_FP8_RECIPE=DelayedScaling" in _engines_fp8.not_applicable(col, cuda, shared)
    monkeypatch.setattr(te_mod, "te_cudnn_version", lambda: (9, 14, 0))
    assert "need cuDNN 9.19 or newer" in _engines_fp8.not_applicable(col, cuda, isolated)


def test_the_weight_cache_is_for_the_eager_columns_with_bf16_weights(tmp_path):
    """``--fp8-cache-quantized-params``: TE's weight cache in the eager FP8 columns whose layers hold bf16 weights
    (ours and NVIDIA's), not the FP8-weight columns (their engine quantizes once a step) nor the bf16 and torchao
    ones; with a graphed FP8 column it is refused, naming the columns; records of both settings do not merge."""
    b = _bench()
    import _engines_fp8

    args = b.parse(["--config", "llama8b_fp8", "--fp8-cache-quantized-params", "--micro-batches", "4",
                    "--columns", "ours_eager", "ours_fp8_current_eager", "nvidia_fp8_eager", "ours_fp8_gather_eager"])
    cached = {c for c in _engines_fp8.FP8_COLUMNS if _engines_fp8.caches_weights(c, args)}
    assert cached == {"ours_fp8_delayed_eager", "ours_fp8_current_eager", "ours_fp8_block_eager", "nvidia_fp8_eager",
                      "ours_fp8_attention_eager", "ours_fp8_attention_kept_eager", "nvidia_fp8_attention_eager"}
    assert not any(_engines_fp8.caches_weights(c, b.parse(["--config", "llama8b_fp8", "--columns", c]))
                   for c in cached)
    for refused in (["--config", "llama8b_fp8", "--columns", "ours_fp8_partial"], ["--config", "llama8b_fp8"],
                    ["--config", "llama8b_fp8", "--columns", "ours_fp8_attention_partial"],
                    ["--config", "llama8b"]):  # a graphed column, named or among the defaults; another config
        with pytest.raises(SystemExit):
            b.parse([*refused, "--fp8-cache-quantized-params"])
    assert isinstance(_engines_fp8.autocast(None, False), contextlib.nullcontext)
    from _engines_report import merge

    paths = []
    for cache in (False, True):
        paths.append(tmp_path / f"{cache}.json")
        paths[-1].write_text(json.dumps({"world_size": 4, "columns": {}, "config": {
            "config": "llama8b_fp8", "layers": 32, "micro_batches": 32, "fp8_cache_quantized_params": cache}}))
    with pytest.raises(ValueError, match="fp8_cache_quantized_params"):
        merge([str(p) for p in paths])


def test_fp8_columns_are_measured_against_their_own_floor():
    """[Note: the FP8 floor]: with the FP8 matmul rate measured, the FP8 columns' multiple is against a floor whose
    layer GEMMs run at that rate (attention and the LM head at the bf16 rate); bf16 columns keep the bf16 floor."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _engines_report import assemble

    losses = [11.0, 10.9, 10.8]
    cols = _rows(ours_eager=(1000.0, 80.0, 8e9, losses), ours_fp8_current_eager=(700.0, 78.0, 8e9, losses),
                 ours_fp8_delayed_eager=(760.0, 78.0, 8e9, losses),
                 ours_fp8_attention_eager=(680.0, 78.0, 8e9, losses))
    for c in cols.values():
        c["counts"]["unit_matmul_params"] = 32 * 218_103_808
    cols["ours_fp8_current_eager"]["fp8"] = "current"
    cols["ours_fp8_attention_eager"].update(fp8="delayed", fp8_attention=True)
    args = argparse.Namespace(config="llama8b_fp8", micro_batch=1, micro_batches=1, warmup=3, fp8_recipe="current")
    rates = {"matmul_tflops": 800.0, "copy_gbps": 4000.0, "all_gather_gbps": 300.0, "reduce_scatter_gbps": 300.0}
    plain = assemble(args, 4, dict(rates), {c: dict(r) for c, r in cols.items()}, {})
    assert "fp8" not in plain["floor"]  # no FP8 rate measured: one floor for all
    res = assemble(args, 4, {**rates, "fp8_matmul_tflops": 1600.0}, cols, {})
    floor, f8 = res["floor"], res["floor"]["fp8"]
    counts = cols["ours_eager"]["counts"]
    fp8_flops = 6 * 8192 * counts["unit_matmul_params"]
    total = floor["model_flops_per_rank"]
    assert f8["fp8_flops_share"] == pytest.approx(fp8_flops / total)
    assert f8["matmul_ms"] == pytest.approx((fp8_flops / 1600e12 + (total - fp8_flops) / 800e12) * 1e3)
    assert f8["matmul_ms"] < floor["matmul_ms"] and f8["optimizer_ms"] == floor["optimizer_ms"]
    assert cols["ours_fp8_current_eager"]["x_floor"] == pytest.approx(700.0 / f8["floor_ms"])
    # attention in FP8 too: its QK^T and AV FLOPs (the model FLOPs beyond 6 x tokens x matmul params) at the FP8 rate
    fa = res["floor"]["fp8_attention"]
    attention = total - 6 * 8192 * counts["matmul_params"]
    assert attention > 0 and fa["matmul_ms"] == pytest.approx(
        ((fp8_flops + attention) / 1600e12 + (total - fp8_flops - attention) / 800e12) * 1e3)
    assert fa["floor_ms"] < f8["floor_ms"]
    assert cols["ours_fp8_attention_eager"]["x_floor"] == pytest.approx(680.0 / fa["floor_ms"])
    assert "FP8 attention floor" in res["table"]
    assert cols["ours_eager"]["x_floor"] == pytest.approx(1000.0 / floor["floor_ms"])
    assert "FP8 floor" in res["table"]


def test_deterministic_run_fails_when_a_graphed_column_is_not_bit_exact():
    """``--deterministic``: a graphed column whose losses differ from its eager column's fails the run, named in the
    table; without the flag the difference is recorded only (the speed record's kernels are not deterministic)."""
    losses = [11.0, 10.9, 10.8]
    for det in (False, True):
        cols = _rows(ours_fp8_current_eager=(700.0, 78.0, 8e9, losses),
                     ours_fp8_partial=(690.0, 79.0, 8e9, [11.0, 10.9, 10.8 + 1e-6]))
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from _engines_report import assemble

        args = argparse.Namespace(config="llama8b_fp8", micro_batch=1, micro_batches=1, warmup=3,
                                  fp8_recipe="current", deterministic=det)
        res = assemble(args, 4, {}, cols, {})
        assert cols["ours_fp8_partial"]["losses_equal_to_ours_fp8_current_eager"] is False
        assert res["evaluation"]["graphed_not_equal_to_eager"] == (["ours_fp8_partial"] if det else [])
        assert ("NOT EQUAL" in res["table"]) is det
    assert _bench().parse(["--config", "llama8b", "--deterministic", "--cpu-smoke"]).deterministic is True


def test_fp8_weight_columns_build_fused_qkv_in_bf16():
    """TE refuses FP8 weights split into q, k and v, and an FP8 weight keeps the dtype it is built in: every FP8-weight
    column (ours and NVIDIA's) builds its layers with one QKV weight, in bf16, whatever --fuse-wgrad says."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _engines_fp8

    from fsdp_cudagraph.apps.llama import LlamaConfig

    assert "nvidia_fp8_gather_eager" in _engines_fp8.FP8_WEIGHTS
    for column in _engines_fp8.FP8_WEIGHTS:
        assert _engines_fp8.layer_overrides(column) == {"te_params_dtype": torch.bfloat16, "fuse_qkv": True}
        assert _engines_fp8.recipe_of(column, argparse.Namespace(fp8_recipe="delayed")) == "current"
    assert _engines_fp8.layer_overrides("ours_fp8_current_eager") == {}
    args = argparse.Namespace(fuse_wgrad="off", fp8_recipe="current", layers_impl="te")
    assert "fuse" not in (_engines_fp8.not_applicable("ours_fp8_gather_eager", torch.device("cpu"), args) or "")
    with pytest.raises(ValueError, match="fuse_qkv=False"):
        LlamaConfig(layers_impl="te", fuse_wgrad=True, fuse_qkv=False)

