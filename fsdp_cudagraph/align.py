"""Bit-exact loss alignment: eager ``megatron_fsdp`` against partial CUDA graphs, across scopes and GPUs.

For every row of the matrix the same model, data and seeds train twice, eagerly and with graphs captured
before step ``--capture-step``, on a side stream; every step's loss and the final parameters must be
equal under ``torch.equal`` (atol = rtol = 0) on every rank. Negative controls show the comparison can
fail: a run with double buffering off is refused by validation, a hook left on a captured module is
refused, a parameter moved after capture is caught before replay, and a one-token data perturbation is
reported as a mismatch.

Run (1 GPU, then 2 GPUs)::

    python -m fsdp_cudagraph.align --out align-1gpu.json
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.align --out align-2gpu.json

``--quick`` runs a reduced matrix; ``--backends torch`` skips TE. Exit status 1 if any row mismatches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

# Deterministic kernels: TE's fused attention may pick non-deterministic backward algorithms otherwise,
# and eager-vs-graph bit equality needs both runs to compute the same thing. Set before TE is imported.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch
import torch.distributed as dist

from ._te import HAS_TE, TE_REASON, TE_VERSION
from .model import GPTConfig
from .train import RunSpec, run_training

logger = logging.getLogger(__name__)

SCOPES: List[List[str]] = [
    ["attn"],
    ["attn", "moe_router", "moe_preprocess"],
    ["moe_router"],
    ["mlp"],
    ["attn", "mlp"],
    [],
]
STRATEGIES = ["optim_grads_params", "optim_grads"]


def model_config(backend: str) -> GPTConfig:
    return GPTConfig(
        vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=128, moe_every=2, num_experts=4,
        moe_top_k=2, use_te=(backend == "te"),
    )


def _equal_everywhere(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def compare(eager: Any, graphed: Any, device: torch.device) -> Dict[str, Any]:
    loss_eq = [torch.equal(a, b) for a, b in zip(eager.losses, graphed.losses)]
    param_eq = all(torch.equal(eager.final_state[k], graphed.final_state[k]) for k in eager.final_state)
    ok = _equal_everywhere(all(loss_eq) and param_eq, device)
    first_bad = next((i for i, e in enumerate(loss_eq) if not e), None)
    return {
        "equal": ok,
        "losses_equal_per_step": loss_eq,
        "params_equal": param_eq,
        "first_mismatch_step": first_bad,
        "eager_losses": [float(x) for x in eager.losses],
        "graphed_losses": [float(x) for x in graphed.losses],
        "eager_step_ms_median": sorted(eager.step_ms[5:])[len(eager.step_ms[5:]) // 2] if len(eager.step_ms) > 5 else None,
        "graphed_step_ms_median": sorted(graphed.step_ms[5:])[len(graphed.step_ms[5:]) // 2] if len(graphed.step_ms) > 5 else None,
        "capture_seconds": graphed.capture.capture_seconds if graphed.capture else None,
        "graphed_callables": len(graphed.capture.callables) if graphed.capture else 0,
    }


def run_row(*, scope: List[str], strategy: str, backend: str, grad_accum: int, steps: int, capture_step: int,
            device: torch.device, perturb_step: Optional[int] = None) -> Dict[str, Any]:
    spec = RunSpec(model=model_config(backend), steps=steps, sharding_strategy=strategy, backend=backend,
                   grad_accum=grad_accum, capture_step=capture_step)
    eager = run_training(spec, device)
    graphed_spec = RunSpec(**{**spec.__dict__, "cuda_graph_modules": scope, "perturb_step": perturb_step})
    graphed = run_training(graphed_spec, device)
    row = {"scope": scope, "strategy": strategy, "backend": backend, "grad_accum": grad_accum}
    row.update(compare(eager, graphed, device))
    return row


def negative_controls(device: torch.device, backend: str) -> List[Dict[str, Any]]:
    """Runs that must fail, each with how it failed."""
    from . import _capture, _hooks
    from .config import CudaGraphConfig
    from .train import build_model, graph_config

    out: List[Dict[str, Any]] = []

    def expect(name: str, fn: Any, exc: type) -> None:
        try:
            fn()
            out.append({"control": name, "caught": False, "detail": "no error"})
        except exc as e:  # noqa: PERF203
            out.append({"control": name, "caught": True, "detail": f"{type(e).__name__}: {str(e)[:300]}"})

    # 1. Double buffering off: refused by validation before anything runs.
    expect("double buffer off", lambda: CudaGraphConfig(
        cuda_graph_impl="transformer_engine", use_megatron_fsdp=True, fsdp_double_buffer=False,
        fsdp_db_use_persist_buf_on_alloc_fail=False), ValueError)

    # 2. One FSDP hook left on a captured module: the graph maker refuses it.
    real_extract = _hooks.extract_hooks

    def leaky_extract(module: torch.nn.Module) -> Any:
        kept = dict(module._forward_pre_hooks)
        ex = real_extract(module)
        first = next(iter(kept.items()), None)
        if first is not None:
            module._forward_pre_hooks[first[0]] = first[1]
            ex.saved["_forward_pre_hooks"].pop(first[0])
        return ex

    def leaky_capture() -> None:
        _capture.extract_hooks = leaky_extract
        try:
            run_training(RunSpec(model=model_config(backend), steps=5, backend=backend, cuda_graph_modules=[]), device)
        finally:
            _capture.extract_hooks = real_extract

    expect("FSDP hook left in the graph", leaky_capture, (RuntimeError, AssertionError))

    # 3. A parameter moved after capture: the pre-replay address check stops the step.
    def moved_param() -> None:
        spec = RunSpec(model=model_config(backend), steps=2, backend=backend, cuda_graph_modules=["attn"], capture_step=1)
        model = build_model(spec, device)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        graphs = _capture.PartialCudaGraphs(model, graph_config(spec), backend=backend)
        from .model import loss_fn, synthetic_batch
        x, y = synthetic_batch(0, 2, spec.model, device)
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        graphs.capture()
        p = next(model.units[0].module.attn.parameters())
        p.data = p.data.clone()
        try:
            loss_fn(model(x), y).backward()
        finally:
            model.reset_step_state()
            graphs.delete()

    expect("parameter moved after capture", moved_param, RuntimeError)

    # 4. One token changed in one step of the graphed run: the comparison must report it.
    row = run_row(scope=["attn"], strategy="optim_grads_params", backend=backend, grad_accum=1, steps=8,
                  capture_step=3, device=device, perturb_step=5)
    out.append({"control": "one token perturbed at step 5", "caught": not row["equal"],
                "detail": f"first mismatch at step {row['first_mismatch_step']}"})
    return out


def versions() -> Dict[str, Any]:
    commit = os.environ.get("GIT_COMMIT")  # a copy of the tree without .git (e.g. a GPU machine) passes it in
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - a tarball has no git
            commit = "unknown"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "te": str(TE_VERSION) if HAS_TE else f"absent ({TE_REASON})",
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit,
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["te", "torch"], choices=["te", "torch"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="two scopes, one strategy")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--out", default=None, help="JSON result path (rank 0 writes)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fsdp_cudagraph.align needs a CUDA GPU (graphs are captured on CUDA); nothing to run here.")
        return 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    device = torch.device("cuda", local)
    rank, world = dist.get_rank(), dist.get_world_size()
    backends = [b for b in args.backends if b != "te" or HAS_TE]
    skipped = [] if len(backends) == len(args.backends) else [f"te: {TE_REASON}"]
    scopes = SCOPES[:2] if args.quick else SCOPES
    strategies = STRATEGIES[:1] if args.quick else STRATEGIES
    rows: List[Dict[str, Any]] = []
    cases = list(itertools.product(backends, strategies, scopes))
    cases += [(b, "optim_grads_params", ["attn", "mlp"], 2) for b in backends]  # gradient accumulation
    t0 = time.time()
    for i, case in enumerate(cases):
        backend, strategy, scope = case[:3]
        accum = case[3] if len(case) > 3 else 1
        row = run_row(scope=scope, strategy=strategy, backend=backend, grad_accum=accum, steps=args.steps,
                      capture_step=args.capture_step, device=device)
        rows.append(row)
        if rank == 0:
            print(f"[{i + 1}/{len(cases)}] {backend:5s} {strategy:18s} accum={accum} scope={scope!s:40s} "
                  f"{'EQUAL' if row['equal'] else 'MISMATCH at step ' + str(row['first_mismatch_step'])}  "
                  f"eager {row['eager_step_ms_median']:.2f} ms  graphed {row['graphed_step_ms_median']:.2f} ms",
                  flush=True)
    controls = [] if args.no_controls else [c for b in backends for c in negative_controls(device, b)]
    ok = all(r["equal"] for r in rows) and all(c["caught"] for c in controls)
    if rank == 0:
        for c in controls:
            print(f"control: {c['control']:35s} {'caught' if c['caught'] else 'NOT CAUGHT'}  {c['detail'][:120]}")
        print(f"{len(rows)} rows, {sum(r['equal'] for r in rows)} equal; controls caught "
              f"{sum(c['caught'] for c in controls)}/{len(controls)}; {time.time() - t0:.0f} s; world {world}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "world_size": world, "versions": versions(),
                           "steps": args.steps, "capture_step": args.capture_step, "skipped": skipped,
                           "rows": rows, "controls": controls, "all_ok": ok}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
