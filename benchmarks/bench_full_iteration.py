"""Step time of one training step, four ways, side by side in one process: the full-iteration table.

Columns (same reference GPT, seed, data, bf16 compute with fp32 main weights and gradients, ZeRO-3, unit =
transformer layer, Adam; every loop on the default stream with its batches already on the device):

  eager            megatron_fsdp, no graphs
  partial          megatron_fsdp + PartialCudaGraphs, whole layers (TE's graph maker with TE, else torch's)
  full_iteration   megatron_fsdp + FullIterationCudaGraph: forward+backward of the step in one graph, the
                   engine's collectives inside; optimizer eager ("full_iteration"), and also in its own graph
                   with a capturable Adam ("full_iteration+opt")
  fsdp2_graph      PyTorch FSDP2 with forward+backward captured by torch.cuda.graph the way torchtitan does it
                   (warmup steps on a side stream, capture_error_mode="thread_local", zero_grad(set_to_none=False),
                   replay on the loop's stream); if torch cannot capture FSDP2, the row records why.
                   "fsdp2" (FSDP2 eager) is measured as its baseline.

Configs: ``launch`` (8 layers, hidden 1024, seq 512, micro-batch 2: launch-bound) and ``compute`` (4 layers,
hidden 4096, seq 2048, micro-batch 1: compute-bound, with MFU against the measured bf16 matmul peak). TE
layers when TE is importable (``--no-te`` for the plain-torch GPT).

    python benchmarks/bench_full_iteration.py --out benchmarks/results/full_iteration-1gpu.json
    torchrun --nproc-per-node 2 benchmarks/bench_full_iteration.py --out benchmarks/results/full_iteration-2gpu.json

Median step time (CUDA events) over the steps after ``--skip``; capture at step ``--capture-step``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import _common  # noqa: F401 - first: the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.capture.te import HAS_TE  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.full_iteration_align import FullRunSpec, run_full  # noqa: E402
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402

COLUMNS = ["eager", "partial", "full_iteration", "full_iteration+opt", "fsdp2", "fsdp2_graph"]
CONFIGS = {
    "launch": (dict(vocab_size=1024, hidden_size=1024, num_layers=8, num_heads=16, seq_len=512), 2),
    "compute": (dict(vocab_size=1024, hidden_size=4096, num_layers=4, num_heads=32, seq_len=2048), 1),
}


def _fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _summary(step_ms: List[float], skip: int, tokens: int) -> Dict[str, Any]:
    ms = statistics.median(step_ms[skip:])
    return {"step_ms": ms, "step_ms_all": step_ms, "tokens_per_step": tokens, "tokens_per_s": tokens / (ms * 1e-3)}


def run_ours(column: str, cfg: GPTConfig, mbs: int, args: argparse.Namespace, device: torch.device,
             reduce_dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
    mode = {"eager": "eager", "partial": "partial"}.get(column, "full_iteration")
    spec = FullRunSpec(model=cfg, mode=mode, steps=args.steps, micro_batch_size=mbs, capture_step=args.capture_step,
                       lr=1e-4, partial_backend="te" if cfg.use_te else "torch", reduce_dtype=reduce_dtype,
                       capturable_optimizer=column == "full_iteration+opt", graph_optimizer=column == "full_iteration+opt")
    r = run_full(spec, device)
    out = _summary(r.step_ms, args.skip, mbs * cfg.seq_len * dist.get_world_size())
    out.update(peak_memory_gib=r.peak_memory_bytes / 2**30, losses=[float(x.sum()) for x in r.losses],
               counters=r.counters)
    train = r.reports.get("train")
    if train is not None:
        out.update(capture_seconds=train.capture_seconds, graph_memory_gib=train.graph_memory_bytes / 2**30,
                   captured_collectives=len(train.collectives))
    return out


def run_fsdp2(cfg: GPTConfig, mbs: int, args: argparse.Namespace, device: torch.device, *, graphed: bool) -> Dict[str, Any]:
    """FSDP2 (torch.distributed.fsdp.fully_shard), eager or with forward+backward in one torch.cuda.graph."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    from _fsdp2_graph import Fsdp2GraphStep

    rank, world = dist.get_rank(), dist.get_world_size()
    default = torch.cuda.default_stream(device)
    default.wait_stream(torch.cuda.current_stream(device))
    torch.cuda.set_stream(default)  # a user's loop: the default stream (an earlier run may have moved it)
    torch.manual_seed(1234)
    model = GPT(cfg).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_fsdp2(model, [m for m in model.modules() if isinstance(m, model.unit_class)], device=device, mp_policy=mp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # the optimizer our columns use (apps default)
    batches = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, mbs * world, cfg, device, seed=1234)
        batches.append((x[rank * mbs:(rank + 1) * mbs].contiguous(), y[rank * mbs:(rank + 1) * mbs].contiguous()))

    def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    step_fn = Fsdp2GraphStep(fwd_bwd, warmup=args.capture_step, device=device) if graphed else None
    events, losses = [], []
    try:
        for x, y in batches:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step_fn(x, y) if step_fn is not None else fwd_bwd(x, y).detach()
            opt.step()
            opt.zero_grad(set_to_none=not graphed)  # graphed: FSDP2 accumulates into the grads of capture time
            end.record()
            events.append((start, end))
            losses.append(loss)
    except Exception as exc:  # noqa: BLE001 - the benchmark records why FSDP2 could not be captured
        if step_fn is None or step_fn.error is None:
            raise
        if rank == 0:
            traceback.print_exc()
        return {"error": step_fn.error, "failed_at": "capture", "torch": torch.__version__,
                "exception": type(exc).__name__}
    torch.cuda.synchronize(device)
    out = _summary([s.elapsed_time(e) for s, e in events], args.skip, mbs * cfg.seq_len * world)
    out.update(peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30, losses=[float(v) for v in losses])
    if step_fn is not None:
        out.update(capture_seconds=step_fn.capture_seconds, graph_memory_gib=step_fn.graph_memory_bytes / 2**30)
    return out


def _slowest_rank(row: Dict[str, Any], device: torch.device) -> None:
    """Step time of the slowest rank (the step is as slow as its slowest rank)."""
    if "step_ms" not in row:
        return
    keys = [k for k in ("step_ms", "peak_memory_gib", "own_peak_gib") if k in row]
    t = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    row.update(zip(keys, t.tolist()))
    row["tokens_per_s"] = row["tokens_per_step"] / (row["step_ms"] * 1e-3)


def ours_config(cfg: GPTConfig, fuse_wgrad: bool) -> GPTConfig:
    """The model of our columns: with TE's fused weight-gradient accumulation when asked and TE is used.

    FSDP2's columns keep ``cfg`` (FSDP2 offers no ``main_grad``).
    """
    return dataclasses.replace(cfg, fuse_wgrad=True) if cfg.use_te and fuse_wgrad else cfg


def warm_libraries(use_te: bool, device: torch.device) -> None:
    """Make the default stream's library workspaces before the first column: cuBLAS's (bf16 and fp32 GEMMs)
    and, with TE, TE's own GEMM workspace.

    [Note: a column's own peak] Those workspaces live for the rest of the process, so without this the first
    column would count them in its peak and every later one would not. With it, each column starts from the
    same libraries' state plus what earlier columns left on streams of their own (graph warmup and capture
    streams' workspaces; benchmarks/diagnose/peak_composition.py shows them), and ``own_peak_gib`` (the peak minus what
    was allocated when the column started) is what the column itself needs: the quantity the memory goals
    compare. ``peak_memory_gib`` stays recorded as measured.
    """
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    if use_te:
        import transformer_engine.pytorch as te

        layer = te.Linear(64, 64, params_dtype=torch.bfloat16, device=device)
        layer(torch.ones(8, 64, device=device, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    torch.cuda.synchronize(device)


def run_columns(name: str, columns: List[str], rows: Dict[str, Any], args: argparse.Namespace,
                device: torch.device) -> None:
    fields, mbs = CONFIGS[name]
    cfg = GPTConfig(**fields, use_te=args.te)
    # The column "eager_unfused" is our eager step without fusing, "eager_bf16_reduce" with gradients reduced in
    # bf16 (fully_shard(reduce_dtype=torch.bfloat16); fp32 main gradients), for comparison: no goal reads them.
    ours = ours_config(cfg, getattr(args, "fuse_wgrad", False))
    warm_libraries(cfg.use_te, device)
    t0 = time.time()
    for column in columns:
        _fresh()
        # what earlier columns left allocated: inside this column's peak, not made by it
        # ([Note: a column's own peak])
        start_gib = torch.cuda.memory_allocated(device) / 2**30
        try:
            if column.startswith("fsdp2"):
                row = run_fsdp2(cfg, mbs, args, device, graphed=column == "fsdp2_graph")
            elif column == "eager_unfused":
                row = run_ours("eager", cfg, mbs, args, device)
            elif column == "eager_bf16_reduce":
                row = run_ours("eager", ours, mbs, args, device, reduce_dtype=torch.bfloat16)
            else:
                row = run_ours(column, ours, mbs, args, device)
        except Exception as exc:  # noqa: BLE001 - one failing column is recorded, the table goes on
            row = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if dist.get_rank() == 0:
                traceback.print_exc()
        if "peak_memory_gib" in row:
            row["own_peak_gib"] = row["peak_memory_gib"] - start_gib
        _slowest_rank(row, device)
        row["start_gib"] = start_gib
        rows[column] = row
        if dist.get_rank() == 0:
            shown = f"{row['step_ms']:8.2f} ms  peak {row['peak_memory_gib']:.2f} GiB (own {row['own_peak_gib']:.2f})" \
                if "step_ms" in row else \
                f"FAILED {row['error'][:300]}"
            cap = f"  capture {row['capture_seconds']:.2f} s" if "capture_seconds" in row else ""
            print(f"[{name} {time.time() - t0:5.0f} s] {column:20s} {shown}{cap}", flush=True)


def summarize(name: str, rows: Dict[str, Any], args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    fields, mbs = CONFIGS[name]
    cfg = GPTConfig(**fields, use_te=args.te)
    ok = {c: r["step_ms"] for c, r in rows.items() if "step_ms" in r}
    ratios = {}
    fulls = [v for c, v in ok.items() if c.startswith("full_iteration")]
    if fulls:
        best_full = min(fulls)
        for base in ("eager", "partial", "fsdp2", "fsdp2_graph"):
            if base in ok:
                ratios[f"full_iteration_best/{base}"] = best_full / ok[base]
    out = {"config": {**fields, "micro_batch_size": mbs, "use_te": args.te}, "columns": rows, "ratios": ratios}
    if name == "compute" and ok:
        from _flops import matmul_peak_tflops, model_flops_per_step

        peak = matmul_peak_tflops(device)
        flops = model_flops_per_step(cfg, mbs * cfg.seq_len)
        out["matmul_peak_tflops"] = peak
        out["mfu"] = {c: flops / (v * 1e-3) / (peak * 1e12) for c, v in ok.items()}
    return out


def run_all(configs: List[str], args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """Every column of every config; ``args`` needs te, steps, skip, capture_step, columns. Rank 0 prints."""
    rows: Dict[str, Dict[str, Any]] = {name: {} for name in configs}
    # the FSDP2 captures last: a capture that fails may leave CUDA in a state later runs cannot use
    first = [c for c in COLUMNS if c in args.columns and c != "fsdp2_graph"]
    for name in configs:
        run_columns(name, first, rows[name], args, device)
    if "fsdp2_graph" in args.columns:
        for name in configs:
            run_columns(name, ["fsdp2_graph"], rows[name], args, device)
    return {name: summarize(name, rows[name], args, device) for name in configs}


def table(results: Dict[str, Any]) -> str:
    lines = ["| config | eager | partial graphs | full_iteration | full_iteration+opt | FSDP2 | FSDP2 + torch.cuda.graph |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, res in results.items():
        cells = []
        for c in COLUMNS:
            r = res["columns"].get(c)
            cells.append("-" if r is None else (f"{r['step_ms']:.2f} ms" if "step_ms" in r else "failed (see JSON)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["launch", "compute"], choices=list(CONFIGS))
    p.add_argument("--columns", nargs="+", default=COLUMNS, choices=COLUMNS)
    p.add_argument("--te", action=argparse.BooleanOptionalAction, default=HAS_TE,
                   help="TE layers (default: when TE is importable)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the median (capture is at --capture-step)")
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/full_iteration.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_full_iteration needs a CUDA GPU (it times CUDA graphs); nothing to run here. The CPU schedule "
              "is tested by tests/graphs/test_full_iteration.py and tests/apps/test_full_iteration_align.py.")
        return 0
    if args.te and not HAS_TE:
        sys.exit("bench_full_iteration: --te needs TransformerEngine; run with --no-te")
    device = init_process_group(cuda=True, default_port=29515)
    t0 = time.time()
    results = run_all(args.configs, args, device)
    if dist.get_rank() == 0:
        print(table(results))
        for name, res in results.items():
            print(name, {k: round(v, 3) for k, v in res["ratios"].items()})
        record = {"benchmark": "bench_full_iteration", **record_fields(), "steps": args.steps,
                  "skip": args.skip, "capture_step": args.capture_step, "results": results,
                  "seconds": time.time() - t0}
        write_record(args.out, record)
        print(f"wrote {args.out} ({record['seconds']:.0f} s)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
