"""FP8 against bf16 over a long run: each recipe's loss curve beside bf16's, on the same data, and their gap.

    python benchmarks/fp8_numerics.py --out fp8-numerics.json                          # 1 GPU, TE: 300 steps
    torchrun --nproc-per-node 2 benchmarks/fp8_numerics.py --out fp8-numerics-2gpu.json
    python benchmarks/fp8_numerics.py --cpu-smoke --out smoke.json                     # CPU: bf16 only, a few steps
    python benchmarks/tools/plot.py fp8-numerics.json --outdir benchmarks/results      # the curves as a PNG

The question is whether FP8 trains like bf16, not whether it matches it bit for bit (graphed FP8 runs are compared
with eager FP8 bit for bit elsewhere: apps/align.py --rows FP8). So the data must be learnable: a fixed random
first-order Markov chain over the vocabulary in which every token has ``--successors`` K possible next tokens, each
equally likely (:func:`markov_table`). A model that learns the chain reaches the chain's entropy rate, at most
ln K (ln 4 = 1.39 by default), from ln V at the start (ln 4096 = 8.32): a model that does not train stays near
ln V, and one that trains differently under FP8 shows as a gap between the curves.

Runs (one process, one after the other, the same seed, model, data and optimizer): bf16 (TE layers, no FP8), then
each recipe of ``--recipes`` under :class:`fsdp_cudagraph.FP8Recipe` (TE's autocast around each forward), all under
``megatron_fsdp`` (``optim_grads_params``, bf16 compute, fp32 main weights, Adam). ``--scope attn mlp`` runs each
one with per-layer graphs (TE's graph maker) instead of eagerly. A recipe named ``<recipe>+attention`` (e.g.
``delayed+attention``) runs attention in FP8 too (``FP8Recipe(..., dot_product_attention=True)``).

The gap ([Note: the FP8 loss gap]): for each recipe, the mean of its last ``--tail`` losses against bf16's, relative;
the goal is at most 1% (GOAL_GAP). Each step's loss is the mean over ranks (each rank trains its slice of the
step's global batch). The JSON has every curve, the gaps and verdicts, ln V and ln K.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import _common  # noqa: F401  (the import path)
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPTConfig, loss_fn

#: The issue's goal: FP8's loss within 1% of bf16's after the run.
GOAL_GAP = 0.01

# [Note: the FP8 loss gap]
# Single losses jump from step to step (a new batch each step), so the last loss alone would judge the noise, not
# the recipe. The mean over the last ``tail`` steps (default 20) of each curve is compared, relative to bf16's:
# |mean(fp8) - mean(bf16)| / mean(bf16). Both runs see the same batches in the same order, so the batch-to-batch
# part of the noise is shared and mostly cancels in the difference.


def markov_table(vocab_size: int, successors: int, seed: int) -> torch.Tensor:
    """``[V, K]``: the K possible next tokens of each token (drawn once from ``seed``; repeats allowed, which only
    lowers the chain's entropy below ln K)."""
    if successors < 1 or successors > vocab_size:
        raise ValueError(f"successors={successors}: must be in 1..vocab_size ({vocab_size})")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (vocab_size, successors), generator=g)


def markov_batch(table: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len + 1]`` tokens of the chain for ``step``: a uniform first token, then each next one one of
    the previous token's successors, uniformly (the same on every rank; each rank takes its rows)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    vocab, k = table.shape
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
    pick = torch.randint(0, k, (batch_size, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], pick[:, t]]
    return tokens


def loss_gap(fp8: Sequence[float], bf16: Sequence[float], tail: int) -> float:
    """The relative gap of the last ``tail`` losses' means ([Note: the FP8 loss gap])."""
    if len(fp8) != len(bf16) or len(bf16) < tail or tail < 1:
        raise ValueError(f"loss_gap: curves of {len(fp8)} and {len(bf16)} steps, tail {tail}: need equal lengths "
                         "of at least tail >= 1 steps")
    a, b = sum(fp8[-tail:]) / tail, sum(bf16[-tail:]) / tail
    return abs(a - b) / b


def parse_run(name: str) -> tuple:
    """``delayed`` -> ("delayed", False); ``delayed+attention`` -> ("delayed", True); anything else raises."""
    recipe, _, extra = name.partition("+")
    if extra not in ("", "attention"):
        raise ValueError(f"run {name!r}: a recipe (delayed, current, block), optionally '+attention'")
    return recipe, extra == "attention"


def train_curve(cfg: GPTConfig, fp8: Any, *, steps: int, micro_batch_size: int, table: torch.Tensor,
                lr: float, seed: int, device: torch.device, scope: Optional[List[str]], backend: str) -> List[float]:
    """One run (``fp8``: its ``FP8Recipe``, or None for bf16); the step losses (mean over ranks)."""
    from fsdp_cudagraph import PartialCudaGraphs
    from fsdp_cudagraph.apps.train import RunSpec, build_model, graph_config, make_adam

    spec = RunSpec(model=cfg, steps=steps, micro_batch_size=micro_batch_size, cuda_graph_modules=scope,
                   backend=backend, lr=lr, seed=seed)
    model = build_model(spec, device)
    opt = make_adam(model.optimizer_parameters(), "adam_fused" if device.type == "cuda" else "adam", lr=lr)
    graphs = (PartialCudaGraphs(model, graph_config(spec), backend=backend, fp8=fp8)
              if scope is not None else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * micro_batch_size, (rank + 1) * micro_batch_size
    losses = []
    for step in range(steps):
        if graphs is not None and step == spec.capture_step:
            graphs.capture()
        data = markov_batch(table, step, micro_batch_size * world, cfg.seq_len, seed)[lo:hi].to(device)
        x, y = data[:, :-1], data[:, 1:]
        with fp8.autocast() if fp8 is not None else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)
    if graphs is not None:
        graphs.delete()
    return (curve / world).tolist()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", nargs="+", default=["delayed", "current", "block"])
    p.add_argument("--scope", nargs="*", default=None, help="per-layer graphs of this scope (e.g. attn mlp); "
                   "default: eager")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4: head dimension 128, the Llama "
                   "shapes', where TE runs FP8 attention; 8 until 2026-11-29)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--successors", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tail", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, Gloo: the bf16 curve of a tiny model for a few "
                   "steps (the data, loop and record; FP8 needs TE on a GPU)")
    args = p.parse_args(argv)
    try:
        parsed = {r: parse_run(r) for r in args.recipes}
    except ValueError as exc:
        p.error(str(exc))
    if args.cpu_smoke:
        args.steps, args.hidden, args.layers, args.heads, args.seq, args.vocab = 6, 32, 2, 2, 16, 64
        args.recipes, parsed = [], {}
        args.micro_batch_size, args.tail = 2, 3
    elif not torch.cuda.is_available():
        raise SystemExit("fp8_numerics.py: FP8 runs on a CUDA GPU with TransformerEngine (Hopper or newer for block "
                         "scaling); this machine has none. --cpu-smoke runs the bf16 path on the CPU")
    device = _common.init_process_group(cuda=not args.cpu_smoke, default_port=29567)
    use_te = not args.cpu_smoke
    if use_te:
        from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON

        if not HAS_TE:
            raise SystemExit(f"fp8_numerics.py: {TE_REASON}")
    cfg = GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                    seq_len=args.seq, use_te=use_te)
    table = markov_table(args.vocab, args.successors, args.seed)
    backend = "te" if use_te else "protocol"
    from fsdp_cudagraph import FP8Recipe

    runs: Dict[str, Any] = {"bf16": None}  # run name -> its FP8Recipe (None: bf16)
    skipped = {}  # a recipe this machine cannot run, with the library's refusal (the other runs go on)
    for r, (name, attention) in parsed.items():
        try:
            fp8 = FP8Recipe(name, dot_product_attention=attention)
            fp8.check_runtime()
            runs[r] = fp8
        except (RuntimeError, ImportError, ValueError) as exc:
            skipped[r] = str(exc)
            if dist.get_rank() == 0:
                print(f"{r:18s} skipped: {exc}", flush=True)
    args.recipes = [r for r in args.recipes if r not in skipped]
    curves: Dict[str, List[float]] = {}
    for name, fp8 in runs.items():
        run_cfg = GPTConfig(**{**cfg.__dict__, "fp8": fp8.name if fp8 is not None else None})
        curves[name] = train_curve(run_cfg, fp8, steps=args.steps, micro_batch_size=args.micro_batch_size,
                                   table=table, lr=args.lr, seed=args.seed, device=device, scope=args.scope,
                                   backend=backend)
        if dist.get_rank() == 0:
            c = curves[name]
            print(f"{name:18s} loss {c[0]:.4f} -> {c[-1]:.4f} (mean of the last {args.tail}: "
                  f"{sum(c[-args.tail:]) / args.tail:.4f})", flush=True)
    gaps = {r: loss_gap(curves[r], curves["bf16"], args.tail) for r in args.recipes}
    bf16_end = sum(curves["bf16"][-args.tail:]) / args.tail
    learned = bf16_end < 0.5 * math.log(args.vocab)
    result = {"config": {**vars(args), "model": cfg.__dict__, "world_size": dist.get_world_size()},
              "ln_vocab": math.log(args.vocab), "ln_successors": math.log(args.successors), "curves": curves,
              "gaps": gaps, "goal_gap": GOAL_GAP, "bf16_learned": learned, "skipped": skipped,
              "verdicts": {r: "PASS" if g <= GOAL_GAP and learned else "FAIL" for r, g in gaps.items()}}
    if dist.get_rank() == 0:
        from fsdp_cudagraph.checker.records import write_record

        write_record(args.out, {**_common.record_fields(), **result})
        print(f"bf16 learned the chain: {learned} (last {args.tail} mean {bf16_end:.3f}; "
              f"ln V {math.log(args.vocab):.3f}, ln K {math.log(args.successors):.3f})")
        for r, g in gaps.items():
            print(f"{r:18s} gap {100 * g:.3f}% (goal <= {100 * GOAL_GAP:.0f}%): {result['verdicts'][r]}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
