"""Where each millisecond of the compute-bound step goes: kernel time by category, against the floor.

Runs the compute config of ``bench_full_iteration`` (4 TE layers, hidden 4096, seq 2048, micro-batch 1) as a
user's loop on the default stream, three ways one after the other in one process: ``ours`` (megatron_fsdp
ZeRO-3, double buffer, bf16 compute, fused Adam; with TE, fused weight gradients unless ``--fuse-wgrad off``),
``ours_partial`` (the same with whole-layer graphs, TE's graph
maker, captured before step 3) and ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per layer and at the root,
bf16 parameters, fp32 reduction, fused Adam). For each: the median step time over ``--steps`` after ``--skip``
(CUDA events, no profiler), then ``--profile-steps`` steps under ``torch.profiler``, whose CUDA kernels are
summed per category (:func:`categorize`) and whose busy time is the union of the kernels' intervals, so
``idle`` is the time the GPU waited on the host or on a dependency. Memory: the peak allocated and, for
``ours``, the engine's persistent tensors by kind. The floor is ``bench_partial_graphs``' (measured matmul
rate for the model's FLOPs, measured copy bandwidth for the optimizer and cast bytes).

    python benchmarks/diagnose/profile_step.py --out profile-compute.json
    torchrun --nproc-per-node 2 benchmarks/diagnose/profile_step.py --out profile-compute-2gpu.json   # rank 0's kernels

Needs a CUDA GPU; TE is used when importable (the plain-torch GPT otherwise, and the JSON says so).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import os
import re
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: E402 - the repository root on sys.path
import torch  # noqa: E402

#: (category, pattern over the kernel name); the first match wins, anything else is ``elementwise/other``.
CATEGORIES: Sequence[Tuple[str, str]] = (
    ("collective", r"nccl"),
    # TE's unfused attention (``scaled_masked_softmax``, ``scaled_upper_triang_masked_softmax``, ...: the backend TE
    # falls back to when no fused one runs) is attention, not the loss
    ("attention", r"fmha|flash|sdpa|fused_attn|fort_native|cudnn_generated|attn|scaled_\w*softmax"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|wgmma|s\d+_.*_tn|s\d+_.*_nt"),
    ("optimizer", r"adam|FusedOptimizer"),
    ("foreach", r"multi_tensor_apply"),
    ("norm", r"layer_?norm|rms_?norm|ln_fwd|ln_bwd|welford"),
    ("loss", r"cross_entropy|log_?softmax|nll_loss|softmax_warp"),  # torch's log-softmax: cunn_SoftMax*<LogSoftMax*>
    ("zero/fill", r"fill|memset|zero"),
    ("copy/cast", r"copy|cast|memcpy|convert|transpose"),
)
_COMPILED = [(name, re.compile(pat, re.IGNORECASE)) for name, pat in CATEGORIES]
OTHER = "elementwise/other"


#: Template arguments that name how an elementwise kernel loads and stores (a mixed-dtype ``add_`` is
#: ``unrolled_elementwise_kernel<CUDAFunctor_add<float>, ..., LoadWithCast<2>, StoreWithCast<1>>``): not a cast.
_IO_ONLY = re.compile(r"(Load|Store)WithCast")


def categorize(kernel: str) -> str:
    """The category of a CUDA kernel (or memcpy/memset) by its name."""
    kernel = _IO_ONLY.sub("", kernel)
    for name, pat in _COMPILED:
        if pat.search(kernel):
            return name
    return OTHER


def _merged(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals (touching ones joined)."""
    out: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy_us(intervals: Sequence[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time at least one kernel ran."""
    return sum(end - start for start, end in _merged(intervals))


def cuda_kernels(prof: Any) -> List[Tuple[str, float, float]]:
    """(name, start us, end us) of a ``torch.profiler`` run's CUDA kernels, memcpys and memsets. CUDA-side events
    also hold the GPU shadows of record_function ranges (``Optimizer.step#Adam.step``, ``nccl:...``): those span
    kernels already counted, so they are left out."""
    cpu_names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU}
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in cpu_names
            and not getattr(e, "is_user_annotation", False)]


def summarize_kernels(kernels: Sequence[Tuple[str, float, float]], steps: int) -> Dict[str, Any]:
    """Per step: kernel milliseconds per category, busy ms (union), the span from first start to last end, idle
    (span - busy), collective time when no other kernel ran (``exposed_collective_ms``: on 2+ GPUs, the
    communication the step waits for instead of hiding it under compute), the ten kernels that took longest in
    all, and the five longest of each category."""
    if not kernels or steps < 1:
        raise ValueError(f"{len(kernels)} kernels over {steps} steps: need at least one of each (was the profiler "
                         "given CUDA activity?)")
    per_cat: Dict[str, float] = {}
    per_kernel: Dict[str, float] = {}
    by_cat: Dict[str, List[Tuple[str, float, float]]] = {}
    for name, start, end in kernels:
        cat = categorize(name)
        per_cat[cat] = per_cat.get(cat, 0.0) + (end - start)
        per_kernel[name] = per_kernel.get(name, 0.0) + (end - start)
        by_cat.setdefault(cat, []).append((name, start, end))
    collectives = by_cat.get("collective", [])
    compute = _merged([(s, e) for cat, ks in by_cat.items() if cat != "collective" for _, s, e in ks])
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = busy_us([(s, e) for _, s, e in kernels])
    exposed = busy - sum(e - s for s, e in compute)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return {
        "steps": steps,
        "category_ms": {k: v / steps / 1e3 for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "busy_ms": busy / steps / 1e3,
        "span_ms": span / steps / 1e3,
        "idle_ms": (span - busy) / steps / 1e3,
        "exposed_collective_ms": exposed / steps / 1e3,
        "collectives": _collective_rows(collectives, compute, steps),
        "matmul_under_collective": _matmul_slowdown(by_cat.get("matmul", []), collectives, steps),
        "top_kernels_ms": [(k[:160], v / steps / 1e3) for k, v in top],
        # the five longest kernels of each category: what a category's time is made of
        "top_kernels_by_category_ms": {cat: _top_kernels(ks, steps, 5) for cat, ks in by_cat.items()},
    }


def _top_kernels(kernels: List[Tuple[str, float, float]], steps: int, n: int) -> List[Tuple[str, float]]:
    """The ``n`` kernels of ``kernels`` ((name, start, end) in us) with the most time, in ms a step."""
    total: Dict[str, float] = {}
    for name, start, end in kernels:
        total[name] = total.get(name, 0.0) + (end - start)
    return [(k[:160], v / steps / 1e3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:n]]


def _overlap(start: float, end: float, merged: Sequence[Tuple[float, float]]) -> float:
    """Length of ``[start, end)`` covered by the sorted, disjoint ``merged`` intervals."""
    i = bisect.bisect_right(merged, (start, float("inf"))) - 1
    total, i = 0.0, max(i, 0)
    while i < len(merged) and merged[i][0] < end:
        total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
        i += 1
    return total


def _collective_rows(collectives: Sequence[Tuple[str, float, float]], compute: Sequence[Tuple[float, float]],
                     steps: int) -> Dict[str, Dict[str, float]]:
    """Per collective kernel name (all-gather, reduce-scatter, ...): calls, milliseconds per step, and of those
    the milliseconds no other kernel overlapped (``compute``: the merged intervals of every other kernel)."""
    rows: Dict[str, Dict[str, float]] = {}
    for name, start, end in collectives:
        key = re.sub(r"\(.*", "", name)[:80]
        r = rows.setdefault(key, {"calls": 0.0, "ms": 0.0, "exposed_ms": 0.0})
        r["calls"] += 1 / steps
        r["ms"] += (end - start) / steps / 1e3
        r["exposed_ms"] += ((end - start) - _overlap(start, end, compute)) / steps / 1e3
    return rows


def _matmul_slowdown(matmuls: Sequence[Tuple[str, float, float]], collectives: Sequence[Tuple[str, float, float]],
                     steps: int) -> Dict[str, float]:
    """Matmul time spent while a collective ran, and what it cost: each matmul kernel that overlapped a
    collective against the median duration of the same kernel (by name) when none ran. NCCL's kernels hold
    SMs and memory bandwidth, so a GEMM beside them runs slower; ``extra_ms`` is that cost per step (kernels
    that never ran alone are left out of it)."""
    merged = _merged([(s, e) for _, s, e in collectives])
    alone: Dict[str, List[float]] = {}
    beside: List[Tuple[str, float]] = []
    under_ms = 0.0
    for name, start, end in matmuls:
        if merged and _overlap(start, end, merged) > 0:
            beside.append((name, end - start))
            under_ms += end - start
        else:
            alone.setdefault(name, []).append(end - start)
    extra = sum(d - statistics.median(alone[n]) for n, d in beside if n in alone)
    return {"matmul_ms_beside_collective": under_ms / steps / 1e3, "extra_ms": extra / steps / 1e3,
            "kernels_beside": len(beside) / steps}


# ---------------------------------------------------------------------------------------------------- GPU part


def _persistent_bytes(model: Any, opt: torch.optim.Optimizer) -> Dict[str, float]:
    """GiB of the engine's persistent tensors by kind (distinct storages only)."""
    seen: Dict[int, Tuple[str, int]] = {}

    def add(kind: str, t: Optional[torch.Tensor]) -> None:
        if t is None or t.untyped_storage().size() == 0:
            return
        seen.setdefault(t.untyped_storage().data_ptr(), (kind, t.untyped_storage().nbytes()))

    for u in model.all_units():
        add("fp32 main parameters", u.main_shard)
        add("fp32 main gradients", u._main_grad_data)
        add("frozen parameters", u.frozen_shard)
        add("parameter gather buffers (bf16)", u.param_buffer.tensor if u.param_buffer else None)
        add("gradient reduce buffers", u.grad_buffer.tensor if u.grad_buffer else None)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                add("Adam state", v)
    out: Dict[str, float] = {}
    for kind, nbytes in seen.values():
        out[kind] = out.get(kind, 0.0) + nbytes / 2**30
    return out


def _run(column: str, cfg: Any, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import GPT, loss_fn, synthetic_batch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_stream(torch.cuda.default_stream(device))
    torch.manual_seed(1234)
    gpt = GPT(cfg).to(device)
    graphs = None
    if column == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard_fsdp2(gpt, list(gpt.layers), device=device, mp_policy=mp)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=args.fused)
    else:
        from megatron_fsdp import fully_shard

        model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                            compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                            fsdp_db_use_persist_buf_on_alloc_fail=True)
        if args.prescale:  # A/B: the fold's scale pass and SUM, as before NCCL's AVG
            model.reduce_average = False
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-4, fused=args.fused)
        if column == "ours_partial":
            config = CudaGraphConfig(cuda_graph_impl="transformer_engine" if cfg.use_te else "local",
                                     cuda_graph_warmup_steps=3, use_megatron_fsdp=True, fsdp_double_buffer=True,
                                     fsdp_db_use_persist_buf_on_alloc_fail=True)
            graphs = PartialCudaGraphs(model, config)
    batches = [synthetic_batch(s, 1, cfg, device, seed=1234) for s in range(4)]

    def step(i: int) -> None:
        if graphs is not None and i == 3:
            graphs.capture()
        x, y = batches[i % len(batches)]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    events = []
    for i in range(args.steps):  # no host sync inside the loop: the host runs ahead, as in a user's loop
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step(i)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in events]
    out: Dict[str, Any] = {"step_ms": statistics.median(times[args.skip:]), "step_ms_all": times,
                           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    if column != "fsdp2":
        out["persistent_gib"] = _persistent_bytes(model, opt)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps, args.steps + args.profile_steps):
            step(i)
        torch.cuda.synchronize(device)
    out["profile"] = summarize_kernels(cuda_kernels(prof), args.profile_steps)
    if graphs is not None:
        graphs.delete()
    del model, opt, gpt, graphs
    return out


def collective_rates(cfg: Any, device: torch.device, reps: int = 10) -> Dict[str, Dict[str, float]]:
    """One transformer layer's collectives alone on the idle GPUs (median ms of ``reps`` after a warm-up, and
    GB/s of what each rank sends): the bf16 all-gather of its parameters, and the reduce-scatter of its
    gradients in fp32 (the engine's default) and bf16. Their sum over the step's units, against the step, is
    what the communication costs when nothing hides it."""
    import torch.distributed as dist

    world = dist.get_world_size()
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    numel = (4 * h * h + 2 * h * f) // world * world  # the layer's matmul weights, a multiple of world
    out: Dict[str, Dict[str, float]] = {}
    for name, dtype, gather in (("all_gather_bf16", torch.bfloat16, True), ("reduce_scatter_fp32", torch.float32, False),
                                ("reduce_scatter_bf16", torch.bfloat16, False)):
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = torch.ones(numel // world, dtype=dtype, device=device)
        times = []
        for i in range(reps + 2):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            if gather:
                dist.all_gather_into_tensor(full, shard)
            else:
                dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
            e.record()
            torch.cuda.synchronize(device)
            if i >= 2:
                times.append(s.elapsed_time(e))
        ms = statistics.median(times)
        sent = full.numel() * full.element_size() * (world - 1) / world
        out[name] = {"numel": numel, "ms": ms, "gbps_sent_per_rank": sent / ms / 1e6}
        del full, shard
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--columns", nargs="+", default=["ours", "ours_partial", "fsdp2"],
                   choices=["ours", "ours_partial", "fsdp2"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--foreach", dest="fused", action="store_false", help="torch's foreach Adam instead of fused")
    p.add_argument("--fuse-wgrad", choices=["on", "off"], default="on",
                   help="with TE: our columns write weight gradients straight into the engine's buffer (as --suite full)")
    p.add_argument("--prescale", action="store_true",
                   help="our columns pre-scale gradients and SUM instead of NCCL's AVG (the engine before it; A/B)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/diagnose/profile_step.py profiles CUDA kernels: it needs a CUDA GPU; nothing to run here.")
        return 2
    import torch.distributed as dist

    from _flops import copy_bandwidth_gbps, matmul_peak_tflops, model_flops_per_step
    from _perf_goals import floor_ms, optimizer_bytes, param_count
    from bench_full_iteration import CONFIGS, ours_config
    from fsdp_cudagraph.apps.model import GPTConfig
    from fsdp_cudagraph.capture.te import HAS_TE
    from fsdp_cudagraph.checker import records

    device = _common.init_process_group(cuda=True, default_port=29533)
    fields, mbs = CONFIGS["compute"]
    cfg = GPTConfig(**fields, use_te=HAS_TE)
    n = param_count(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                    ffn_hidden_size=cfg.ffn_hidden_size, seq_len=cfg.seq_len)
    flops = model_flops_per_step(cfg, mbs * cfg.seq_len)
    ours = ours_config(cfg, args.fuse_wgrad == "on")  # as the suite's columns
    rows = {c: _run(c, ours if c.startswith("ours") else cfg, args, device) for c in args.columns}
    matmul, copy = matmul_peak_tflops(device), copy_bandwidth_gbps(device)
    world = dist.get_world_size()  # ZeRO-3: each rank updates 1/world of the parameters
    floor = floor_ms(flops=flops, bytes_moved=optimizer_bytes(n, world), matmul_tflops=matmul, copy_gbps=copy)
    rates = collective_rates(cfg, device) if world > 1 else None
    result = {"config": {**fields, "micro_batch_size": mbs, "use_te": HAS_TE, "fused_adam": args.fused,
                         "fuse_wgrad": ours.fuse_wgrad},
              "collective_rates": rates, "prescale": args.prescale,
              "params": n, "world_size": world, "flops_per_step": flops, "matmul_tflops": matmul, "copy_gbps": copy, "floor": floor,
              "columns": rows, **_common.record_fields()}
    if dist.get_rank() == 0:  # the kernels are rank 0's; every rank runs the same step
        print(format_table(result))
        if args.out:
            records.write_record(args.out, result)
    dist.destroy_process_group()
    return 0


#: Kernel categories the floor does not count (the model's own element-wise work, run alike by every engine).
NOT_IN_FLOOR = ("elementwise/other", "attention", "norm", "loss", "zero/fill")


def budget_lines(result: Dict[str, Any], column: str) -> List[Tuple[str, float]]:
    """Where the column's step goes beyond the floor, line by line (milliseconds per step); the lines sum to
    ``step_ms - floor_ms`` exactly.

    From the profiled steps: the matmuls at the rate they ran when no collective ran beside them, against the
    floor's matmul time; what running beside a collective cost them; the collective time nothing overlapped;
    the optimizer, cast and copy kernels against the floor's optimizer-and-cast bytes; the kernels the floor
    leaves out (:data:`NOT_IN_FLOOR`); compute kernels that overlapped one another (the union of non-collective
    kernels against their sum, <= 0); and the step time (CUDA events, no profiler) against the profiled GPU
    busy time (host gaps, or the profiler's own overhead when negative).
    """
    row, floor = result["columns"][column], result["floor"]
    p = row["profile"]
    cat = p["category_ms"]
    slowdown = p.get("matmul_under_collective", {}).get("extra_ms", 0.0)
    exposed = p["exposed_collective_ms"]
    non_collective = {k: v for k, v in cat.items() if k != "collective"}
    union = p["busy_ms"] - exposed  # the time some non-collective kernel ran
    lines = [
        ("matmuls at their own rate, against the floor's", cat.get("matmul", 0.0) - slowdown - floor["matmul_ms"]),
        ("matmuls slowed beside collectives", slowdown),
        ("collectives nothing overlapped", exposed),
        ("optimizer, casts and copies, against the floor's",
         sum(cat.get(k, 0.0) for k in ("optimizer", "foreach", "copy/cast")) - floor["optimizer_ms"]),
        ("element-wise, attention, norms, loss, fills (not in the floor)", sum(cat.get(k, 0.0) for k in NOT_IN_FLOOR)),
        ("compute kernels overlapping one another", union - sum(non_collective.values())),
        ("step (no profiler) against GPU busy (profiled)", row["step_ms"] - p["busy_ms"]),
    ]
    return lines


def format_table(result: Dict[str, Any]) -> str:
    """Markdown: one row per category, one column per run, milliseconds per step; then the floor's parts."""
    cols = list(result["columns"])
    cats = []
    for c in cols:
        for k in result["columns"][c]["profile"]["category_ms"]:
            if k not in cats:
                cats.append(k)
    lines = ["| ms per step | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]

    def row(label: str, get) -> None:
        lines.append(f"| {label} | " + " | ".join(get(result["columns"][c]) for c in cols) + " |")

    row("step (CUDA events, no profiler)", lambda r: f"{r['step_ms']:.2f}")
    row("span under the profiler", lambda r: f"{r['profile']['span_ms']:.2f}")
    for k in cats:
        row(k, lambda r, k=k: f"{r['profile']['category_ms'].get(k, 0.0):.2f}")
    row("GPU busy (union)", lambda r: f"{r['profile']['busy_ms']:.2f}")
    row("GPU idle", lambda r: f"{r['profile']['idle_ms']:.2f}")
    row("collective not overlapped", lambda r: f"{r['profile'].get('exposed_collective_ms', 0.0):.2f}")
    row("matmul beside a collective", lambda r: f"{r['profile'].get('matmul_under_collective', {}).get('matmul_ms_beside_collective', 0.0):.2f}")
    row("its slowdown vs alone", lambda r: f"{r['profile'].get('matmul_under_collective', {}).get('extra_ms', 0.0):.2f}")
    row("peak allocated GiB", lambda r: f"{r['peak_memory_gib']:.2f}")
    f = result["floor"]
    lines.append(f"\nfloor {f['floor_ms']:.2f} ms = matmul {f['matmul_ms']:.2f} ms ({result['flops_per_step'] / 1e12:.2f} "
                 f"TFLOP at {result['matmul_tflops']:.0f} TFLOP/s) + optimizer/cast {f['optimizer_ms']:.2f} ms "
                 f"({result['params'] / 1e6:.1f} M params / {result.get('world_size', 1)} rank(s) x 38 B at "
                 f"{result['copy_gbps']:.0f} GB/s)")
    for c in cols:
        for name, r in result["columns"][c]["profile"].get("collectives", {}).items():
            lines.append(f"{c}: {name}: {r['calls']:.0f} calls, {r['ms']:.2f} ms, not overlapped {r['exposed_ms']:.2f} ms")
    for c in cols:
        lines.append(f"\n{c}: {result['columns'][c]['step_ms']:.2f} ms = floor {f['floor_ms']:.2f} ms")
        for label, ms in budget_lines(result, c):
            lines.append(f"  {ms:+7.2f} ms  {label}")
    for name, r in (result.get("collective_rates") or {}).items():
        lines.append(f"one layer alone: {name} {r['ms']:.3f} ms ({r['gbps_sent_per_rank']:.0f} GB/s sent per rank)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
