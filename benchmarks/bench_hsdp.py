"""The suite's HSDP column: flat ZeRO-3 over every rank against hybrid sharding (HSDP), per engine.

For each engine (``megatron_fsdp``: ours, ZeRO-3 with the double buffer; ``fsdp2``: PyTorch's
``fully_shard`` per layer and root with ``keep_unsharded_storage``) and topology (``flat``: a 1-D mesh of the
W ranks; ``hsdp``: a 2-D mesh ``(R, W/R)``, sharded within rows of W/R consecutive ranks, i.e. a node, and
replicated across the R rows), the reference GPT trains ``--steps`` steps eagerly. Per column:

- step time (median after ``--skip`` steps; CUDA events on GPUs, host time on CPU);
- the bytes of every collective the engine issued in one step, by the group it ran on (``world``, ``shard``,
  ``replicate``), counted by wrapping ``torch.distributed``'s collectives during an eager step; the slow
  dimension's share is what ran on a group that spans nodes: everything for ``flat`` (its group is the
  world), the ``replicate`` all-reduce for ``hsdp``;
- the same bytes computed from the parameter sizes (``expected``: flat, an estimate: all-gathers of the
  compute-dtype parameters twice per step (forward, backward) and one reduce-scatter of the gradients; HSDP,
  exact: one all-reduce of each unit's padded ``1/S`` of the gradients across the replicas, checked against
  the count);
- ring wire bytes per rank across the slow dimension: ``(W-1)/W`` of what the flat column issued (counted),
  ``2(R-1)/R`` of the replicate all-reduce.

With ``--align`` each column also trains with partial CUDA graphs (whole layers captured at step 3; ``torch``
backend on GPUs, ``protocol`` on CPU) and must equal the eager column bit for bit (every step's loss and every
final parameter, ``torch.equal`` on every rank; deterministic kernels, SDPA's math kernel). Exit status 1 if a column mismatches or a count differs
from the expected bytes.

Run (2 GPUs: flat 1 x 2 against HSDP 2 x 1; 4 GPUs: 1 x 4 against 2 x 2)::

    torchrun --nproc-per-node 2 benchmarks/bench_hsdp.py --replicate 2 --align --out hsdp-2gpu.json
    torchrun --nproc-per-node 4 benchmarks/bench_hsdp.py --replicate 2 --align --out hsdp-4gpu.json
    torchrun --nproc-per-node 4 benchmarks/bench_hsdp.py --cpu-smoke --replicate 2 --align   # Gloo, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _common  # noqa: E402,F401 - the import path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402

ENGINES = ("megatron_fsdp", "fsdp2")
TOPOLOGIES = ("flat", "hsdp")
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                "all_gather_single")


@contextlib.contextmanager
def counting(groups: Dict[str, List[int]]) -> Iterator[Dict[str, Dict[str, int]]]:
    """Count the bytes of the collectives issued in the block, ``{group kind: {op: bytes}}``.

    The input tensor's bytes for all-reduce and reduce-scatter (what is reduced), the output's for all-gather
    (what is gathered). ``groups`` maps a kind to its global ranks; a group matching none is ``other``.
    """
    tally: Dict[str, Dict[str, int]] = {}
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def kind(group: Any) -> str:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return next((k for k, r in groups.items() if r == ranks), "other")

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
            group = bound.get("group")
            t = bound.get("tensor", bound.get("output_tensor", bound.get("input")))
            per = tally.setdefault(kind(group), {})
            op = name.split("_into")[0].replace("_single", "").replace("_tensor", "")
            per[op] = per.get(op, 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted

    import megatron_fsdp._collectives as ours  # binds two collectives at import: wrapped there too

    own = {n: getattr(ours, n) for n in ("_all_gather_single", "_reduce_scatter_single")}
    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    for n, fn in own.items():
        setattr(ours, n, wrap(n.strip("_"), fn))
    try:
        yield tally
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        for n, fn in own.items():
            setattr(ours, n, fn)


_MESHES: Dict[str, Any] = {}


def _mesh(topology: str, replicate: int, device: torch.device):
    """The column's mesh, built once per run of the script (every column reuses its communicators)."""
    from torch.distributed.device_mesh import init_device_mesh

    if topology not in _MESHES:
        world = dist.get_world_size()
        _MESHES[topology] = (init_device_mesh(device.type, (world,)) if topology == "flat" else
                             init_device_mesh(device.type, (replicate, world // replicate),
                                              mesh_dim_names=("replicate", "shard")))
    return _MESHES[topology]


def _build(engine: str, topology: str, args: argparse.Namespace, cfg: GPTConfig, device: torch.device):
    """(model to call, optimizer, final-parameter reader, padded gradient numel per shard group rank)."""
    torch.manual_seed(0)
    gpt = GPT(cfg).to(device)
    mesh = _mesh(topology, args.replicate, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if engine == "megatron_fsdp":
        from megatron_fsdp import fully_shard

        model = fully_shard(gpt, mesh=mesh, fsdp_unit_modules=[TransformerBlock], compute_dtype=dtype,
                            fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        shard_numel = sum(u.layout.shard_numel for u in model.all_units() if u.grad_numel)
        return model, opt, lambda: {k: v.float().cpu() for k, v in model.full_state_dict().items()}, shard_numel
    from fsdp_cudagraph import keep_unsharded_storage
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    gpt = gpt.to(dtype)
    shard_fsdp2(gpt, list(gpt.layers), mesh=mesh)
    keep_unsharded_storage(gpt)
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-3)
    shard_numel = sum(p.to_local().numel() for p in gpt.parameters())
    return gpt, opt, lambda: {n: p.full_tensor().float().cpu() for n, p in gpt.named_parameters()}, shard_numel


def run(engine: str, topology: str, args: argparse.Namespace, cfg: GPTConfig, device: torch.device, *,
        graphed: bool) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    if device.type == "cuda":  # every run starts as a fresh user process would: on the default stream
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(torch.cuda.default_stream())
    model, opt, final, shard_numel = _build(engine, topology, args, cfg, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    graphs = None
    if graphed:
        backend = "torch" if device.type == "cuda" else "protocol"
        extra = dict(use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True) \
            if engine == "megatron_fsdp" else {}
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[],
                                                          cuda_graph_warmup_steps=3, **extra), backend=backend)
    per = args.micro_batch
    data = []
    for s in range(args.steps):
        x, y = synthetic_batch(s, per * world, cfg, device)
        data.append((x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]))
    losses, times, tally = [], [], None
    reps = dist.get_process_group_ranks
    mesh_groups: Dict[str, List[int]] = {}
    if topology == "hsdp":  # replicate first: on a (W, 1) mesh it is the world
        mesh = _mesh(topology, args.replicate, device)
        mesh_groups.update(replicate=reps(mesh.get_group(0)), shard=reps(mesh.get_group(1)))
    mesh_groups["world"] = list(range(world))
    for s, (x, y) in enumerate(data):
        if graphs is not None and s == 3:
            graphs.capture()
        count = not graphed and s == 1
        ctx = counting(mesh_groups) if count else contextlib.nullcontext()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx as t:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if count:
            tally = t
        losses.append(loss.detach().float().cpu())
    if graphs is not None:
        graphs.delete()
    out = {"losses": losses, "params": final(), "step_ms": statistics.median(times[args.skip:]) if
           len(times) > args.skip else None, "shard_numel": shard_numel}
    if tally is not None:
        out["bytes_per_step"] = tally
    return out


def expected_bytes(topology: str, cfg: GPTConfig, args: argparse.Namespace, numel: int, shard_numel: int,
                   engine: str, device: torch.device) -> Dict[str, Any]:
    """What one step should move, from the parameter sizes (see the module docstring)."""
    world = dist.get_world_size()
    compute = 2 if device.type == "cuda" else 4
    grad = 4 if engine == "megatron_fsdp" else compute  # ours reduces fp32 main gradients; FSDP2 in param dtype
    if topology == "flat":
        # An estimate, not checked: shard_numel x world elements gathered twice (forward, backward; a unit whose
        # slot still holds it at its backward gathers once) and reduced once, all across the slow dim
        slow = {"all_gather": 2 * shard_numel * world * compute, "reduce_scatter": shard_numel * world * grad}
        return {"slow_group": "world", "slow_issued": slow, "slow_wire_per_rank": None,
                "from_parameters_unpadded": {"all_gather": 2 * numel * compute, "reduce_scatter": numel * grad}}
    r = args.replicate
    return {"slow_group": "replicate", "slow_issued": {"all_reduce": shard_numel * grad},
            "slow_wire_per_rank": shard_numel * grad * 2 * (r - 1) / r,
            "from_parameters_unpadded": {"all_reduce": numel * grad // (world // r)}}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicate", type=int, default=2, help="R of the HSDP column's (R, W/R) mesh")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=6)
    p.add_argument("--align", action="store_true", help="also train with partial graphs and compare bit for bit")
    p.add_argument("--cpu-smoke", action="store_true", help="Gloo on CPU, a tiny model, protocol backend")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.hidden, args.layers, args.seq_len, args.micro_batch, args.steps, args.skip = 32, 2, 8, 2, 5, 4
    if args.align:  # the compared runs use deterministic kernels (SDPA's math kernel), as engines_align does
        from fsdp_cudagraph.apps.train import use_deterministic_kernels

        use_deterministic_kernels()
    device = _common.init_process_group(cuda=not args.cpu_smoke, default_port=29531)
    world = dist.get_world_size()
    if world % args.replicate:
        raise SystemExit(f"--replicate {args.replicate} does not divide the world size {world}")
    cfg = GPTConfig(vocab_size=512 if not args.cpu_smoke else 64, hidden_size=args.hidden,
                    num_layers=args.layers, num_heads=max(2, args.hidden // 64), seq_len=args.seq_len)
    numel = sum(q.numel() for q in GPT(cfg).parameters())
    rank = dist.get_rank()
    columns, ok = [], True
    for engine in args.engines:
        for topology in TOPOLOGIES:
            eager = run(engine, topology, args, cfg, device, graphed=False)
            exp = expected_bytes(topology, cfg, args, numel, eager["shard_numel"], engine, device)
            counted = eager.get("bytes_per_step", {}).get(exp["slow_group"], {})
            if topology == "flat":  # the ring's share of what was issued (the estimate above counts every gather)
                exp["slow_wire_per_rank"] = sum(counted.values()) * (world - 1) / world
            col = {"engine": engine, "topology": topology,
                   "mesh": [world] if topology == "flat" else [args.replicate, world // args.replicate],
                   "step_ms": eager["step_ms"], "bytes_per_step_by_group": eager.get("bytes_per_step"),
                   "slow_dim": exp, "slow_counted": counted}
            if topology == "hsdp":  # exact: one all-reduce of each unit's padded shard of the gradients
                col["count_matches"] = counted == exp["slow_issued"]
                ok &= col["count_matches"]
            if args.align:
                graphed = run(engine, topology, args, cfg, device, graphed=True)
                same = ([torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])]
                        + [torch.equal(eager["params"][k], graphed["params"][k]) for k in eager["params"]])
                flag = torch.tensor([int(all(same))], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                col.update(graphed_equal=bool(flag.item()), graphed_step_ms=graphed["step_ms"])
                ok &= col["graphed_equal"]
            columns.append(col)
            if rank == 0:
                print(f"{engine:>13} {topology:>4} mesh {col['mesh']}: step {col['step_ms']:.2f} ms, slow dim "
                      f"({exp['slow_group']}) issued {sum(counted.values()) / 2**20:.2f} MiB/step "
                      f"(expected {sum(exp['slow_issued'].values()) / 2**20:.2f}"
                      + {True: ", match", False: ", MISMATCH", None: ""}[col.get("count_matches")]
                      + f"), ring wire per rank "
                      f"{exp['slow_wire_per_rank'] / 2**20:.2f} MiB"
                      + (f"; graphed {'equal' if col.get('graphed_equal') else 'MISMATCH'}" if args.align else ""),
                      flush=True)
    if rank == 0 and args.out:
        write_record(args.out, {**_common.record_fields(), "config": {**vars(args), "num_parameters": numel},
                                "columns": columns, "ok": ok})
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.apps.train import exit_process

    exit_process(main())
