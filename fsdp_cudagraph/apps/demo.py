"""Demo: train a tiny GPT under megatron_fsdp on 2 processes, eagerly and with partial CUDA graphs.

    torchrun --standalone --nproc-per-node 2 -m fsdp_cudagraph.apps.demo [--steps 12] [--scope attn mlp]
        [--reduce-dtype bf16] [--hsdp R] [--out losses.json]

Two nodes (HSDP: shard within a node, replicate across nodes; docs/launch.md), run on each node:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m fsdp_cudagraph.apps.demo --hsdp 2

On GPUs (NCCL, bf16) it trains twice with the same seeds, eagerly and with per-layer graphs captured at
step 3 (TransformerEngine if installed, else PyTorch's graphs), and prints both loss columns side by side
with step times. On CPU (Gloo, fp32) CUDA graphs cannot be captured: it trains eagerly and runs the same
hook schedule on the CPU protocol backend, which shows the losses stay identical but measures no speed-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # both columns must run deterministic kernels
# cuBLAS keeps one workspace per stream it runs on; graphs add two streams (warmup, capture). ":16:8" (128 KiB,
# deterministic like ":4096:8") keeps that from doubling a small model's memory; see docs/HISTORY.md,
# "2026-11-25 (commits `26f9a30`..`b72eab5`)", "Graph memory on small models is cuBLAS workspaces".
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")

import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPTConfig
from fsdp_cudagraph.apps.train import RunSpec, run_training, use_deterministic_kernels
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON

CAPTURE_STEP = 3  # steps 0-2 eager (warm-up), the graphs captured before step 3, which replays them


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--scope", nargs="*", default=[], help="cuda_graph_modules (empty: whole layers)")
    p.add_argument("--strategy", default="optim_grads_params")
    p.add_argument("--no-fuse-wgrad", action="store_true",
                   help="with TE: keep TE's weight gradients as ordinary .grad (by default TE writes them straight "
                        "into the engine's fp32 gradient buffer, fuse_wgrad_accumulation=True)")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the gradient buffers and of the reduction over ranks (fully_shard's reduce_dtype); "
                        "main gradients and the optimizer stay fp32")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="hybrid sharding: the world as an (R, world / R) mesh, sharded within each group of "
                        "world / R consecutive ranks (a node) and replicated across the R groups (docs/launch.md)")
    p.add_argument("--out", help="write rank 0's losses (both columns) and the run's topology to this JSON file")
    args = p.parse_args()
    if args.steps <= CAPTURE_STEP:
        p.error(f"--steps {args.steps}: the demo captures before step {CAPTURE_STEP}, which replays; need --steps "
                f">= {CAPTURE_STEP + 1}")
    logging.basicConfig(level=logging.WARNING)
    cuda = torch.cuda.is_available()
    use_deterministic_kernels()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = ("te" if HAS_TE else "torch") if cuda else "protocol"
    cfg = GPTConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=2,
                    use_te=backend == "te", fuse_wgrad=backend == "te" and not args.no_fuse_wgrad)
    # The eager run's TE attention picks the backend the graphs will use (match_graph_attention), so that the
    # two columns can be compared bit for bit; see fsdp_cudagraph/capture/attention.py.
    spec = RunSpec(model=cfg, steps=args.steps, sharding_strategy=args.strategy, backend=backend,
                   compute_dtype=torch.bfloat16 if cuda else torch.float32, capture_step=CAPTURE_STEP,
                   attention_as_graphed=list(args.scope),
                   reduce_dtype=torch.bfloat16 if args.reduce_dtype == "bf16" else None, replicate=args.hsdp)
    if rank == 0:
        print(f"megatron_fsdp demo: {world} ranks on {device.type} ({dist.get_backend()}), strategy {args.strategy}, "
              f"{cfg.num_layers} layers (every 2nd MoE), graph scope {args.scope or 'whole layers'}, backend {backend}"
              + (", fused weight gradients" if cfg.fuse_wgrad else "")
              + (", gradients reduced in bf16" if spec.reduce_dtype is not None else "")
              + (f", HSDP {args.hsdp} x {world // args.hsdp} (replicate x shard)" if args.hsdp > 1 else ""))
        if not cuda:
            print("No CUDA GPU here: CUDA graphs need one. The 'graphed' column runs the same capture schedule and "
                  "hook rerouting on the CPU protocol backend (no graphs, no speed-up).")
        elif not HAS_TE:
            print(f"TransformerEngine not available ({TE_REASON}); using torch.cuda.make_graphed_callables.")
    eager = run_training(spec, device)
    eager.final_state = {}  # not compared here; off the GPU before the graphed run measures its peak
    graphed = run_training(RunSpec(**{**spec.__dict__, "cuda_graph_modules": list(args.scope),
                                      "attention_as_graphed": None}), device)
    if rank == 0:
        print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}  {'equal':>5}  {'eager ms':>9}  {'graphed ms':>10}")
        for i, (a, b) in enumerate(zip(eager.losses, graphed.losses)):
            mark = "  <- capture" if i == spec.capture_step else ""
            print(f"{i:4d}  {a.item():12.6f}  {b.item():12.6f}  {str(torch.equal(a, b)):>5}  "
                  f"{eager.step_ms[i]:9.2f}  {graphed.step_ms[i]:10.2f}{mark}")
        if cuda:
            mem = (f"peak GPU memory eager {eager.peak_memory_bytes / 2**20:.1f} MiB, "
                   f"graphed {graphed.peak_memory_bytes / 2**20:.1f} MiB")
        else:
            mem = f"peak process memory (rank 0) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
        same = all(torch.equal(a, b) for a, b in zip(eager.losses, graphed.losses))
        print(f"losses bit-identical: {same}; {mem}; capture took {graphed.capture.capture_seconds:.2f} s "
              f"for {len(graphed.capture.callables)} callables")
        # A TE attention backend that differs under capture is reported once, by the library's notice (rank 0).
        if args.out:
            import json

            with open(args.out, "w") as f:
                json.dump({"world_size": world, "hsdp": args.hsdp, "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
                           "eager_losses": [a.item() for a in eager.losses],
                           "graphed_losses": [b.item() for b in graphed.losses], "bit_identical": same}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    from fsdp_cudagraph.apps.train import exit_process

    main()
    exit_process(0)
