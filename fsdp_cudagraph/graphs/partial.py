"""Partial (per-layer) CUDA graphs of modules that ``megatron_fsdp`` has wrapped.

Lifecycle::

    graphs = PartialCudaGraphs(fsdp_model, config)   # selects callables, starts recording sample args
    for step in range(num_steps):
        if step == config.cuda_graph_warmup_steps:
            graphs.capture()                          # after real eager steps: shapes and state are known
        loss = loss_fn(fsdp_model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
    graphs.delete()                                   # back to eager, hooks as before capture

Hazards (the rules that keep replay correct):
- Replay reads parameters and writes outputs at the addresses of capture. ``megatron_fsdp`` guarantees
  stable addresses only with ``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``; before
  every replay a forward-pre hook compares each graphed callable's parameter addresses (and its unit's
  gradient buffer) with those recorded at capture and raises on any difference.
- FSDP collectives never enter a graph: the engine's hooks are taken off the captured modules and run
  around warmup and capture by the backend (TE's ``capture_time_hooks``), then restored, so at replay they
  fire around the graph through ``nn.Module.__call__``. The engine raises if asked for a collective while
  a capture is under way.
- Inputs are copied into static buffers and outputs are static buffers overwritten by the next replay of
  the same callable: do not keep a graphed callable's output across its next call.
- Each graphed callable runs once per forward with the shapes of capture (the reference model's are
  static); a graphed module in a different training/eval mode than at capture runs eagerly (TE).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn

# te: TE's make_graphed_callables; torch: torch.cuda.make_graphed_callables; protocol: the same warmup/capture
# schedule and hook calls without graphs (runs on CPU). [Note: backends] in config.py.
from fsdp_cudagraph.config import BACKENDS, CudaGraphConfig, graph_unsafe_modules, module_tag
from fsdp_cudagraph.engines.contract import PerLayerEngine, per_layer_engine
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.hooks import HOOK_DICTS, extract_hooks, restore_hooks
from fsdp_cudagraph.offload import offloader as _offload
from fsdp_cudagraph.capture import args as _args
from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.capture import schedules as _schedules
from fsdp_cudagraph.capture.schedules import CaptureReport, GraphedCallable as _Callable
from fsdp_cudagraph.capture import protocol as _protocol
from fsdp_cudagraph.capture import recipe as _recipe
from fsdp_cudagraph.capture import streams as _streams
from fsdp_cudagraph.capture.attention import AttentionBackendMatcher, before_capture, check_policy
from fsdp_cudagraph.capture.te import require_te

__all__ = ["PartialCudaGraphs", "CaptureReport", "BACKENDS", "select_modules", "match_graph_attention"]

logger = logging.getLogger(__name__)

#: Said when the replay check finds a cached FP8 weight moved ([Note: quantized weights across micro-batches]).
_FP8_HINT = (" A TE module dropped or replaced its FP8 weight cache (_fp8_workspaces; TE does on a recipe change), "
             "which the graph keeps writing and reading at the old address.")



def select_modules(engine: PerLayerEngine, config: CudaGraphConfig) -> List[Tuple[str, nn.Module]]:
    """The (qualified name, module) pairs of ``engine.root`` that ``config`` selects as graphed callables, in
    module order. ``engine``: the model's adapter (``adapter_for(model)``, resolved once by the caller)."""
    root = engine.root
    cfg = config
    named = list(root.named_modules())
    if cfg.cuda_graph_module_patterns:
        pats = list(cfg.cuda_graph_module_patterns)
        chosen = [(n, m) for n, m in named if n and any(fnmatch.fnmatchcase(n, p) or type(m).__name__ == p for p in pats)]
        if not chosen:
            raise ValueError(f"cuda_graph_module_patterns={pats} match no submodule; patterns are globs over qualified names (e.g. 'layers.*.attn') or class names")
    elif not cfg.cuda_graph_modules:
        unit_ids = {id(m) for m in engine.unit_modules()}
        if not unit_ids:
            raise ValueError("cuda_graph_modules=[] (whole layers) needs a sharded model (e.g. megatron_fsdp) whose units are the layers, or cuda_graph_module_patterns")
        chosen = [(n, m) for n, m in named if id(m) in unit_ids]
        # Units may nest (FSDP2 with expert parallelism: each experts module is a unit inside its layer); a
        # whole-layer graph is the outermost unit, and refuse_graph_unsafe judges what it contains.
        chosen = [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen if o)]
    else:
        wanted = {getattr(v, "value", v) for v in cfg.cuda_graph_modules}
        # A tag on the instance (``layer.attn.cuda_graph_module = "attn"``) or on its class.
        chosen = [(n, m) for n, m in named if module_tag(m) in wanted]
        found = {module_tag(m) for _, m in chosen}
        missing = sorted(wanted - found)
        if missing:
            tags = sorted({t for _, m in named if (t := module_tag(m))})
            raise ValueError(
                f"cuda_graph_modules includes {missing} but no submodule of {type(root).__name__} is tagged "
                f"so (tags present: {tags}); drop them, or set `cuda_graph_module` on the classes or instances "
                "to graph"
            )
    names = [n for n, _ in chosen]
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"selected callables {a!r} and {b!r} are nested; graph one or the other")
    refuse_graph_unsafe(chosen)
    return chosen


def refuse_graph_unsafe(chosen: List[Tuple[str, nn.Module]], *, what: str = "graphed callable") -> None:
    """Refuse selected callables that contain a module declaring ``cuda_graph_unsafe`` ([Note: graph-unsafe
    modules] in ``config.py``): capture would fail on its host sync, or replay stale shapes."""
    for name, module in chosen:
        unsafe = graph_unsafe_modules(module)
        if unsafe:
            inner, reason = unsafe[0]
            inner_name = ".".join(p for p in (name, inner) if p) or type(module).__name__
            raise ValueError(
                f"{what} {name or type(module).__name__!r} contains {inner_name!r}, which cannot be captured: "
                f"{reason}. Fixes: graph around it (e.g. PartialCudaGraphs with cuda_graph_modules=['attn', "
                "'moe_router', 'moe_preprocess'] runs the experts eagerly between graphs, as Megatron does for "
                "dropless MoE), "
                "or, where its reason allows, make it capturable (the reference model without expert parallelism: "
                "moe_experts='grouped_mm' with device offsets, no sync)")


class PartialCudaGraphs:
    """Select, capture, check and delete per-layer CUDA graphs of a (``megatron_fsdp``-wrapped) model.

    Args:
        model: a :class:`megatron_fsdp.MegatronFSDP` (or a plain module, without FSDP).
        config: the :class:`CudaGraphConfig`; ``cuda_graph_modules`` picks submodules by their
            ``cuda_graph_module`` tag (empty: the FSDP units, i.e. whole layers), or
            ``cuda_graph_module_patterns`` picks them by qualified-name glob or class name.
        backend: ``te``, ``torch`` or ``protocol``; default from ``config.cuda_graph_impl``
            (``transformer_engine`` -> te, ``local`` -> torch).
        attention_backend: what to do when TE attention inside a graphed callable would pick another backend
            under capture than eagerly (see [Note: attention backends under capture] in ``capture/attention.py``):
            ``match_graph`` (default) makes the eager steps use the graph's backend from now on, ``warn``
            keeps TE's eager choice and warns at capture, ``error`` refuses the capture.
        fp8: the run's :class:`~fsdp_cudagraph.capture.fp8.FP8Recipe` (TE backend only): TE's graph maker captures
            the callables in FP8 with its recipe and amax reduction group, the same object's ``autocast()`` must
            wrap each micro-batch's forward, eager steps and replays alike ([Note: the FP8 region under graphs]).
            None: built from ``config.fp8_recipe`` when that is set (default group), else no FP8. Exposed as
            ``self.fp8``.
        clone_param_grads: TE backend: return clones of the graph's parameter gradients (TE's default) rather
            than its static buffers. ``False`` saves a copy per parameter per replay and is safe when nothing
            keeps a returned gradient past the next replay of its callable: autograd's AccumulateGrad copies a
            gradient it cannot own into ``.grad``, and megatron_fsdp folds ``.grad`` into its buffer at the
            unit's post-backward (the torch backend never clones).

    Streams: building it moves this thread off the legacy default CUDA stream (backends ``te`` and
    ``torch``; see [Note: the default stream and graph capture] in ``capture/streams.py``), so build it before the
    first training step: the eager steps before capture must run on a stream a capture can join.
    """

    def __init__(self, model: nn.Module, config: CudaGraphConfig, *, backend: Optional[str] = None,
                 attention_backend: str = "match_graph", clone_param_grads: bool = True,
                 fp8: Optional[_fp8.FP8Recipe] = None) -> None:
        check_policy(attention_backend)
        self.config = config
        self.attention_backend = attention_backend
        self.clone_param_grads = clone_param_grads
        #: The engine contract (a plain module's adapter without an engine); every question to the engine goes
        #: through it, and everything this object builds is handed it (nothing resolves the model again).
        self.engine = per_layer_engine(adapter_for(model), "PartialCudaGraphs")
        self.root = self.engine.root
        if backend is None:
            backend = config.backend
        if backend not in BACKENDS:
            raise ValueError(
                f"backend={backend!r} is not one of {BACKENDS}; with backend=None set cuda_graph_impl to "
                "'transformer_engine' or 'local'"
            )
        self.backend = backend
        self.fp8 = fp8_for(config, fp8, backend)
        if self.fp8 is not None and not self.engine.fp8_supported:
            raise NotImplementedError(
                f"{self.fp8!r} under {self.engine.name} is not supported yet: FP8 with TE's graph maker has been "
                "proven bit-exact against eager under megatron_fsdp only; under "
                f"{self.engine.name} TE's FP8 weights and their cached quantized copies would meet the engine's own "
                "parameter handling (its resharding or FP8 buffers), which has not run. Train FP8 with graphs under "
                "megatron_fsdp (docs/fp8.md), or without FP8 here")
        if backend != "protocol":
            # The machine first, before any hook or stream changes: a missing GPU or TE is known now, not
            # after the warmup steps.
            config.check_runtime()
            if self.fp8 is not None:  # this GPU and CUDA run the recipe (block scaling needs Hopper)
                self.fp8.check_runtime()
        self.engine.check_partial_graphs()
        self.callables = self._select()
        # config.activation_offload_*: built now (the next eager step is recorded), boundaries checked here.
        self.offload = _offload.offloader_for(self.engine, config, [(c.name, c.module) for c in self.callables])
        # Before the eager steps that precede capture: no autograd node of theirs may live on the legacy
        # default stream ([Note: the default stream and graph capture]).
        self._steps_before_side_stream = 0
        if backend in ("te", "torch") and _streams.on_legacy_default_stream():
            self._steps_before_side_stream = self.engine.num_forward_calls
            _streams.use_side_stream()
        self._attention = AttentionBackendMatcher(
            {c.name: c.module for c in self.callables}, force=attention_backend == "match_graph"
        )
        self._order: List[_Callable] = []
        self._recorders = [
            c.module.register_forward_pre_hook(self._recorder(c), with_kwargs=True) for c in self.callables
        ]
        self._checks: List[Any] = []
        self.captured = False
        #: Set by delete(): the recorders and hooks are gone, so these graphs can never capture again.
        self.deleted = False
        self.report: Optional[CaptureReport] = None

    # ------------------------------------------------------------------ selection
    def _select(self) -> List[_Callable]:
        out = []
        for n, m in select_modules(self.engine, self.config):
            out.append(_Callable(name=n, module=m, unit=self.engine.unit_of(m)))
        return out

    def _recorder(self, c: _Callable):
        def record(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            # Never raises mid-step: arguments a graph cannot bind are refused by capture() (check_recorded).
            # Calls without gradients (evaluation under no_grad) are not training calls: a graph captured from
            # one would never replay in training.
            if not torch.is_grad_enabled():
                return
            if c not in self._order:
                self._order.append(c)
            c.sample_args, c.signature = _args.record_call(args, kwargs)
            c.sample_kwargs = {}

        return record

    # ------------------------------------------------------------------ capture
    def capture(self) -> CaptureReport:
        """Capture every selected callable (after at least one eager step). Restores hooks on failure."""
        if self.deleted:
            raise RuntimeError("capture() after delete(): these graphs no longer record the eager steps they would "
                               "capture from; build a new PartialCudaGraphs(model, config), run at least one eager "
                               "training step, then call its capture()")
        if self.captured:
            raise RuntimeError("capture() was already called; delete() these graphs and build a new PartialCudaGraphs "
                               "to capture again")
        self.check_capturable()
        not_run = [c.name for c in self.callables if c.sample_args is None]
        if not_run:
            raise RuntimeError(
                f"callables {not_run[:5]} did not run in an eager step before capture, so their sample args are "
                "unknown; run at least one eager training step (cuda_graph_warmup_steps >= 1) before capture()"
            )
        self.check_callables(self.callables)
        self.check_fp8(self.callables)
        before_capture(self._attention, self.attention_backend, logger)  # error refuses; else one line, rank 0
        attention_backends = {n: dict(s) for n, s in self._attention.selections.items()}
        self.stop_recording()
        self._attention.remove_hooks()  # graph makers refuse modules with hooks; capture selects as captured
        order = self._order + [c for c in self.callables if c not in self._order]
        try:
            seconds, mem, reserved0, unknown = self.capture_order(order, install=self._install, pool_for=lambda _: {})
        finally:
            self._attention.uninstall()  # replays select nothing; eager calls go back to TE's own choice
        for c in order:
            self._checks.append(c.module.register_forward_pre_hook(self.arm_address_check(c)))
        self._order = order
        self.captured = True
        if self.fp8 is not None:
            _fp8.captured_with(self.fp8, self)
        self.report = CaptureReport(self.backend, [c.name for c in order], seconds, mem, unknown, attention_backends,
                                    _schedules.memory_breakdown(order, mem, reserved0))
        return self.report

    # ------------------------------------------------------------------ the capture core (also LengthBucketGraphs')
    def check_capturable(self) -> None:
        """Refuse a capture that stale legacy-stream autograd nodes would break ([Note: the default stream and
        graph capture]); the machine itself was checked when this object was built."""
        if self.backend != "protocol":
            hazard = _streams.legacy_stream_hazard(steps_before_side_stream=self._steps_before_side_stream)
            if hazard is not None:
                raise RuntimeError(f"fsdp_cudagraph: cannot capture: {hazard}")

    def check_callables(self, callables: List[_Callable]) -> None:
        """Refuse recorded calls a graph cannot bind, and callables whose unit recomputes its forward."""
        _args.check_recorded(callables)
        # A unit under activation checkpointing re-runs its forward inside backward, where a
        # graphed callable would replay out of the captured schedule: refused, the engine tells which units.
        recomputed = sorted({self.engine.unit_name(c.unit) for c in callables if c.unit is not None
                             and self.engine.unit_uses_recompute(c.unit)})
        if recomputed:
            raise NotImplementedError(
                f"FSDP units {recomputed[:5]} run under activation checkpointing (their forward is recomputed in "
                "backward); partial graphs of such units are not supported: graph other layers, or do not "
                "checkpoint the graphed layers")

    def check_fp8(self, callables: List[_Callable]) -> None:
        """With FP8: refuse a capture inside a TE autocast region (TE's graph maker opens its own per callable, and
        the scaling bookkeeping of the outer one would mix with it), shapes TE's FP8 GEMMs refuse, and a capture
        that TE's process-wide weight flag would break ([Note: TE's one weight flag] in ``capture/fp8.py``)."""
        ran_fp8, ran_plain = _fp8.te_modules_by_last_forward((c.name, c.module) for c in callables)
        if self.fp8 is None:
            if ran_fp8:
                raise ValueError(
                    f"fsdp_cudagraph: TE modules {ran_fp8[:3]} ran their last forward in FP8 (inside TE's autocast), "
                    "but these graphs have no FP8 recipe: TE's graph maker would capture them without FP8, and the "
                    "replays would compute in bf16 what the eager steps computed in FP8. Pass the recipe of your "
                    "autocast: PartialCudaGraphs(..., fp8=FP8Recipe(name)) or CudaGraphConfig(fp8_recipe=name), and "
                    "run each micro-batch's forward under that object's autocast()")
            return
        if ran_plain and not ran_fp8:
            raise ValueError(
                f"fsdp_cudagraph: these graphs capture with {self.fp8!r}, but no TE module of the graphed callables "
                f"ran FP8 in the eager steps before capture ({ran_plain[:3]} ran without it): the replays would "
                "compute in FP8 what the eager steps computed in bf16. Run each micro-batch's forward under "
                "`with fp8.autocast():` (the same FP8Recipe object), or build the graphs without fp8")
        if _fp8.te_autocast_active():
            raise RuntimeError(
                "fsdp_cudagraph: capture() was called inside a TE autocast region; TE's graph maker wraps each "
                "callable in its own FP8 autocast while it captures, and an open region would take the scaling "
                "bookkeeping of warmup as its own. Call capture() between steps, outside `with fp8.autocast():`")
        problems = [p for c in callables for p in _fp8.fp8_gemm_problems(c.name, c.module, c.sample_args or ())]
        if problems:
            raise ValueError(f"fsdp_cudagraph: {self.fp8!r} cannot capture these callables: {'; '.join(problems[:3])}"
                             f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}. Pad the sequence "
                             "(tokens per micro-batch a multiple of 8) and pick hidden sizes that are multiples of 16, "
                             "or train these layers without FP8")
        _fp8.before_te_capture(self.fp8, self)  # last: it may reset TE's weight flag ([Note: TE's one weight flag])

    def stop_recording(self) -> None:
        """Stop recording the callables' eager calls (their sample args); capture() does it, length buckets
        (which record calls of their own) right away."""
        for h in self._recorders:
            h.remove()
        self._recorders = []

    def capture_order(self, order: List[_Callable], *, install: _schedules.Install,
                      pool_for: _schedules.PoolFor) -> Tuple[float, int, int, List[str]]:
        """Capture ``order`` (callables whose ``sample_args`` and ``signature`` are set) with this object's
        backend, engine and offloader, handing each result to ``install(c, wrapper, graphed)``; ``pool_for``
        gives one graph-maker call's extra arguments. Hooks are taken off and put back exactly, and a failure
        undoes what was installed. Returns (seconds, graph memory bytes, memory reserved before, unknown hooks).
        """
        self.engine.reset()
        for c in order:
            c.extracted = None
            c.had_forward_attr = "forward" in c.module.__dict__
            c.own_forward = c.module.__dict__.get("forward")
        mem0 = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        reserved0 = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        t0 = time.perf_counter()
        try:
            for c in order:
                c.extracted = extract_hooks(c.module, hook_plan=self.engine.hook_plan)  # phase 2: the engine's reading
            _schedules.plan_hooks(order, lambda unit: self.engine.hook_plan(
                {name: getattr(unit, name) for name in HOOK_DICTS}).capture_time)
            self.engine.prepare_capture(list({id(c.unit): c.unit for c in order if c.unit is not None}.values()))
            for c in order:
                c.capture_params = tuple(c.module.parameters())
            with _streams.stale_stream_override(), _offload.graph_maker(self.offload), _schedules.parked_grad_hooks(order):
                self._run_schedule(order, install, pool_for)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except BaseException:
            for c in order:
                _schedules.restore_forward(c)
                for attr in ("reset", "backward_dw"):
                    c.module.__dict__.pop(attr, None)
            raise
        finally:
            for c in order:
                if c.extracted is not None:
                    restore_hooks(c.extracted)
            self.engine.reset()
        seconds = time.perf_counter() - t0
        unknown = [f"{c.name}.{d}[{hid}]={getattr(h, '__qualname__', repr(h))}" for c in order for d, hid, h in c.extracted.unknown]
        if unknown:
            logger.warning("fsdp_cudagraph: hooks kept but not run at capture time (they fire around replays): %s", unknown)
        mem = (torch.cuda.memory_allocated() - mem0) if torch.cuda.is_available() else 0
        return seconds, mem, reserved0, unknown

    def arm_address_check(self, c: _Callable) -> Callable[[nn.Module, Tuple[Any, ...]], None]:
        """Record, right after capture, the addresses a replay of ``c`` reads; return its pre-replay check."""
        # What a replay reads by address is the engine's answer (its parameters may be swapped in by its own
        # pre-forward hook, as FSDP2's are; a plain module's are its parameters), read through one probe.
        c.replay_ptrs = self._replay_ptrs(c)
        c.probe = self.engine.replay_probe(c.module)
        if c.probe() != tuple(ptr for _, ptr in c.replay_ptrs):
            raise RuntimeError(f"fsdp_cudagraph: the {self.engine.name} adapter's replay_probe({c.name}) disagrees "
                               "with its replay_tensors (same tensors, same order); fix the adapter")
        # FP8 weights cached across micro-batches sit outside the graphs' memory, written and read by them.
        c.quantized_probe = _fp8.quantized_weight_probe(c.module) if self.fp8 is not None else None
        return self._address_check(c)

    def _run_schedule(self, order: List[_Callable], install: _schedules.Install, pool_for: _schedules.PoolFor) -> None:
        """The backend's schedule (``capture/schedules.py``) over ``order``, installing each result."""
        wrappers = self._wrappers(order)
        n = self.config.cuda_graph_num_warmup_iters
        if self.backend == "torch":
            # [Note: the engine contract] item 8: the engine's handlers gather only the unit being captured.
            return _schedules.capture_torch(order, wrappers, num_warmup_iters=n, install=install,
                                            pool_for=pool_for, unit_scope=self.engine.one_unit_at_a_time)
        who = self.engine.name
        hooks = [_schedules.capture_time_hooks(c, guard=lambda c=c: _schedules.check_params(c, who)) for c in order]
        if self.backend == "te":
            extra = dict(_offload.te_warmup_hooks(self.offload))  # offloading on for capture only
            if self.fp8 is not None:
                extra.update(self.fp8.graph_maker_kwargs())
            return _schedules.capture_te(order, wrappers, hooks, te=require_te("cuda_graph_impl='transformer_engine'"),
                                         num_warmup_iters=n, install=install,
                                         clone_param_grads=self.clone_param_grads, pool_for=pool_for, extra=extra)
        _schedules.capture_protocol(order, wrappers, hooks, num_warmup_iters=n, install=install,
                                    region=self._simulated_capture)

    def _simulated_capture(self) -> ContextManager[None]:
        # Our capture flag (offloading reads it) and the engine's guard ([Note: the engine contract], item 4).
        return _protocol.capture_pass(self.engine.simulated_capture())

    # ------------------------------------------------------------------ calls with constants (see capture/args.py)
    def _wrappers(self, order: List[_Callable]) -> Dict[_Callable, _args.CallWrapper]:
        """What each backend captures: a module taking the recorded call's tensors, constants bound."""
        return {c: _args.CallWrapper(c.module, c.name, c.signature, c.module.forward) for c in order}

    def _install(self, c: _Callable, wrapper: _args.CallWrapper, graphed: Any) -> None:
        """After capture: the module's forward checks each call against capture's and replays or runs eagerly."""
        for attr in ("reset", "backward_dw"):  # graph makers attach these to the module they were given
            if attr in wrapper.__dict__:
                c.module.__dict__[attr] = wrapper.__dict__[attr]
        # TE's graphs of cached FP8 weights take is_first_microbatch at each replay
        caching = self.fp8 is not None and self.fp8.cache_quantized_params
        c.module.forward = _args.Dispatcher(c.module, c.name, graphed, wrapper, wrapper.eager_forward,
                                            strict=self.config.cuda_graph_strict_signature,
                                            on_replay=self._on_replay(c),
                                            replay_kwargs=self.fp8.replay_kwargs if caching else None)

    def _on_replay(self, c: _Callable) -> Optional[Callable[[], None]]:
        """What a replay of ``c`` tells the engine (which module's graph ran), or None."""
        return self.engine.replay_notice(c.module)

    def _replay_ptrs(self, c: _Callable) -> Tuple[Tuple[str, int], ...]:
        """(name, address) of every tensor the engine says a replay of ``c`` reads or writes, read live."""
        return tuple((n, t.data_ptr()) for n, t in self.engine.replay_tensors(c.module))

    def _address_check(self, c: _Callable):
        rank = self.engine.rank
        unit_name = self.engine.unit_name(c.unit) if c.unit is not None else "-"
        hint = self.engine.address_hint

        probe, probed = c.probe, tuple(ptr for _, ptr in c.replay_ptrs)
        qprobe, qnames = c.quantized_probe or (None, ())
        qprobed = qprobe() if qprobe is not None else ()

        def check(module: nn.Module, args: Tuple[Any, ...]) -> None:
            # The hot path is one tuple comparison per replay, its addresses read by the probe resolved at capture
            # (no model walk: flat in depth); names are looked up only to report.
            moved = None
            if probe() != probed:
                now = self._replay_ptrs(c)
                if now != c.replay_ptrs:
                    moved = [(n if n.startswith("gradient") else f"parameter {n}", ptr, new)
                             for (n, ptr), (_, new) in zip(c.replay_ptrs, now) if new != ptr] or [
                        ("set of replay tensors", 0, 0)]
            if qprobe is not None and not moved:
                now_q = qprobe()
                if now_q != qprobed:
                    moved = [(f"quantized weight {n}", ptr, new) for n, ptr, new in zip(qnames, qprobed, now_q)
                             if new != ptr]
            if moved:
                what, ptr, now_ptr = moved[0]
                extra = _FP8_HINT if what.startswith("quantized weight") else ""
                raise RuntimeError(
                    f"[rank {rank}] fsdp_cudagraph: graphed callable {c.name} (unit {unit_name}) would replay with "
                    f"{what} at {now_ptr:#x}, but it was captured at {ptr:#x}; replay would read stale memory. "
                    f"{hint}{extra} Do not reassign parameters, engine buffers or FP8 weight caches after capture (or "
                    "delete() these graphs and capture with a new PartialCudaGraphs)"
                )

        return check

    # ------------------------------------------------------------------ delete
    def delete(self) -> None:
        """Reset the graphs, give their memory back and return the modules to eager (hooks as before).

        The modules end exactly as they were before this object existed; to capture again, build a new
        :class:`PartialCudaGraphs` and run at least one eager step before its ``capture()``. The thread stays
        on the side stream it was moved to (so that capturing again works; see ``capture/streams.py``).
        """
        for h in self._checks + self._recorders:
            h.remove()
        self._checks, self._recorders = [], []
        self._attention.uninstall()
        for c in self._order:
            if self.captured:  # else the modules are untouched (never captured, or the capture undid itself)
                reset = c.module.__dict__.get("reset")
                if callable(reset):
                    reset()
                _schedules.restore_forward(c)
                for attr in ("reset", "backward_dw"):
                    c.module.__dict__.pop(attr, None)
        for c in self.callables:
            c.sample_args, c.sample_kwargs = None, None
        self.captured = False
        self.deleted = True
        self._order = []
        if self.offload is not None:  # after the forwards above are back: it restores the modules' own
            self.offload.delete()
            self.offload = None
        _recipe.free_memory(cuda=torch.cuda.is_available())


def fp8_for(config: CudaGraphConfig, fp8: Optional[_fp8.FP8Recipe], backend: str) -> Optional[_fp8.FP8Recipe]:
    """The FP8 recipe of a per-layer graph kind: ``fp8`` (whose name must agree with ``config.fp8_recipe`` when
    both are given), else one built from ``config``; refused with another backend than ``te``."""
    if fp8 is not None and not isinstance(fp8, _fp8.FP8Recipe):
        raise TypeError(f"fp8 must be an FP8Recipe (fsdp_cudagraph.FP8Recipe('delayed')) or None, got "
                        f"{type(fp8).__name__}")
    if fp8 is not None and config.fp8_recipe is not None and (
            (fp8.name, fp8.cache_quantized_params, fp8.dot_product_attention)
            != (config.fp8_recipe, config.fp8_cache_quantized_params, config.fp8_dot_product_attention)):
        raise ValueError(f"fp8={fp8!r} disagrees with config.fp8_recipe={config.fp8_recipe!r}, "
                         f"fp8_cache_quantized_params={config.fp8_cache_quantized_params}, "
                         f"fp8_dot_product_attention={config.fp8_dot_product_attention}; give the same recipe to "
                         "both, or leave config.fp8_recipe unset")
    if fp8 is None and config.fp8_recipe is not None:
        fp8 = _fp8.FP8Recipe(config.fp8_recipe, cache_quantized_params=config.fp8_cache_quantized_params,
                             dot_product_attention=config.fp8_dot_product_attention)
    if fp8 is not None and fp8.dot_product_attention and fp8.name == "current":
        raise NotImplementedError(_fp8.attention_graph_problem(fp8.name))
    if fp8 is not None and backend != "te":
        raise NotImplementedError(
            f"{fp8!r} with backend={backend!r} is not supported: only TE's graph maker knows the FP8 state (it "
            "captures each callable inside TE's autocast and restores the scaling state its warmup changed); "
            "torch's graph maker and the protocol schedule do neither. Use backend='te' "
            "(cuda_graph_impl='transformer_engine')")
    return fp8


def match_graph_attention(model: nn.Module, config: CudaGraphConfig) -> AttentionBackendMatcher:
    """Make an eager run's TE attention pick, inside the callables ``config`` selects, the backend a graph would.

    For an eager baseline that must be bit-identical to a graphed run (``PartialCudaGraphs`` does the same to
    its own eager steps by default; see [Note: attention backends under capture]). Call ``.uninstall()``
    on the result when the run ends. Inert without TE.
    """
    return AttentionBackendMatcher(dict(select_modules(per_layer_engine(adapter_for(model), "match_graph_attention"),
                                                       config)), force=True)
