"""The engine contract: what a sharded data-parallel engine tells the graph layer, and the registry of engines.

The graph kinds (partial graphs first) never read an engine's internals. They ask one
:class:`EngineAdapter`, built by :func:`adapter_for` from whatever the user passed, the questions below.
A new engine is one module in this folder with one subclass and one ``register_engine`` call; no graph
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
   :func:`read_sentinel`, which every adapter calls first, withholds it and plans the handler instead.
   The engine's own hooks that nothing runs at capture (e.g. call guards) are ``engine_only``: restored,
   never run at capture, not reported. Hooks the engine does not own are ``unknown``: restored, never run
   at capture, reported (they are the user's).
3. **What must not move.** ``replay_tensors`` names every tensor a replay of a callable reads or writes by
   address (parameters, gradient targets); the graph layer records their addresses at capture and
   refuses a replay if one moved. ``check_partial_graphs`` refuses, before any CUDA work, settings under
   which the engine cannot keep them still, naming the settings that work.
4. **No collective inside a capture.** ``capture_guard`` is entered around each capture pass: the
   engine's collectives raise ``RuntimeError`` inside it. ``simulated_capture`` is the same guard for
   the CPU protocol backend, which captures nothing.
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
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

__all__ = ["EngineAdapter", "HookPlan", "HOOK_KEYS", "adapter_for", "register_engine", "registered_engines",
           "plan_bare_hooks", "root_of", "unavailable_engines", "HOOK_DICTS", "PRE_SENTINEL", "POST_SENTINEL",
           "read_sentinel", "sentinel_plan", "adapt"]

#: TE's capture_time_hooks keys, in the order TE runs them in a step.
HOOK_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

#: The module hook dicts a hook plan reads, in the order nn.Module runs them.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: Attributes an engine puts on a hook that only registers a backward handler on tensors: the inner handler.
PRE_SENTINEL = "_cuda_graph_backward_pre_handler"
POST_SENTINEL = "_cuda_graph_backward_handler"

CaptureTimeHook = Callable[[nn.Module], None]


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


# -- the sentinel reader every adapter's hook_plan calls first ----------------------------------------
def adapt(fn: Callable[..., Any], kind: str) -> Callable[[nn.Module], None]:
    """Turn an engine hook or inner handler into TE's one-argument form."""
    if kind == "handler":
        def run(module: nn.Module) -> None:
            fn(module)
    elif kind == "pre":
        def run(module: nn.Module) -> None:
            fn(module, ())
    else:
        def run(module: nn.Module) -> None:
            fn(module, (), None)
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def read_sentinel(hook: Any, hid: int, dict_name: str, plan: HookPlan) -> bool:
    """The reusable half of phase 2: plan a sentinel wrapper's inner handler and withhold the wrapper.

    Returns whether ``hook`` carried a sentinel. An engine's :meth:`EngineAdapter.hook_plan` calls it first
    for each hook and reads its own hooks (e.g. a role attribute) only when it returns False.
    """
    pre_handler = getattr(hook, PRE_SENTINEL, None)
    post_handler = getattr(hook, POST_SENTINEL, None)
    if pre_handler is not None:
        plan.capture_time["backward_pre_hooks"][hid] = adapt(pre_handler, "handler")
    elif post_handler is not None:
        plan.capture_time["backward_hooks"][hid] = adapt(post_handler, "handler")
    else:
        return False
    plan.withheld.append((dict_name, hid, hook))
    return True


def sentinel_plan(hook_dicts: Mapping[str, Mapping[int, Any]]) -> HookPlan:
    """Phase 2 knowing no engine: sentinel wrappers are planned, every other hook is unknown."""
    plan = HookPlan()
    for dict_name in HOOK_DICTS:
        for hid, hook in hook_dicts.get(dict_name, {}).items():
            if not read_sentinel(hook, hid, dict_name, plan):
                plan.unknown.append((dict_name, hid, hook))
    return plan


class EngineAdapter(abc.ABC):
    """One wrapped model as the graph layer sees it (see [Note: the engine contract])."""

    #: Short name for messages, e.g. ``"megatron_fsdp"`` or ``"torch FSDP2"``.
    name: str = "engine"
    #: The settings that keep replay tensors still, for the message of a refused replay (one sentence).
    address_hint: str = "Keep the engine's settings that hold its buffers at fixed addresses."

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # -- recognition ------------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def recognizes(cls, model: nn.Module) -> bool:
        """Whether ``model`` (what the user passed) is wrapped by this engine. Cheap; imports nothing new."""

    # -- 1. units ---------------------------------------------------------------------------------
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

    @abc.abstractmethod
    def unit_modules(self) -> List[nn.Module]:
        """The modules that carry the engine's per-unit hooks, in forward order."""

    @abc.abstractmethod
    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        """The unit module that owns ``module`` (itself or its nearest unit ancestor), None if none does."""

    def unit_name(self, unit: nn.Module) -> str:
        """The unit's qualified name in :attr:`root` (for messages)."""
        for name, m in self.root.named_modules():
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
    @classmethod
    def plan_bare_hooks(cls, hooks: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
        """:meth:`hook_plan` without a wrapped model (``extract_hooks`` on a bare module); None: not supported."""
        return None

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


_ENGINES: List[type] = []


def register_engine(cls: type) -> type:
    """Add an :class:`EngineAdapter` subclass to the registry (usable as a class decorator)."""
    if cls not in _ENGINES:
        _ENGINES.append(cls)
    return cls


def registered_engines() -> List[type]:
    _load_builtin()
    return list(_ENGINES)


def adapter_for(model: nn.Module) -> Optional[EngineAdapter]:
    """The adapter of the engine that wraps ``model``, or None for a model no engine wraps."""
    for cls in registered_engines():
        if cls.recognizes(model):
            return cls(model)
    return None


def plan_bare_hooks(hooks: Mapping[str, Mapping[int, Any]]) -> Optional[HookPlan]:
    """The plan of the first registered engine that recognises any of these hooks, or None if none does."""
    for cls in registered_engines():
        plan = cls.plan_bare_hooks(hooks)
        if plan is not None and plan.claims_any():
            return plan
    return None


def root_of(model: nn.Module) -> nn.Module:
    """The user's module tree under whatever registered engine wraps ``model`` (``model`` itself if none does)."""
    adapter = adapter_for(model)
    return adapter.root if adapter is not None else model


_LOADED = False
#: engine module -> why it could not be imported (a missing optional dependency); see _load_builtin.
_UNAVAILABLE: Dict[str, str] = {}


def unavailable_engines() -> Dict[str, str]:
    """Built-in engine modules that failed to import, with the reason (e.g. a missing optional dependency)."""
    _load_builtin()
    return dict(_UNAVAILABLE)


def _load(name: str) -> None:
    # importlib, not an import statement: an engine module imports this contract, and the contract must not
    # import it back (tests/unit/test_layout.py forbids the circle). A missing dependency disables one engine only.
    try:
        importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        _UNAVAILABLE[name] = f"{type(exc).__name__}: {exc}"


def _load_builtin() -> None:
    """Import the engine modules of this folder once (each registers itself)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    # The modules register themselves on import; one line per engine module of this folder.
    _load("megatron_fsdp")
    _load("fsdp2")
    _load("nvidia_megatron_fsdp")  # imports nothing of megatron: recognises NVIDIA's classes by name
