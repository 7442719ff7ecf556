"""Length buckets on a ViT-style encoder under megatron_fsdp: step time per bucket against eager packed.

The encoder (``fsdp_cudagraph.apps.vision``; patches 14x14x3, hidden 1024, 8 layers, 16 heads, bf16, ZeRO-3 with
the double buffer) trains on packed multi-image samples. The schedule has one phase per bucket: every step
of a phase has ``--fill`` x bucket patches (split into 2-4 images), so the bucket's padding overhead is
``1 / fill - 1``. Four runs train on that same schedule, each in this process:

- ``eager_packed``: no padding, no graphs (the baseline);
- ``eager_padded``: the blocks run at the bucket length, no graphs (what padding alone costs);
- ``graphed``: LengthBucketGraphs, one graph per bucket (the encoder pads once before its blocks);
- ``graphed_max``: one bucket only, the largest (Megatron-Bridge PR 2334's single padded length).

Per bucket: median step time (CUDA events) over the phase's steps after ``--warm`` (and before its last
step, where ranks change phase at different steps), the padding overhead (padded / real patches), and the
graphed run's capture time, graph memory and memory-pool growth. Run (1 GPU, then 2)::

    python benchmarks/bench_length_buckets.py --out length-buckets-1gpu.json
    torchrun --nproc-per-node 2 benchmarks/bench_length_buckets.py --out length-buckets-2gpu.json

About a minute on one H100. ``--quick`` shrinks the model (hidden 256, 4 layers); ``--device cpu`` runs the
script on Gloo with the protocol backend (a smoke test: CPU timings mean nothing). Kernels are not forced
deterministic (``--deterministic`` does, as the correctness record ``python -m fsdp_cudagraph.apps.vision`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Any, Dict, List

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.vision import VisionConfig, VisionRunSpec, run_vision  # noqa: E402


def schedule(buckets: List[int], fill: float, warmup: int, per_phase: int) -> List[int]:
    """Patches per step: ``warmup`` eager steps at the first bucket's length, then ``per_phase`` per bucket."""
    lengths = [max(1, int(fill * b)) for b in buckets]
    return [lengths[0]] * warmup + [n for n in lengths for _ in range(per_phase)]


def run(mode: str, buckets: List[int], lengths: List[int], cfg: VisionConfig, args: argparse.Namespace,
        device: torch.device) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    spec = VisionRunSpec(model=cfg, mode="graphed" if mode.startswith("graphed") else mode, backend=args.backend,
                         buckets=buckets, lengths=lengths, steps=len(lengths), capture_step=args.warmup,
                         compute_dtype=torch.bfloat16 if cuda else None, probe_length=0)
    t0 = time.perf_counter()
    r = run_vision(spec, device)
    out: Dict[str, Any] = {"seconds": time.perf_counter() - t0, "step_ms": r.step_ms,
                           "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
                           "padding_overhead": r.padding_overhead}
    if r.report is not None:
        out["capture"] = [{"bucket": b.bucket, "seconds": b.capture_seconds, "graph_memory_bytes": b.graph_memory_bytes,
                           "pool_growth_bytes": b.reserved_bytes} for b in r.report.buckets]
        out["stats"] = {str(k): v for k, v in (r.stats or {}).items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--fill", type=float, default=0.75, help="patches per step as a fraction of the bucket")
    p.add_argument("--warmup", type=int, default=2, help="eager steps before capture")
    p.add_argument("--warm", type=int, default=3, help="steps of each phase left out of its median")
    p.add_argument("--timed", type=int, default=10, help="steps of each phase in its median")
    p.add_argument("--backend", default="torch", choices=["torch", "te", "protocol"])
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (as the correctness record)")
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers (a smoke test)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of this script (Gloo, protocol backend, --quick sizes; timings meaningless)")
    p.add_argument("--out", default=None, help="JSON path (rank 0 writes)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_length_buckets needs a CUDA GPU (or --device cpu for a smoke test)")
        return 0
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if not cuda:
        args.backend, args.quick = "protocol", True
    device = init_process_group(cuda=cuda, default_port=29519)
    buckets = sorted(args.buckets)
    cfg = (VisionConfig(patch_dim=588, hidden_size=256, num_layers=4, num_heads=4, max_patches_per_image=4096) if args.quick
           else VisionConfig(patch_dim=588, hidden_size=1024, num_layers=8, num_heads=16, max_patches_per_image=4096))
    per_phase = args.warm + args.timed + 1
    lengths = schedule(buckets, args.fill, args.warmup, per_phase)
    runs = {
        "eager_packed": run("eager_packed", buckets, lengths, cfg, args, device),
        "eager_padded": run("eager_padded", buckets, lengths, cfg, args, device),
        "graphed": run("graphed", buckets, lengths, cfg, args, device),
        "graphed_max": run("graphed_max", [buckets[-1]], lengths, cfg, args, device),
    }
    rows = []
    for i, b in enumerate(buckets):
        start = args.warmup + i * per_phase + args.warm
        window = slice(start, start + args.timed)
        real = max(1, int(args.fill * b))
        row: Dict[str, Any] = {"bucket": b, "patches": real, "padding_overhead": (b - real) / real,
                               "padding_overhead_max_bucket": (buckets[-1] - real) / real}
        for name, r in runs.items():
            row[f"{name}_ms"] = statistics.median(r["step_ms"][window])
        row["speedup_graphed_vs_eager_packed"] = row["eager_packed_ms"] / row["graphed_ms"]
        row["speedup_graphed_max_vs_eager_packed"] = row["eager_packed_ms"] / row["graphed_max_ms"]
        cap = next(c for c in runs["graphed"]["capture"] if c["bucket"] == b)
        row.update(capture_seconds=cap["seconds"], graph_memory_bytes=cap["graph_memory_bytes"],
                   pool_growth_bytes=cap["pool_growth_bytes"])
        rows.append(row)
    if dist.get_rank() == 0:
        print(f"{'bucket':>7} {'patches':>7} {'pad':>5} {'eager packed':>12} {'eager padded':>12} {'graphed':>9} "
              f"{'x':>5} {'one max bucket':>14} {'capture s':>9} {'graph MiB':>9} {'pool MiB':>8}")
        for r in rows:
            print(f"{r['bucket']:>7} {r['patches']:>7} {r['padding_overhead']:>5.2f} {r['eager_packed_ms']:>9.2f} ms "
                  f"{r['eager_padded_ms']:>9.2f} ms {r['graphed_ms']:>6.2f} ms {r['speedup_graphed_vs_eager_packed']:>5.2f} "
                  f"{r['graphed_max_ms']:>11.2f} ms {r['capture_seconds']:>9.3f} {r['graph_memory_bytes'] / 2**20:>9.1f} "
                  f"{r['pool_growth_bytes'] / 2**20:>8.1f}")
        print("peak memory (GiB): " + ", ".join(f"{k} {v['peak_memory_bytes'] / 2**30:.2f}" for k, v in runs.items()))
        if args.out:
            write_record(args.out, {**record_fields(), "config": dataclasses.asdict(cfg), "args": vars(args),
                                    "lengths": lengths, "rows": rows, "runs": runs})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
