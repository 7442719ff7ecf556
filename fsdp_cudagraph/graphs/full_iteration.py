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
  value or break the capture; they are refused by name in a rehearsal of the last warmup step and during the
  capture ([Note: host syncs in a captured step]). Python values the step branches on (counters, flags) are
  not seen: frozen too.
- Python side effects of ``forward_step`` (appending to a list, counting calls) happen at capture only.
- RNG: PyTorch registers the default CUDA generator with every graph (each replay advances its offset as
  an eager step would); other generators (a tensor-parallel RNG tracker's) must be passed as
  ``generators``. The reference model has no dropout, so its bit-exact checks do not exercise this.
- Optimizer graph (with optional sync-free clipping, ``optimizer_step(opt, max_norm=...)``, its all-reduce
  captured too): hyperparameters, ``max_norm`` and each parameter's ``.grad`` are bound at capture and
  checked before each replay; a device-tensor ``lr`` updated in place is read (``graphs/optimizer.py``).
- Ranks: every rank must capture the same collectives in the same order (compared across ranks right after
  capture, ``capture/recipe.py`` ``agree_collectives``: a difference raises before the first replay).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fsdp_cudagraph.config import WHOLE_STEP_BACKENDS, CudaGraphConfig, CudaGraphImpl
from fsdp_cudagraph.engines.contract import PER_LAYER_BUFFERS, static_step_engine
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.graphs.optimizer import FullIterationReport, OptimizerGraph
from fsdp_cudagraph.graphs.partial import refuse_graph_unsafe
from fsdp_cudagraph.capture import args as _args
from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.capture import protocol as _protocol
from fsdp_cudagraph.capture import streams as _streams
from fsdp_cudagraph.capture.attention import AttentionBackendMatcher, before_capture, check_policy
from fsdp_cudagraph.capture import recipe as _recipe
from fsdp_cudagraph.capture.capture_safety import CaptureSafetyCheck, rehearsal

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
    replays: int = 0
    eager_steps: int = 0
    fallbacks: int = 0
    warned: bool = False
    report: Optional[FullIterationReport] = None


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
        step = static_step_engine(engine, "FullIterationCudaGraph")
        if not callable(forward_step) or (eval_step is not None and not callable(eval_step)):
            raise TypeError("forward_step (and eval_step) must be callables: fn(model, *micro_batch) -> tensor")
        config = config if config is not None else CudaGraphConfig(cuda_graph_impl="full_iteration")
        if config.cuda_graph_impl != CudaGraphImpl.FULL_ITERATION:
            raise ValueError(f"FullIterationCudaGraph got cuda_graph_impl='{config.cuda_graph_impl}'; pass a config with "
                             "cuda_graph_impl='full_iteration', or use PartialCudaGraphs for per-layer graphs")
        backend = _streams.graph_backend(backend, step.device, FULL_ITERATION_BACKENDS)
        check_policy(attention_backend)
        _recipe.check_generators(generators, cuda=backend == "torch")
        if backend == "torch":
            config.check_runtime()
        step.require_fixed_buffers("FullIterationCudaGraph", PER_LAYER_BUFFERS)  # [Note: fixed addresses]
        # The whole step is one graph: any module that cannot be captured refuses it ([Note: graph-unsafe
        # modules] in config.py); per-layer graphs can leave such a module eager between graphs.
        refuse_graph_unsafe([("", engine.root)], what="FullIterationCudaGraph's model")
        #: The model the step functions are given; every question to its engine goes through ``engine``.
        self.model = model
        self.engine = engine
        #: The engine's static step (contract item 9): every host decision of a captured step goes through it.
        self.static_step = step
        self.forward_step = forward_step
        self.eval_step = eval_step if eval_step is not None else forward_step
        self.config = config
        self.backend = backend
        self.device = step.device
        self.graph_optimizer = graph_optimizer
        self.generators = tuple(generators)
        self.attention_backend = attention_backend
        warmup = config.cuda_graph_warmup_steps
        self._train = _Slot("train", warmup)
        self._eval = _Slot("eval", warmup)
        self._opt = OptimizerGraph(step, engine_name=engine.name, backend=backend, warmup=warmup, enabled=graph_optimizer,
                                   agree=self._agree)
        self.deleted = False
        self._steps_before_side_stream = 0
        self._attention: Optional[AttentionBackendMatcher] = None
        if backend == "torch":  # before any eager step: [Note: the default stream and graph capture]
            self._steps_before_side_stream = _streams.leave_legacy_stream(self.device,
                                                                         forward_calls=engine.num_forward_calls)
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
            self.static_step.release_main_grads()  # kept for this graph since its capture
        for slot in (self._train, self._eval):
            _recipe.reset_graph(slot.graph)
            slot.graph, slot.captured = None, False
            slot.static_leaves, slot.static_batch, slot.output = [], None, None
        self.static_step.quiesce()
        self.static_step.mark_params_stale()
        if self._attention is not None:
            self._attention.uninstall()
        self.deleted = True
        _recipe.free_memory(cuda=self.backend == "torch")

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
            loss = _args.call_with(self.forward_step, self.model, mb)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError(f"forward_step must return the micro-batch's loss, a one-element tensor that requires "
                                f"grad; micro-batch {i} gave {type(loss).__name__} "
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            loss.backward()
            losses.append(loss.detach().reshape(()))
        return torch.stack(losses)

    def _eval_body(self, micro_batches: Sequence[Any]) -> Tuple[torch.Tensor, ...]:
        with torch.no_grad():
            outs = tuple(_args.call_with(self.eval_step, self.model, mb) for mb in micro_batches)
        bad = [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]
        if bad:
            raise TypeError(f"eval_step must return a tensor per micro-batch; micro-batches {bad} did not")
        return outs

    def _eager(self, slot: _Slot, micro_batches: Sequence[Any], *, check: bool) -> Any:
        start = lambda: self.static_step.begin_static_step(replace_grads=slot.kind == "train")  # noqa: E731
        if check:  # run once under the host-sync check, discarded: [Note: the host-sync rehearsal] in capture_safety.py
            if self.backend == "torch":
                self._refuse_delayed_scaling()  # before the rehearsal, whose own errors would hide the reason
            with rehearsal(self.device, _KINDS[slot.kind], start=start, generators=self.generators):
                self._body(slot)(micro_batches)
        start()
        return self._body(slot)(micro_batches)

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
        static_leaves = [torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t) for t in leaves]
        static_batch = _args.rebuild(sig, static_leaves)[0][0]
        bindings = self.static_step.grads_bound()
        self.static_step.begin_static_step(replace_grads=train)
        log: List[str] = []
        meter = _recipe.CaptureMeter(self.device, cuda=self.backend == "torch")
        try:
            if self.backend == "torch":
                torch.cuda.synchronize(self.device)
                _recipe.barrier(self.static_step.process_group, device=self.device,  # ranks capture together
                                nccl=self.static_step.collective_backend == "nccl")
                graph, out = _recipe.capture_graph(
                    lambda: self._body(slot)(static_batch), device=self.device, phase=what, generators=self.generators,
                    guard=lambda: self.static_step.static_capture_guard(allow_collectives=True, collective_log=log))
            else:
                out, decisions = self._run_protocol(slot, static_batch, log)
                graph = _protocol.ProtocolGraph(
                    what, rank=self.engine.rank, run=lambda lg: self._run_protocol(slot, static_batch, lg),
                    start=lambda: self.static_step.begin_static_step(replace_grads=train), collectives=log,
                    decisions=decisions, outputs=out)
            bound = self.static_step.grads_bound() if train else bindings
        except BaseException as exc:
            # nothing of the failed capture runs; drop its host state without waiting on captured work
            self.static_step.end_static_step(bound=frozenset() if train else bindings)
            slot.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            _recipe.raise_translated(exc, what)
            raise
        self.static_step.end_static_step(bound=bound)  # host state as after a replay: nothing ran yet
        self._agree(log, what)
        slot.graph, slot.output, slot.collectives = graph, out, log
        slot.static_leaves, slot.static_batch, slot.signature, slot.bound = static_leaves, static_batch, sig, bound
        if train:
            self.static_step.keep_main_grads()  # the graph writes them at these addresses; delete() releases
        slot.captured = True
        slot.report = FullIterationReport(slot.kind, self.backend, meter.seconds(), meter.memory(), len(static_batch),
                                          list(log), sorted(bound) if train else [])
        logger.info("fsdp_cudagraph: captured %s (%s backend, %d micro-batches, %d collectives) in %.2f s",
                    what, self.backend, len(static_batch), len(log), slot.report.capture_seconds)

    def _check_capturable(self) -> None:
        hazard = _streams.legacy_stream_hazard(steps_before_side_stream=self._steps_before_side_stream,
                                               built="FullIterationCudaGraph")
        if hazard is not None:
            raise RuntimeError(f"[rank {self.engine.rank}] fsdp_cudagraph: cannot capture: {hazard}")
        if self._attention is not None:  # error: refused; warn: one line, rank 0, once per process
            before_capture(self._attention, self.attention_backend, logger, notice=("warn",))
        self._refuse_delayed_scaling()

    def _refuse_delayed_scaling(self) -> None:
        delayed = _fp8.delayed_scaling_modules(self.engine.root)
        if delayed:
            raise NotImplementedError(
                f"[rank {self.engine.rank}] fsdp_cudagraph: cannot capture the step: TE modules {delayed[:3]} train "
                "in FP8 with delayed scaling (FP8 attention keeps it under every recipe), whose gradient scales TE "
                "updates on the host after the first FP8 module's backward and skips while a capture is under way (a "
                "replayed step would never update them). Use the 'current' or 'block' recipe with attention in bf16 "
                "in whole-step graphs, or per-layer graphs (PartialCudaGraphs, backend 'te') for delayed scaling")

    def _agree(self, log: List[str], what: str) -> None:  # the group is read now: the engine holds it weakly
        _recipe.agree_collectives(log, what, rank=self.engine.rank, world_size=self.static_step.world_size,
                                  group=self.static_step.process_group)

    def _run_protocol(self, slot: _Slot, static_batch: Any, log: List[str]) -> Tuple[Any, Dict[str, Any]]:
        """One capture or replay on the protocol backend: the step under simulated capture; its outputs and host
        decisions (phases, and the units whose gradients a training step wrote)."""
        guard = self.static_step.static_capture_guard(allow_collectives=True, collective_log=log)
        with self.static_step.recording_phases() as trace, _protocol.capture_pass(
                self.engine.simulated_capture(), guard, CaptureSafetyCheck(self.device, _KINDS[slot.kind])):
            out = self._body(slot)(static_batch)
        units = sorted(self.static_step.grads_bound()) if slot.kind == "train" else None
        return out, {"phases": trace, "gradient units": units}

    # ------------------------------------------------------------------ replay
    def _replay(self, slot: _Slot, leaves: List[torch.Tensor]) -> Any:
        step = self.static_step
        step.quiesce()  # an eager collective still in flight would race with the graph
        for s, t in zip(slot.static_leaves, leaves):
            s.copy_(t)
        bound = slot.bound if slot.kind == "train" else step.grads_bound()
        slot.graph.replay()  # protocol backend: checked against the capture (capture/protocol.py)
        step.end_static_step(bound=bound)
        slot.replays += 1
        return slot.output.clone() if slot.kind == "train" else tuple(o.clone() for o in slot.output)

