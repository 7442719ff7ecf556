"""Host cost of a graphed layer against depth: ms per layer of a launch-bound training step at 8, 32, 64 layers.

    python benchmarks/bench_depth.py --layers 8 32 64 --out depth.json          # one GPU (NCCL, one rank)
    python benchmarks/bench_depth.py --device cpu --layers 4 8 --steps 3        # CPU smoke (Gloo, protocol backend)

The layers are small on purpose (hidden 256, sequence 128, micro-batch 2; ten submodules per layer: two
LayerNorms, q/k/v/o, fc1, GELU, fc2, a dropout at p=0), so a step is bound by the host, not by the GPU: the
per-layer step time is what the host spends on one layer, eager or graphed. Whole layers are graphed (one
graph per layer, torch backend: ``torch.cuda.make_graphed_callables``). Columns, each built fresh from the
same seed and data, all in one process:

  plain_eager       the stack without any FSDP (bf16 parameters, fused Adam): the eager reference
  plain_graphed     the same, each layer graphed by torch with no hooks to reroute: the launch limit
  ours_eager        megatron_fsdp ZeRO-3 with the double buffer, bf16 compute, fp32 main parameters, fused Adam
  ours_graphed      + PartialCudaGraphs over whole layers
  fsdp2_eager       torch FSDP2 fully_shard per layer and the root (bf16 model), its defaults (ZeRO-3)
  fsdp2_graphed     FSDP2 with keep_unsharded_storage + PartialCudaGraphs over whole layers
  fsdp2_mp_eager    FSDP2 as torchtitan runs it: fp32 model, MixedPrecisionPolicy(param_dtype=bf16,
                    reduce_dtype=fp32), fp32 inputs cast by FSDP2
  fsdp2_mp_graphed  the same with keep_unsharded_storage + PartialCudaGraphs over whole layers

Timing: after warmup (graphed columns capture at step ``--capture-step``), ``--runs`` runs of ``--steps``
steps, each run bracketed by ``torch.cuda.synchronize``; the best run's mean step time, divided by the
depth, is the column's ms per layer (a run on a shared host can vary by 50%, so the best of several is the
figure). The graphed columns' losses are compared with their engine's eager column (``torch.equal``,
recorded as ``equal``). ``--profile COLUMN`` then runs 5 more steps of that column at the largest depth under
cProfile and prints where the host time goes (by own time), for the next cut. The physical floor of a graphed layer is one replay (~10 us) plus the engine's
per-unit collectives launch and hooks; the goal is <= 0.15 ms per layer, flat in depth.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402

COLUMNS = ("plain_eager", "plain_graphed", "ours_eager", "ours_graphed", "fsdp2_eager", "fsdp2_graphed",
           "fsdp2_mp_eager", "fsdp2_mp_graphed")
#: graphed column -> the eager column its losses must equal
PAIRS = {"ours_graphed": "ours_eager", "fsdp2_graphed": "fsdp2_eager", "fsdp2_mp_graphed": "fsdp2_mp_eager",
         "plain_graphed": "plain_eager"}


class Layer(nn.Module):
    """A small pre-norm transformer layer with ten submodules (the graphed unit)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.act, self.drop = nn.GELU(), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.drop(self.o(a))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _build(column: str, layers: int, args: argparse.Namespace, device: torch.device):
    """(model to call, optimizer, graphs or None) for one column."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    torch.manual_seed(0)
    stack = Stack(layers, args.hidden, args.heads).to(device)
    graphed = column.endswith("_graphed")
    cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[], cuda_graph_warmup_steps=args.capture_step,
                          use_megatron_fsdp=column.startswith("ours"), fsdp_double_buffer=column.startswith("ours"),
                          fsdp_db_use_persist_buf_on_alloc_fail=column.startswith("ours"))
    backend = "torch" if device.type == "cuda" else "protocol"
    fused = device.type == "cuda"
    if column.startswith("plain"):
        model = stack.to(args.dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)
        graphs = _PlainGraphs(model, args.capture_step) if graphed and device.type == "cuda" else None
        return model, opt, graphs
    if column.startswith("ours"):
        from megatron_fsdp import fully_shard

        model = fully_shard(stack, fsdp_unit_modules=[Layer], sharding_strategy="optim_grads_params",
                            compute_dtype=args.dtype, fsdp_double_buffer=True,
                            fsdp_db_use_persist_buf_on_alloc_fail=True)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-4, fused=fused)
        return model, opt, PartialCudaGraphs(model, cfg, backend=backend) if graphed else None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_cudagraph import keep_unsharded_storage
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    kw = {}
    if column.startswith("fsdp2_mp"):  # fp32 shards, bf16 compute, fp32 reduction
        model = stack
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=args.dtype, reduce_dtype=torch.float32)
    else:
        model = stack.to(args.dtype)
    shard_fsdp2(model, list(model.layers), **kw)
    if graphed:
        keep_unsharded_storage(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)
    return model, opt, PartialCudaGraphs(model, cfg, backend=backend) if graphed else None


class _PlainGraphs:
    """Each layer of an unsharded stack graphed by torch after ``capture_step`` eager steps (no hooks)."""

    def __init__(self, model: Stack, capture_step: int) -> None:
        self.model, self.capture_step = model, capture_step
        self.sample: torch.Tensor = None

    def capture(self) -> None:
        x = self.sample
        for i, layer in enumerate(self.model.layers):
            self.model.layers[i] = torch.cuda.make_graphed_callables(layer, (x.detach().requires_grad_(i > 0),))


def _time_column(column: str, layers: int, args: argparse.Namespace, device: torch.device,
                 data: torch.Tensor) -> Dict[str, Any]:
    model, opt, graphs = _build(column, layers, args, device)
    losses: List[torch.Tensor] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(i: int) -> None:
        if graphs is not None and i == args.capture_step:
            if isinstance(graphs, _PlainGraphs):
                graphs.sample = data[0].to(args.dtype)
            graphs.capture()
        x = data[i % len(data)]
        loss = model(x if column.startswith("fsdp2_mp") else x.to(args.dtype)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    runs: List[float] = []
    i = 0
    while i < args.capture_step + 2:
        step(i)
        i += 1
    for _ in range(args.runs):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(i)
            i += 1
        sync()
        runs.append((time.perf_counter() - t0) * 1e3 / args.steps)
    best = min(runs)
    if args.profile == column and layers == max(args.layers):
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step(i)
            i += 1
        sync()
        prof.disable()
        del losses[-5:]  # the profiled steps are not compared with the eager column's
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(f"cProfile of {column} at {layers} layers, 5 steps (by own time):\n{text.getvalue()}", flush=True)
    out = {"step_ms": best, "ms_per_layer": best / layers, "runs_step_ms": runs,
           "losses": [float(l) for l in losses], "_losses": torch.stack(losses).cpu()}
    if graphs is not None and hasattr(graphs, "delete"):
        graphs.delete()
    del model, opt, graphs
    return out


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps per timed run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per column; the best counts")
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="JSON record")
    p.add_argument("--profile", default=None, choices=COLUMNS, help="cProfile this column at the largest depth")
    args = p.parse_args(argv)
    device = init_process_group(cuda=args.device == "cuda", default_port=29541)
    if device.type == "cuda":
        args.dtype = torch.bfloat16
    else:
        print("bench_depth: no CUDA device; running the CPU smoke (Gloo, protocol backend, fp32): the script's "
              "path only, no graphs and no meaningful times. The figures need a GPU.")
        args.dtype = torch.float32
    if device.type == "cuda":  # graphs need the thread off the legacy default stream from the first step on
        from fsdp_cudagraph import use_side_stream

        use_side_stream()
    g = torch.Generator().manual_seed(1)
    n_data = args.capture_step + 2 + args.runs * args.steps
    data = torch.randn(min(n_data, 8), args.micro_batch, args.seq, args.hidden, generator=g).to(device)
    results: Dict[str, Dict[str, Any]] = {}
    for layers in args.layers:
        row: Dict[str, Any] = {}
        for column in args.columns:
            if column == "plain_graphed" and device.type != "cuda":
                continue
            row[column] = _time_column(column, layers, args, device, data)
            print(f"layers={layers:3d} {column:14s} {row[column]['step_ms']:8.2f} ms/step "
                  f"{row[column]['ms_per_layer']:6.3f} ms/layer", flush=True)
        for graphed, eager in PAIRS.items():
            if graphed in row and eager in row:
                row[graphed]["equal_to_" + eager] = bool(torch.equal(row[graphed]["_losses"], row[eager]["_losses"]))
                row[graphed]["vs_" + eager] = row[graphed]["ms_per_layer"] / row[eager]["ms_per_layer"]
        for r in row.values():
            r.pop("_losses")
        results[str(layers)] = row
    # the graph layer's added host time per layer over the plain graphed stack, and its growth with depth
    summary: Dict[str, Any] = {}
    for col in COLUMNS:
        per = {k: v[col]["ms_per_layer"] for k, v in results.items() if col in v}
        if per:
            summary[col] = per
            lo, hi = str(min(args.layers)), str(max(args.layers))
            if lo in per and hi in per and lo != hi:
                summary[col + "_growth"] = per[hi] / per[lo]
    record = {**record_fields(), "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()},
              "results": results, "ms_per_layer": summary}
    print("ms per layer:", {k: ({d: round(x, 3) for d, x in v.items()} if isinstance(v, dict) else round(v, 3))
                            for k, v in summary.items()})
    if args.out:
        write_record(args.out, record)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(main())
