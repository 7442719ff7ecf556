"""What is allocated at the moment of the peak: our eager step against FSDP2's, allocator trace by site.

Runs the suite's columns (``bench_full_iteration.run_ours`` / ``run_fsdp2``: same model, data, optimizer and
loop as ``bench_partial_graphs.py --suite full``) for a few steps each, in a fresh state of the caching
allocator, while ``torch.cuda.memory._record_memory_history`` records every allocation and free with its
Python stack. It then replays the trace (up to the run's closing ``full_state_dict``, which comes after the
measured steps) to the instant of the largest allocated total, and sums the blocks live at that instant by the
first frame that belongs to the project, TE, FSDP2, the optimizer or autograd. Each row also names the
allocation that made the peak, which says where in the step it falls. Blocks allocated before the column
started (``base_gib``: what earlier columns left) are in ``max_memory_allocated`` but not in the trace.

    python benchmarks/diagnose/peak_composition.py [--config compute|launch|demo] [--columns eager fsdp2] [--out PATH]
    torchrun --nproc-per-node 2 benchmarks/diagnose/peak_composition.py ...   # rank 0's trace on 2 GPUs

Columns: those of ``bench_full_iteration`` (eager, partial, full_iteration, fsdp2, ...). The record also carries
``CUBLAS_WORKSPACE_CONFIG``: cuBLAS keeps one workspace per stream it runs on (32 MiB each on Hopper by default),
which on a small model is most of what graphs add (their warmup and capture streams).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from graph_memory_snapshot import frame_site  # noqa: E402

# the suite's configs, and the demo's model (fsdp_cudagraph.apps.demo; 2 rows per rank, one rank here)
DEMO = dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=2)


def _configs() -> Dict[str, Tuple[Dict[str, Any], int]]:
    import bench_full_iteration as bfi

    return dict(bfi.CONFIGS, demo=(DEMO, 2))


MARKERS = ("megatron_fsdp/", "fsdp_cudagraph/", "torch/distributed/fsdp/", "transformer_engine/", "torch/optim/",
           "torch/autograd/", "torch/nn/", "benchmarks/")


def _site(frames: List[Dict[str, Any]]) -> str:
    return frame_site(frames, MARKERS) or "no Python stack (C++: cuBLAS/TE workspaces, NCCL)"


def peak_composition(trace: List[Dict[str, Any]]) -> Tuple[int, Dict[str, int], str]:
    """(peak bytes, live bytes by site at the peak, the site of the allocation that made the peak)."""
    live: Dict[int, Tuple[int, str]] = {}
    total = best = 0
    best_live: Dict[int, Tuple[int, str]] = {}
    best_site = ""
    for ev in trace:
        action = ev.get("action")
        if action == "alloc" and any(fr.get("name") == "full_state_dict" for fr in ev.get("frames") or []):
            break  # the run's closing state gather (for the alignment record), after the measured steps
        if action == "alloc":
            site = _site(ev.get("frames"))
            live[ev["addr"]] = (ev["size"], site)
            total += ev["size"]
            if total > best:
                best, best_live, best_site = total, dict(live), site
        elif action == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    by_site: Dict[str, int] = collections.defaultdict(int)
    for size, site in best_live.values():
        by_site[site] += size
    return best, dict(by_site), best_site


def run_column(column: str, cfg_name: str, fuse: bool, steps: int, device: torch.device) -> Dict[str, Any]:
    import bench_full_iteration as bfi
    from fsdp_cudagraph.apps.model import GPTConfig

    fields, mbs = _configs()[cfg_name]
    cfg = GPTConfig(**fields, use_te=bfi.HAS_TE)
    args = argparse.Namespace(steps=steps, skip=1, capture_step=2, te=bfi.HAS_TE, fuse_wgrad=fuse)
    bfi._fresh()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        if column.startswith("fsdp2"):
            row = bfi.run_fsdp2(cfg, mbs, args, device, graphed=column == "fsdp2_graph")
        else:
            row = bfi.run_ours(column, bfi.ours_config(cfg, fuse), mbs, args, device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index or 0]
    peak, by_site, at = peak_composition(trace)
    return {"column": column, "config": cfg_name, "fuse_wgrad": fuse, "max_memory_allocated_gib": row["peak_memory_gib"],
            "base_gib": base / 2**30, "trace_peak_gib": peak / 2**30, "peak_made_by": at, "events": len(trace),
            "sites_gib": {k: v / 2**30 for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])},
            "step_ms": row.get("step_ms"), "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="compute", choices=["launch", "compute", "demo"])
    p.add_argument("--columns", nargs="+", default=["eager", "fsdp2"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fuse-wgrad", choices=["on", "off"], default="on")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("peak_composition needs a CUDA GPU; nothing to run here.")
        return 2
    dev = _common.init_process_group(cuda=True, default_port=29519)
    torch.cuda.set_stream(torch.cuda.default_stream(dev))
    rows = [run_column(c, args.config, args.fuse_wgrad == "on", args.steps, dev) for c in args.columns]
    for r in rows if dist.get_rank() == 0 else []:  # under torchrun: rank 0's trace (every rank runs the same steps)
        print(f"\n{r['column']} ({r['config']}): max_memory_allocated {r['max_memory_allocated_gib']:.3f} GiB, trace peak "
              f"{r['trace_peak_gib']:.3f} GiB above {r['base_gib']:.3f}; the peak was made by {r['peak_made_by']}")
        print("| GiB live at the peak | allocated at |\n| --- | --- |")
        for site, gib in list(r["sites_gib"].items())[:14]:
            print(f"| {gib:.3f} | {site} |")
    if args.out and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({**_common.record_fields(), "config": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
