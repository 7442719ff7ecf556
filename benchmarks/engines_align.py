"""Partial CUDA graphs under the FSDP engines users run: eager vs graphed, bit for bit, and step times.

For each engine (``--engines``) and backend (``--backends``): the reference GPT (TE layers for the te backend,
plain torch layers for the torch backend; seq 100, not a multiple of 128) trained on the default CUDA stream
for ``--steps`` steps, eagerly and with per-layer graphs captured at step 3 (scope ``--scope``: whole layers
by default), same seeds. Every step's loss and every final parameter must be ``torch.equal``. Negative
controls: the engine's unsafe setting is refused when PartialCudaGraphs is built; a parameter moved after
capture is refused before the replay. Step times (median after ``--skip``) of eager vs graphed, side by
side in one run; for FSDP2 also FSDP2 captured whole the torchtitan way (``_fsdp2_graph.py``).

Engines: ``fsdp2`` (torch.distributed.fsdp.fully_shard per layer and root, keep_unsharded_storage; bf16
parameters: the adapter refuses FSDP2 mixed precision that casts in hooks), ``megatron_fsdp`` (ours, bf16
compute, ZeRO-3 with double buffering). Run (1 GPU)::

    python benchmarks/engines_align.py --out engines-align.json

Exit status 1 if a row is not bit-equal or a control is not caught.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _model(engine: str, use_te: bool, seq: int, keep: bool = True):
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    from fsdp_cudagraph.apps.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=seq, use_te=use_te)
    gpt = GPT(cfg).to(device)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from fsdp_cudagraph.engines.fsdp2 import keep_unsharded_storage

        gpt = gpt.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        for layer in gpt.layers:
            fully_shard(layer)
        fully_shard(gpt)
        if keep:
            keep_unsharded_storage(gpt)
        return gpt, cfg, list(gpt.parameters())
    from megatron_fsdp import fully_shard

    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16 if device.type == "cuda" else None, fsdp_double_buffer=keep,
                        fsdp_db_use_persist_buf_on_alloc_fail=keep)
    return model, cfg, model.optimizer_parameters()


def _full_params(engine: str, model) -> Dict[str, Any]:
    if engine == "fsdp2":
        return {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
    return {k: v.float().cpu() for k, v in model.full_state_dict().items()}


def run(engine: str, backend: str, args: argparse.Namespace, *, mode: str) -> Dict[str, Any]:
    """``mode``: eager, graphed, moved (graphed, a parameter moved after capture) or whole (FSDP2 captured whole)."""
    import torch
    import torch.distributed as dist

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, match_graph_attention
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(torch.cuda.default_stream())  # as a fresh user process starts
    model, cfg, params = _model(engine, backend == "te", args.seq_len)
    opt = torch.optim.Adam(params, lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, 2 * world, cfg, device)
        data.append((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
    config = CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                             cuda_graph_modules=args.scope, cuda_graph_warmup_steps=3,
                             use_megatron_fsdp=engine == "megatron_fsdp", fsdp_double_buffer=True,
                             fsdp_db_use_persist_buf_on_alloc_fail=True)
    graphs = matcher = whole = None
    if mode in ("graphed", "moved"):
        graphs = PartialCudaGraphs(model, config, backend=backend if cuda else "protocol")
    else:
        matcher = match_graph_attention(model, config)
    if mode == "whole":
        from _fsdp2_graph import Fsdp2GraphStep

        def fwd_bwd(x, y):
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        whole = Fsdp2GraphStep(fwd_bwd, warmup=3, device=torch.device("cuda"))
    losses: List[Any] = []
    times: List[float] = []
    error: Optional[str] = None
    for step, (x, y) in enumerate(data):
        if graphs is not None and step == 3:
            graphs.capture()
            if mode == "moved":
                from fsdp_cudagraph.engines import adapter_for

                _, t = adapter_for(model).replay_tensors(model.layers[1] if engine == "fsdp2" else
                                                          model.module.layers[1])[0]
                t.data = t.data.clone()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (0, 0)
        if cuda:
            start.record()
        try:
            if whole is not None:
                losses.append(whole(x, y))
            else:
                loss = loss_fn(model(x), y)
                loss.backward()
                losses.append(loss.detach())
        except RuntimeError as exc:
            error = str(exc)
            break
        opt.step()
        opt.zero_grad(set_to_none=whole is None)
        if cuda:
            end.record()
            times.append((start, end))
    if cuda:
        torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times]
    out = {"losses": [l.float().cpu() for l in losses], "error": error,
           "step_ms": statistics.median(ms[args.skip:]) if len(ms) > args.skip else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
    if error is None:
        out["params"] = _full_params(engine, model)
    if graphs is not None:
        out["callables"] = len(graphs.report.callables) if graphs.report else 0
        if error is None:
            graphs.delete()
    if matcher is not None:
        matcher.uninstall()
    return out


def unsafe(engine: str, backend: str, args: argparse.Namespace) -> Optional[str]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    import torch

    model, _, _ = _model(engine, backend == "te", args.seq_len, keep=False)
    try:
        PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                                                 cuda_graph_modules=args.scope),
                          backend=backend if torch.cuda.is_available() else "protocol")
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["fsdp2", "megatron_fsdp"], choices=["fsdp2", "megatron_fsdp"])
    p.add_argument("--backends", nargs="+", default=["te", "torch"], choices=["te", "torch"])
    p.add_argument("--scope", nargs="*", default=[], help="cuda_graph_modules (default: whole layers)")
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=6)
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="on CPU: the same rows on Gloo with the protocol backend "
                   "(no graphs, no timings): checks this script, not the GPU")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("benchmarks/engines_align.py needs a CUDA GPU (CUDA graphs, NCCL); nothing to run on this machine")
        return 0
    import torch.distributed as dist

    from fsdp_cudagraph.apps.align import versions, write_record
    from fsdp_cudagraph.apps.train import init_distributed, use_deterministic_kernels
    from fsdp_cudagraph.runtime.te import HAS_TE

    use_deterministic_kernels()
    init_distributed(default_port=29533)
    rows, ok = [], True
    for engine in args.engines:
        for backend in args.backends:
            if backend == "te" and (not HAS_TE or not torch.cuda.is_available()):
                rows.append({"engine": engine, "backend": backend, "skipped": "TransformerEngine not installed"})
                continue
            eager = run(engine, backend, args, mode="eager")
            graphed = run(engine, backend, args, mode="graphed")
            moved = run(engine, backend, args, mode="moved")
            refused = unsafe(engine, backend, args)
            loss_eq = [torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])]
            equal = (graphed["error"] is None and len(loss_eq) == args.steps and all(loss_eq)
                     and all(torch.equal(eager["params"][k], graphed["params"][k]) for k in eager["params"]))
            row = {"engine": engine, "backend": backend, "equal": equal, "losses_equal": loss_eq,
                   "first_mismatch": next((i for i, e in enumerate(loss_eq) if not e), None),
                   "graphed_error": graphed["error"], "callables": graphed.get("callables"),
                   "eager_ms": eager["step_ms"], "graphed_ms": graphed["step_ms"],
                   "eager_peak_gib": eager["peak_gib"], "graphed_peak_gib": graphed["peak_gib"],
                   "moved_caught": moved["error"] is not None and "captured at" in moved["error"],
                   "moved_error": (moved["error"] or "")[:400], "unsafe_refused": refused is not None,
                   "unsafe_error": (refused or "")[:400]}
            if engine == "fsdp2" and torch.cuda.is_available():
                whole = run(engine, backend, args, mode="whole")
                row["whole_ms"], row["whole_error"] = whole["step_ms"], whole["error"]
            ok &= equal and row["moved_caught"] and row["unsafe_refused"]
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{engine:14s} {backend:5s} {'EQUAL' if equal else 'MISMATCH at ' + str(row['first_mismatch'])}"
                      f"  eager {row['eager_ms'] or float('nan'):.2f} ms  graphed {row['graphed_ms'] or float('nan'):.2f} ms"
                      + (f"  whole {row['whole_ms']:.2f} ms" if row.get("whole_ms") else "")
                      + f"  moved caught {row['moved_caught']}  unsafe refused {row['unsafe_refused']}", flush=True)
    if dist.get_rank() == 0:
        print(f"engines alignment: {'all bit-equal, controls caught' if ok else 'FAILED'}")
        if args.out:
            write_record(args.out, {"command": " ".join(sys.argv), "versions": versions(), "world_size":
                                    dist.get_world_size(), "steps": args.steps, "scope": args.scope,
                                    "seq_len": args.seq_len, "rows": rows, "all_ok": ok})
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
