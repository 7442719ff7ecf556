"""Full-iteration CUDA graphs under ``megatron_fsdp``: a whole training step in one graph, collectives inside.

Lifecycle::

    model = fully_shard(gpt.cuda(), fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=torch.tensor(1e-4, device="cuda"), capturable=True)

    def forward_step(model, tokens, targets):           # one micro-batch -> the loss to backpropagate
        return loss_fn(model(tokens), targets) / num_micro_batches

    graph = FullIterationCudaGraph(model, forward_step, CudaGraphConfig(cuda_graph_impl="full_iteration"),
                                   graph_optimizer=True)   # build it before the first training step
    for micro_batches in loader:                        # a list of (tokens, targets) micro-batches
        losses = graph.step(micro_batches)              # eager warmup steps, one capture, then replays
        graph.optimizer_step(opt)                       # opt.step(): eagerly, or replayed from its own graph
        opt.zero_grad()
    graph.delete()                                      # graphs reset, the model stays eager (torch 2.11 keeps part of
                                                        # the memory: benchmarks/diagnose/graph_memory.py)

The training graph holds forward and backward over all micro-batches: the engine's casts, all-gathers and
reduce-scatters included (the engine's capture guard is switched to ``ALLOW_COLLECTIVES`` around the
capture only; on-demand buffer allocations stay refused, so ZeRO-3 and ``optim_grads`` need
``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``). Each step copies the user's tensors
into static input buffers and replays; ``step`` returns a fresh tensor of the micro-batch losses.
Evaluation (``evaluate``) has its own forward-only graph; the optimizer step has its own graph
(``graph_optimizer=True``: ``capturable=True`` optimizers, learning rates as device tensors).

[Note: frozen host decisions]
At replay no Python runs: every decision taken on the host while the step was captured is replayed as it
was taken then. The engine's decisions follow a fixed schedule (``megatron_fsdp.graph_contract``, [Note: the
static schedule]): every step re-installs the compute parameters from the main shards, gathers every unit
it needs, and writes this step's gradients over the main gradients. The eager steps this class runs (the
warmup before capture, fallbacks on other inputs) start from the same state, so they issue the same
collectives in the same order as a replay (checked on the CPU protocol backend). What this layer freezes
and how it keeps that honest:

- Inputs: only tensors that sit in the static buffers change between replays. Each call's inputs are
  flattened into a signature (structure, constants, shapes, dtypes; ``model.training`` included); a call
  with another signature never replays: it runs eagerly with one warning, or raises ValueError with
  ``cuda_graph_strict_signature=True``. Constants in the micro-batches (ints, flags) are bound at capture.
- Gradients: a step replaces gradients (as an eager step after ``optimizer.zero_grad()`` does). After each
  replay ``main_shard.grad`` is bound to the main gradient for the units the captured step reduced, and
  unbound for the others, whatever ``zero_grad(set_to_none=True)`` did in between.
- Host reads: a host sync, a CPU tensor or a host<->device copy in the step would be frozen at its capture
  value or break the capture; a rehearsal of the last warmup step runs under a check that refuses them by name, and the
  capture under ``torch.cuda.set_sync_debug_mode("error")`` ([Note: host syncs in a captured step]). Python values
  the step branches on (counters, flags) cannot be seen: they are frozen too.
- Python side effects of ``forward_step`` (appending to a list, counting calls) happen at capture only.
- RNG: PyTorch registers the default CUDA generator with every graph (each replay advances its offset as
  an eager step would); other generators (a tensor-parallel RNG tracker's) must be passed as
  ``generators``. The reference model has no dropout, so its bit-exact checks do not exercise this.
- Optimizer graph (with optional sync-free clipping, ``optimizer_step(opt, max_norm=...)``, whose
  all-reduce of the ranks' norms is captured too): hyperparameters and ``max_norm`` are bound at capture;
  before each replay a changed Python value (a float ``lr`` a scheduler changed) raises, a device-tensor
  ``lr`` updated in place is read by the graph.
  Each parameter's ``.grad`` must be the tensor it was at capture (the main gradient): an optimizer replay
  without a preceding step, or after ``zero_grad(set_to_none=True)``, raises instead of stepping stale
  gradients. After a replay the engine is told that the main shards changed (their version counters do
  not move under a graph).
- Ranks: every rank must capture the same collectives in the same order; the descriptions are compared
  across ranks right after capture, and a difference raises before the first replay.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torch import nn

from fsdp_cudagraph.config import WHOLE_STEP_BACKENDS, CudaGraphConfig, CudaGraphImpl
from fsdp_cudagraph.engines.contract import PER_LAYER_BUFFERS
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.graphs.optimizer import FullIterationReport, OptimizerGraph
from fsdp_cudagraph.capture import args as _args
from fsdp_cudagraph.capture import state as _capture_state
from fsdp_cudagraph.capture import streams as _streams
from fsdp_cudagraph.capture.attention import ATTENTION_POLICIES, AttentionBackendMatcher, attention_notice, mismatch_message
from fsdp_cudagraph.capture import recipe as _recipe
from fsdp_cudagraph.capture.capture_safety import CaptureSafetyCheck, rng_restored

__all__ = ["FullIterationCudaGraph", "FullIterationReport", "FULL_ITERATION_BACKENDS"]

logger = logging.getLogger(__name__)

#: torch: torch.cuda.graph, NCCL inside the graph; protocol: the same schedule without graphs (runs on CPU),
#: each "replay" re-runs the step under the capture guard and must issue what the capture issued
#: ([Note: backends] in config.py).
FULL_ITERATION_BACKENDS = WHOLE_STEP_BACKENDS
_KINDS = {"train": "the training step", "eval": "the evaluation step", "optimizer": "the optimizer step"}


@dataclasses.dataclass(eq=False)
class _Slot:
    """One graph (train or eval) with its warmup schedule, static buffers and replay counters."""

    kind: str
    warmup_left: int
    last_signature: Any = None
    signature: Any = None
    captured: bool = False
    failed: Optional[str] = None
    graph: Any = None
    static_leaves: List[torch.Tensor] = dataclasses.field(default_factory=list)
    static_batch: Any = None
    output: Any = None
    bound: FrozenSet[str] = frozenset()
    collectives: List[str] = dataclasses.field(default_factory=list)
    trace: Optional[list] = None
    replays: int = 0
    eager_steps: int = 0
    fallbacks: int = 0
    warned: bool = False
    report: Optional[FullIterationReport] = None


def _call_step(fn: Callable[..., Any], model: nn.Module, micro_batch: Any) -> Any:
    if isinstance(micro_batch, dict):
        return fn(model, **micro_batch)
    if isinstance(micro_batch, (tuple, list)):
        return fn(model, *micro_batch)
    return fn(model, micro_batch)


class FullIterationCudaGraph:
    """Capture and replay whole training steps (forward + backward of all micro-batches) of a megatron_fsdp model.

    Args:
        model: the :class:`megatron_fsdp.MegatronFSDP` to train. Every engine buffer must have a fixed address
            (ZeRO-3 and ``optim_grads``: ``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``).
        forward_step: ``forward_step(model, *micro_batch) -> loss`` (``**micro_batch`` for a dict, one tensor
            for a tensor): the loss of one micro-batch, as it is backpropagated (divide by the number of
            micro-batches yourself). Runs at warmup, at capture, and in eager fallbacks, never at replay.
        config: a :class:`CudaGraphConfig` with ``cuda_graph_impl='full_iteration'`` (default: one): it sets
            ``cuda_graph_warmup_steps`` (eager steps before capture, per graph) and
            ``cuda_graph_strict_signature`` (raise instead of running eagerly on changed inputs).
        eval_step: ``eval_step(model, *micro_batch) -> tensor`` for :meth:`evaluate` (default
            ``forward_step``), run under ``torch.no_grad()``.
        graph_optimizer: capture :meth:`optimizer_step` in a second graph after its warmup steps.
        backend: ``torch`` (default on a CUDA model) or ``protocol`` (default on CPU: no graphs, the same
            schedule, every "replay" checked against the capture).
        generators: extra CUDA generators the step draws from (the default generator is always handled).
        attention_backend: TE attention policy, as for :class:`PartialCudaGraphs` (``match_graph``: the eager
            steps use the backend TE picks under capture; ``warn``; ``error``).
        host_sync_check: rehearse the last warmup step under :class:`CaptureSafetyCheck` (host syncs named before
            capture; [Note: the host-sync rehearsal]). ``False`` skips the rehearsal (the capture's own
            sync-debug check still runs).

    Streams: on CUDA, building it moves this thread off the legacy default stream (see ``capture/streams.py``): build
    it before the first training step. Every call then runs on the thread's current stream, the capture too.

    Hazards: the returned losses are fresh tensors, but tensors inside the graph (activations, the graph's
    own outputs) are reused by the next replay; Python side effects of ``forward_step`` happen at capture
    only (see [Note: frozen host decisions]); while the graphs exist, do not reassign the engine's buffers
    or parameters, and call :meth:`delete` before changing the model.
    """

    def __init__(
        self,
        model: nn.Module,
        forward_step: Callable[..., torch.Tensor],
        config: Optional[CudaGraphConfig] = None,
        *,
        eval_step: Optional[Callable[..., torch.Tensor]] = None,
        graph_optimizer: bool = False,
        backend: Optional[str] = None,
        generators: Sequence[torch.Generator] = (),
        attention_backend: str = "match_graph",
        host_sync_check: bool = True,
    ) -> None:
        self.host_sync_check = host_sync_check
        engine = adapter_for(model)  # refuses an engine's inner module, naming the object to pass
        if engine is None:
            raise TypeError(f"FullIterationCudaGraph needs a megatron_fsdp.MegatronFSDP model (from fully_shard), got "
                            f"{type(model).__name__}; wrap the model with megatron_fsdp.fully_shard first")
        if not engine.supports_static_step():
            raise engine.no_static_step("FullIterationCudaGraph")
        if not callable(forward_step) or (eval_step is not None and not callable(eval_step)):
            raise TypeError("forward_step (and eval_step) must be callables: fn(model, *micro_batch) -> tensor")
        config = config if config is not None else CudaGraphConfig(cuda_graph_impl="full_iteration")
        if config.cuda_graph_impl != CudaGraphImpl.FULL_ITERATION:
            raise ValueError(f"FullIterationCudaGraph got cuda_graph_impl='{config.cuda_graph_impl}'; pass a config with "
                             "cuda_graph_impl='full_iteration', or use PartialCudaGraphs for per-layer graphs")
        backend = _streams.graph_backend(backend, engine.device, FULL_ITERATION_BACKENDS)
        if attention_backend not in ATTENTION_POLICIES:
            raise ValueError(f"attention_backend={attention_backend!r} is not one of {ATTENTION_POLICIES}; 'match_graph' "
                             "runs the eager steps with the attention backend the graph will use")
        if generators and backend == "torch" and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            raise NotImplementedError(f"generators= needs CUDAGraph.register_generator_state, missing in torch "
                                      f"{torch.__version__}")
        if backend == "torch":
            config.check_runtime()
        engine.require_fixed_buffers("FullIterationCudaGraph", PER_LAYER_BUFFERS)  # [Note: fixed addresses]
        #: The model the step functions are given; every question to its engine goes through ``engine``.
        self.model = model
        self.engine = engine
        self.forward_step = forward_step
        self.eval_step = eval_step if eval_step is not None else forward_step
        self.config = config
        self.backend = backend
        self.device = engine.device
        self.graph_optimizer = graph_optimizer
        self.generators = tuple(generators)
        self.attention_backend = attention_backend
        warmup = config.cuda_graph_warmup_steps
        self._train = _Slot("train", warmup)
        self._eval = _Slot("eval", warmup)
        self._opt = OptimizerGraph(engine, backend=backend, warmup=warmup, enabled=graph_optimizer,
                                   agree=self._agree_across_ranks)
        self.deleted = False
        self._steps_before_side_stream = 0
        self._attention: Optional[AttentionBackendMatcher] = None
        if backend == "torch":
            if _streams.on_legacy_default_stream(self.device):
                self._steps_before_side_stream = engine.num_forward_calls
                _streams.use_side_stream(self.device)
            self._attention = AttentionBackendMatcher({"model": engine.root}, force=attention_backend == "match_graph")

    # ------------------------------------------------------------------ public API
    @property
    def captured(self) -> bool:
        """Whether the training graph has been captured (and not deleted)."""
        return self._train.captured

    @property
    def reports(self) -> Dict[str, FullIterationReport]:
        """Capture reports by graph kind (``train``, ``eval``, ``optimizer``)."""
        out = {s.kind: s.report for s in (self._train, self._eval) if s.report is not None}
        if self._opt.report is not None:
            out["optimizer"] = self._opt.report
        return out

    @property
    def counters(self) -> Dict[str, int]:
        """Replays and eager steps so far: what ran as a graph and what did not."""
        t, e = self._train, self._eval
        return {"train_replays": t.replays, "train_eager_steps": t.eager_steps, "train_fallbacks": t.fallbacks,
                "eval_replays": e.replays, "eval_eager_steps": e.eager_steps, "eval_fallbacks": e.fallbacks,
                "optimizer_replays": self._opt.replays}

    def step(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """Forward and backward over ``micro_batches``; returns the detached losses, shape ``[num_micro_batches]``.

        The main gradients afterwards hold this step's gradients (the previous ones are replaced). Eager
        for the first ``cuda_graph_warmup_steps`` calls, then captured once and replayed.
        """
        self._check_usable("step")
        if not torch.is_grad_enabled():
            raise RuntimeError("FullIterationCudaGraph.step() runs forward and backward, but gradients are disabled "
                               "(torch.no_grad()); evaluate with FullIterationCudaGraph.evaluate(), which has its own "
                               "forward-only graph")
        return self._call(self._train, micro_batches)

    def evaluate(self, micro_batches: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        """``eval_step`` over ``micro_batches`` under ``torch.no_grad()``, in its own graph; one tensor each.

        Gradient bindings are left as they are. Set the model's mode (``model.eval()``) yourself: the mode is
        part of the inputs' signature, so the evaluation graph replays only in the mode it was captured in.
        """
        self._check_usable("evaluate")
        return self._call(self._eval, micro_batches)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, max_norm: Optional[float] = None
                       ) -> Optional[torch.Tensor]:
        """``optimizer.step()``; with ``graph_optimizer=True`` captured after the warmup steps and replayed.

        ``max_norm``: clip the main gradients by their global norm first (``model.clip_grad_norm_``, sync-free:
        an all-reduce and device-side scaling, inside the optimizer graph when there is one) and return that
        norm (before clipping) as a fresh tensor. The value is bound at capture: a replay with another raises.
        See ``graphs/optimizer.py`` for what a replay checks.
        """
        self._check_usable("optimizer_step")
        return self._opt.step(optimizer, max_norm)

    def delete(self) -> None:
        """Reset every graph, give its memory back, and leave the model eager and correct. Idempotent.

        The engine's host state is made safe for eager steps (parameters re-installed from the main shards at
        the next forward). The thread stays on its side stream. To graph again, build a new instance.
        """
        if self.deleted:
            return
        if self.backend == "torch":
            torch.cuda.synchronize(self.device)
        self._opt.reset()
        if self._train.captured:
            self.engine.release_main_grads()  # kept for this graph since its capture
        for slot in (self._train, self._eval):
            graph, slot.graph = slot.graph, None
            reset = getattr(graph, "reset", None)
            if callable(reset):
                reset()
            slot.captured = False
        for slot in (self._train, self._eval):
            slot.static_leaves, slot.static_batch, slot.output = [], None, None
        self.engine.quiesce()
        self.engine.mark_params_stale()
        if self._attention is not None:
            self._attention.uninstall()
        self.deleted = True
        gc.collect()
        if self.backend == "torch":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one call of a graph
    def _check_usable(self, what: str) -> None:
        if self.deleted:
            raise RuntimeError(f"FullIterationCudaGraph.{what}() after delete(): the graphs are gone and the model is "
                               "eager again; train it directly (model(...), loss.backward()), or build a new "
                               "FullIterationCudaGraph to graph again")
        for slot in (self._train, self._eval):
            if slot.failed is not None and {"step": "train", "evaluate": "eval"}.get(what) == slot.kind:
                raise RuntimeError(f"FullIterationCudaGraph.{what}(): the capture of {_KINDS[slot.kind]} failed earlier "
                                   f"({slot.failed}); the model is eager and correct: fix the cause and build a new "
                                   "FullIterationCudaGraph, or train eagerly")

    def _signature(self, micro_batches: Sequence[Any]) -> Tuple[List[torch.Tensor], Any]:
        if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
            raise TypeError(f"micro_batches must be a non-empty list or tuple of micro-batches, got "
                            f"{type(micro_batches).__name__}; pass [(inputs, targets), ...] (one entry per micro-batch)")
        leaves, sig = _args.flatten(((list(micro_batches), self.model.training), {}))
        for i, t in enumerate(leaves):
            if t.requires_grad:
                raise ValueError(f"input tensor {i} of the micro-batches requires grad; a graph's inputs are copied into "
                                 "static buffers, so gradients would not reach it: pass it detached, or compute it "
                                 "inside forward_step")
        return leaves, sig

    def _call(self, slot: _Slot, micro_batches: Sequence[Any]) -> Any:
        leaves, sig = self._signature(micro_batches)
        if not slot.captured:
            if slot.warmup_left > 0 or sig != slot.last_signature:
                # a capture follows at least one eager step with the same inputs (lazy init, workspaces)
                slot.warmup_left = max(0, slot.warmup_left - 1)
                slot.last_signature = sig
                slot.eager_steps += 1
                # the step right before capture runs under the host-sync check: caches are warm by then, so
                # what it refuses would happen at capture too
                return self._eager(slot, micro_batches, check=self.host_sync_check and slot.warmup_left == 0)
            self._capture(slot, leaves, sig)
        elif sig != slot.signature:
            return self._fallback(slot, micro_batches, sig)
        return self._replay(slot, leaves)

    def _body(self, slot: _Slot) -> Callable[[Any], Any]:
        return self._train_body if slot.kind == "train" else self._eval_body

    def _train_body(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        losses = []
        for i, mb in enumerate(micro_batches):
            loss = _call_step(self.forward_step, self.model, mb)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError(f"forward_step must return the micro-batch's loss, a one-element tensor that requires "
                                f"grad; micro-batch {i} gave {type(loss).__name__} "
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            loss.backward()
            losses.append(loss.detach().reshape(()))
        return torch.stack(losses)

    def _eval_body(self, micro_batches: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        with torch.no_grad():
            outs = tuple(_call_step(self.eval_step, self.model, mb) for mb in micro_batches)
        bad = [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]
        if bad:
            raise TypeError(f"eval_step must return a tensor per micro-batch; micro-batches {bad} did not")
        return outs

    def _eager(self, slot: _Slot, micro_batches: Sequence[Any], *, check: bool) -> Any:
        if check:
            self._rehearse(slot, micro_batches)
        self.engine.begin_static_step(replace_grads=slot.kind == "train")
        return self._body(slot)(micro_batches)

    def _rehearse(self, slot: _Slot, micro_batches: Sequence[Any]) -> None:
        """Run the step once under the host-sync check and discard what it computed.

        [Note: the host-sync rehearsal] The check is a dispatch mode that only looks, yet a step computed
        under it runs the functions a library compiled with ``torch.compile`` (TE's bias+GeLU fusion) as
        uncompiled Python, which rounds differently ([Note: dispatch modes and torch.compile]; that is also
        why the check forces eager mode, or Dynamo would give those functions up for the whole process).
        So the check never runs on a step whose results count: it runs on a rehearsal of the step right before
        capture, from the same starting state (``begin_static_step``; gradients are replaced, not added), with
        every random generator the step draws from put back afterwards; then the step runs again, plainly,
        as every other warmup step does. Costs one extra forward and backward, once per capture; a
        ``forward_step`` with Python side effects sees that step twice.
        """
        with rng_restored(self.device, self.generators):
            self.engine.begin_static_step(replace_grads=slot.kind == "train")
            with CaptureSafetyCheck(self.device, _KINDS[slot.kind]):
                self._body(slot)(micro_batches)

    def _fallback(self, slot: _Slot, micro_batches: Sequence[Any], sig: Any) -> Any:
        change = _args.describe_change(slot.signature, sig, ["micro_batches", "model.training"])
        head = (f"[rank {self.engine.rank}] fsdp_cudagraph: FullIterationCudaGraph: {_KINDS[slot.kind]} was captured for "
                f"other inputs ({change})")
        if self.config.cuda_graph_strict_signature:
            raise ValueError(f"{head}; a graph never replays on stale buffers. Pass inputs with the captured structure, "
                             "shapes and dtypes (e.g. pad the batch), or set cuda_graph_strict_signature=False to run "
                             "such steps eagerly")
        slot.fallbacks += 1
        if not slot.warned:
            slot.warned = True
            warnings.warn(_args.SignatureChangedWarning(f"{head}; this and every such step runs eagerly (warned once)"),
                          stacklevel=4)  # _fallback <- _call <- step/evaluate <- the caller
        else:
            logger.debug("%s; running eagerly", head)
        return self._eager(slot, micro_batches, check=False)

    # ------------------------------------------------------------------ capture
    def _capture(self, slot: _Slot, leaves: List[torch.Tensor], sig: Any) -> None:
        what = _KINDS[slot.kind]
        if self.backend == "torch":
            self._check_capturable()
        train = slot.kind == "train"
        t0 = time.perf_counter()
        static_leaves = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in leaves]
        for s, t in zip(static_leaves, leaves):
            s.copy_(t)
        static_batch = _args.rebuild(sig, static_leaves)[0][0]
        bindings = self.engine.grads_bound()
        self.engine.begin_static_step(replace_grads=train)
        log: List[str] = []
        mem0 = torch.cuda.memory_allocated(self.device) if self.backend == "torch" else 0
        try:
            if self.backend == "torch":
                graph, out, trace = self._capture_cuda(slot, static_batch, log)
            else:
                graph, (out, trace) = None, self._run_protocol(slot, static_batch, log)
            bound = self.engine.grads_bound() if train else bindings
        except BaseException as exc:
            # nothing of the failed capture runs; drop its host state without waiting on captured work
            self.engine.end_static_step(bound=frozenset() if train else bindings)
            slot.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            _recipe.raise_translated(exc, what)
            raise
        self.engine.end_static_step(bound=bound)  # host state as after a replay: nothing ran yet
        self._agree_across_ranks(log, what)
        slot.graph, slot.output, slot.trace, slot.collectives = graph, out, trace, log
        slot.static_leaves, slot.static_batch, slot.signature, slot.bound = static_leaves, static_batch, sig, bound
        if train:
            self.engine.keep_main_grads()  # the graph writes them at these addresses; delete() releases
        slot.captured = True
        mem = torch.cuda.memory_allocated(self.device) - mem0 if self.backend == "torch" else 0
        slot.report = FullIterationReport(slot.kind, self.backend, time.perf_counter() - t0, mem, len(static_batch),
                                          list(log), sorted(bound) if train else [])
        logger.info("fsdp_cudagraph: captured %s (%s backend, %d micro-batches, %d collectives) in %.2f s",
                    what, self.backend, len(static_batch), len(log), slot.report.capture_seconds)

    def _check_capturable(self) -> None:
        if self._steps_before_side_stream and not _streams.has_stale_stream_override():
            raise RuntimeError(
                f"[rank {self.engine.rank}] fsdp_cudagraph: cannot capture: the model ran {self._steps_before_side_stream} "
                "forward pass(es) on the legacy default CUDA stream before FullIterationCudaGraph was built; autograd "
                "keeps nodes from those steps that would pull the legacy stream into the capture on torch "
                f"{torch.__version__} (< 2.13). Build FullIterationCudaGraph before the first training step, or call "
                "fsdp_cudagraph.use_side_stream() once at start-up")
        if self._attention is not None:
            mismatched = self._attention.mismatches()
            if mismatched and self.attention_backend == "error":
                raise RuntimeError("fsdp_cudagraph: cannot capture: " + mismatch_message(mismatched, "error"))
            if mismatched and self.attention_backend == "warn":
                attention_notice(mismatched, "warn", logger)  # one line, rank 0, once per process

    def _capture_cuda(self, slot: _Slot, static_batch: Any, log: List[str]) -> Tuple[Any, Any, None]:
        torch.cuda.synchronize(self.device)
        self._barrier()  # ranks capture together (nothing runs during capture; this keeps logs readable)
        graph, out = _recipe.capture_graph(
            lambda: self._body(slot)(static_batch), device=self.device, phase=_KINDS[slot.kind],
            guard=lambda: self.engine.static_capture_guard(allow_collectives=True, collective_log=log),
            generators=self.generators)
        return graph, out, None

    def _run_protocol(self, slot: _Slot, static_batch: Any, log: List[str]) -> Tuple[Any, list]:
        """One capture or replay on the protocol backend: the step under simulated capture, phases recorded."""
        with self.engine.recording_phases() as trace, _capture_state.simulated_capture(), \
                self.engine.simulated_capture(), \
                self.engine.static_capture_guard(allow_collectives=True, collective_log=log), \
                CaptureSafetyCheck(self.device, _KINDS[slot.kind]):
            out = self._body(slot)(static_batch)
        return out, trace

    def _barrier(self) -> None:
        if self.engine.collective_backend == "nccl":
            dist.barrier(group=self.engine.process_group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.engine.process_group)

    def _agree_across_ranks(self, log: List[str], what: str) -> None:
        _recipe.agree_collectives(log, what, rank=self.engine.rank, world_size=self.engine.world_size,
                                  group=self.engine.process_group)

    # ------------------------------------------------------------------ replay
    def _replay(self, slot: _Slot, leaves: List[torch.Tensor]) -> Any:
        engine = self.engine
        engine.quiesce()  # an eager collective still in flight would race with the graph
        for s, t in zip(slot.static_leaves, leaves):
            s.copy_(t)
        bound = slot.bound if slot.kind == "train" else engine.grads_bound()
        if self.backend == "torch":
            slot.graph.replay()
        else:
            self._protocol_replay(slot)
        engine.end_static_step(bound=bound)
        slot.replays += 1
        if slot.kind == "train":
            return slot.output.clone()
        return tuple(o.clone() for o in slot.output)

    def _protocol_replay(self, slot: _Slot) -> None:
        """Re-run the step from the capture's starting state; it must issue exactly what the capture issued."""
        self.engine.begin_static_step(replace_grads=slot.kind == "train")
        log: List[str] = []
        out, trace = self._run_protocol(slot, slot.static_batch, log)
        bound = self.engine.grads_bound()
        if log != slot.collectives or trace != slot.trace or (slot.kind == "train" and bound != slot.bound):
            first = next((i for i, (a, b) in enumerate(zip(log, slot.collectives)) if a != b), min(len(log), len(slot.collectives)))
            raise RuntimeError(
                f"[rank {self.engine.rank}] fsdp_cudagraph: protocol replay of {_KINDS[slot.kind]} took other host "
                f"decisions than its capture (collective {first}: {log[first:first + 1]} vs "
                f"{slot.collectives[first:first + 1]}; {len(log)} vs {len(slot.collectives)} collectives; phases equal: "
                f"{trace == slot.trace}; gradient units {sorted(bound)} vs {sorted(slot.bound)}); a CUDA graph would "
                "replay the capture's decisions and compute something else than an eager step")
        with torch.no_grad():
            if slot.kind == "train":
                slot.output.copy_(out)
            else:
                for o, n in zip(slot.output, out):
                    o.copy_(n)
