"""The engine contract: what a sharded data-parallel engine tells the graph layer.

The graph kinds never read an engine's internals. Each entry point asks ``engines.registry.adapter_for`` once
for the model's :class:`EngineAdapter` (an unwrapped module gets ``engines/plain.py``'s) and passes that adapter
on. The adapter answers for the model tree (its root, rank, device) and implements the roles its engine supports,
each a small ABC: :class:`PerLayerEngine` (items 1-8 below: per-layer graphs) and :class:`StaticStepEngine`
(item 9: whole-step graphs), reached through :meth:`EngineAdapter.static_step`. A graph kind tests for the role
it needs (:func:`per_layer_engine`, :func:`static_step_engine`) and refuses with NotImplementedError naming the
engine and itself. A new engine is one folder here with one adapter and one ``register_engine`` call; no graph
kind changes.

[Note: the engine contract]
An FSDP engine drives its communication from module hooks. A per-layer graph needs, from the engine:

1. **Its units.** Which modules carry the engine's per-unit hooks (``unit_modules``, in forward order:
   whole-layer graphs capture exactly these), and which unit owns a given submodule (``unit_of``), so that
   several callables of one unit run the unit's handlers once per pass.
2. **Its hooks, in TE's form.** Given a module's saved hook dicts, ``hook_plan`` says which hooks are the
   engine's and what each one does at capture time, as ``fn(module) -> None`` under TE's four
   ``capture_time_hooks`` keys. A hook that only *registers* a backward handler on tensors (autograd
   cannot use it at capture) carries a sentinel (``PRE_SENTINEL`` / ``POST_SENTINEL``, the inner handler):
   ``hookplan.read_sentinel``, which every adapter calls first, withholds it and plans the handler instead.
   The engine's own hooks that nothing runs at capture (e.g. call guards) are ``engine_only``: restored,
   never run at capture, not reported. Hooks the engine does not own are ``unknown``: restored, never run
   at capture, reported (they are the user's).
3. **What must not move.** ``replay_tensors`` names every tensor a replay of a callable reads or writes by
   address (parameters, gradient targets); the graph layer records their addresses at capture and
   refuses a replay if one moved. The check runs before every replay, so it reads the addresses through
   ``replay_probe``, resolved once at capture: a closure that knows where each tensor lives and reads
   its ``data_ptr`` (no model walk, whatever the depth). ``check_partial_graphs`` refuses, before any
   CUDA work, settings under which the engine cannot keep them still ([Note: fixed addresses]).
4. **No collective inside a capture.** ``capture_guard`` is entered around each capture pass: the
   engine's collectives raise ``RuntimeError`` inside it. ``simulated_capture`` is the same guard for
   the CPU protocol backend, which captures nothing. The graph layer enters its own capture flag
   (``fsdp_cudagraph.capture.state``) alongside; offloading reads that flag, never the engine's.
5. **A step boundary.** ``reset`` waits for anything in flight and brings every unit to idle; the graph
   layer calls it before and after capture.
6. **The parameters a capture reads.** TE's graph maker reads ``module.parameters()`` once, when it is
   called, before any capture-time hook runs, and makes those tensors the graph's inputs: their gradients
   are what a replay's backward returns. An engine that registers other tensors on the module in its
   pre-forward (FSDP2 swaps the sharded DTensor for the unsharded parameter) registers, in
   ``prepare_capture``, the ones its forward reads. The graph layer checks after every capture-time
   pre-forward that the registered parameters are the ones it captured with, and refuses the capture
   otherwise (the graph would compute gradients that reach no parameter).
7. **Replays the engine must hear of.** ``replay_notice`` (below).
8. **A capture one unit at a time.** TE's graph maker runs every forward in order, then every backward in
   reverse, as an eager step does. PyTorch's runs one unit's forward and backward back to back, so the
   graph layer runs that unit's pre-forward and pre-backward handlers together. ``one_unit_at_a_time``
   is entered around such a capture. An engine whose handlers prefetch the next unit turns prefetching off
   inside it. Otherwise the pre-backward handler prefetches the unit before this one while the pre-forward
   handler's prefetch still holds a buffer. NVIDIA's double buffer then has no free slot.
9. **A static step** (whole-step graphs: ``FullIterationCudaGraph``, its optimizer graph, and
   ``InferenceCudaGraphs``' block graphs, whose captures hold the engine's work, collectives included).
   The engine fixes its host decisions for the captured step (``begin_static_step`` / ``end_static_step``,
   ``quiesce``, ``grads_bound``, ``keep_main_grads`` / ``release_main_grads``, ``mark_params_stale``,
   ``recording_phases``), lets collectives into a capture (``static_capture_guard``), and says what the
   graph layer needs around it: ``require_fixed_buffers``, the process group, its backend and world size
   (the full-iteration barrier, the cross-rank comparisons of full-iteration and inference block graphs),
   the device, and the clipping a graphed optimizer step runs (inference selects layers by item 1's units).
   These are :class:`StaticStepEngine`; an engine without one is refused by :func:`static_step_engine`,
   naming itself and the graph kind. Partial graphs need none of them.

[Note: fixed addresses]
The one address rule: a graph reads and writes the engine's buffers at the addresses of its capture, so
every buffer *a replay touches* must be allocated once, never on demand. Which buffers that is depends on
the graph kind, and is the ``buffers`` argument of :meth:`StaticStepEngine.require_fixed_buffers`:

- per-layer graphs (``PartialCudaGraphs``, ``LengthBucketGraphs``) and whole training steps
  (``FullIterationCudaGraph``): ``("unshard", "gradient")``: the parameters a forward reads, and the
  gradient buffer a backward writes (TE's fused weight gradients write it from inside the graph);
- forward-only graphs (``InferenceCudaGraphs``): ``("unshard",)``: no gradient is written.

The engine phrases the refusal (its settings and their fix); the graph kinds only name themselves.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["EngineAdapter", "PerLayerEngine", "StaticStepEngine", "per_layer_engine", "static_step_engine", "HookPlan", "HOOK_KEYS", "HOOK_DICTS", "PRE_SENTINEL", "POST_SENTINEL", "CaptureTimeHook",
           "ReplayProbe", "PER_LAYER_BUFFERS", "FORWARD_ONLY_BUFFERS", "parameter_slots"]

#: TE's capture_time_hooks keys, in the order TE runs them in a step.
HOOK_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

#: The module hook dicts a hook plan reads, in the order nn.Module runs them.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: Attributes an engine puts on a hook that only registers a backward handler on tensors: the inner handler.
PRE_SENTINEL = "_cuda_graph_backward_pre_handler"
POST_SENTINEL = "_cuda_graph_backward_handler"

#: The buffers a graph kind needs at fixed addresses ([Note: fixed addresses]).
PER_LAYER_BUFFERS = ("unshard", "gradient")
FORWARD_ONLY_BUFFERS = ("unshard",)

CaptureTimeHook = Callable[[nn.Module], None]
#: What :meth:`PerLayerEngine.replay_probe` returns: the current addresses, in ``replay_tensors`` order.
ReplayProbe = Callable[[], Tuple[int, ...]]


@dataclasses.dataclass
class HookPlan:
    """An engine's reading of one module's hooks (phase 2 of the extraction in ``fsdp_cudagraph.hooks``)."""

    #: TE-form capture-time hooks: key (one of HOOK_KEYS) -> {hook_id: fn(module) -> None}.
    capture_time: Dict[str, Dict[int, CaptureTimeHook]] = dataclasses.field(
        default_factory=lambda: {k: {} for k in HOOK_KEYS})
    #: (dict name, hook id, hook) of the engine's wrappers whose inner handlers are planned instead.
    withheld: List[Tuple[str, int, Any]] = dataclasses.field(default_factory=list)
    #: (dict name, hook id, hook) of hooks the engine does not own: restored, reported, not run at capture.
    unknown: List[Tuple[str, int, Any]] = dataclasses.field(default_factory=list)
    #: (dict name, hook id, hook) of the engine's own hooks that nothing runs at capture (e.g. call guards):
    #: restored like the rest, not reported (they are not the user's).
    engine_only: List[Tuple[str, int, Any]] = dataclasses.field(default_factory=list)

    def claims_any(self) -> bool:
        """Whether the engine recognised any hook (planned, withheld or its own)."""
        return bool(any(self.capture_time.values()) or self.withheld or self.engine_only)


def parameter_slots(module: nn.Module) -> List[Tuple[Dict[str, Any], str]]:
    """(owning module's ``_parameters`` dict, name) per parameter, in ``module.named_parameters()`` order.

    For a :meth:`PerLayerEngine.replay_probe`: resolved once, then ``d[name].data_ptr()`` reads the parameter
    registered now (an engine that swaps parameter objects, or a user who reassigns one, is seen) in O(1).
    """
    seen, out = set(), []
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((m._parameters, n))
    return out


class EngineAdapter(abc.ABC):
    """One model as the graph layer sees it: the engine that wraps it (or none), its tree, rank and device.

    What the engine supports is a role: :class:`PerLayerEngine` (every built-in adapter) and, through
    :meth:`static_step`, :class:`StaticStepEngine`. Built once per model by ``registry.adapter_for`` at a graph
    kind's entry point and passed on; nothing resolves the model again.
    """

    #: Short name for messages, e.g. ``"megatron_fsdp"`` or ``"torch FSDP2"``.
    name: str = "engine"
    #: TE's FP8 under per-layer graphs is supported with this engine: proven bit-exact against eager on GPUs under
    #: megatron_fsdp (docs/fp8.md); a module without an engine adds nothing to TE's own graph maker. Under any other
    #: engine ``PartialCudaGraphs`` refuses an FP8 recipe (its parameter handling and TE's FP8 weights have not run).
    fp8_supported: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @classmethod
    @abc.abstractmethod
    def recognizes(cls, model: nn.Module) -> bool:
        """Whether ``model`` (what the user passed) is wrapped by this engine. Cheap; imports nothing new."""

    @classmethod
    def wrapper_of(cls, model: nn.Module) -> Optional[str]:
        """For a module this engine wraps *inside* a wrapper (a unit's or the root's inner module), a description
        of the object to pass instead (e.g. ``"the MegatronFSDP that fully_shard returned"``); None otherwise.

        ``adapter_for`` asks it of models no engine recognises and refuses them, so that every graph kind
        rejects the inner module at build instead of failing at capture.
        """
        return None

    @classmethod
    def bare_hook_plan(cls, hooks: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
        """:meth:`PerLayerEngine.hook_plan` without a wrapped model (``extract_hooks`` on a bare module); None: not
        supported. Asked by ``registry.plan_bare_hooks`` of every registered engine in turn.
        """
        return None

    @property
    @abc.abstractmethod
    def root(self) -> nn.Module:
        """The module tree callables are selected in (the user's model, unwrapped)."""

    @property
    def rank(self) -> int:
        """This process's rank, for ``[rank N]`` prefixes."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0

    @property
    def device(self) -> torch.device:
        """Where the model computes (the first parameter's device; CPU for a model without parameters)."""
        p = next(iter(self.model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def static_step(self) -> object:
        """The engine's :class:`StaticStepEngine` (this adapter itself by default; an engine may answer with an
        object of its own). Whole-step graph kinds ask it through :func:`static_step_engine`, which refuses
        anything that is not a :class:`StaticStepEngine`."""
        return self


class PerLayerEngine(abc.ABC):
    """Items 1-8 of [Note: the engine contract]: what per-layer graphs (partial, length buckets, inference
    layers) ask of an engine whose hooks run around each graphed callable."""

    #: The settings that keep replay tensors still, for the message of a refused replay (one sentence).
    address_hint: str = "Keep the engine's settings that hold its buffers at fixed addresses."

    # -- 1. units ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def unit_modules(self) -> List[nn.Module]:
        """The modules that carry the engine's per-unit hooks, in forward order (none for a plain module)."""

    @abc.abstractmethod
    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        """The unit module that owns ``module`` (itself or its nearest unit ancestor), None if none does."""

    def unit_name(self, unit: nn.Module) -> str:
        """The unit's qualified name in the adapter's root (for messages)."""
        for name, m in self.root.named_modules():  # type: ignore[attr-defined]
            if m is unit:
                return name or type(unit).__name__
        return type(unit).__name__

    def unit_uses_recompute(self, unit: nn.Module) -> bool:
        """Whether the unit's forward is recomputed in backward (activation checkpointing)."""
        return False

    @property
    def num_forward_calls(self) -> int:
        """Root forward calls so far (0 where the engine does not count them)."""
        return 0

    # -- 2. hooks ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def hook_plan(self, hooks: Mapping[str, Mapping[int, Any]]) -> HookPlan:
        """Read a module's saved hook dicts (``_forward_pre_hooks`` ... ``_backward_hooks`` and the flag dicts)."""

    # -- 3. what must not move -------------------------------------------------------------------
    @abc.abstractmethod
    def check_partial_graphs(self) -> None:
        """Raise ValueError (bad settings) or NotImplementedError (unsupported) before any CUDA work."""

    @abc.abstractmethod
    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) pairs a replay of ``module`` reads or writes by address, in a fixed order."""

    def replay_probe(self, module: nn.Module) -> ReplayProbe:
        """A closure, resolved now (at capture), returning the current addresses of ``replay_tensors(module)``.

        Called before every replay: it must cost the same at any model depth (no ``named_modules`` walk, no
        unit lookup). This default asks ``replay_tensors`` on each call; every built-in adapter overrides it.
        """
        def probe() -> Tuple[int, ...]:
            return tuple(t.data_ptr() for _, t in self.replay_tensors(module))
        return probe

    # -- 4. capture guard -------------------------------------------------------------------------
    def capture_guard(self) -> ContextManager[None]:
        """Entered around each real capture pass: the engine's collectives raise RuntimeError inside."""
        return contextlib.nullcontext()

    def simulated_capture(self) -> ContextManager[None]:
        """The same guard for the CPU protocol backend (nothing is captured)."""
        return self.capture_guard()

    # -- 5. step boundary -------------------------------------------------------------------------
    def reset(self) -> None:
        """Wait for anything in flight and bring every unit to idle (before and after capture)."""

    # -- 6. the parameters a capture reads ---------------------------------------------------------
    def prepare_capture(self, units: List[nn.Module]) -> None:
        """Register on each unit the parameters its forward reads (called after ``reset``, before capture)."""

    # -- 7. replays the engine must hear of -------------------------------------------------------
    def replay_notice(self, module: nn.Module) -> Optional[Callable[[], None]]:
        """A callable to run before each replay of ``module``'s graph, or None (the default: nothing to hear).

        An engine whose hooks learn at run time what a backward wrote (``megatron_fsdp``: which TE weights wrote
        their gradients into its buffer) cannot learn it from a replay, which runs no Python.
        """
        return None

    # -- 8. a capture one unit at a time ----------------------------------------------------------
    def one_unit_at_a_time(self) -> ContextManager[None]:
        """Entered around PyTorch's graph maker, which captures one unit's forward and backward together:
        the engine's handlers gather only the unit they are called for inside it (the default: nothing to do)."""
        return contextlib.nullcontext()


class StaticStepEngine(abc.ABC):
    """Item 9 of [Note: the engine contract]: an engine that can fix its host decisions for a captured step,
    so that whole-step graphs (``FullIterationCudaGraph``, its optimizer graph, ``InferenceCudaGraphs``' block
    graphs) may hold its work, collectives included.

    Lifecycle: ``require_fixed_buffers`` at build; ``begin_static_step`` before a capture and before every eager
    step standing in for a replay; ``grads_bound`` right after capture, ``keep_main_grads`` for a training step;
    ``quiesce`` and ``end_static_step`` around every replay; ``release_main_grads`` when the graph is deleted.
    Implemented by an engine's own object where it can be (``megatron_fsdp.graph_contract.StaticStep``,
    registered as a virtual subclass by its adapter), so that no adapter forwards one-liners.
    """

    @abc.abstractmethod
    def require_fixed_buffers(self, graph_kind: str, buffers: Sequence[str] = PER_LAYER_BUFFERS) -> None:
        """Raise ValueError unless every engine buffer of the kinds ``buffers`` keeps its address ([Note: fixed
        addresses]); ``graph_kind`` names the caller in the message."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the engine computes."""

    @property
    @abc.abstractmethod
    def process_group(self) -> Any:
        """The data-parallel process group whose collectives a static step captures."""

    @property
    @abc.abstractmethod
    def collective_backend(self) -> str:
        """That group's backend for this model's device (``"nccl"``, ``"gloo"``): the barrier needs it."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""

    @abc.abstractmethod
    def static_capture_guard(self, *, allow_collectives: bool, collective_log: Optional[List[str]] = None
                             ) -> ContextManager[None]:
        """Entered around a whole-step capture (and each protocol replay): collectives are captured when
        ``allow_collectives``, refused otherwise; each one appends its description to ``collective_log``."""

    @abc.abstractmethod
    def quiesce(self) -> None:
        """Before a replay: wait for collectives in flight, units to idle (cheap when nothing is pending)."""

    @abc.abstractmethod
    def begin_static_step(self, *, replace_grads: bool = True) -> None:
        """Put the host state at the fixed start of a static step (before capture and any stand-in eager step)."""

    @abc.abstractmethod
    def end_static_step(self, *, bound: Iterable[str]) -> None:
        """Make the host state what a replayed static step leaves (a replay runs no Python)."""

    @abc.abstractmethod
    def grads_bound(self) -> FrozenSet[str]:
        """The units whose main gradients are bound now (what a training step wrote)."""

    @abc.abstractmethod
    def keep_main_grads(self) -> None:
        """Hold the main gradients at their addresses from now on (after capturing a training step)."""

    @abc.abstractmethod
    def release_main_grads(self) -> None:
        """The captured training step :meth:`keep_main_grads` was called for is gone."""

    @abc.abstractmethod
    def mark_params_stale(self) -> None:
        """Every unit re-installs its compute parameters before its next eager use (after a graphed optimizer)."""

    @abc.abstractmethod
    def recording_phases(self) -> ContextManager[List[Tuple[str, str, bool]]]:
        """Record the engine's unit phases in the block (what the protocol backend compares with its capture)."""

    def clip_grad_norm(self) -> Optional[Callable[[float], torch.Tensor]]:
        """The engine's global-norm clipping ``fn(max_norm) -> norm``, or None where it has none."""
        return None


def per_layer_engine(engine: EngineAdapter, graph_kind: str) -> PerLayerEngine:
    """``engine`` as a :class:`PerLayerEngine`, or NotImplementedError naming the engine and ``graph_kind``."""
    if not isinstance(engine, PerLayerEngine):
        raise NotImplementedError(
            f"{graph_kind} needs an engine whose hooks can run around per-layer graphs (a PerLayerEngine); "
            f"{engine.name}'s adapter {type(engine).__name__} is none; implement PerLayerEngine in its adapter")
    return engine


def static_step_engine(engine: EngineAdapter, graph_kind: str) -> StaticStepEngine:
    """``engine``'s :class:`StaticStepEngine`, or NotImplementedError naming the engine and ``graph_kind``."""
    step = engine.static_step()
    if not isinstance(step, StaticStepEngine):
        raise NotImplementedError(
            f"{graph_kind} needs an engine with a static step; {engine.name} has none; use megatron_fsdp.fully_shard "
            "or partial graphs (PartialCudaGraphs)")
    return step
