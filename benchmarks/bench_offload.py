"""Activation offloading on GPUs: offload off/on x eager/graphed, bit-exact, with peak memory and step time.

A config where activations dominate memory: the reference GPT (hidden 1024, 16 heads, 8 layers, seq 4096,
micro-batch 2 per rank, vocab 1024) under megatron_fsdp ZeRO-3 with the double buffer, bf16 compute, Adam,
deterministic kernels, the loop on the default stream with its batches already on the device. Models:
``torch`` (plain-torch layers, PyTorch's graph maker) and ``te`` (TE layers, TE's graph maker; when TE is
importable). Per model, four rows: eager and graphed (PartialCudaGraphs over ``--graph-modules``), each
without and with offloading of ``--offload-modules`` (by default the same modules: the groups lie inside
the graphs). Eager rows make TE attention select as under capture (``match_graph_attention``), so that
eager and graphed rows are comparable too.

    python benchmarks/bench_offload.py --out benchmarks/results/offload-1gpu.json
    torchrun --nproc-per-node 2 benchmarks/bench_offload.py --out benchmarks/results/offload-2gpu.json
    python benchmarks/bench_offload.py --quick --out /tmp/offload-quick.json     # what tests/gpu/test_offload.py runs
    python benchmarks/bench_offload.py --cpu-smoke --out /tmp/offload-smoke.json # the script on CPU (protocol backend)

Verdicts (all ranks): ``bit_exact`` -- each offload row's per-step losses and final parameters equal the
same mode's row without offloading (``torch.equal``); ``eager_equals_graphed`` (reported, not required).
Memory, per rank, over the steps after capture: peak allocated and peak reserved minus what was allocated
when that window opened (parameters, optimizer state, graph buffers), against the bytes offloaded (eager:
what the recorded iteration copied to the host; graphed: what the captured copies move); eager rows are
judged on allocated, graphed rows on reserved (a graph's private pool is reserved, not allocated, between
replays). Time: median step (CUDA events) over
the steps after ``--skip``, and the offload/plain ratio. Exit status 1 when a bit-exact verdict fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

for _k, _v in {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_NVLS_ENABLE": "0",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)  # before torch and TE load

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, match_graph_attention  # noqa: E402
from fsdp_cudagraph.offload.offloader import ActivationOffloader  # noqa: E402
from fsdp_cudagraph.capture.te import HAS_TE  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.apps.train import use_deterministic_kernels  # noqa: E402
from megatron_fsdp import fully_shard  # noqa: E402

GiB = 2**30


def _config(args: argparse.Namespace, use_te: bool, graphed: bool, offload: bool) -> CudaGraphConfig:
    impl = ("transformer_engine" if use_te else "local") if graphed else "none"
    return CudaGraphConfig(
        cuda_graph_impl=impl, cuda_graph_modules=args.graph_modules if graphed else [],
        cuda_graph_warmup_steps=args.capture_step, use_megatron_fsdp=True, fsdp_double_buffer=True,
        fsdp_db_use_persist_buf_on_alloc_fail=True, activation_offload_modules=args.offload_modules if offload else [],
        activation_offload_fraction=args.fraction if offload else 1.0,
        **({} if args.min_bytes is None else {"activation_offload_min_bytes": args.min_bytes}),
    )


def run_row(args: argparse.Namespace, use_te: bool, graphed: bool, offload: bool, device: torch.device) -> Dict[str, Any]:
    """Train one row; return its losses, final state (CPU), step times, memory and offload numbers."""
    cuda = device.type == "cuda"
    if cuda:
        default = torch.cuda.default_stream(device)  # every row starts on the default stream, as a fresh process would
        default.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.set_stream(default)
        torch.cuda.empty_cache()
    gc.collect()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                    seq_len=args.seq, use_te=use_te)
    torch.manual_seed(1234)
    gpt = GPT(cfg).to(device)
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-4)
    config = _config(args, use_te, graphed, offload)
    graphs = PartialCudaGraphs(model, config, backend=None if cuda else "protocol") if graphed else None
    off = graphs.offload if graphed else (ActivationOffloader.from_config(model, config) if offload else None)
    matcher = None if graphed else match_graph_attention(model, _config(args, use_te, True, False))
    mbs = args.micro_batch
    batches = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, mbs * world, cfg, device)
        batches.append((x[rank * mbs:(rank + 1) * mbs], y[rank * mbs:(rank + 1) * mbs]))
    losses: List[torch.Tensor] = []
    events: List[Tuple[Any, Any]] = []
    report, base_alloc, base_reserved = None, 0, 0
    for step, (x, y) in enumerate(batches):
        if step == args.capture_step:
            if graphs is not None:
                report = graphs.capture()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()  # cached blocks of the eager steps go; graph pools stay reserved
                torch.cuda.reset_peak_memory_stats(device)  # the window: steps after capture
                base_alloc, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        start, end = _Timer(cuda), _Timer(cuda)
        start.record()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        events.append((start, end))
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize(device)
    step_ms = [s.elapsed_time(e) for s, e in events]
    peak_alloc = torch.cuda.max_memory_allocated(device) if cuda else 0
    peak_reserved = torch.cuda.max_memory_reserved(device) if cuda else 0
    row = {
        "model": "te" if use_te else "torch", "graphed": graphed, "offload": offload,
        "step_ms": statistics.median(step_ms[args.skip:]), "step_ms_all": step_ms,
        "peak_allocated_gib": peak_alloc / GiB, "peak_reserved_gib": peak_reserved / GiB,
        "activation_peak_allocated_gib": (peak_alloc - base_alloc) / GiB,
        "activation_peak_reserved_gib": (peak_reserved - base_alloc) / GiB,
        "graph_pool_gib": (base_reserved - base_alloc) / GiB,  # reserved beyond allocated when the window opened
        "losses": [float(v) for v in losses],
        "planned_offload_gib": off.planned_bytes / GiB if off is not None else 0.0,
        "captured_offload_gib": off.captured_bytes / GiB if off is not None else 0.0,
        "host_pool_gib": off.pool.allocated_bytes / GiB if off is not None else 0.0,
        "capture_seconds": report.capture_seconds if report is not None else None,
    }
    state = {k: v.detach().cpu() for k, v in model.full_state_dict().items()}
    if graphs is not None:
        graphs.delete()
    elif off is not None:
        off.delete()
    if matcher is not None:
        matcher.uninstall()
    del model, gpt, opt
    return {"row": row, "losses": [v.cpu() for v in losses], "state": state}


class _Timer:
    """A CUDA event, or (--cpu-smoke) a host clock with the same two methods."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def elapsed_time(self, end: "_Timer") -> float:
        return self.event.elapsed_time(end.event) if self.event is not None else (end.t - self.t) * 1e3


def _equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return (len(a["losses"]) == len(b["losses"]) and all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            and a["state"].keys() == b["state"].keys() and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]))


def _all_ranks(ok: bool, device: torch.device) -> bool:
    t = torch.tensor([int(ok)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _max_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_model(args: argparse.Namespace, use_te: bool, device: torch.device) -> Dict[str, Any]:
    runs = {(g, o): run_row(args, use_te, g, o, device) for g in (False, True) for o in (False, True)}
    rows = {f"{'graphed' if g else 'eager'}/{'offload' if o else 'plain'}": r["row"] for (g, o), r in runs.items()}
    for r in rows.values():
        r["step_ms_max_rank"] = _max_over_ranks(r["step_ms"], device)
    verdicts: Dict[str, Any] = {
        "bit_exact_eager": _all_ranks(_equal(runs[(False, False)], runs[(False, True)]), device),
        "bit_exact_graphed": _all_ranks(_equal(runs[(True, False)], runs[(True, True)]), device),
        "eager_equals_graphed": _all_ranks(_equal(runs[(False, False)], runs[(True, False)]), device),
    }
    # What each mode offloads: eager rows what the recorded iteration copied; graphed rows what the captures
    # copy (a graph's static inputs are leaves kept on the device, so a little less).
    for mode, metric, expected in (("eager", "activation_peak_allocated_gib", "planned_offload_gib"),
                                   ("graphed", "activation_peak_reserved_gib", "captured_offload_gib")):
        plain, offl = rows[f"{mode}/plain"], rows[f"{mode}/offload"]
        saved = plain[metric] - offl[metric]
        verdicts[f"{mode}_saved_gib"] = saved
        verdicts[f"{mode}_saved_over_offloaded"] = saved / offl[expected] if offl[expected] else None
        verdicts[f"{mode}_step_time_ratio"] = offl["step_ms_max_rank"] / plain["step_ms_max_rank"]
    return {"rows": rows, "verdicts": verdicts}


def table(results: Dict[str, Any]) -> str:
    lines = [f"{'row':22s} {'step ms':>9s} {'act. alloc GiB':>15s} {'act. reserved GiB':>18s} {'planned GiB':>12s}"]
    for model, res in results.items():
        for name, r in res["rows"].items():
            lines.append(f"{model + '/' + name:22s} {r['step_ms']:9.2f} {r['activation_peak_allocated_gib']:15.3f} "
                         f"{r['activation_peak_reserved_gib']:18.3f} {r['planned_offload_gib']:12.3f}")
        lines.append(f"{model} verdicts: " + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res["verdicts"].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["torch", "te"] if HAS_TE else ["torch"], choices=["torch", "te"])
    p.add_argument("--graph-modules", nargs="+", default=["attn", "mlp"])
    p.add_argument("--offload-modules", nargs="+", default=["attn", "mlp"])
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=6, help="steps left out of the median (capture is at --capture-step)")
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--sdpa", choices=["flash", "math", "any"], default="math",
                   help="torch SDPA kernel of the torch model: math (deterministic, s^2 memory; the default, so the "
                        "bit-exact columns can hold), flash (its backward differed between two runs on an H100: "
                        "not bit-exact), any (torch's choice)")
    p.add_argument("--quick", action="store_true", help="seq 1024, 4 layers, 8 steps: the GPU test")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on CPU/Gloo with the protocol backend: checks the script and bit-exactness, no timings")
    p.add_argument("--out", default="benchmarks/results/offload.json")
    args = p.parse_args()
    if args.quick:
        args.seq, args.layers, args.steps, args.skip = 1024, 4, 8, 5
    if args.cpu_smoke:
        args.models, args.hidden, args.heads, args.layers, args.seq, args.vocab = ["torch"], 64, 4, 2, 32, 128
        args.steps, args.skip, args.capture_step, args.sdpa = 5, 3, 2, "any"
        return _main(args, torch.device("cpu"), min_bytes=0)
    if not torch.cuda.is_available():
        print("bench_offload needs a CUDA GPU (pinned-memory copies, CUDA graphs); --cpu-smoke runs its logic on the "
              "CPU. Nothing to run here.")
        return 0
    if "te" in args.models and not HAS_TE:
        sys.exit("bench_offload: --models te needs TransformerEngine; drop 'te'")
    return _main(args, torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))


def _main(args: argparse.Namespace, device: torch.device, min_bytes: Optional[int] = None) -> int:
    device = init_process_group(cuda=device.type == "cuda", default_port=29517)
    args.min_bytes = min_bytes
    use_deterministic_kernels()
    t0 = time.time()
    kernels = {"flash": [SDPBackend.FLASH_ATTENTION], "math": [SDPBackend.MATH]}.get(args.sdpa)
    with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():  # held through eager steps and captures
        results = {m: run_model(args, m == "te", device) for m in args.models}
    ok = all(r["verdicts"]["bit_exact_eager"] and r["verdicts"]["bit_exact_graphed"] for r in results.values())
    if dist.get_rank() == 0:
        print(table(results))
        record = {"benchmark": "bench_offload", **record_fields(),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": results, "all_bit_exact": ok,
                  "seconds": time.time() - t0}
        write_record(args.out, record)
        print(f"wrote {args.out} ({record['seconds']:.0f} s); all bit-exact: {ok}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
