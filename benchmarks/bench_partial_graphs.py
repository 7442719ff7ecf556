"""What partial CUDA graphs buy under megatron_fsdp: eager vs graphed, side by side in one run.

Suites (each trains the reference GPT eagerly and with graphs, same seeds, same process):
  launch   8 TE layers, hidden 1024, seq 512, micro-batch 2, Adam: the launch-bound case, every scope
  compute  4 TE layers, hidden 4096, seq 2048, micro-batch 1: the compute-bound case, with MFU against the
           measured bf16 matmul peak of the device
  overlap  eager only, prefetch on vs off: how much of the communication the engine hides
  scaling  step and capture time against number of layers (2, 8, 32) and sequence length (256, 512, 2048)
  full     the launch and compute configs in four columns: eager, partial graphs (whole layers),
           full-iteration graphs, and PyTorch FSDP2 captured with torch.cuda.graph the torchtitan way (see
           bench_full_iteration.py, whose loop these runs share: batches on the device before the loop)

Run on 2 GPUs (1 GPU works too)::

    torchrun --nproc-per-node 2 benchmarks/bench_partial_graphs.py --suite launch compute overlap scaling \
        --out benchmarks/results/partial_graphs.json

Reports median step time over the steps after ``--skip`` (capture happens at step 3), tokens/s over the
whole data-parallel group, peak memory, capture time and the memory the graphs hold.

The regression check of the performance goals (one GPU)::

    python benchmarks/bench_partial_graphs.py --suite full --out benchmarks/results/perf_goals.json

``--suite full`` also measures the device's bf16 matmul rate (an 8192^3 GEMM) and copy bandwidth (a 1 GiB
device-to-device copy, bytes read + written), computes each config's floor (model FLOPs / matmul rate +
Adam and bf16-cast bytes / bandwidth, see [Note: the floor of a step] in ``_perf_goals.py``), runs the eager
column a second time to measure the run-to-run noise, and prints each column's multiple of the floor, the
goal ratios with PASS / NOISE / FAIL, and the memory breakdown of partial graphs (``--suite memory``: memory
allocated before and after capture, static parameter gradients, static inputs, pool growth). Exit status:
0 when every goal is PASS or NOISE (outside the goal by less than the noise measured in the same run), 1
when one is FAIL or could not be measured (MISSING), 2 without a CUDA GPU (nothing measured). The rule is
[Note: noise and the exit code] in ``_perf_goals.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.capture.te import HAS_TE  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.model import GPTConfig  # noqa: E402
from fsdp_cudagraph.apps.train import RunSpec, run_training  # noqa: E402
from _flops import adam_step_ms, copy_bandwidth_gbps, matmul_peak_tflops, model_flops_per_step  # noqa: E402,F401
import _perf_goals as goals  # noqa: E402

#: Adam's share of the optimizer bytes (32 of the 38 per parameter; the other 6 are the bf16 cast).
ADAM_SHARE = goals.ADAM_BYTES_PER_PARAM / (goals.ADAM_BYTES_PER_PARAM + goals.CAST_BYTES_PER_PARAM)


def measure(spec: RunSpec, device: torch.device, skip: int) -> Dict[str, Any]:
    # The previous run's model is garbage only once its reference cycles (module <-> FSDP unit) are
    # collected: without this, its memory counts towards this run's peak.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    r = run_training(spec, device)
    ms = statistics.median(r.step_ms[skip:])
    world = dist.get_world_size()
    tokens = spec.micro_batch_size * spec.model.seq_len * spec.grad_accum * world
    out = {
        "step_ms": ms,
        "step_ms_all": r.step_ms,
        "tokens_per_s": tokens / (ms * 1e-3),
        "peak_memory_gib": r.peak_memory_bytes / 2**30,
        "losses": [float(x) for x in r.losses],
    }
    if r.capture is not None:
        out.update(capture_seconds=r.capture.capture_seconds, graph_memory_gib=r.capture.graph_memory_bytes / 2**30,
                   num_graphed_callables=len(r.capture.callables),
                   memory_breakdown_gib={k: v / 2**30 for k, v in r.capture.memory_breakdown.items()})
    return out


def memory_breakdown(args: argparse.Namespace, device: torch.device, use_te: bool) -> Dict[str, Any]:
    """Eager vs partial graphs (whole layers) in the launch and compute configs: peaks and where the graphs'
    memory sits (CaptureReport.memory_breakdown, see [Note: where graph memory goes] in graphs/partial.py)."""
    import bench_full_iteration as bfi

    out: Dict[str, Any] = {}
    for name in ("launch", "compute"):
        fields, mbs = bfi.CONFIGS[name]
        cfg = bfi.ours_config(GPTConfig(**fields, use_te=use_te), args.fuse_wgrad == "on")
        rows = pair(cfg, scopes=[None, []], args=args, device=device, label=f"mem-{name}", mbs=mbs)
        eager, graphed = rows
        out[name] = {"eager_peak_gib": eager["peak_memory_gib"], "partial_peak_gib": graphed["peak_memory_gib"],
                     "partial_over_eager_peak": graphed["peak_memory_gib"] / eager["peak_memory_gib"],
                     "extra_gib": graphed["peak_memory_gib"] - eager["peak_memory_gib"],
                     "graph_memory_gib": graphed.get("graph_memory_gib"),
                     "breakdown_gib": graphed.get("memory_breakdown_gib", {}), "rows": rows}
    return out


def memory_table(mem: Dict[str, Any]) -> str:
    lines = ["| config | eager peak | partial peak | ratio | extra | graph memory | static param grads | "
             "other graph memory | static inputs | pool reserved growth |", "| --- |" + " --- |" * 9]
    for name, m in mem.items():
        b = m["breakdown_gib"]
        cell = (lambda k: f"{b[k]:.3f}" if k in b else "-")
        gm = m["graph_memory_gib"]
        lines.append(f"| {name} | {m['eager_peak_gib']:.3f} | {m['partial_peak_gib']:.3f} | "
                     f"{m['partial_over_eager_peak']:.3f} | {m['extra_gib']:.3f} | "
                     f"{'-' if gm is None else f'{gm:.3f}'} | {cell('param_grad_bytes')} | {cell('other_bytes')} | "
                     f"{cell('static_input_bytes')} | {cell('reserved_growth_bytes')} |")
    return "GiB:\n" + "\n".join(lines)


def repeat_eager(full: Dict[str, Any], fargs: argparse.Namespace, device: torch.device) -> None:
    """The noise measurement: the eager column again, same spec, after the others (column ``eager_repeat``)."""
    import bench_full_iteration as bfi

    for name, res in full.items():
        again: Dict[str, Any] = {}
        bfi.run_columns(name, ["eager"], again, fargs, device)
        res["columns"]["eager_repeat"] = again["eager"]


def goal_check(full: Dict[str, Any], fargs: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """Floors from the device's measured rates, Adam's measured step, and every goal's verdict."""
    import bench_full_iteration as bfi

    matmul = matmul_peak_tflops(device)
    copy = copy_bandwidth_gbps(device)
    world = dist.get_world_size()
    configs: Dict[str, Any] = {}
    for name, res in full.items():
        fields, mbs = bfi.CONFIGS[name]
        cfg = GPTConfig(**fields)
        n = goals.param_count(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                              ffn_hidden_size=cfg.ffn_hidden_size, seq_len=cfg.seq_len)
        flops = model_flops_per_step(cfg, mbs * cfg.seq_len)
        floor = goals.floor_ms(flops=flops, bytes_moved=goals.optimizer_bytes(n, world), matmul_tflops=matmul,
                               copy_gbps=copy)
        res["floor"] = {**floor, "params": n, "model_flops_per_rank": flops}
        configs[name] = {"columns": res["columns"], "floor_ms": floor["floor_ms"], "skip": fargs.skip}
    # The optimizer part of the floor against what torch's Adam reaches on the same bytes (one flat fp32
    # tensor of this rank's parameters, after every column, so that its memory is no column's peak).
    for name, res in full.items():
        n = res["floor"]["params"] // world
        gc.collect()
        torch.cuda.empty_cache()
        res["adam_ms"] = {"floor_ms": goals.optimizer_bytes(n) * ADAM_SHARE / (copy * 1e9) * 1e3,
                          "foreach_ms": adam_step_ms(device, n, fused=False),
                          "fused_ms": adam_step_ms(device, n, fused=True)}
        gc.collect()
        torch.cuda.empty_cache()
    ev = goals.evaluate(configs)
    columns = [c for c in bfi.COLUMNS + ["eager_repeat", "eager_unfused", "eager_bf16_reduce"]
               if any(c in v["columns"] for v in configs.values())]
    adam = "\n".join(f"{name}: Adam step over {res['floor']['params'] // world:,} fp32 parameters: floor "
                     f"{res['adam_ms']['floor_ms']:.2f} ms, foreach {res['adam_ms']['foreach_ms']:.2f} ms, fused "
                     f"{res['adam_ms']['fused_ms']:.2f} ms" for name, res in full.items())
    return {"matmul_tflops": matmul, "copy_gbps": copy, "evaluation": ev,
            "adam_ms": {name: res["adam_ms"] for name, res in full.items()},
            "table": goals.format_table(configs, ev, columns) + "\n\n" + adam}


_runs_done = [0]
_T0 = time.time()


def pair(cfg: GPTConfig, *, scopes: List[Optional[List[str]]], args: argparse.Namespace, device: torch.device,
         label: str, mbs: int, prefetch: bool = True) -> List[Dict[str, Any]]:
    rows = []
    for scope in scopes:
        spec = RunSpec(model=cfg, steps=args.steps, micro_batch_size=mbs, backend=args.backend,
                       cuda_graph_modules=scope, capture_step=3, prefetch=prefetch, lr=1e-4)
        m = measure(spec, device, args.skip)
        m.update(label=label, scope=scope, prefetch=prefetch, layers=cfg.num_layers, seq=cfg.seq_len,
                 hidden=cfg.hidden_size)
        rows.append(m)
        _runs_done[0] += 1
        if dist.get_rank() == 0:  # one line per training run: the progress indicator of long suites
            name = "eager" if scope is None else f"graphed {scope}"
            print(f"[run {_runs_done[0]:2d}, {time.time() - _T0:5.0f} s] {label:10s} L={cfg.num_layers:2d} "
                  f"s={cfg.seq_len:4d} {name:28s} prefetch={prefetch!s:5s} "
                  f"{m['step_ms']:8.2f} ms  {m['tokens_per_s']:10.0f} tok/s  peak {m['peak_memory_gib']:.2f} GiB"
                  + (f"  capture {m['capture_seconds']:.2f} s" if 'capture_seconds' in m else ""), flush=True)
    base = rows[0]["step_ms"]
    for r in rows:
        r["ratio_to_eager"] = r["step_ms"] / base
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", nargs="+", default=["launch"],
                   choices=["launch", "compute", "overlap", "scaling", "full", "memory"])
    p.add_argument("--backend", default="te" if HAS_TE else "torch", choices=["te", "torch"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the median (capture is at step 3)")
    p.add_argument("--out", default="benchmarks/results/partial_graphs.json")
    p.add_argument("--fuse-wgrad", choices=["on", "off"], default="on",
                   help="TE backend: our columns use TE's fused weight-gradient accumulation into the engine's fp32 "
                        "gradient buffer (fuse_wgrad_accumulation=True; FSDP2 cannot); the full suite also runs our "
                        "eager step without it (column eager_unfused); with or without it, the full suite also "
                        "runs our eager step with gradients reduced in bf16 (column eager_bf16_reduce, no goal)")
    p.add_argument("--profile", action="store_true",
                   help="also profile steps 15.. of the launch-bound model, eager and graphed (whole layers)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_partial_graphs needs a CUDA GPU (it times CUDA graphs and measures the device's matmul rate "
              "and bandwidth); no GPU is visible, so nothing was measured (exit 2). The floor and verdict "
              "arithmetic is tested on CPU by tests/benchmarks/test_perf_goals.py.", file=sys.stderr)
        return 2
    if args.backend == "te" and not HAS_TE:
        sys.exit("bench_partial_graphs: --backend te needs TransformerEngine; pass --backend torch")
    device = init_process_group(cuda=True, default_port=29513)
    use_te = args.backend == "te"
    result: Dict[str, Any] = {**record_fields(), "backend": args.backend, "suites": {}}
    t0 = _T0
    failed = False
    if "launch" in args.suite:
        cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=8, num_heads=16, seq_len=512, use_te=use_te)
        result["suites"]["launch"] = pair(cfg, scopes=[None, [], ["attn"], ["mlp"], ["attn", "mlp"]], args=args,
                                          device=device, label="launch", mbs=2)
    if "compute" in args.suite:
        cfg = GPTConfig(vocab_size=1024, hidden_size=4096, num_layers=4, num_heads=32, seq_len=2048, use_te=use_te)
        rows = pair(cfg, scopes=[None, []], args=args, device=device, label="compute", mbs=1)
        peak = matmul_peak_tflops(device)
        for r in rows:
            tokens = 1 * cfg.seq_len
            r["mfu"] = model_flops_per_step(cfg, tokens) / (r["step_ms"] * 1e-3) / (peak * 1e12)
            r["matmul_peak_tflops"] = peak
        result["suites"]["compute"] = rows
    if "overlap" in args.suite:
        cfg = GPTConfig(vocab_size=1024, hidden_size=4096, num_layers=4, num_heads=32, seq_len=2048, use_te=use_te)
        rows = []
        for prefetch in (True, False):
            rows += pair(cfg, scopes=[None], args=args, device=device, label="overlap", mbs=1, prefetch=prefetch)
        rows[1]["ratio_to_prefetch"] = rows[1]["step_ms"] / rows[0]["step_ms"]
        result["suites"]["overlap"] = rows
    if "scaling" in args.suite:
        rows = []
        for L in (2, 8, 32):
            cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=L, num_heads=16, seq_len=512, use_te=use_te)
            rows += pair(cfg, scopes=[None, []], args=args, device=device, label="layers", mbs=2)
        for s in (256, 2048):
            cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=8, num_heads=16, seq_len=s, use_te=use_te)
            rows += pair(cfg, scopes=[None, []], args=args, device=device, label="seq", mbs=2)
        result["suites"]["scaling"] = rows
    if "full" in args.suite:
        import bench_full_iteration as bfi

        # Our columns and FSDP2 eager, the eager column again (noise), the memory breakdown, and the FSDP2
        # capture last (a capture that fails may leave CUDA in a state later runs cannot use).
        fargs = argparse.Namespace(te=use_te, steps=args.steps, skip=args.skip, capture_step=3,
                                   columns=[c for c in bfi.COLUMNS if c != "fsdp2_graph"],
                                   fuse_wgrad=args.fuse_wgrad == "on")
        full = bfi.run_all(["launch", "compute"], fargs, device)
        repeat_eager(full, fargs, device)
        for name in full:
            extra = (["eager_unfused"] if fargs.fuse_wgrad and use_te else []) + ["eager_bf16_reduce"]
            bfi.run_columns(name, extra, full[name]["columns"], fargs, device)
        result["suites"]["memory"] = memory_breakdown(args, device, use_te)
        for name in full:
            rows = full[name]["columns"]
            bfi.run_columns(name, ["fsdp2_graph"], rows, fargs, device)
            full[name] = bfi.summarize(name, rows, fargs, device)
        result["suites"]["full"] = full
        if dist.get_rank() == 0:
            print(bfi.table(full), flush=True)
            print(memory_table(result["suites"]["memory"]), flush=True)
        result["goals"] = goal_check(full, fargs, device)
        failed = failed or result["goals"]["evaluation"]["failed"]
        if dist.get_rank() == 0:
            g = result["goals"]
            print(f"matmul {g['matmul_tflops']:.0f} TFLOP/s, copy {g['copy_gbps']:.0f} GB/s (read + written)\n"
                  f"{g['table']}", flush=True)
    if "memory" in args.suite and "full" not in args.suite:
        result["suites"]["memory"] = memory_breakdown(args, device, use_te)
        if dist.get_rank() == 0:
            print(memory_table(result["suites"]["memory"]), flush=True)
    if args.profile:
        cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=8, num_heads=16, seq_len=512, use_te=use_te)
        result["profiles"] = {}
        for scope in (None, []):
            spec = RunSpec(model=cfg, steps=20, micro_batch_size=2, backend=args.backend, cuda_graph_modules=scope,
                           capture_step=3, lr=1e-4)
            r = run_training(spec, device, profile_from=15)
            key = "eager" if scope is None else "graphed"
            result["profiles"][key] = r.profile
            if dist.get_rank() == 0:
                print(f"--- profile, {key}, 5 steps ---\n{r.profile}", flush=True)
    result["seconds"] = time.time() - t0
    if dist.get_rank() == 0:
        write_record(args.out, result)
        print(f"wrote {args.out} ({result['seconds']:.0f} s)")
        if failed:
            print("bench_partial_graphs: a goal FAILed (or was MISSING) by more than the noise of this run; see the "
                  "table above and 'goals' in the JSON (exit 1)", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
