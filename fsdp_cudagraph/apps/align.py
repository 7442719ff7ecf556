"""Bit-exact loss alignment: eager ``megatron_fsdp`` against partial CUDA graphs, across scopes and GPUs.

For every row of the matrix the same model, data and seeds train twice, eagerly and with graphs captured
before step ``--capture-step``, both from a plain loop on the default CUDA stream (the README's loop); every
step's loss, the final parameters and what user hooks saw must be equal under ``torch.equal``
(atol = rtol = 0) on every rank. The rows cover what users run: sequence lengths that are and are not
multiples of 128 (64, 100, 128, 512), head dims 32/64/128, TE's own ``TransformerLayer`` as the unit
(sequence-first), plain-torch layers under the TE backend, all four sharding strategies, gradient
accumulation, user forward hooks and full backward hooks on graphed modules, tuple outputs with tensor
keyword arguments, and a dropless MoE (``apps/moe.py``): Megatron's scopes ``attn moe_router moe_preprocess``
with the experts eager between graphs (``split``, whose ``counts.tolist()`` syncs, and ``grouped_mm``), the
whole ``moe`` block and whole layers with ``grouped_mm`` experts (bf16, no sync), and ``moe`` with
drop-and-pad ``capacity`` experts; with TE, FP8 training (``--rows FP8``): delayed, current and block scaling, per
layer (``attn mlp``) and whole layers, delayed scaling with quantized weights cached across two micro-batches
and with TE's own layer (every micro-batch's forward inside the run's ``FP8Recipe.autocast()``, eager and
graphed alike: docs/fp8.md). The eager run uses
``match_graph_attention`` for the row's scope (TE attention picks the backend a graph would; see
``capture/attention.py``).

Negative controls show the comparison can fail: double buffering off is refused by validation, a hook left
on a captured module is refused, a parameter moved after capture is caught before replay, a one-token data
perturbation is reported as a mismatch, an eager baseline that keeps TE's eager attention backend mismatches
where TE picks another one under capture, ``attention_backend='error'`` refuses such a capture, (torch <
2.13) graphs built after eager steps on the default stream are refused at capture with the fix, and with FP8:
delayed-scaling state reset after capture (what a graph maker that did not restore it would leave) is reported
as a mismatch, and a cached FP8 weight dropped after capture is caught before the replay.

Run (1 GPU, then 2 GPUs)::

    python -m fsdp_cudagraph.apps.align --out align-1gpu.json
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.align --out align-2gpu.json

``--quick`` runs a reduced matrix; ``--backends torch`` skips TE; ``--rows MoE`` runs only the rows whose
description contains ``MoE``; ``--rows FP8`` only the FP8 rows, with the FP8 controls only (TE backend). Exit
status 1 if any row mismatches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

# Deterministic kernels: eager-vs-graph bit equality needs both runs to compute the same thing. TE's fused
# attention may otherwise pick non-deterministic backward algorithms (set before TE is imported), and
# PyTorch's flash SDPA backward accumulates dQ with atomics past one key block (seq 512 differed between two
# eager runs on an H100 before this); deterministic mode makes it use its deterministic path. cuBLAS needs a
# fixed workspace in that mode (set before CUDA starts).
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPTConfig
from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.apps.train import (RunSpec, add_optimizer_argument, init_distributed, run_training, states_equal,
                                       use_deterministic_kernels)
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON
from fsdp_cudagraph.checker.records import versions, write_record  # noqa: F401 - re-exported for the suites and benchmarks

logger = logging.getLogger(__name__)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
ZERO3 = "optim_grads_params"


def model_config(backend: str, *, seq_len: int = 100, num_heads: int = 4, unit: str = "block",
                 use_te: Optional[bool] = None, rich_calls: bool = False, fuse_wgrad: bool = False,
                 moe_experts: str = "dense", moe_grouped_mm_dtype: str = "input", fp8: Optional[str] = None) -> GPTConfig:
    """The matrix's model: 4 layers, hidden 256 (head dim 256 / num_heads), every second layer MoE (the dense
    toy unless ``moe_experts`` picks a dropless path, see ``apps/moe.py``)."""
    use_te = (backend == "te") if use_te is None else use_te
    return GPTConfig(
        vocab_size=1024, hidden_size=256, num_layers=4, num_heads=num_heads, seq_len=seq_len,
        moe_every=0 if unit == "te_layer" else 2, num_experts=4, moe_top_k=2, use_te=use_te, unit=unit,
        rich_calls=rich_calls, fuse_wgrad=fuse_wgrad, moe_experts=moe_experts,
        moe_grouped_mm_dtype=moe_grouped_mm_dtype, fp8=fp8,
    )


#: Dropless MoE rows ([Note: capturability of the experts] in ``apps/moe.py``): Megatron's scopes with the
#: experts eager between graphs (``split``: a host sync there; ``grouped_mm``: none), and the whole ``moe``
#: block and whole layers graphed with ``grouped_mm`` (bf16 experts: torch's only no-sync CUDA kernel).
MEGATRON_MOE_SCOPE = ["attn", "moe_router", "moe_preprocess"]
SPLIT = dict(moe_experts="split")
GROUPED = dict(moe_experts="grouped_mm", moe_grouped_mm_dtype="bfloat16")


def moe_rows(row: Any, *, quick: bool) -> None:
    row(MEGATRON_MOE_SCOPE, "dropless MoE, split experts eager between graphs", **SPLIT)
    if quick:
        return
    row(MEGATRON_MOE_SCOPE, "dropless MoE, grouped_mm experts eager between graphs", **GROUPED)
    row(["moe"], "dropless MoE, whole moe block graphed (grouped_mm)", **GROUPED)
    row([], "dropless MoE, whole layers graphed (grouped_mm)", **GROUPED)
    row(["moe"], "drop-and-pad MoE (capacity factor 1), whole moe block graphed", moe_experts="capacity")
    row(MEGATRON_MOE_SCOPE, "dropless MoE, split experts, gradient accumulation 2", grad_accum=2, **SPLIT)
    if HAS_TE:  # Megatron's TEGroupedMLP: GroupedLinear with m_splits=counts.tolist(), eager between graphs
        row(MEGATRON_MOE_SCOPE, "dropless MoE, TE GroupedLinear experts eager between graphs", moe_experts="te_grouped")


def block_scaling_supported() -> bool:
    """Whether this machine runs TE's FP8 block scaling (compute capability 9.0, CUDA 12.9): the block rows need it."""
    try:
        _fp8.check_fp8_runtime("block")
    except RuntimeError:
        return False
    return True


def fp8_attention_refusal() -> Optional[str]:
    """Why this machine cannot run FP8 attention with delayed scaling and deterministic kernels (None: it can):
    the GPU, and the cuDNN TE loaded ([Note: FP8 attention] in capture/fp8.py). The FP8 attention rows need it."""
    try:
        _fp8.FP8Recipe("delayed", dot_product_attention=True).check_runtime()
    except (RuntimeError, ImportError) as exc:
        return str(exc)
    return None


#: [Note: FP8 rows] Sequence 128 (TE's FP8 GEMMs need tokens and widths in multiples of 16); MEGATRON's per-layer
#: scopes (attention, MLP) and whole layers. The cached-weight rows run last: TE's one weight-update flag
#: ([Note: TE's one weight flag] in capture/fp8.py).
FP8_SEQ = 128


def fp8_rows(row: Any, *, quick: bool) -> None:
    row(["attn", "mlp"], "FP8 delayed scaling", seq_len=FP8_SEQ, fp8="delayed")
    if quick:
        return
    row([], "FP8 delayed scaling", seq_len=FP8_SEQ, fp8="delayed")
    row(["attn", "mlp"], "FP8 delayed scaling, gradient accumulation 2", grad_accum=2, seq_len=FP8_SEQ, fp8="delayed")
    row([], "FP8 delayed scaling, TE TransformerLayer units", seq_len=FP8_SEQ, unit="te_layer", use_te=True,
        fp8="delayed")
    for recipe in ("current", "block"):
        if recipe == "block" and not block_scaling_supported():
            continue
        row(["attn", "mlp"], f"FP8 {recipe} scaling", seq_len=FP8_SEQ, fp8=recipe)
        row([], f"FP8 {recipe} scaling", seq_len=FP8_SEQ, fp8=recipe)
    row(["attn", "mlp"], "FP8 delayed scaling, cached weights, gradient accumulation 2", grad_accum=2, fp8_cache=True,
        seq_len=FP8_SEQ, fp8="delayed")
    row([], "FP8 current scaling, cached weights, gradient accumulation 2", grad_accum=2, fp8_cache=True,
        seq_len=FP8_SEQ, fp8="current")
    if fp8_attention_refusal() is None:  # head dim 128, as the Llama shapes (num_heads 2 of hidden 256)
        row(["attn", "mlp"], "FP8 delayed scaling, FP8 attention", seq_len=FP8_SEQ, num_heads=2, fp8="delayed",
            fp8_attention=True)
        row([], "FP8 delayed scaling, FP8 attention, gradient accumulation 2", grad_accum=2, seq_len=FP8_SEQ,
            num_heads=2, fp8="delayed", fp8_attention=True)


def matrix(backend: str, *, quick: bool) -> List[Dict[str, Any]]:
    """The rows for one backend: each a dict of run_row keyword arguments plus ``model`` kwargs."""
    rows: List[Dict[str, Any]] = []

    def row(scope: List[str], what: str, strategy: str = ZERO3, grad_accum: int = 1, user_hooks: bool = False,
            reduce_dtype: Optional[torch.dtype] = None, fp8_cache: bool = False, fp8_attention: bool = False,
            **model: Any) -> None:
        rows.append(dict(scope=scope, what=what, strategy=strategy, grad_accum=grad_accum, user_hooks=user_hooks,
                         model=model, **({"reduce_dtype": reduce_dtype} if reduce_dtype else {}),
                         **({"fp8_cache": True} if fp8_cache else {}),
                         **({"fp8_attention": True} if fp8_attention else {})))

    seqs = (100,) if quick else (64, 100, 128, 512)
    for seq in seqs:
        for scope in ([], ["attn"]):
            row(scope, f"seq {seq}", seq_len=seq)
    fused = dict(fuse_wgrad=True, use_te=True)  # TE writes weight gradients into the engine's buffer
    if quick:
        row(["attn", "mlp"], "tuple outputs, tensor kwargs", rich_calls=True)
        row(["attn"], "user hooks", user_hooks=True)
        moe_rows(row, quick=True)
        if HAS_TE:
            row([], "fused wgrad", **fused)
        if backend == "te":
            fp8_rows(row, quick=True)
        return rows
    row(["attn"], "head dim 32", num_heads=8)
    row(["attn"], "head dim 128", num_heads=2)
    for strategy in STRATEGIES:
        row(["attn", "mlp"], f"strategy {strategy}", strategy=strategy)
    for scope in (["attn", "moe_router", "moe_preprocess"], ["moe_router"], ["mlp"]):
        row(scope, "scope")
    moe_rows(row, quick=False)
    row(["attn", "mlp"], "gradient accumulation 2", grad_accum=2)
    row(["attn", "mlp"], "reduce in bf16, gradient accumulation 2", grad_accum=2, reduce_dtype=torch.bfloat16)
    if HAS_TE:
        for seq in (100, 128):
            row([], f"TE TransformerLayer units, seq {seq}", seq_len=seq, unit="te_layer", use_te=True)
    if HAS_TE:
        # [Note: fused weight gradients]: whole layers, submodules (the MLP eager beside a graphed attention in
        # one unit), every strategy, accumulation, TE's own layer
        row([], "fused wgrad", **fused)
        row(["attn", "mlp"], "fused wgrad", **fused)
        row(["attn"], "fused wgrad, MLP eager", **fused)
        row(["attn", "mlp"], "fused wgrad, gradient accumulation 2", grad_accum=2, **fused)
        row(["attn", "mlp"], "fused wgrad, reduce in bf16", grad_accum=2, reduce_dtype=torch.bfloat16, **fused)
        for strategy in STRATEGIES[:3]:
            row([], f"fused wgrad, strategy {strategy}", strategy=strategy, **fused)
        row([], "fused wgrad, TE TransformerLayer units", unit="te_layer", **fused)
    if backend == "te":
        row([], "plain-torch layers", use_te=False)
        row(["attn"], "plain-torch layers", use_te=False)
    row(["attn"], "user forward + full backward hooks", user_hooks=True)
    row([], "user forward + full backward hooks", user_hooks=True)
    row(["attn", "mlp"], "tuple outputs, tensor kwargs", rich_calls=True)
    row([], "tuple outputs, tensor kwargs", rich_calls=True)
    if backend == "te":
        fp8_rows(row, quick=False)
    return rows


def _equal_everywhere(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _hooks_equal(eager: Any, graphed: Any) -> Optional[bool]:
    """Whether user hooks saw the same values eagerly and around replays (None: no hooks in this row)."""
    if eager.hook_values is None:
        return None
    if eager.hook_values.keys() != graphed.hook_values.keys():
        return False
    for k, a in eager.hook_values.items():
        b = graphed.hook_values[k]
        if not a or len(a) != len(b) or not torch.equal(torch.stack(a), torch.stack(b)):
            return False
    return True


def compare(eager: Any, graphed: Any, device: torch.device) -> Dict[str, Any]:
    loss_eq = [torch.equal(a, b) for a, b in zip(eager.losses, graphed.losses)]
    param_eq = states_equal(eager.final_state, graphed.final_state)  # FP8 scaling state included
    hooks_eq = _hooks_equal(eager, graphed)
    ok = _equal_everywhere(all(loss_eq) and param_eq and hooks_eq is not False, device)
    first_bad = next((i for i, e in enumerate(loss_eq) if not e), None)
    return {
        "equal": ok,
        "losses_equal_per_step": loss_eq,
        "params_equal": param_eq,
        "user_hooks_equal": hooks_eq,
        "num_hook_values": sum(len(v) for v in (graphed.hook_values or {}).values()),
        "attention_backends": graphed.capture.attention_backends if graphed.capture else {},
        "first_mismatch_step": first_bad,
        "eager_losses": [float(x) for x in eager.losses],
        "graphed_losses": [float(x) for x in graphed.losses],
        "eager_step_ms_median": sorted(eager.step_ms[5:])[len(eager.step_ms[5:]) // 2] if len(eager.step_ms) > 5 else None,
        "graphed_step_ms_median": sorted(graphed.step_ms[5:])[len(graphed.step_ms[5:]) // 2] if len(graphed.step_ms) > 5 else None,
        "capture_seconds": graphed.capture.capture_seconds if graphed.capture else None,
        "graphed_callables": len(graphed.capture.callables) if graphed.capture else 0,
    }


def run_row(*, scope: List[str], strategy: str, backend: str, grad_accum: int, steps: int, capture_step: int,
            device: torch.device, perturb_step: Optional[int] = None, what: str = "", user_hooks: bool = False,
            model: Optional[Dict[str, Any]] = None, eager_matches_graph_attention: bool = True,
            spec_overrides: Optional[Dict[str, Any]] = None, reduce_dtype: Optional[torch.dtype] = None,
            fp8_cache: bool = False, fp8_attention: bool = False,
            after_capture: Optional[Any] = None) -> Dict[str, Any]:
    model = dict(model or {})
    spec = RunSpec(model=model_config(backend, **model), steps=steps, sharding_strategy=strategy, backend=backend,
                   grad_accum=grad_accum, capture_step=capture_step, user_hooks=user_hooks, reduce_dtype=reduce_dtype,
                   fp8_cache_quantized_params=fp8_cache, fp8_dot_product_attention=fp8_attention,
                   attention_as_graphed=scope if eager_matches_graph_attention else None, **(spec_overrides or {}))
    eager = run_training(spec, device)
    graphed_spec = RunSpec(**{**spec.__dict__, "cuda_graph_modules": scope, "perturb_step": perturb_step,
                              "attention_as_graphed": None, "after_capture": after_capture})
    graphed = run_training(graphed_spec, device)
    row = {"what": what, "scope": scope, "strategy": strategy, "backend": backend, "grad_accum": grad_accum,
           "reduce_dtype": str(reduce_dtype) if reduce_dtype else None, "fp8_cache_quantized_params": fp8_cache,
           "fp8_dot_product_attention": fp8_attention,
           "model": {k: v for k, v in dataclasses.asdict(spec.model).items() if k != "ffn_hidden_size"}}
    row.update(compare(eager, graphed, device))
    return row


def _first_attention(model: Any) -> Any:
    """Layer 0's attention module of a sharded reference GPT (the FP8 controls change its state)."""
    return model.units[0].module.attn


def reset_scaling_after_capture(model: Any) -> None:
    """What a graph maker that did not restore the scaling state its warmup changed would leave: layer 0's
    attention back to scale 1 and an empty amax history (TE's ``reset_fp8_meta_tensors``, in place)."""
    if not _fp8.reset_scaling_state(_first_attention(model)):
        raise RuntimeError("no TE module with delayed-scaling state in layer 0's attention")


def drop_quantized_weights_after_capture(model: Any) -> None:
    """Layer 0's attention drops its cached FP8 weights after capture (TE clears ``_fp8_workspaces`` on a recipe
    change): the graphs would keep writing and reading the old copies."""
    spaces = [m._fp8_workspaces for m in _first_attention(model).modules() if getattr(m, "_fp8_workspaces", None)]
    if not spaces:
        raise RuntimeError("no cached FP8 weight in layer 0's attention after capture")
    for ws in spaces:
        ws.clear()


def fp8_controls(device: torch.device, expect: Any) -> List[Dict[str, Any]]:
    """The FP8 controls (TE backend): a lost scaling state is a mismatch, a moved cached weight an error."""
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch
    from fsdp_cudagraph.apps.train import build_model, fp8_recipe, graph_config
    from fsdp_cudagraph.graphs.partial import PartialCudaGraphs

    out: List[Dict[str, Any]] = []
    row = run_row(scope=["attn", "mlp"], strategy=ZERO3, backend="te", grad_accum=1, steps=8, capture_step=3,
                  device=device, model={"seq_len": FP8_SEQ, "fp8": "delayed"},
                  after_capture=reset_scaling_after_capture)
    out.append({"control": "FP8 scaling state not restored", "caught": not row["equal"],
                "detail": f"first mismatch at step {row['first_mismatch_step']}" if not row["equal"] else
                row.get("error", "all steps equal")})

    def weight_moved() -> None:  # as "parameter moved after capture", with FP8 weights cached over 2 micro-batches
        spec = RunSpec(model=model_config("te", seq_len=FP8_SEQ, fp8="delayed"), steps=3, backend="te",
                       cuda_graph_modules=["attn", "mlp"], capture_step=1, fp8_cache_quantized_params=True)
        model = build_model(spec, device)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        fp8 = fp8_recipe(spec)
        graphs = PartialCudaGraphs(model, graph_config(spec), backend="te", fp8=fp8)

        def step(n: int) -> None:
            for mb in range(2):
                x, y = synthetic_batch(2 * n + mb, 2, spec.model, device)
                with fp8.autocast(first_microbatch=mb == 0):
                    loss = loss_fn(model(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()

        try:
            step(0)
            graphs.capture()
            step(1)  # replays
            drop_quantized_weights_after_capture(model)
            step(2)
        finally:
            model.reset_step_state()
            graphs.delete()

    expect("FP8 quantized weight moved", weight_moved, RuntimeError, ["quantized weight"])
    return out


def negative_controls(device: torch.device, backend: str, *, fp8_only: bool = False) -> List[Dict[str, Any]]:
    """Runs that must fail, each with how it failed (``fp8_only``: the FP8 ones, TE backend)."""
    from fsdp_cudagraph.graphs import partial as _capture
    from fsdp_cudagraph import hooks as _hooks
    from fsdp_cudagraph.config import CudaGraphConfig
    from fsdp_cudagraph.apps.train import build_model, graph_config

    out: List[Dict[str, Any]] = []

    def expect(name: str, fn: Any, exc: Any, must: Sequence[str] = ()) -> None:
        try:
            fn()
            out.append({"control": name, "caught": False, "detail": "no error"})
        except exc as e:  # noqa: PERF203
            text = f"{type(e).__name__}: {e}"
            out.append({"control": name, "caught": all(m in text for m in must), "detail": text[:300]})

    if fp8_only:
        return out + (fp8_controls(device, expect) if backend == "te" and HAS_TE else [])

    # 1. Double buffering off: refused by validation before anything runs.
    expect("double buffer off", lambda: CudaGraphConfig(
        cuda_graph_impl="transformer_engine", use_megatron_fsdp=True, fsdp_double_buffer=False,
        fsdp_db_use_persist_buf_on_alloc_fail=False), ValueError)

    # 2. One FSDP hook left on a captured module: the graph maker refuses it.
    real_extract = _hooks.extract_hooks

    def leaky_extract(module: torch.nn.Module, **kwargs: Any) -> Any:
        kept = dict(module._forward_pre_hooks)
        ex = real_extract(module, **kwargs)
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
        from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch
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

    # 5./6. Where TE attention picks another backend under capture (seq 100 is not a multiple of 128): an
    # eager baseline that keeps TE's eager choice must mismatch, and attention_backend='error' must refuse.
    if backend == "te":
        row = run_row(scope=["attn"], strategy=ZERO3, backend=backend, grad_accum=1, steps=6, capture_step=3,
                      device=device, eager_matches_graph_attention=False)
        differs = any(s["eager"] != s["graph"] for s in row["attention_backends"].values())
        if differs:
            out.append({"control": "eager baseline keeps TE's eager attention", "caught": not row["equal"],
                        "detail": f"first mismatch at step {row['first_mismatch_step']}; {row['attention_backends']}"})
            expect("attention_backend='error' with a backend change", lambda: run_training(RunSpec(
                model=model_config(backend), steps=5, backend=backend, cuda_graph_modules=["attn"],
                attention_backend="error"), device), RuntimeError)
        else:
            out.append({"control": "attention backend change under capture", "caught": None,
                        "detail": f"not applicable here: TE picks the same backend eagerly and under capture "
                                  f"({row['attention_backends']}); the eager baseline matched: {row['equal']}"})

    # 7. Graphs built after eager steps on the default stream: refused at capture on torch < 2.13.
    if not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
        expect("graphs built after 2 default-stream steps", lambda: run_training(RunSpec(
            model=model_config(backend), steps=5, backend=backend, cuda_graph_modules=[], build_graphs_step=2,
            capture_step=3), device), RuntimeError)
    # 8./9. FP8 (TE): scaling state lost after capture, a cached FP8 weight dropped after capture.
    if backend == "te":
        out += fp8_controls(device, expect)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["te", "torch"], choices=["te", "torch"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a reduced matrix (seq 100, two scopes, tuple outputs, hooks)")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--rows", default=None, metavar="TEXT",
                   help="run only the rows whose description contains TEXT (e.g. 'MoE'), from the full or quick matrix; "
                        "'FP8': the FP8 training rows (TE backend: delayed, current, block scaling, per layer and "
                        "whole layers, cached weights) and only the FP8 controls")
    p.add_argument("--no-clone-param-grads", action="store_true",
                   help="TE backend: clone_param_grads_on_return=False (less work per replay)")
    add_optimizer_argument(p)
    p.add_argument("--out", default=None, help="JSON result path (rank 0 writes)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fsdp_cudagraph.apps.align needs a CUDA GPU (graphs are captured on CUDA); nothing to run here.")
        return 0
    use_deterministic_kernels()
    device = init_distributed(default_port=29512)
    rank, world = dist.get_rank(), dist.get_world_size()
    backends = [b for b in args.backends if b != "te" or HAS_TE]
    skipped = [] if len(backends) == len(args.backends) else [f"te: {TE_REASON}"]
    rows: List[Dict[str, Any]] = []
    cases = [(b, case) for b in backends for case in matrix(b, quick=args.quick)
             if args.rows is None or args.rows in case["what"]]
    if not cases:
        raise SystemExit(f"--rows {args.rows!r} matches no row of the {'quick' if args.quick else 'full'} matrix")
    t0 = time.time()
    for i, (backend, case) in enumerate(cases):
        try:
            row = run_row(backend=backend, steps=args.steps, capture_step=args.capture_step, device=device,
                          spec_overrides={"clone_param_grads": not args.no_clone_param_grads,
                                          "optimizer": args.optimizer}, **case)
        except Exception as exc:  # noqa: BLE001 - a row that raises is a failed row, reported with the rest
            logger.exception("row %s failed", case)
            row = {**{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in case.items() if k != "model"},
                   "backend": backend, "equal": False,
                   "error": f"{type(exc).__name__}: {str(exc)[:500]}", "first_mismatch_step": None,
                   "eager_step_ms_median": float("nan"), "graphed_step_ms_median": float("nan")}
        rows.append(row)
        if rank == 0:
            verdict = "EQUAL" if row["equal"] else row.get("error") or f"MISMATCH at step {row['first_mismatch_step']}"
            print(f"[{i + 1}/{len(cases)}] {backend:5s} {row['strategy']:18s} accum={row['grad_accum']} "
                  f"{case['what']:34s} scope={case['scope']!s:36s} {verdict[:200]}  "
                  f"eager {row['eager_step_ms_median']:.2f} ms  graphed {row['graphed_step_ms_median']:.2f} ms",
                  flush=True)
    fp8_only = args.rows is not None and "FP8" in args.rows
    controls = [] if args.no_controls else [c for b in backends for c in negative_controls(device, b, fp8_only=fp8_only)]
    ok = all(r["equal"] for r in rows) and all(c["caught"] is not False for c in controls)
    if rank == 0:
        for c in controls:
            verdict = {True: "caught", False: "NOT CAUGHT", None: "n/a"}[c["caught"]]
            print(f"control: {c['control']:42s} {verdict:10s}  {c['detail'][:160]}")
        print(f"{len(rows)} rows, {sum(r['equal'] for r in rows)} equal; controls caught "
              f"{sum(c['caught'] is True for c in controls)}/{sum(c['caught'] is not None for c in controls)}; "
              f"{time.time() - t0:.0f} s; world {world}")
        if args.out:
            write_record(args.out, {"command": " ".join(sys.argv), "world_size": world, "versions": versions(),
                                    "steps": args.steps, "capture_step": args.capture_step, "skipped": skipped,
                                    "clone_param_grads": not args.no_clone_param_grads, "optimizer": args.optimizer,
                                    "rows": rows, "controls": controls, "all_ok": ok})
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.apps.train import exit_process

    exit_process(main())
