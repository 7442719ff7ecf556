"""Bit-exact alignment of full-iteration CUDA graphs against eager ``megatron_fsdp`` training.

Every row trains the same model on the same data twice, on the default CUDA stream: with the plain engine
loop (eager) and through :class:`~fsdp_cudagraph.FullIterationCudaGraph` (eager warmup steps, capture
before ``--capture-step``, replays after). Each step's micro-batch losses and the final parameters must be
``torch.equal`` on every rank, and so must the main gradients of the warmup steps, the capture and the first
replay (Adam's first update is a sign, so a loss only differs a step after the gradient that caused it; the
row names both steps). Rows: every strategy, the plain-torch GPT and (with TE) the TE GPT, one
and two micro-batches, each with the eager Adam and with the optimizer graph (capturable Adam with a
device-tensor learning rate in both runs of the row); then a shape change mid-run (an eager fallback), an
evaluation graph between steps, ``delete()`` mid-run, and clipping (``model.clip_grad_norm_``) inside the
optimizer graph, whose returned norms must be equal too; and a dropless MoE whose experts run
``grouped_mm`` in bf16 (no host sync: permute, grouped GEMMs and unpermute inside the step's graph); with TE,
FP8 training with current and block scaling (each micro-batch's forward inside ``FP8Recipe.autocast()``, in
the captured step too: the recipes keep no state between steps; docs/fp8.md).
Negative controls must be caught: a perturbed token, ``.item()`` in the step, a host sync that only happens under capture (torch's sync debug mode), a CPU
tensor in the step, ZeRO-3 without double buffering, a strict shape change, and with TE FP8 delayed scaling in a
whole-step graph (refused: its gradient scales are updated on the host, which a replay skips).

Run (1 GPU, then 2 GPUs; each well under 4 minutes on an H100)::

    python -m fsdp_cudagraph.apps.full_iteration_align --out fi-align-1gpu.json
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.apps.full_iteration_align --out fi-align-2gpu.json

``--quick`` runs two strategies of the torch model; ``--models torch`` skips TE; ``--moe-only`` runs only the
MoE rows; ``--fp8-only`` only the FP8 rows and the FP8 control. Exit status 1 if a row mismatches or a control is not caught. :func:`run_full` is also the training loop of the benchmarks.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# Deterministic kernels in both runs of a row (see train.use_deterministic_kernels): TE's attention reads this
# when it selects a backend; cuBLAS reads its workspace setting when CUDA starts.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from megatron_fsdp import fully_shard

from fsdp_cudagraph.apps.align import versions, write_record
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn
from fsdp_cudagraph.apps.train import (add_optimizer_argument, init_distributed, make_adam, rank_batches, states_equal,
                                       use_deterministic_kernels)
from fsdp_cudagraph.config import CudaGraphConfig
from fsdp_cudagraph.graphs.full_iteration import FullIterationCudaGraph, FullIterationReport
from fsdp_cudagraph.graphs.partial import PartialCudaGraphs
from fsdp_cudagraph.capture.attention import AttentionBackendMatcher
from fsdp_cudagraph.capture.capture_safety import HostSyncError
from fsdp_cudagraph.capture.fp8 import FP8Recipe, check_fp8_runtime
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON

__all__ = ["FullRunSpec", "FullRunResult", "run_full", "main"]

logger = logging.getLogger(__name__)

MODES = ("eager", "partial", "full_iteration")
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


@dataclasses.dataclass
class FullRunSpec:
    """One training run of the reference GPT: ``mode`` eager, partial (whole-layer graphs) or full_iteration."""

    model: GPTConfig
    mode: str = "eager"
    steps: int = 20
    micro_batch_size: int = 2
    grad_accum: int = 1
    sharding_strategy: str = "optim_grads_params"
    compute_dtype: torch.dtype = torch.bfloat16
    #: fully_shard's reduce_dtype (None: reduce in the fp32 main gradients' dtype)
    reduce_dtype: Optional[torch.dtype] = None
    capture_step: int = 3
    #: Adam(capturable=True, lr=device tensor): what an optimizer graph needs; use it in both runs of a row
    capturable_optimizer: bool = False
    graph_optimizer: bool = False
    #: ``adam_fused`` (default) or ``adam`` (foreach): see ``apps.train.make_adam``
    optimizer: str = "adam_fused"
    partial_backend: str = "te"
    lr: float = 1e-3
    seed: int = 1234
    prefetch: bool = True
    #: graphed runs: flip one token of this step (a negative control of the comparison)
    perturb_step: Optional[int] = None
    #: these steps use half the sequence length (graphed runs fall back to eager for them)
    short_steps: Sequence[int] = ()
    #: evaluate a fixed batch (forward only) before these steps
    eval_steps: Sequence[int] = ()
    #: full_iteration runs: delete() the graphs before this step and continue eagerly
    delete_step: Optional[int] = None
    strict: bool = False
    #: clip the main gradients to this global norm before each optimizer step (model.clip_grad_norm_)
    max_norm: Optional[float] = None
    #: full_iteration runs: the last warmup step runs under the host-sync check (FullIterationCudaGraph's default)
    host_sync_check: bool = True
    #: forward_step(model, x, y) -> loss; default the reference loss divided by grad_accum
    forward_step: Optional[Callable[..., torch.Tensor]] = None
    double_buffer: bool = True
    #: wrap every layer in checkpoint_wrapper(preserve_rng_state=False): forwards recomputed inside backward
    activation_checkpointing: bool = False
    #: keep a copy of every main gradient (before clipping) of the first this-many steps. Adam's first update
    #: is lr * sign(grad) whatever the gradient's rounding, so a loss first differs one step after the
    #: gradient that caused it; the copies name that step (``first_grad_mismatch_step``)
    record_grad_steps: int = 0


@dataclasses.dataclass
class FullRunResult:
    losses: List[torch.Tensor]  # per step, [grad_accum] micro-batch losses
    evals: List[Tuple[torch.Tensor, ...]]
    norms: List[torch.Tensor]  # the total gradient norm of each step, with max_norm
    step_ms: List[float]
    peak_memory_bytes: int
    final_state: Dict[str, torch.Tensor]
    reports: Dict[str, FullIterationReport]
    counters: Dict[str, int]
    grads: List[List[torch.Tensor]] = dataclasses.field(default_factory=list)  # see FullRunSpec.record_grad_steps


def _batches(spec: FullRunSpec, device: torch.device) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Every step's micro-batches, on the device before the loop (no host work inside timed steps)."""
    data = rank_batches(spec.model, steps=spec.steps, grad_accum=spec.grad_accum,
                        micro_batch_size=spec.micro_batch_size, device=device, seed=spec.seed)
    out = []
    for step, micro in enumerate(data):
        mbs = []
        for x, y in micro:
            if step in spec.short_steps:
                x, y = x[:, : spec.model.seq_len // 2], y[:, : spec.model.seq_len // 2]
            if spec.perturb_step == step and spec.mode != "eager":
                x = x.clone()
                x[0, 0] = (x[0, 0] + 1) % spec.model.vocab_size
            mbs.append((x.contiguous(), y.contiguous()))
        out.append(mbs)
    return out


def run_full(spec: FullRunSpec, device: torch.device) -> FullRunResult:
    """Train per ``spec`` on the default CUDA stream (as a user's loop does) and return losses, times, state."""
    if spec.mode not in MODES:
        raise ValueError(f"mode={spec.mode!r} is not one of {MODES}")
    cuda = device.type == "cuda"
    if cuda:  # start as a fresh process would: an earlier graphed run left the thread on a side stream
        default = torch.cuda.default_stream(device)
        default.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.set_stream(default)
    # as train.build_model, plus the options a row varies (double buffer, activation checkpointing)
    torch.manual_seed(spec.seed)
    gpt = GPT(spec.model).to(device)
    unit_class = gpt.unit_class
    if spec.activation_checkpointing:
        for i in range(len(gpt.layers)):
            gpt.layers[i] = checkpoint_wrapper(gpt.layers[i], preserve_rng_state=False)
    model = fully_shard(gpt, fsdp_unit_modules=[unit_class], sharding_strategy=spec.sharding_strategy,
                        compute_dtype=spec.compute_dtype, reduce_dtype=spec.reduce_dtype,
                        fsdp_double_buffer=spec.double_buffer,
                        fsdp_db_use_persist_buf_on_alloc_fail=spec.double_buffer, prefetch=spec.prefetch)
    lr: Any = torch.tensor(spec.lr, device=device) if spec.capturable_optimizer else spec.lr
    opt = make_adam(model.optimizer_parameters(), spec.optimizer, lr=lr, capturable=spec.capturable_optimizer)
    grad_accum = spec.grad_accum
    fp8 = FP8Recipe(spec.model.fp8) if spec.model.fp8 is not None else None

    def default_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fp8 is None:
            return loss_fn(m(x), y) / grad_accum
        with fp8.autocast():  # inside the captured step too: [Note: the FP8 region under graphs]
            return loss_fn(m(x), y) / grad_accum

    forward_step = spec.forward_step or default_step
    batches = _batches(spec, device)
    eval_batch = _batches(dataclasses.replace(spec, steps=1, seed=spec.seed + 1, short_steps=(), perturb_step=None),
                          device)[0]
    graph: Optional[FullIterationCudaGraph] = None
    partial: Optional[PartialCudaGraphs] = None
    matcher: Optional[AttentionBackendMatcher] = None
    if spec.mode == "full_iteration":
        config = CudaGraphConfig(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=spec.capture_step,
                                 cuda_graph_strict_signature=spec.strict)
        graph = FullIterationCudaGraph(model, forward_step, config, graph_optimizer=spec.graph_optimizer,
                                       host_sync_check=spec.host_sync_check)
    elif spec.mode == "partial":
        config = CudaGraphConfig(cuda_graph_impl="transformer_engine" if spec.partial_backend == "te" else "local",
                                 cuda_graph_modules=[], cuda_graph_warmup_steps=spec.capture_step,
                                 use_megatron_fsdp=True, fsdp_double_buffer=True,
                                 fsdp_db_use_persist_buf_on_alloc_fail=True)
        partial = PartialCudaGraphs(model, config, backend=spec.partial_backend)
    elif cuda:  # eager: TE attention selects the backend a graph would (no-op without TE)
        matcher = AttentionBackendMatcher({"model": model.module}, force=True)
    losses: List[torch.Tensor] = []
    evals: List[Tuple[torch.Tensor, ...]] = []
    norms: List[torch.Tensor] = []
    events: List[Any] = []
    host_ms: List[float] = []
    grads: List[List[torch.Tensor]] = []

    def record_grads(step: int) -> None:
        if step < spec.record_grad_steps:
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                          for p in model.optimizer_parameters()])
    for step in range(spec.steps):
        if partial is not None and step == spec.capture_step:
            partial.capture()
        if graph is not None and step == spec.delete_step:
            graph.delete()
        live = graph is not None and not graph.deleted
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        if step in spec.eval_steps:
            if live:
                evals.append(graph.evaluate(eval_batch))
            else:
                with torch.no_grad():
                    evals.append(tuple(forward_step(model, x, y) for x, y in eval_batch))
        if live:
            losses.append(graph.step(batches[step]))
            record_grads(step)
            norm = graph.optimizer_step(opt, max_norm=spec.max_norm)
            if norm is not None:
                norms.append(norm)
        else:
            per = []
            for x, y in batches[step]:
                loss = forward_step(model, x, y)
                loss.backward()
                per.append(loss.detach().reshape(()))
            losses.append(torch.stack(per))
            record_grads(step)
            if spec.max_norm is not None:
                norms.append(model.clip_grad_norm_(spec.max_norm))
            opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
            events.append((start, end))
        host_ms.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
    ms = [s.elapsed_time(e) for s, e in events] if cuda else host_ms
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    state = model.full_state_dict()
    reports = dict(graph.reports) if graph is not None else {}
    counters = dict(graph.counters) if graph is not None else {}
    if graph is not None:
        graph.delete()
    if partial is not None:
        partial.delete()
    if matcher is not None:
        matcher.uninstall()
    return FullRunResult(losses, evals, norms, ms, peak, state, reports, counters, grads)


# ---------------------------------------------------------------------------------------------- alignment
def _everywhere(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def compare(eager: FullRunResult, graphed: FullRunResult, device: torch.device) -> Dict[str, Any]:
    loss_eq = [torch.equal(a, b) for a, b in zip(eager.losses, graphed.losses)] + [len(eager.losses) == len(graphed.losses)]
    param_eq = states_equal(eager.final_state, graphed.final_state)
    eval_eq = len(eager.evals) == len(graphed.evals) and all(
        all(torch.equal(a, b) for a, b in zip(ea, ga)) for ea, ga in zip(eager.evals, graphed.evals))
    norm_eq = len(eager.norms) == len(graphed.norms) and all(torch.equal(a, b) for a, b in zip(eager.norms, graphed.norms))
    grad_eq = [len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
               for a, b in zip(eager.grads, graphed.grads)]
    ok = _everywhere(all(loss_eq) and param_eq and eval_eq and norm_eq and all(grad_eq), device)
    med = lambda ms: sorted(ms[5:])[len(ms[5:]) // 2] if len(ms) > 5 else None  # noqa: E731
    train = graphed.reports.get("train")
    return {
        "equal": ok, "losses_equal_per_step": loss_eq[:-1], "params_equal": param_eq, "evals_equal": eval_eq,
        "norms_equal": norm_eq, "norms": [float(n) for n in eager.norms],
        "first_mismatch_step": next((i for i, e in enumerate(loss_eq[:-1]) if not e), None),
        "grads_equal_per_step": grad_eq,
        "first_grad_mismatch_step": next((i for i, e in enumerate(grad_eq) if not e), None),
        "eager_losses": [x.float().tolist() for x in eager.losses],
        "graphed_losses": [x.float().tolist() for x in graphed.losses],
        "eager_step_ms_median": med(eager.step_ms), "graphed_step_ms_median": med(graphed.step_ms),
        "capture_seconds": train.capture_seconds if train else None,
        "graph_memory_bytes": train.graph_memory_bytes if train else None,
        "captured_collectives": len(train.collectives) if train else None,
        "counters": graphed.counters,
    }


def run_row(spec: FullRunSpec, device: torch.device, *, graphed_first: bool = False,
            **graphed_overrides: Any) -> Dict[str, Any]:
    """The eager and the full-iteration run of ``spec``, compared; ``graphed_first`` swaps their order."""
    runs = {"eager": lambda: run_full(dataclasses.replace(spec, mode="eager", graph_optimizer=False), device),
            "graphed": lambda: run_full(dataclasses.replace(spec, mode="full_iteration", **graphed_overrides), device)}
    done = {k: runs[k]() for k in (("graphed", "eager") if graphed_first else ("eager", "graphed"))}
    eager, graphed = done["eager"], done["graphed"]
    row = {"model": "te" if spec.model.use_te else "torch", "moe_experts": spec.model.moe_experts,
           "fp8": spec.model.fp8, "strategy": spec.sharding_strategy,
           "grad_accum": spec.grad_accum, "graph_optimizer": spec.graph_optimizer, "max_norm": spec.max_norm,
           "activation_checkpointing": spec.activation_checkpointing,
           "short_steps": list(spec.short_steps), "eval_steps": list(spec.eval_steps), "delete_step": spec.delete_step,
           "reduce_dtype": str(spec.reduce_dtype) if spec.reduce_dtype else None,
           **{k: v for k, v in graphed_overrides.items() if k != "forward_step"}}
    row.update(compare(eager, graphed, device))
    return row


def model_config(use_te: bool, **moe: Any) -> GPTConfig:
    # seq 128 (a multiple of 128: TE's fused attention stays available under capture; a multiple of 16 for FP8),
    # two MoE layers (the dense toy unless ``moe`` picks dropless experts, e.g. GROUPED_MOE); ``fp8`` in ``moe``
    return GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=128, moe_every=2,
                     num_experts=4, moe_top_k=2, use_te=use_te, **moe)


def fp8_recipes() -> List[str]:
    """The FP8 recipes of the whole-step rows on this machine: current, and block where it runs (Hopper,
    CUDA 12.9). Delayed scaling is refused in whole-step graphs (its control)."""
    out = ["current"]
    try:
        check_fp8_runtime("block")
        out.append("block")
    except RuntimeError:
        pass
    return out


def fp8_control(device: torch.device, expect: Callable[..., None]) -> None:
    """FP8 delayed scaling in a whole-step graph: refused at the last warmup step, naming the reason."""
    spec = FullRunSpec(model=model_config(True, fp8="delayed"), steps=6, capture_step=2, mode="full_iteration")
    expect("FP8 delayed scaling in a whole-step graph", lambda: run_full(spec, device), NotImplementedError,
           ["delayed scaling"])


#: Dropless MoE whose experts run torch's grouped_mm with device offsets in bf16: no host sync, so the whole
#: step is capturable (``split``/``te_grouped`` experts are refused by FullIterationCudaGraph, apps/moe.py).
GROUPED_MOE = dict(moe_experts="grouped_mm", moe_grouped_mm_dtype="bfloat16")


def negative_controls(device: torch.device, steps: int, *, fp8_only: bool = False) -> List[Dict[str, Any]]:
    """Runs that must fail, each with how it failed (``fp8_only``: the FP8 control alone, with TE)."""
    out: List[Dict[str, Any]] = []
    base = FullRunSpec(model=model_config(False), steps=6, capture_step=2)

    def expect(name: str, fn: Callable[[], Any], exc: Any, must: Sequence[str] = ()) -> None:
        try:
            fn()
            out.append({"control": name, "caught": False, "detail": "no error"})
        except Exception as e:  # noqa: BLE001 - the wrong kind of error is a control not caught, recorded
            text = f"{type(e).__name__}: {e}"
            caught = isinstance(e, exc) and all(m in text for m in must)
            out.append({"control": name, "caught": caught, "detail": text[:600]})

    if fp8_only:
        if HAS_TE:
            fp8_control(device, expect)
        return out
    def item_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        if loss.item() > 1e9:  # a data-dependent Python branch
            loss = loss * 0
        return loss

    def capture_only_sync(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(m(x), y)
        if torch.cuda.is_current_stream_capturing():
            loss = loss * float(loss.detach().sum())  # a host read only the capture sees
        return loss

    cpu_scale = torch.tensor(1.0)  # a CPU scalar tensor: read on the host at capture, frozen

    def cpu_tensor_step(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(m(x), y) * cpu_scale

    expect(".item() in the step", lambda: run_full(dataclasses.replace(base, mode="full_iteration", forward_step=item_step), device),
           HostSyncError, ["aten._local_scalar_dense", "loss.item()"])
    # torch's sync debug mode raises a HostSyncError; if CUDA refuses first (a pinned-memory allocation of the
    # read-back under capture), the translated RuntimeError names the same line
    expect("host sync only under capture", lambda: run_full(
        dataclasses.replace(base, mode="full_iteration", forward_step=capture_only_sync), device),
        (HostSyncError, RuntimeError), ["capture_only_sync", "captur"])
    expect("CPU tensor in the step", lambda: run_full(
        dataclasses.replace(base, mode="full_iteration", forward_step=cpu_tensor_step), device),
        HostSyncError, ["CPU tensor"])
    expect("ZeRO-3 without double buffer", lambda: run_full(
        dataclasses.replace(base, mode="full_iteration", double_buffer=False), device), ValueError, ["fixed address"])
    expect("strict shape change", lambda: run_full(
        dataclasses.replace(base, mode="full_iteration", strict=True, short_steps=(4,)), device), ValueError,
        ["captured for other inputs"])
    row = run_row(dataclasses.replace(base, steps=min(steps, 8)), device, perturb_step=4)
    out.append({"control": "one token perturbed at step 4", "caught": not row["equal"],
                "detail": f"first mismatch at step {row['first_mismatch_step']}"})
    if HAS_TE:  # last: a delayed-scaling run leaves its amax buffers in TE's process-wide state
        fp8_control(device, expect)
    return out


def _mismatch(row: Dict[str, Any]) -> str:
    return (f"MISMATCH at step {row['first_mismatch_step']} (losses), "
            f"{row.get('first_grad_mismatch_step')} (gradients)")


def plan_rows(models: Sequence[str], strategies: Sequence[str], *, steps: int, capture_step: int,
              optimizer: str) -> List[FullRunSpec]:
    """The matrix's rows, in order: per model and strategy, one and two micro-batches with the optimizer eager
    and graphed; then the shape change with evaluation, ``delete()``, clipping, activation checkpointing; per
    model the dropless MoE row and the row that reduces gradients in bf16. The GPU tests count rows from
    this list, not from a formula of their own."""
    specs: List[FullRunSpec] = []
    for m in models:
        for s in strategies:
            common = dict(model=model_config(m == "te"), steps=steps, capture_step=capture_step, sharding_strategy=s)
            # one and two micro-batches, each with the eager Adam and with capturable Adam in an optimizer graph
            for accum in (1, 2):
                specs.append(FullRunSpec(**common, grad_accum=accum))
                specs.append(FullRunSpec(**common, grad_accum=accum, capturable_optimizer=True, graph_optimizer=True))
    extra = dict(model=model_config(False), steps=steps, capture_step=capture_step)
    c = capture_step  # evaluations before the training capture too: they install parameters eagerly
    specs.append(FullRunSpec(**extra, grad_accum=2, short_steps=(c + 4,),
                             eval_steps=tuple(sorted({1, c - 1, c, c + 2, c + 3, c + 5, c + 6} - {0}))))
    specs.append(FullRunSpec(**extra, capturable_optimizer=True, graph_optimizer=True, delete_step=capture_step + 3))
    # sync-free clipping (its all-reduce included) inside the optimizer graph
    specs.append(FullRunSpec(**extra, grad_accum=2, capturable_optimizer=True, graph_optimizer=True, max_norm=0.5))
    # activation checkpointing: each layer's forward (and its gather) runs again inside the captured backward
    specs.append(FullRunSpec(**extra, grad_accum=2, activation_checkpointing=True))
    # dropless MoE (grouped_mm experts, bf16, no host sync): permute, grouped GEMMs, unpermute inside the graph
    for m in models:
        specs.append(FullRunSpec(model=model_config(m == "te", **GROUPED_MOE), steps=steps,
                                 capture_step=capture_step, grad_accum=2, capturable_optimizer=True,
                                 graph_optimizer=True))
    # gradients reduced in bf16 into fp32 main gradients ([Note: reducing in another dtype]), each model
    for m in models:
        specs.append(FullRunSpec(model=model_config(m == "te"), steps=steps, capture_step=capture_step,
                                 grad_accum=2, capturable_optimizer=True, graph_optimizer=True,
                                 reduce_dtype=torch.bfloat16))
    # FP8 (TE model): current and block scaling, two micro-batches, eager Adam and the optimizer graph
    if "te" in models:
        for recipe in fp8_recipes():
            for graph_opt in (False, True):
                specs.append(FullRunSpec(model=model_config(True, fp8=recipe), steps=steps, capture_step=capture_step,
                                         grad_accum=2, capturable_optimizer=graph_opt, graph_optimizer=graph_opt))
    # gradients of the warmup steps, the capture and the first replay, compared too (see record_grad_steps)
    specs = [dataclasses.replace(sp, record_grad_steps=capture_step + 2, optimizer=optimizer) for sp in specs]
    return specs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["torch", "te"], choices=["torch", "te"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="torch model, strategies no_shard and optim_grads_params")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--no-host-sync-check", action="store_true",
                   help="graphed runs skip the host-sync check on their last warmup step (a diagnosis aid)")
    p.add_argument("--graphed-first", action="store_true",
                   help="in each row, run the graphed run before the eager one (a diagnosis aid: order effects)")
    p.add_argument("--only", nargs="*", default=None, metavar="MODEL:STRATEGY[:ACCUM]",
                   help="run only these rows, e.g. te:no_shard:1 (a diagnosis aid)")
    p.add_argument("--moe-only", action="store_true", help="run only the dropless MoE rows (grouped_mm experts)")
    p.add_argument("--fp8-only", action="store_true",
                   help="run only the FP8 rows (TE model, current and block scaling) and the FP8 control")
    add_optimizer_argument(p)
    p.add_argument("--out", default=None, help="JSON result path (rank 0 writes)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fsdp_cudagraph.apps.full_iteration_align needs a CUDA GPU; the CPU schedule is tested by "
              "tests/graphs/test_full_iteration.py. Nothing to run here.")
        return 0
    use_deterministic_kernels()
    device = init_distributed(default_port=29514)
    rank, world = dist.get_rank(), dist.get_world_size()
    models = ["torch"] if args.quick else [m for m in args.models if m != "te" or HAS_TE]
    skipped = [f"te: {TE_REASON}"] if "te" in args.models and not HAS_TE and not args.quick else []
    strategies = ["no_shard", "optim_grads_params"] if args.quick else STRATEGIES
    specs = plan_rows(models, strategies, steps=args.steps, capture_step=args.capture_step, optimizer=args.optimizer)
    # Determinism control: each model's first eager run, twice. A row can only be bit-exact if eager is
    # reproducible; a failing repeat says the mismatch is in the kernels, not in the graph.
    repeats = []
    for m in models:
        first = next(sp for sp in specs if sp.model.use_te == (m == "te"))
        a = run_full(dataclasses.replace(first, mode="eager", graph_optimizer=False), device)
        b = run_full(dataclasses.replace(first, mode="eager", graph_optimizer=False), device)
        cmp = compare(a, b, device)
        repeats.append({"model": m, "strategy": first.sharding_strategy, "equal": cmp["equal"],
                        "first_mismatch_step": cmp["first_mismatch_step"],
                        "first_grad_mismatch_step": cmp["first_grad_mismatch_step"]})
        if rank == 0:
            print(f"eager repeat {m:5s} {first.sharding_strategy:18s} "
                  f"{'EQUAL' if cmp['equal'] else _mismatch(cmp)}", flush=True)
    if args.only is not None:
        wanted = [tuple(w.split(":")) for w in args.only]

        def _match(sp: FullRunSpec) -> bool:
            key = ("te" if sp.model.use_te else "torch", sp.sharding_strategy, str(sp.grad_accum))
            return any(key[:len(w)] == w for w in wanted)

        specs = [sp for sp in specs if _match(sp)]
    if args.moe_only:
        specs = [sp for sp in specs if sp.model.moe_experts != "dense"]
    if args.fp8_only:
        specs = [sp for sp in specs if sp.model.fp8 is not None]
    if args.no_host_sync_check:
        specs = [dataclasses.replace(sp, host_sync_check=False) for sp in specs]
    rows = []
    t0 = time.time()
    for i, spec in enumerate(specs):
        try:
            row = run_row(spec, device, graphed_first=args.graphed_first)
        except Exception as exc:  # noqa: BLE001 - one failing row is recorded; the matrix goes on
            logger.exception("row %d failed", i)
            row = {"model": "te" if spec.model.use_te else "torch", "moe_experts": spec.model.moe_experts,
                   "fp8": spec.model.fp8, "strategy": spec.sharding_strategy,
                   "grad_accum": spec.grad_accum, "graph_optimizer": spec.graph_optimizer, "max_norm": spec.max_norm,
                   "activation_checkpointing": spec.activation_checkpointing, "short_steps": list(spec.short_steps),
                   "eval_steps": list(spec.eval_steps), "delete_step": spec.delete_step, "equal": False,
                   "first_mismatch_step": None, "first_grad_mismatch_step": None,
                   "error": f"{type(exc).__name__}: {exc}"[:2000],
                   "eager_step_ms_median": float("nan"), "graphed_step_ms_median": float("nan"),
                   "capture_seconds": float("nan"), "captured_collectives": None, "counters": {}}
        rows.append(row)
        if rank == 0:
            print(f"[{i + 1}/{len(specs)}, {time.time() - t0:4.0f} s] {row['model']:5s} {row['moe_experts']:10s} "
                  f"{('fp8=' + row['fp8']) if row.get('fp8') else '':12s} "
                  f"{row['strategy']:18s} "
                  f"accum={row['grad_accum']} opt_graph={row['graph_optimizer']!s:5s} clip={row['max_norm']} "
                  f"ckpt={row['activation_checkpointing']!s:5s} "
                  f"short={row['short_steps']} "
                  f"eval={bool(row['eval_steps'])} delete={row['delete_step']}  "
                  f"{'EQUAL' if row['equal'] else _mismatch(row)}  "
                  f"eager {row['eager_step_ms_median']:.2f} ms  graphed {row['graphed_step_ms_median']:.2f} ms  "
                  f"capture {row['capture_seconds']:.2f} s, {row['captured_collectives']} collectives  {row['counters']}",
                  flush=True)
    controls = [] if args.no_controls else negative_controls(device, args.steps, fp8_only=args.fp8_only)
    ok = all(r["equal"] for r in rows) and all(c["caught"] for c in controls)
    if rank == 0:
        for c in controls:
            print(f"control: {c['control']:32s} {'caught' if c['caught'] else 'NOT CAUGHT'}  {c['detail'][:160]}")
        print(f"{len(rows)} rows, {sum(r['equal'] for r in rows)} equal; controls caught "
              f"{sum(c['caught'] for c in controls)}/{len(controls)}; {time.time() - t0:.0f} s; world {world}")
        if args.out:
            write_record(args.out, {"command": " ".join(sys.argv), "world_size": world, "versions": versions(),
                                    "steps": args.steps, "capture_step": args.capture_step, "skipped": skipped,
                                    "eager_repeats": repeats, "rows": rows, "controls": controls, "all_ok": ok})
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.apps.train import exit_process

    exit_process(main())
