"""The floor arithmetic and the goal verdicts of ``bench_partial_graphs.py --suite full`` (pure functions, CPU).

No process group and no GPU: ``benchmarks/_perf_goals.py`` imports nothing but the standard library.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "diagnose"))  # profile_step
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "tools"))  # scaling

import _perf_goals as g  # noqa: E402


def test_param_count_matches_the_reference_gpt():
    from fsdp_cudagraph.apps.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, seq_len=16)
    n = g.param_count(vocab_size=96, hidden_size=32, num_layers=3, ffn_hidden_size=cfg.ffn_hidden_size, seq_len=16)
    assert n == sum(p.numel() for p in GPT(cfg).parameters())


def test_optimizer_bytes_are_38_per_owned_parameter():
    assert g.ADAM_BYTES_PER_PARAM == 32 and g.CAST_BYTES_PER_PARAM == 6
    assert g.optimizer_bytes(1000) == 38_000
    assert g.optimizer_bytes(1000, world_size=2) == 19_000
    with pytest.raises(ValueError, match="world_size=0"):
        g.optimizer_bytes(10, 0)


def test_floor_adds_matmul_time_and_optimizer_time():
    f = g.floor_ms(flops=2e12, bytes_moved=3e9, matmul_tflops=500, copy_gbps=3000)
    assert f["matmul_ms"] == pytest.approx(4.0)
    assert f["optimizer_ms"] == pytest.approx(1.0)
    assert f["floor_ms"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="copy_gbps=0"):
        g.floor_ms(flops=1, bytes_moved=1, matmul_tflops=1, copy_gbps=0)


def test_compute_config_floor_on_h100_like_rates():
    # The compute config (4 layers, h4096, s2048, vocab 1024, mbs 1) on one GPU at 700 TFLOP/s, 3000 GB/s:
    # about 14.7 ms of matmuls and 10.3 ms of Adam + cast: a floor near 25 ms.
    from _flops import model_flops_per_step
    from fsdp_cudagraph.apps.model import GPTConfig

    cfg = GPTConfig(vocab_size=1024, hidden_size=4096, num_layers=4, num_heads=32, seq_len=2048)
    n = g.param_count(vocab_size=1024, hidden_size=4096, num_layers=4, ffn_hidden_size=cfg.ffn_hidden_size,
                      seq_len=2048)
    assert 0.82e9 < n < 0.83e9
    f = g.floor_ms(flops=model_flops_per_step(cfg, 2048), bytes_moved=g.optimizer_bytes(n), matmul_tflops=700,
                   copy_gbps=3000)
    assert 14 < f["matmul_ms"] < 15.5 and 10 < f["optimizer_ms"] < 10.6


def test_spread_and_repeat_noise():
    assert g.relative_spread([10.0]) == 0.0  # one value: nothing to compare
    assert g.relative_spread([10.0, 10.0, 10.0]) == 0.0
    # two or three timed steps (too few for quartiles): half the range over the median, not a noiseless 0
    assert g.relative_spread([695.8, 722.9, 718.3]) == pytest.approx((722.9 - 695.8) / 2 / 718.3)
    assert g.relative_spread([9.0, 11.0]) == pytest.approx(0.1)
    assert g.relative_spread([10.0] * 8) == 0.0
    s = g.relative_spread([9.0, 10.0, 10.0, 11.0, 10.0, 9.0, 11.0, 10.0])
    assert 0 < s < 0.1
    assert g.repeat_noise(10.0, 10.5) == pytest.approx(0.05)
    assert g.repeat_noise(None, 3.0) == 0.0


@pytest.mark.parametrize("ratio,noise,want", [(0.9, 0.0, "PASS"), (1.0, 0.0, "PASS"), (1.02, 0.03, "NOISE"),
                                              (1.05, 0.03, "FAIL"), (1.01, 0.0, "FAIL"), (None, 0.5, "MISSING")])
def test_verdict(ratio, noise, want):
    assert g.verdict(ratio, 1.0, noise) == want


def _col(ms, peak, spread=0.0):
    steps = [ms * (1 - spread), ms, ms, ms * (1 + spread)] * 3
    return {"step_ms": ms, "step_ms_all": steps, "peak_memory_gib": peak}


def _configs(**over):
    compute = {"eager": _col(30.0, 10.0), "eager_repeat": _col(30.3, 10.0), "partial": _col(30.0, 10.5),
               "full_iteration": _col(29.0, 10.2), "fsdp2": _col(40.0, 10.0), "fsdp2_graph": _col(39.0, 10.0)}
    launch = {"eager": _col(40.0, 1.0), "eager_repeat": _col(40.0, 1.0), "partial": _col(16.0, 1.05),
              "full_iteration": _col(6.0, 1.0), "fsdp2": _col(59.0, 1.0), "fsdp2_graph": _col(8.0, 1.0)}
    compute.update(over)
    return {"compute": {"columns": compute, "floor_ms": 25.0},
            "launch": {"columns": launch, "floor_ms": 2.0}}


def test_evaluate_passes_when_every_goal_holds():
    ev = g.evaluate(_configs())
    assert {r["verdict"] for r in ev["goals"]} == {"PASS"}, ev["goals"]
    assert not ev["failed"]
    assert len(ev["goals"]) == len(g.GOALS)
    assert ev["configs"]["compute"]["floor_multiple"]["eager"] == pytest.approx(1.2)
    assert ev["configs"]["compute"]["repeat_noise_ms"] == pytest.approx(0.01)


def test_evaluate_noise_forgives_a_small_miss_and_fails_a_large_one():
    # partial 1.5% slower than eager: inside the 1% repeat noise? no; inside the spread of partial (2-3%, by quartile method): NOISE.
    ev = g.evaluate(_configs(partial=_col(30.45, 10.5, spread=0.04)))
    row = next(r for r in ev["goals"] if r["name"] == "partial step / eager")
    assert row["verdict"] == "NOISE" and 0.015 < row["noise"] < 0.04
    assert not ev["failed"]
    ev = g.evaluate(_configs(partial=_col(33.0, 10.5)))
    row = next(r for r in ev["goals"] if r["name"] == "partial step / eager")
    assert row["verdict"] == "FAIL" and ev["failed"]


def test_evaluate_memory_and_missing_columns():
    ev = g.evaluate(_configs(partial=_col(30.0, 11.5)))  # 1.15x the eager peak, goal 1.1, memory noise 0
    row = next(r for r in ev["goals"] if r["name"] == "partial peak / eager peak" and r["config"] == "compute")
    assert row["verdict"] == "FAIL" and row["ratio"] == pytest.approx(1.15)
    ev = g.evaluate(_configs(fsdp2={"error": "RuntimeError: boom"}))
    missing = [r for r in ev["goals"] if r["verdict"] == "MISSING"]
    assert {r["name"] for r in missing} == {"eager step / FSDP2 eager", "eager peak / FSDP2 peak"}
    assert ev["failed"]
    table = g.format_table(_configs(fsdp2={"error": "x"}), ev, ["eager", "fsdp2"])
    assert "| compute | step ms | 30.00 | failed |" in table and "MISSING" in table


def test_memory_goals_compare_each_column_own_peak():
    # bench_full_iteration's [Note: a column's own peak]: a full-iteration column that started with 0.1 GiB of an
    # earlier column's workspaces peaks at 1.08 GiB (1.08x eager: FAIL); its own peak, 0.98 GiB, passes.
    launch_fi = dict(_col(6.0, 1.08), own_peak_gib=0.98)
    configs = _configs()
    configs["launch"]["columns"]["full_iteration"] = launch_fi
    row = next(r for r in g.evaluate(configs)["goals"]
               if r["name"] == "full-iteration peak / eager peak" and r["config"] == "launch")
    assert row["verdict"] == "PASS" and row["ratio"] == pytest.approx(0.98)
    configs["launch"]["columns"]["full_iteration"] = dict(launch_fi, own_peak_gib=1.08)
    row = next(r for r in g.evaluate(configs)["goals"]
               if r["name"] == "full-iteration peak / eager peak" and r["config"] == "launch")
    assert row["verdict"] == "FAIL"
    table = g.format_table(configs, g.evaluate(configs), ["eager", "full_iteration"])
    assert "| launch | own peak GiB | 1.00 | 1.08 |" in table


def test_the_benchmark_says_it_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_partial_graphs.py"), "--suite", "full"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_capture_report_memory_breakdown_arithmetic(monkeypatch):
    # capture/schedules.py's read-only breakdown (moved from graphs/partial.py): static inputs, static parameter
    # gradients (each parameter once, frozen ones left out), the rest of the graph memory, and pool growth.
    # CUDA's counters are stubbed.
    import types

    import torch
    from torch import nn

    from fsdp_cudagraph.capture import schedules

    shared = nn.Linear(4, 4)  # 20 fp32 parameters = 80 bytes, seen by both callables, counted once
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    a = types.SimpleNamespace(sample_args=(torch.zeros(10),), module=nn.Sequential(shared, frozen))
    b = types.SimpleNamespace(sample_args=(torch.zeros(5, dtype=torch.bfloat16),), module=shared)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 1000)
    got = schedules.memory_breakdown([a, b], graph_bytes=500, reserved0=400)
    assert got == {"static_input_bytes": 40 + 10, "param_grad_bytes": 80, "other_bytes": 420,
                   "reserved_growth_bytes": 600}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert schedules.memory_breakdown([a, b], graph_bytes=0, reserved0=0) == {}


def test_goal_check_and_memory_table_glue(monkeypatch):
    # The GPU-only glue of --suite full, on CPU: device rates, the repeated eager column and the Adam timings
    # are stubbed; what is checked is that the pieces fit (keys, floors, table, verdicts).
    import argparse

    import bench_full_iteration as bfi
    import bench_partial_graphs as bpg

    monkeypatch.setattr(bpg, "matmul_peak_tflops", lambda device: 700.0)
    monkeypatch.setattr(bpg, "copy_bandwidth_gbps", lambda device: 3000.0)
    monkeypatch.setattr(bpg, "adam_step_ms", lambda device, n, fused: 9.0 if fused else 20.0)
    monkeypatch.setattr(bpg.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(bpg.gc, "collect", lambda: 0)
    monkeypatch.setattr(bpg.torch.cuda, "empty_cache", lambda: None)

    def run_columns(name, columns, rows, args, device):
        rows["eager"] = _configs()[name]["columns"]["eager_repeat"]

    monkeypatch.setattr(bfi, "run_columns", run_columns)
    full = {name: {"columns": {c: r for c, r in cfg["columns"].items() if c != "eager_repeat"}}
            for name, cfg in _configs().items()}
    bpg.repeat_eager(full, argparse.Namespace(skip=0), device=None)
    assert full["compute"]["columns"]["eager_repeat"]["step_ms"] == 30.3
    out = bpg.goal_check(full, argparse.Namespace(skip=0), device=None)
    ev = out["evaluation"]
    assert len(ev["goals"]) == len(g.GOALS)
    assert 24 < full["compute"]["floor"]["floor_ms"] < 27  # the H100-like rates of the test above
    assert out["adam_ms"]["compute"]["fused_ms"] == 9.0 and 8 < out["adam_ms"]["compute"]["floor_ms"] < 10
    assert "eager_repeat" in out["table"] and "fused" in out["table"]
    mem = {"compute": {"eager_peak_gib": 10.0, "partial_peak_gib": 11.5, "partial_over_eager_peak": 1.15,
                       "extra_gib": 1.5, "graph_memory_gib": 3.0,
                       "breakdown_gib": {"param_grad_bytes": 1.5, "other_bytes": 1.5}}}
    assert "| compute | 10.000 | 11.500 | 1.150 | 1.500 | 3.000 | 1.500 | 1.500 | - | - |" in bpg.memory_table(mem)


# --- benchmarks/diagnose/profile_step.py: the kernel arithmetic of the profile write-up (pure functions) -------


def test_profile_categories_of_kernel_names_seen_on_hopper():
    import profile_step as ps

    names = {
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "void at::native::(anonymous namespace)::fused_adam_kernel<float>": "optimizer",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": "optimizer",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, BinaryOpScalarFunctor<float>>": "foreach",
        "void transformer_engine::normalization::ln_fwd_tuned_kernel<float>": "norm",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "elementwise/other",
        # seen on an H200 (2026-11-29): the LM loss's log-softmax, TE's unfused attention, a mixed-dtype add
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
        "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
        "void transformer_engine::scaled_masked_softmax_warp_forward<__nv_bfloat16, __nv_bfloat16, float, 13>": "attention",
        "void transformer_engine::scaled_upper_triang_masked_softmax_warp_backward<__nv_bfloat16, float, 13>": "attention",
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, 4, "
        "TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >": "elementwise/other",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "zero/fill",
        "Memcpy DtoD (Device -> Device)": "copy/cast",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copy/cast",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "elementwise/other",
    }
    assert {n: ps.categorize(n) for n in names} == names


def test_profile_busy_time_is_the_union_and_idle_the_rest():
    import profile_step as ps

    assert ps.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    kernels = [("nvjet_a", 0, 10), ("ncclKernel_b", 5, 12), ("fused_adam", 20, 30)]
    s = ps.summarize_kernels(kernels, steps=2)
    # per step: matmul 10 us, collective 7 us, optimizer 10 us; busy 22 of a 30 us span
    assert s["category_ms"] == {"matmul": 0.005, "optimizer": 0.005, "collective": 0.0035}
    assert s["top_kernels_by_category_ms"] == {"matmul": [("nvjet_a", 0.005)], "collective": [("ncclKernel_b", 0.0035)],
                                               "optimizer": [("fused_adam", 0.005)]}
    assert (s["busy_ms"], s["span_ms"], s["idle_ms"]) == (0.011, 0.015, 0.004)
    # the collective ran 5..12, the matmul until 10: 2 us of it (1 us per step) hid under nothing
    assert s["exposed_collective_ms"] == 0.001
    overlapped = ps.summarize_kernels([("ncclAllGather", 0, 4), ("nvjet_a", 0, 4)], steps=1)
    assert overlapped["exposed_collective_ms"] == 0  # fully overlapped
    with pytest.raises(ValueError, match="0 kernels"):
        ps.summarize_kernels([], steps=1)


def test_profile_names_each_collective_and_what_it_costs_the_matmuls_beside_it():
    import profile_step as ps

    kernels = [("nvjet_a", 0, 10), ("nvjet_a", 20, 34), ("nvjet_a", 40, 50),
               ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 22, 38), ("ncclDevKernel_AllGather_RING_LL(y)", 60, 64)]
    s = ps.summarize_kernels(kernels, steps=1)
    rs, ag = s["collectives"]["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"], s["collectives"]["ncclDevKernel_AllGather_RING_LL"]
    assert rs == {"calls": 1, "ms": 0.016, "exposed_ms": 0.004}  # 34..38 ran alone
    assert ag == {"calls": 1, "ms": 0.004, "exposed_ms": 0.004}
    # the matmul beside the reduce-scatter took 14 us, the same kernel alone 10 us: 4 us of slowdown
    assert s["matmul_under_collective"] == {"matmul_ms_beside_collective": 0.014, "extra_ms": 0.004, "kernels_beside": 1}
    assert ps._overlap(5, 25, [(0, 10), (12, 14), (20, 30)]) == 5 + 2 + 5


def test_the_step_budget_sums_to_the_step_beyond_the_floor_line_by_line():
    import profile_step as ps

    kernels = [("nvjet_a", 0, 10), ("nvjet_a", 20, 34), ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 22, 38),
               ("fused_adam", 40, 46), ("cast_kernel", 46, 48), ("gelu_kernel", 48, 50)]
    profile = ps.summarize_kernels(kernels, steps=1)
    result = {"floor": {"floor_ms": 0.030, "matmul_ms": 0.020, "optimizer_ms": 0.010},
              "columns": {"ours": {"step_ms": 0.052, "profile": profile}}}
    lines = dict(ps.budget_lines(result, "ours"))
    # matmuls 24 us of which 4 us slowdown (the same kernel took 10 alone, 14 beside the reduce-scatter): 20 at
    # their own rate, the floor's 20; 4 us of the reduce-scatter ran alone (34..38); Adam + cast 8 us against the
    # floor's 10; GELU 2 us; the step (52 us) is 14 us longer than the busy 38 (0..10, 20..38, 40..50)
    assert lines["matmuls slowed beside collectives"] == pytest.approx(0.004)
    assert lines["matmuls at their own rate, against the floor's"] == pytest.approx(0.0)
    assert lines["collectives nothing overlapped"] == pytest.approx(0.004)
    assert lines["optimizer, casts and copies, against the floor's"] == pytest.approx(-0.002)
    assert lines["element-wise, attention, norms, loss, fills (not in the floor)"] == pytest.approx(0.002)
    assert lines["step (no profiler) against GPU busy (profiled)"] == pytest.approx(0.052 - 0.038)
    assert sum(lines.values()) == pytest.approx(0.052 - 0.030)


# --- benchmarks/tools/scaling.py: the 1 -> N table from the suite's JSON ------------------------------------------


def _suite_file(world: int, eager_ms: float, peak: float, own=None) -> dict:
    col = {"step_ms": eager_ms, "tokens_per_s": 1000.0 * world, "peak_memory_gib": peak}
    if own is not None:
        col["own_peak_gib"] = own
    return {"world_size": world, "suites": {"full": {"compute": {"columns": {"eager": col, "fsdp2": {"error": "x"}},
                                                                 "floor": {"floor_ms": 20.0 / world}}}}}


def test_scaling_rows_and_table(tmp_path, capsys):
    import json

    import scaling

    rows = scaling.suite_rows([_suite_file(2, 33.0, 9.0, own=8.5), _suite_file(1, 30.0, 14.0)])
    assert [(r["config"], r["column"]) for r in rows] == [("compute", "eager")]  # a failed column is left out
    r = rows[0]
    assert [p["world_size"] for p in r["runs"]] == [1, 2] and r["step_vs_smallest"] == pytest.approx([1.0, 1.1])
    assert [p["peak_gib"] for p in r["runs"]] == [14.0, 8.5]  # own peak where the file has it
    assert [p["tokens_per_s_per_gpu"] for p in r["runs"]] == [1000.0, 1000.0]
    assert "| compute | eager | 30.00 | 33.00 | 1.100 | 1000 | 1000 | 14.00 | 8.50 | 20.00 | 10.00 |" in scaling.table(rows)
    paths = []
    for w in (1, 2):
        paths.append(tmp_path / f"s{w}.json")
        paths[-1].write_text(json.dumps(_suite_file(w, 30.0, 10.0)))
    with pytest.raises(SystemExit, match="same world size"):
        scaling.main([str(paths[0]), str(paths[0])])
    assert scaling.main([str(p) for p in paths]) == 0 and "| compute | eager |" in capsys.readouterr().out


def test_zero3_comm_bytes_two_gathers_and_one_reduce_scatter_times_w_minus_1_over_w():
    b = g.zero3_comm_bytes(1000, 4)  # bf16 gathers, fp32 reduce-scatter
    assert b["all_gather_bytes"] == pytest.approx(2 * 1000 * 2 * 3 / 4)
    assert b["reduce_scatter_bytes"] == pytest.approx(1000 * 4 * 3 / 4)
    assert g.zero3_comm_bytes(1000, 1) == {"all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0}
    assert g.zero3_comm_bytes(1000, 2, grad_bytes=2)["reduce_scatter_bytes"] == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="world_size=0"):
        g.zero3_comm_bytes(10, 0)


def test_floor_with_comm_compute_bound_adds_only_what_cannot_overlap():
    # 2 ranks, 1e9 params: gathers 2e9 bytes (1e9 per pass), reduce-scatter 2e9 bytes; 100 GB/s each
    f = g.floor_with_comm_ms(matmul_ms=100.0, optimizer_ms=5.0, num_params=10**9, first_unit_params=10**8,
                             last_unit_params=2 * 10**8, world_size=2, all_gather_gbps=100, reduce_scatter_gbps=100)
    assert f["all_gather_ms"] == pytest.approx(20.0) and f["reduce_scatter_ms"] == pytest.approx(20.0)
    assert f["first_gather_ms"] == pytest.approx(1.0)  # 1e8 params x 2 bytes x 1/2, forward gather only
    assert f["last_reduce_scatter_ms"] == pytest.approx(4.0)  # 2e8 x 4 bytes x 1/2
    assert f["bound"] == "compute"
    assert f["floor_ms"] == pytest.approx(1.0 + 100.0 + 4.0 + 5.0)
    assert f["compute_floor_ms"] == pytest.approx(105.0)


def test_floor_with_comm_communication_bound_is_all_collectives_plus_optimizer():
    f = g.floor_with_comm_ms(matmul_ms=10.0, optimizer_ms=5.0, num_params=10**9, first_unit_params=10**8,
                             last_unit_params=2 * 10**8, world_size=2, all_gather_gbps=100, reduce_scatter_gbps=50)
    assert f["reduce_scatter_ms"] == pytest.approx(40.0)
    assert f["bound"] == "communication"
    assert f["floor_ms"] == pytest.approx(20.0 + 40.0 + 5.0)  # max(compute + edges, all comm) + optimizer


def test_floor_with_comm_on_one_rank_is_the_compute_floor_and_needs_no_rates():
    f = g.floor_with_comm_ms(matmul_ms=10.0, optimizer_ms=2.0, num_params=10**9, first_unit_params=10**8,
                             last_unit_params=10**8, world_size=1, all_gather_gbps=None, reduce_scatter_gbps=None)
    assert f["floor_ms"] == pytest.approx(12.0) and f["comm_ms"] == 0.0


def test_floor_with_comm_refuses_missing_rates_and_oversized_units():
    kw = dict(matmul_ms=1.0, optimizer_ms=1.0, num_params=100, first_unit_params=10, last_unit_params=10, world_size=2)
    with pytest.raises(ValueError, match="all_gather_gbps=None"):
        g.floor_with_comm_ms(all_gather_gbps=None, reduce_scatter_gbps=10, **kw)
    with pytest.raises(ValueError, match="first_unit_params=200"):
        g.floor_with_comm_ms(**{**kw, "first_unit_params": 200}, all_gather_gbps=1, reduce_scatter_gbps=1)


def test_engine_goals_name_bench_engines_columns():
    import bench_engines

    assert {x.config for x in g.ENGINE_GOALS} == set(bench_engines.COLUMNS)
    for goal in g.ENGINE_GOALS:  # each goal's columns are columns of its config (or its floor)
        assert {goal.num, goal.den} <= set(bench_engines.COLUMNS[goal.config]) | {"floor"}, goal
    configs = {"llama8b": {"columns": {"ours_eager": {"step_ms": 110.0, "peak_memory_gib": 10.0},
                                       "fsdp2_eager": {"step_ms": 150.0, "peak_memory_gib": 11.0}},
                           "floor_ms": 100.0}}
    ev = g.evaluate(configs, [x for x in g.ENGINE_GOALS if x.config == "llama8b"])
    by = {r["name"]: r["verdict"] for r in ev["goals"]}
    assert by["ours eager step / floor with communication"] == "PASS"
    assert by["ours eager step / FSDP2 eager (tokens/s >= 1.25x)"] == "PASS"  # 110/150 = 0.73 <= 0.8
    assert by["ours eager step / NVIDIA eager (tokens/s >= 1.25x)"] == "MISSING"
    assert ev["failed"]
