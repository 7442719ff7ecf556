"""Less work per replay: our graphed step against the same model graphed without FSDP, side by side in one run.

    python benchmarks/bench_replay_work.py --suite launch compute --out replay.json [--profile]
    torchrun --nproc-per-node 2 benchmarks/bench_replay_work.py ...

Columns, all in one process on the same data (bf16 compute):
  nofsdp_eager        the reference GPT without any sharding (bf16 parameters, fused Adam)
  nofsdp_graphed      the same, its layers graphed with TE's make_graphed_callables (no hooks to reroute)
  ours_eager          megatron_fsdp ZeRO-3 with double buffer (fp32 main parameters, Adam over the shards)
  ours_graphed        + whole-layer partial graphs (TE backend), TE's defaults
  ours_noclone        + clone_param_grads=False (TE returns its static gradient buffers)
  ours_noclone_fused  + fused Adam over the flat shards
The ``ours_*`` graphed columns must keep losses bit-identical to ``ours_eager`` (checked and recorded); the
ratio to ``nofsdp_graphed`` is the launch-bound goal of less work per replay (<= 1.05). ``--profile`` adds a
torch.profiler table (top CPU ops) of ``ours_noclone_fused``'s replayed steps. Needs a CUDA GPU and TE.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON, require_te  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.apps.train import RunSpec, run_training, use_deterministic_kernels  # noqa: E402

SUITES = {
    "launch": dict(cfg=dict(vocab_size=1024, hidden_size=1024, num_layers=8, num_heads=16, seq_len=512), mbs=2),
    "compute": dict(cfg=dict(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, seq_len=2048), mbs=1),
}


def median_ms(ms: List[float], skip: int) -> float:
    return statistics.median(ms[skip:])


def no_fsdp(cfg: GPTConfig, mbs: int, steps: int, graphed: bool, device: torch.device) -> Dict[str, Any]:
    """The model without sharding: bf16 parameters, fused Adam; optionally its layers graphed by TE."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    batches = []
    for step in range(steps):
        x, y = synthetic_batch(step, mbs * world, cfg, device)
        batches.append((x[rank * mbs:(rank + 1) * mbs], y[rank * mbs:(rank + 1) * mbs]))
    if graphed:
        te = require_te("bench_replay_work")
        x0 = model.tok(batches[0][0]) + model.pos(torch.arange(cfg.seq_len, device=device))[None]
        sample = tuple((torch.randn_like(x0).requires_grad_(),) for _ in model.layers)
        graphed_layers = te.make_graphed_callables(tuple(model.layers), sample, num_warmup_iters=3)
        for i, g in enumerate(graphed_layers):
            model.layers[i] = g
    ms = []
    for x, y in batches:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e.record()
        ms.append((s, e))
    torch.cuda.synchronize()
    return {"step_ms": [a.elapsed_time(b) for a, b in ms], "peak_bytes": torch.cuda.max_memory_allocated(device)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", nargs="+", default=["launch", "compute"], choices=list(SUITES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=8, help="steps left out of the median (capture is at step 3)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or not HAS_TE:
        print(f"bench_replay_work needs a CUDA GPU and TE ({TE_REASON or 'no GPU'}); nothing to run here.")
        return 0
    use_deterministic_kernels()
    device = init_process_group(cuda=True, default_port=29519)
    out: Dict[str, Any] = {**record_fields(), "steps": args.steps, "skip": args.skip, "suites": {}}
    for suite in args.suite:
        cfg = GPTConfig(use_te=True, **SUITES[suite]["cfg"])
        mbs = SUITES[suite]["mbs"]
        res: Dict[str, Any] = {"config": {**SUITES[suite]["cfg"], "micro_batch_size": mbs}, "columns": {}}
        cols = res["columns"]
        for name, graphed in (("nofsdp_eager", False), ("nofsdp_graphed", True)):
            torch.cuda.reset_peak_memory_stats(device)
            r = no_fsdp(cfg, mbs, args.steps, graphed, device)
            cols[name] = {"step_ms": median_ms(r["step_ms"], args.skip), "peak_gib": r["peak_bytes"] / 2**30}
        base = RunSpec(model=cfg, steps=args.steps, micro_batch_size=mbs, backend="te", capture_step=3)
        runs = {
            "ours_eager": {},
            "ours_graphed": {"cuda_graph_modules": []},
            "ours_noclone": {"cuda_graph_modules": [], "clone_param_grads": False},
            "ours_noclone_fused": {"cuda_graph_modules": [], "clone_param_grads": False, "optimizer": "adam_fused"},
            "ours_eager_fused": {"optimizer": "adam_fused"},
        }
        results = {}
        for name, over in runs.items():
            torch.cuda.reset_peak_memory_stats(device)
            profile = args.profile and name == "ours_noclone_fused"
            r = run_training(RunSpec(**{**base.__dict__, **over}), device, profile_from=args.steps - 5 if profile else None)
            results[name] = r
            cols[name] = {"step_ms": median_ms(r.step_ms, args.skip), "peak_gib": r.peak_memory_bytes / 2**30}
            if r.profile:
                res["profile_ours_noclone_fused"] = r.profile
        for a, b in (("ours_eager", "ours_graphed"), ("ours_eager", "ours_noclone"),
                     ("ours_eager_fused", "ours_noclone_fused")):
            cols[b]["losses_equal_to_" + a] = all(torch.equal(x, y) for x, y in zip(results[a].losses, results[b].losses))
        ng = cols["nofsdp_graphed"]["step_ms"]
        res["ratios"] = {f"{k}/nofsdp_graphed": round(v["step_ms"] / ng, 3) for k, v in cols.items()}
        res["ratios"]["ours_graphed/ours_eager"] = round(cols["ours_graphed"]["step_ms"] / cols["ours_eager"]["step_ms"], 3)
        out["suites"][suite] = res
        if dist.get_rank() == 0:
            print(f"== {suite}: {res['config']}")
            for k, v in cols.items():
                extra = {kk: vv for kk, vv in v.items() if kk.startswith("losses")}
                print(f"  {k:20s} {v['step_ms']:8.2f} ms  peak {v['peak_gib']:.2f} GiB  "
                      f"x{v['step_ms'] / ng:.3f} of nofsdp_graphed {extra or ''}", flush=True)
            if "profile_ours_noclone_fused" in res:
                print(res["profile_ours_noclone_fused"][:6000])
    if dist.get_rank() == 0 and args.out:
        write_record(args.out, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
