"""Where the memory of partial graphs sits on a small model: allocator snapshots, eager against graphed.

The demo's model (``fsdp_cudagraph.apps.demo``: 4 layers, hidden 128, seq 64, every second layer MoE, TE
when installed) trains 6 steps under ``megatron_fsdp`` ZeRO-3 with double buffering, eagerly and with
whole-layer graphs (captured at step 2), each in a fresh state of the caching allocator; the peak of each is
``torch.cuda.max_memory_allocated``. At the end of each run, with the graphs still alive, every live block of
the allocator is put in a category: the graph pool it belongs to (private pools of captured graphs), else the
project, TE or torch frame that allocated it (``torch.cuda.memory._record_memory_history`` stacks). The table
lists each category's MiB in both runs and the difference, largest first.

    python benchmarks/diagnose/graph_memory_snapshot.py [--fuse-wgrad on|off] [--out PATH]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MARKERS = ("fsdp_cudagraph/", "megatron_fsdp/", "transformer_engine/", "torch/cuda/graphs.py", "torch/optim/",
           "torch/autograd/", "torch/nn/")


def frame_site(frames: Optional[List[Dict[str, Any]]], markers: Sequence[str]) -> Optional[str]:
    """``dir/file.py:line function`` of the innermost allocator-stack frame in a file matching ``markers``."""
    for fr in frames or []:
        fn = fr.get("filename", "")
        if any(m in fn for m in markers):
            short = fn[fn.rfind("/", 0, fn.rfind("/")) + 1:]
            return f"{short}:{fr.get('line')} {fr.get('name')}"
    return None


def _where(block: Dict[str, Any], segment: Dict[str, Any]) -> str:
    pool = segment.get("segment_pool_id")
    in_pool = pool is not None and tuple(pool) != (0, 0)
    return ("graph pool | " if in_pool else "") + (frame_site(block.get("frames"), MARKERS) or "no stack")


def snapshot_by_site() -> Dict[str, int]:
    out: Dict[str, int] = collections.defaultdict(int)
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[_where(b, seg)] += b["size"]
    return dict(out)


def run(graphed: bool, fuse: bool, dev: torch.device) -> Dict[str, Any]:
    from megatron_fsdp import fully_shard

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
    from fsdp_cudagraph.capture.te import HAS_TE

    cfg = GPTConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=2,
                    use_te=HAS_TE, fuse_wgrad=HAS_TE and fuse)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    torch.manual_seed(0)
    gpt = GPT(cfg).to(dev)
    m = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                    compute_dtype=torch.bfloat16, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(m.optimizer_parameters(), lr=1e-3, fused=True)
    config = CudaGraphConfig(cuda_graph_impl="transformer_engine" if HAS_TE else "local", cuda_graph_warmup_steps=2,
                             use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    g = PartialCudaGraphs(m, config) if graphed else None
    losses = []
    for s in range(6):
        if g is not None and s == 2:
            g.capture()
        x, y = synthetic_batch(s, 2, cfg, dev)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float().item())
    torch.cuda.synchronize()
    sites = snapshot_by_site()
    torch.cuda.memory._record_memory_history(enabled=None)
    res = {"peak_mib": (torch.cuda.max_memory_allocated(dev) - base) / 2**20,
           "live_mib": (torch.cuda.memory_allocated(dev) - base) / 2**20, "sites": sites, "losses": losses,
           "te": HAS_TE, "fuse_wgrad": cfg.fuse_wgrad}
    if g is not None:
        res["capture_breakdown"] = g.report.memory_breakdown if g.report is not None else None
        g.delete()
    del m, opt, g, gpt
    gc.collect()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fuse-wgrad", choices=["on", "off"], default="on")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("graph_memory_snapshot needs a CUDA GPU; nothing to run here.")
        return 2
    dev = _common.init_process_group(cuda=True, default_port=29517)
    torch.cuda.set_stream(torch.cuda.default_stream(dev))
    eager = run(False, args.fuse_wgrad == "on", dev)
    graphed = run(True, args.fuse_wgrad == "on", dev)
    keys = set(eager["sites"]) | set(graphed["sites"])
    rows = sorted(((graphed["sites"].get(k, 0) - eager["sites"].get(k, 0), k) for k in keys), reverse=True)
    print(f"fuse_wgrad={eager['fuse_wgrad']} te={eager['te']}: peak eager {eager['peak_mib']:.1f} MiB, graphed "
          f"{graphed['peak_mib']:.1f} MiB ({graphed['peak_mib'] / eager['peak_mib']:.2f}x); live at the end "
          f"{eager['live_mib']:.1f} / {graphed['live_mib']:.1f} MiB")
    print("| MiB graphed - eager | eager | graphed | where |\n| --- | --- | --- | --- |")
    for d, k in rows[:25]:
        print(f"| {d / 2**20:.2f} | {eager['sites'].get(k, 0) / 2**20:.2f} | {graphed['sites'].get(k, 0) / 2**20:.2f} | {k} |")
    print("capture breakdown:", graphed.get("capture_breakdown"))
    if args.out and dist.get_rank() == 0:
        with open(args.out, "w") as f:  # default=str: the snapshot's frames hold non-JSON values
            json.dump({**_common.record_fields(), "eager": eager, "graphed": graphed, "fuse_wgrad": args.fuse_wgrad},
                      f, indent=1, default=str)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
