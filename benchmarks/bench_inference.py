"""Inference CUDA graphs: evaluation step time and per-token decode latency, eager vs layer vs block, with the
bit-exactness checks, in one run.

Sections (each compares ``inference_cuda_graph_scope`` none / layer / block on the same model and data):
  eval      the reference GPT under megatron_fsdp (``--strategy``, bf16), ``InferenceCudaGraphs``: the median
            time of one evaluation forward at a batch that fills its bucket and at one that is padded; logits
            and loss against the eager forward (torch.equal): at the exact bucket against plain eager, and for
            the padded batch against eager on the padded batch (and, recorded only, against the unpadded one)
  decode    the same GPT unwrapped (bf16), ``GreedyGenerator`` with the static KV cache: per-token decode latency
            ((time of N new tokens - time of 1) / (N - 1)), prefill excluded; tokens and logits against eager
            decode steps (exact bucket: ``scope none``; padded batch: eager steps at the padded batch), and,
            recorded only, tokens against a decode without cache
  training  a small model trained with PartialCudaGraphs (torch backend) while InferenceCudaGraphs evaluates
            after the capture: training losses, final parameters and training-graph replays against the same
            run without evaluation (torch.equal), graphed against eager evaluation losses

Run (1 GPU, or 2 GPUs; ``--quick`` is the reduced run of tests/gpu/test_inference.py)::

    python benchmarks/bench_inference.py --out inference-1gpu.json
    python benchmarks/bench_inference.py --cpu-smoke      # the logic on CPU (Gloo, protocol backends), no graphs
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_inference.py --out inference-2gpu.json

Times come from CUDA events after ``--warmup`` calls, medians over ``--iters`` calls. Rank 0 writes the JSON
(device, versions, command, config, tables, checks, ``all_ok``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import _common  # noqa: F401 - first: the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph import CudaGraphConfig, InferenceCudaGraphs, PartialCudaGraphs  # noqa: E402
from fsdp_cudagraph.capture.buckets import Buckets, pad_to  # noqa: E402
from _common import cuda_time_ms, init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.apps.generate import GreedyGenerator, greedy_reference  # noqa: E402
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.apps.train import RunSpec, build_model, graph_config, use_deterministic_kernels  # noqa: E402

SCOPES = ("none", "layer", "block")


def _cfg(scope: str, **kw: Any) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope=scope, use_megatron_fsdp=True,
                           fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True, **kw)


def _time(fn: Callable[[], Any], warmup: int, iters: int, cuda: bool) -> List[float]:
    for _ in range(warmup):
        fn()
    if not cuda:  # --cpu-smoke: host time (the protocol backend has no graphs to time)
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    return cuda_time_ms(fn, warmup=0, iters=iters)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _tokens(cfg: GPTConfig, b: int, s: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s), generator=g).to(device)


# ---------------------------------------------------------------------------------------------- evaluation


def eval_section(args: argparse.Namespace, cfg: GPTConfig, device: torch.device) -> Dict[str, Any]:
    rank = dist.get_rank()
    model = build_model(RunSpec(model=cfg, sharding_strategy=args.strategy, compute_dtype=torch.bfloat16), device)
    model.eval()
    buckets = Buckets(args.buckets)
    sizes = {"exact": args.eval_batch, "padded": args.eval_batch - 3}
    if buckets.select(sizes["padded"]) == sizes["padded"] or sizes["padded"] < 1:
        raise ValueError(f"--eval-batch {args.eval_batch} - 3 must fall between two buckets of {args.buckets}")
    data = {k: synthetic_batch(7 + rank, b, cfg, device) for k, b in sizes.items()}
    rows, logits, losses, captures = [], {}, {}, {}
    cuda = device.type == "cuda"
    for scope in SCOPES:
        if cuda:
            torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        graphs = InferenceCudaGraphs(model, _cfg(scope), batch_buckets=buckets)
        for kind, (x, y) in data.items():
            with torch.no_grad():
                ms = _time(lambda: graphs(x), args.warmup, args.iters, cuda)
                out = graphs(x)
                losses[(scope, kind)] = loss_fn(out, y)
            logits[(scope, kind)] = out
            rows.append({"scope": scope, "batch": kind, "rows": x.shape[0], "ms_median": statistics.median(ms),
                         "ms_min": min(ms), "loss": losses[(scope, kind)].item()})
        captures[scope] = {"num_graphs": graphs.num_graphs, "capture_s": sum(c.seconds for c in graphs.captures),
                           "graph_memory_bytes": sum(c.graph_memory_bytes for c in graphs.captures)}
        graphs.delete()
        del out
        # what delete() did not give back, besides the logits and losses kept for the checks
        kept = sum(t.numel() * t.element_size() for k, t in list(logits.items()) + list(losses.items()) if k[0] == scope)
        captures[scope]["allocated_after_delete_bytes"] = (torch.cuda.memory_allocated() - mem0 - kept) if cuda else 0
    with torch.no_grad():
        x = data["padded"][0]
        padded_ref = model(pad_to(x, buckets.select(x.shape[0]), 0))[: x.shape[0]]
    checks = []
    for scope in ("layer", "block"):
        exact = (scope, "exact")
        checks.append({"check": f"eval {scope}: logits and loss at an exact bucket == eager",
                       "ok": torch.equal(logits[exact], logits[("none", "exact")])
                       and torch.equal(losses[exact], losses[("none", "exact")])})
        padded = (scope, "padded")
        checks.append({"check": f"eval {scope}: padded batch == eager on the padded batch",
                       "ok": torch.equal(logits[padded], padded_ref)})
        checks.append({"check": f"eval {scope}: padded batch == eager on the unpadded batch (recorded)", "ok": None,
                       "equal": torch.equal(logits[padded], logits[("none", "padded")]),
                       "max_abs_diff": _diff(logits[padded], logits[("none", "padded")])})
    return {"rows": rows, "captures": captures, "checks": checks}


# ---------------------------------------------------------------------------------------------- decode


def decode_section(args: argparse.Namespace, cfg: GPTConfig, device: torch.device) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    gpt = GPT(cfg).to(device=device, dtype=torch.bfloat16 if cuda else torch.float32).eval()
    max_len = args.prompt + args.new_tokens
    buckets = Buckets(args.buckets)
    prompts = {"exact": _tokens(cfg, args.decode_batch, args.prompt, 5, device),
               "padded": _tokens(cfg, args.decode_batch - 3, args.prompt, 6, device)}
    rows, out = [], {}
    for scope in SCOPES:
        gen = GreedyGenerator(gpt, _cfg(scope), max_batch=max(args.buckets), max_len=max_len, batch_buckets=buckets)
        for kind, p in prompts.items():
            out[(scope, kind)] = gen.generate(p, args.new_tokens, return_logits=True)  # also captures
            full = _time(lambda: gen.generate(p, args.new_tokens), 1, args.iters, cuda)
            prefill = _time(lambda: gen.generate(p, 1), 1, args.iters, cuda)
            per_token = (statistics.median(full) - statistics.median(prefill)) / (args.new_tokens - 1)
            rows.append({"scope": scope, "batch": kind, "rows": p.shape[0], "ms_per_token": per_token,
                         "prefill_ms": statistics.median(prefill), "generate_ms": statistics.median(full)})
        gen.delete()
    # eager decode steps at the padded batch: the protocol backend runs the same padded calls without graphs
    eager_padded = GreedyGenerator(gpt, _cfg("block"), max_batch=max(args.buckets), max_len=max_len,
                                   batch_buckets=buckets, backend="protocol")
    ref_padded = eager_padded.generate(prompts["padded"], args.new_tokens, return_logits=True)
    eager_padded.delete()
    checks = []
    for scope in ("layer", "block"):
        tok, lg = out[(scope, "exact")]
        etok, elg = out[("none", "exact")]
        checks.append({"check": f"decode {scope}: tokens and logits at an exact bucket == eager decode",
                       "ok": torch.equal(tok, etok) and torch.equal(lg, elg)})
        tok, lg = out[(scope, "padded")]
        checks.append({"check": f"decode {scope}: padded batch == eager decode steps on the padded batch",
                       "ok": torch.equal(tok, ref_padded[0]) and torch.equal(lg, ref_padded[1])})
        etok, elg = out[("none", "padded")]
        checks.append({"check": f"decode {scope}: padded batch tokens == eager unpadded decode (recorded)", "ok": None,
                       "equal": torch.equal(tok, etok), "logits_max_abs_diff": _diff(lg, elg)})
    ref_tok, ref_lg = greedy_reference(gpt, prompts["exact"], args.new_tokens, return_logits=True)
    tok, lg = out[("block", "exact")]
    same = (tok == ref_tok).all(dim=0)
    first = int((~same).nonzero()[0]) if not bool(same.all()) else None
    top2 = ref_lg.float().topk(2, dim=-1).values
    checks.append({"check": "decode: KV-cache tokens == decode without cache (recorded)", "ok": None,
                   "equal": bool(same.all()), "first_divergent_step": first,
                   "logits_max_abs_diff_before_divergence": _diff(lg[:, :first], ref_lg[:, :first]) if first != 0 else 0.0,
                   "min_top2_margin": (top2[..., 0] - top2[..., 1]).min().item()})
    return {"rows": rows, "checks": checks}


# ---------------------------------------------------------------------------------------------- training


def training_section(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    use_deterministic_kernels()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RunSpec(model=GPTConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, seq_len=64),
                   micro_batch_size=2, sharding_strategy=args.strategy, compute_dtype=torch.bfloat16,
                   backend="torch", capture_step=3)
    cuda = device.type == "cuda"
    runs = {}
    for scope in (None, "none", "layer", "block"):
        if cuda:  # each run starts on the default stream, as a user process would
            default = torch.cuda.default_stream(device)
            default.wait_stream(torch.cuda.current_stream(device))
            torch.cuda.set_stream(default)
        model = build_model(spec, device)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        graphs = PartialCudaGraphs(model, graph_config(spec), backend="torch" if cuda else "protocol")
        inference = None if scope is None else InferenceCudaGraphs(model, _cfg(scope), batch_buckets=Buckets([2, 4]))
        losses, evals = [], []
        for step in range(args.train_steps):
            if step == spec.capture_step:
                graphs.capture()
            x, y = synthetic_batch(step, 2 * world, spec.model, device)
            loss = loss_fn(model(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if inference is not None and step > spec.capture_step and step % 2 == 0:
                model.eval()
                with torch.no_grad():
                    for b in (4, 3):
                        xe, ye = synthetic_batch(1000 + step, b, spec.model, device)
                        # eager evaluates the padded batch the graphs compute (bit-exact by construction)
                        logits = inference(pad_to(xe, 4, 0))[:b] if scope == "none" else inference(xe)
                        evals.append(loss_fn(logits, ye))
                model.train()
        replays = [c.module.forward.replays for c in graphs.callables]
        runs[scope] = {"losses": torch.stack(losses), "evals": evals, "state": model.state_dict(), "replays": replays}
        graphs.delete()
        if inference is not None:
            inference.delete()
    torch.use_deterministic_algorithms(False)
    base = runs[None]
    checks = []
    for scope in ("none", "layer", "block"):
        r = runs[scope]
        checks.append({"check": f"training with {scope} evaluation == training without evaluation",
                       "ok": torch.equal(r["losses"], base["losses"]) and r["replays"] == base["replays"]
                       and all(torch.equal(r["state"][k], base["state"][k]) for k in base["state"]),
                       "replays": r["replays"]})
        if scope != "none":
            checks.append({"check": f"evaluation losses {scope} == eager (an exact bucket, and a padded batch)",
                           "ok": all(torch.equal(a, b) for a, b in zip(r["evals"], runs["none"]["evals"])),
                           "num_evals": len(r["evals"])})
    return {"checks": checks, "losses": base["losses"].tolist()}


# ---------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--strategy", default="optim_grads_params")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--sections", nargs="+", default=["eval", "decode", "training"], choices=["eval", "decode", "training"])
    p.add_argument("--quick", action="store_true", help="a small model and few iterations (the GPU test)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny run on CPU (Gloo, protocol backends, host timers): the script's logic, no graphs")
    p.add_argument("--out", default=None, help="JSON result path (rank 0 writes)")
    args = p.parse_args(argv)
    if args.quick or args.cpu_smoke:
        args.hidden, args.layers, args.heads, args.seq, args.vocab = 256, 2, 4, 128, 512
        args.prompt, args.new_tokens, args.warmup, args.iters, args.train_steps = 16, 8, 2, 5, 8
    if args.cpu_smoke:
        args.hidden, args.seq, args.vocab, args.iters = 32, 32, 64, 2
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench_inference needs a CUDA GPU (it times CUDA graphs; --cpu-smoke runs its logic on CPU); "
              "nothing to run here.")
        return 0
    device = init_process_group(cuda=not args.cpu_smoke, default_port=29514)
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                    seq_len=args.seq)
    result: Dict[str, Any] = {**record_fields(), "config": vars(args)}
    if "eval" in args.sections:
        result["eval"] = eval_section(args, cfg, device)
    if "decode" in args.sections:
        result["decode"] = decode_section(args, cfg, device)
    if "training" in args.sections:
        result["training"] = training_section(args, device)
    checks = [c for s in ("eval", "decode", "training") for c in result.get(s, {}).get("checks", [])]
    result["all_ok"] = all(c["ok"] is not False for c in checks)
    if rank == 0:
        for row in result.get("eval", {}).get("rows", []):
            print(f"eval   {row['scope']:5s} {row['batch']:6s} rows {row['rows']:3d}: {row['ms_median']:8.3f} ms "
                  f"(min {row['ms_min']:.3f})  loss {row['loss']:.6f}")
        for row in result.get("decode", {}).get("rows", []):
            print(f"decode {row['scope']:5s} {row['batch']:6s} rows {row['rows']:3d}: {row['ms_per_token']:8.3f} ms/token "
                  f"(prefill {row['prefill_ms']:.3f} ms)")
        for c in checks:
            verdict = {True: "OK", False: "FAILED", None: "recorded"}[c["ok"]]
            extra = {k: v for k, v in c.items() if k not in ("check", "ok")}
            print(f"{verdict:8s} {c['check']} {extra if extra else ''}")
        print("all_ok:", result["all_ok"])
        if args.out:
            write_record(args.out, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
