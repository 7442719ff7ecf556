"""Unmodified HuggingFace causal LMs under megatron_fsdp: eager vs partial CUDA graphs, bit-exact, with timings.

For each family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``; ``attn_implementation="sdpa"``, random weights
from a small config, no download), FSDP units = the decoder-layer class, ZeRO-3 with double buffer, bf16
compute, Adam, a default-stream training loop: one eager run, then graphed runs for each backend (``te``
when TransformerEngine is installed, ``torch``) and scope (whole layers, ``model.layers.*.self_attn``,
``model.layers.*.mlp``). Each graphed row records: losses equal per step (``torch.equal``, every rank),
final parameters equal, eager and graphed step times (CUDA events, median after warmup), and how many
calls replayed or ran eagerly. Then the alignment checker (``fsdp_cudagraph.check_alignment``) runs on a
passing model, on a perturbed callable (``perturb=``, a synthetic fault) and on a model with Python state in
a layer's forward (a real graph-vs-eager divergence: the graph bakes the state at capture), and its reports
are printed and stored.

Run (1 GPU, then 2 GPUs)::

    python benchmarks/hf_models.py --out hf-1gpu.json
    torchrun --nproc-per-node 2 benchmarks/hf_models.py --out hf-2gpu.json

Exit status 1 if a graphed row is not bit-identical or a checker verdict is not the expected one.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

# Deterministic kernels in every run (see fsdp_cudagraph.apps.train.use_deterministic_kernels), set before CUDA/TE.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, check_alignment  # noqa: E402
from fsdp_cudagraph.apps import hf_models  # noqa: E402
from _common import init_process_group, record_fields  # noqa: E402
from fsdp_cudagraph.checker import records  # noqa: E402
from fsdp_cudagraph.checker.records import write_record  # noqa: E402
from fsdp_cudagraph.capture.te import HAS_TE  # noqa: E402
from fsdp_cudagraph.apps.train import use_deterministic_kernels  # noqa: E402
from megatron_fsdp import fully_shard  # noqa: E402

SCOPES = {"layers": [], "self_attn": ["model.layers.*.self_attn"], "mlp": ["model.layers.*.mlp"]}


def _shape(args: argparse.Namespace) -> hf_models.HFShape:
    return hf_models.HFShape(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                             num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                             seq_len=args.seq, micro_batch_size=args.mbs, attn_implementation=args.attn)


def train(family: str, shape: hf_models.HFShape, device: torch.device, *, steps: int, capture_step: int,
          backend: Optional[str], patterns: Optional[List[str]], seed: int = 1234) -> Dict[str, Any]:
    """One run; ``backend=None``: eager. The loop runs on the default stream, as a user's loop does."""
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    model, layer_cls = hf_models.build(family, shape, device)
    model = fully_shard(model, fsdp_unit_modules=[layer_cls], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    graphs = None
    if backend is not None:
        cfg = CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                              cuda_graph_module_patterns=list(patterns or []), cuda_graph_warmup_steps=capture_step,
                              use_megatron_fsdp=True, fsdp_double_buffer=True,
                              fsdp_db_use_persist_buf_on_alloc_fail=True)
        graphs = PartialCudaGraphs(model, cfg, backend=backend)  # before the first step (streams)
    torch.cuda.reset_peak_memory_stats(device)
    losses, events, report = [], [], None
    for step in range(steps):
        if graphs is not None and step == capture_step:
            report = graphs.capture()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = hf_models.loss(model, hf_models.batch(step, shape, device, seed=seed))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        events.append((start, end))
        losses.append(loss.detach().clone())
    torch.cuda.synchronize(device)
    ms = [s.elapsed_time(e) for s, e in events]
    calls = {}
    if graphs is not None:
        for name in report.callables:
            d = model.module.get_submodule(name).__dict__.get("forward")
            calls[name] = [d.replays, d.eager_calls]
    out = {"losses": losses, "step_ms": ms, "state": model.full_state_dict(), "report": report, "calls": calls,
           "peak_memory_bytes": torch.cuda.max_memory_allocated(device)}
    if graphs is not None:
        graphs.delete()
    del model, opt, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _everywhere(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _median_after(ms: List[float], skip: int) -> float:
    return statistics.median(ms[skip:]) if len(ms) > skip else float("nan")


def python_state_llama(device: torch.device) -> Any:
    """Checker factory: HF Llama whose layer-1 MLP scales its output by a Python counter's parity.

    Eagerly the factor alternates every call; a graph replays the factor of its capture. A model written
    this way is not graph-safe, and the checker must say so and name the callable holding it.
    """
    spec = hf_models.llama(device)
    mlp = spec.model.model.layers[1].mlp
    state = {"calls": 0}
    cls_forward = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        state["calls"] += 1
        return cls_forward(mlp, x) * (1.0 + 0.0625 * (state["calls"] % 2))

    mlp.forward = forward
    return spec


def run_checker(device: torch.device, backend: str, rank: int) -> List[Dict[str, Any]]:
    cases = [
        ("passing: llama, whole layers", hf_models.llama, dict(), True, None),
        ("passing: qwen2, mlp scope", hf_models.qwen2, dict(cuda_graph_module_patterns=["model.layers.*.mlp"]), True, None),
        ("perturbed callable model.layers.1 (synthetic)", hf_models.llama, dict(perturb="model.layers.1"), False,
         "model.layers.1"),
        ("python state in model.layers.1.mlp (real divergence), whole layers", python_state_llama, dict(), False,
         "model.layers.1"),
        ("python state in model.layers.1.mlp (real divergence), mlp scope", python_state_llama,
         dict(cuda_graph_module_patterns=["model.layers.*.mlp"]), False, "model.layers.1.mlp"),
    ]
    out = []
    for what, factory, kw, expect_equal, expect_culprit in cases:
        try:
            report = check_alignment(factory, backend=backend, compute_dtype=torch.bfloat16, device=device, **kw)
        except Exception as exc:  # noqa: BLE001 - reported as an unexpected case
            traceback.print_exc()
            out.append({"case": what, "backend": backend, "as_expected": False,
                        "error": f"{type(exc).__name__}: {str(exc)[:1000]}"})
            continue
        ok = report.equal == expect_equal and (expect_culprit is None or report.culprit == expect_culprit)
        if rank == 0:
            print(f"\n=== checker, backend {backend}: {what} -> {'as expected' if ok else 'UNEXPECTED'}")
            print(report.format(), flush=True)
        out.append({"case": what, "backend": backend, "expected_equal": expect_equal,
                    "expected_culprit": expect_culprit, "as_expected": ok, "report": report.to_dict(),
                    "text": report.format()})
    return out


def versions() -> Dict[str, Any]:
    """The suites' version record (torch, CUDA, NCCL, cuDNN, TE, device, commit), plus transformers'."""
    return {**records.versions(), "transformers": hf_models.TRANSFORMERS_VERSION}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["llama", "qwen2"], choices=sorted(hf_models.FAMILIES))
    p.add_argument("--backends", nargs="+", default=["te", "torch"], choices=["te", "torch"])
    p.add_argument("--scopes", nargs="+", default=list(SCOPES), choices=list(SCOPES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--skip", type=int, default=6, help="steps left out of the median step time")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch per rank")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--no-checker", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/hf_models.py needs a CUDA GPU; nothing to run here (CPU CI runs tests/test_hf*.py).")
        return 0
    if not hf_models.HAS_TRANSFORMERS:
        print(f"benchmarks/hf_models.py: {hf_models.TRANSFORMERS_REASON}")
        return 1
    use_deterministic_kernels()
    device = init_process_group(cuda=True, default_port=29533)
    rank, world = dist.get_rank(), dist.get_world_size()
    backends = [b for b in args.backends if b != "te" or HAS_TE]
    shape = _shape(args)
    t0 = time.time()
    rows: List[Dict[str, Any]] = []
    determinism: Dict[str, bool] = {}
    for family in args.families:
        eager = train(family, shape, device, steps=args.steps, capture_step=args.capture_step, backend=None, patterns=None)
        e_ms = _median_after(eager["step_ms"], args.skip)
        # Control: two eager runs must agree bit for bit, or a graphed mismatch could be the kernels' own
        # nondeterminism (e.g. atomics in an attention backward) rather than the graphs.
        again = train(family, shape, device, steps=args.steps, capture_step=args.capture_step, backend=None,
                      patterns=None)
        determinism[family] = _everywhere(all(torch.equal(a, b) for a, b in zip(eager["losses"], again["losses"]))
                                          and all(torch.equal(eager["state"][k], again["state"][k])
                                                  for k in eager["state"]), device)
        del again
        if rank == 0:
            print(f"{family}: eager run repeated {'bit-identically' if determinism[family] else 'WITH DIFFERENCES'}",
                  flush=True)
        for backend in backends:
            for scope in args.scopes:
                try:
                    g = train(family, shape, device, steps=args.steps, capture_step=args.capture_step,
                              backend=backend, patterns=SCOPES[scope])
                except Exception as exc:  # noqa: BLE001 - a row that raises is a failed row, reported with the rest
                    traceback.print_exc()
                    rows.append({"family": family, "backend": backend, "scope": scope, "equal": False,
                                 "error": f"{type(exc).__name__}: {str(exc)[:1000]}"})
                    if rank == 0:
                        print(f"{family:7s} {backend:5s} {scope:10s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                per_step = [torch.equal(a, b) for a, b in zip(eager["losses"], g["losses"])]
                params = all(torch.equal(eager["state"][k], g["state"][k]) for k in eager["state"])
                equal = _everywhere(all(per_step) and params, device)
                g_ms = _median_after(g["step_ms"], args.skip)
                row = {"family": family, "backend": backend, "scope": scope, "patterns": SCOPES[scope],
                       "equal": equal, "losses_equal_per_step": per_step, "params_equal": params,
                       "eager_losses": [float(x) for x in eager["losses"]],
                       "graphed_losses": [float(x) for x in g["losses"]],
                       "eager_step_ms_median": e_ms, "graphed_step_ms_median": g_ms,
                       "speedup": e_ms / g_ms if g_ms == g_ms and g_ms > 0 else None,
                       "eager_peak_memory_bytes": eager["peak_memory_bytes"],
                       "graphed_peak_memory_bytes": g["peak_memory_bytes"],
                       "callables": g["report"].callables, "capture_seconds": g["report"].capture_seconds,
                       "graph_memory_bytes": g["report"].graph_memory_bytes,
                       "unknown_hooks": g["report"].unknown_hooks, "calls_replayed_eager": g["calls"]}
                rows.append(row)
                if rank == 0:
                    print(f"{family:7s} {backend:5s} {scope:10s} {'EQUAL' if equal else 'MISMATCH':8s} "
                          f"eager {e_ms:7.2f} ms  graphed {g_ms:7.2f} ms  ({row['speedup'] or float('nan'):.2f}x)  "
                          f"capture {row['capture_seconds']:.2f} s  calls {g['calls']}", flush=True)
        del eager
    checker: List[Dict[str, Any]] = []
    if not args.no_checker:
        for backend in backends:
            checker += run_checker(device, backend, rank)
    ok = all(r["equal"] for r in rows) and all(c["as_expected"] for c in checker) and all(determinism.values())
    if rank == 0:
        print(f"\n{len(rows)} rows, {sum(r['equal'] for r in rows)} bit-identical; checker cases as expected: "
              f"{sum(c['as_expected'] for c in checker)}/{len(checker)}; world {world}; {time.time() - t0:.0f} s")
        if args.out:
            write_record(args.out, {**record_fields(), "versions": versions(), "shape": vars(shape),
                                    "steps": args.steps, "capture_step": args.capture_step, "skip": args.skip,
                                    "dtype": "bf16", "eager_repeat_equal": determinism, "rows": rows,
                                    "checker": checker, "all_ok": ok})
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(main())
