"""Capture schedules of per-layer graphs, one function per backend: ``te``, ``torch`` and ``protocol``.

Each schedule captures an ``order`` of callables and hands every result to ``install``; what it needs from
its graph kind comes in as arguments (``install``, ``pool_for``, the capture-time hooks, the capture region),
never as ``self``, so partial graphs and length buckets share them without a subclass.

A callable here is a :class:`GraphedCallable`; the schedules read only its ``name``, ``module``, ``unit``,
``plan``, ``sample_args`` and ``capture_params``. ``plan`` holds capture-time hooks in TE's form
(``{key: {hook_id: fn(module) -> None}}``); :func:`capture_time_hooks` turns it into what TE is handed,
once per callable and capture.

:func:`run_te_schedule` is the one driver of TE's warmup/capture schedule without graphs: the ``protocol``
backend runs it, and the CPU tests that stand in for TE or drive an engine through TE's schedule run it
too, instead of copies of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fsdp_cudagraph.capture.attention import te_capture_flag
from fsdp_cudagraph.hooks import HOOK_DICTS, HOOK_KEYS, ExtractedHooks

__all__ = ["CaptureReport", "GraphedCallable", "parked_grad_hooks", "run_hooks", "capture_time_hooks",
           "check_graph_maker_preconditions", "te_backward", "run_te_schedule", "capture_te", "capture_torch",
           "capture_protocol", "unit_groups", "PARAMS_GUARD", "plan_hooks", "check_params", "ProtocolReplay",
           "restore_forward", "memory_breakdown"]


@dataclasses.dataclass
class CaptureReport:
    """What a capture did."""

    backend: str
    callables: List[str]
    capture_seconds: float
    graph_memory_bytes: int
    unknown_hooks: List[str] = dataclasses.field(default_factory=list)
    #: callable name -> {"eager": TE's eager attention backend, "graph": its backend under capture,
    #: "eager_used": what the eager steps ran}; empty without TE attention in the graphed callables.
    attention_backends: Dict[str, Dict[str, str]] = dataclasses.field(default_factory=dict)
    #: Where the graphs' memory sits (empty on CPU), see [Note: where graph memory goes]: ``param_grad_bytes``,
    #: their static parameter gradients (one per parameter of every graphed callable, as the module holds it
    #: after capture, kept for the graphs' lifetime) and ``other_bytes``, the rest of ``graph_memory_bytes``
    #: (saved activations, static outputs, incoming-gradient buffers); ``static_input_bytes``, the recorded
    #: sample args the graphs read their inputs from (allocated before capture, so outside
    #: ``graph_memory_bytes``); ``reserved_growth_bytes``, what the allocator reserved during capture (pools'
    #: free blocks included).
    memory_breakdown: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)  # identity: membership tests must never compare fields (tensors among them)
class GraphedCallable:
    """One graphed callable of a per-layer graph kind: what the schedules read and what capture records."""

    name: str
    module: nn.Module
    #: The engine unit's module that owns this callable (None: a plain module's callable, or the root's).
    unit: Optional[nn.Module]
    sample_args: Optional[Tuple[torch.Tensor, ...]] = None
    sample_kwargs: Optional[Dict[str, torch.Tensor]] = None
    extracted: Optional[ExtractedHooks] = None
    plan: Dict[str, Dict[int, Any]] = dataclasses.field(default_factory=lambda: {k: {} for k in HOOK_KEYS})
    #: ``module.parameters()`` when the graph maker is called: what TE makes the graph's inputs (contract item 6).
    capture_params: Tuple[torch.Tensor, ...] = ()
    #: (name, address) of every tensor a replay reads or writes by address (the engine's replay_tensors).
    replay_ptrs: Tuple[Tuple[str, int], ...] = ()
    #: The engine's replay probe (resolved at capture): the addresses of replay_ptrs as they are now, in O(1).
    probe: Optional[Callable[[], Tuple[int, ...]]] = None
    #: With FP8: ``(probe, names)`` of the TE modules' cached quantized weights, resolved at capture
    #: (``capture/fp8.py`` ``quantized_weight_probe``); None without FP8 or without a cached weight.
    quantized_probe: Optional[Tuple[Callable[[], Tuple[int, ...]], Tuple[str, ...]]] = None
    had_forward_attr: bool = False
    #: The module's own instance-level ``forward`` before capture (when ``had_forward_attr``): graph makers
    #: replace it, and delete() or a failed capture must put it back.
    own_forward: Any = None
    #: The recorded call's signature (structure, constants, tensor metadata; see ``capture/args.py``). The graph's
    #: inputs are its tensor leaves, ``sample_args``; ``sample_kwargs`` stays empty.
    signature: Any = None


#: Hooks in TE's form, per key: ``{hook_id: fn(module) -> None}``.
HookDicts = Mapping[str, Mapping[int, Callable[[Any], None]]]
#: The install step of a graph kind: ``install(callable, wrapper, graphed)``.
Install = Callable[[Any, Any, Any], None]
#: Extra graph-maker arguments for one capture call of these callables (e.g. ``{"pool": handle}``), or {}.
PoolFor = Callable[[List[Any]], Dict[str, Any]]

#: The key of the parameter guard in a callable's capture-time pre-forward hooks (hook ids are >= 0).
PARAMS_GUARD = -1


@contextlib.contextmanager
def parked_grad_hooks(order: Sequence[Any]) -> Iterator[None]:
    """[Note: post-accumulate-grad hooks at capture]
    TE's graph maker runs warmup and capture backwards with ``torch.autograd.backward`` (``.grad`` of the inputs
    and parameters cleared before, restored after), so AccumulateGrad runs and so do the parameters'
    post-accumulate-grad hooks: on warmup gradients computed from uninitialised output gradients, and inside the
    capture. An engine that reduces from such a hook (NVIDIA Megatron-FSDP: main_grad accumulation, bucket
    waits) would take warmup gradients into its buffers and wait on events inside the capture (on an H100:
    ``CUDA error: invalid argument``). While a graph maker runs, the hooks of the captured parameters are parked
    (their dict emptied in place, so handles stay valid) and put back afterwards; they fire at every replay,
    where AccumulateGrad runs outside the graph.
    """
    parked: List[Tuple[Dict[Any, Any], Dict[Any, Any]]] = []
    seen: set = set()
    for c in order:
        for p in c.capture_params:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks and id(hooks) not in seen:
                seen.add(id(hooks))
                parked.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in parked:
            hooks.clear()
            hooks.update(saved)


def run_hooks(hooks: Mapping[int, Callable[[Any], None]], module: Any) -> None:
    """Run capture-time hooks in order, as TE does: each takes the module and must return None."""
    for fn in hooks.values():
        if fn(module) is not None:
            raise RuntimeError("capture-time hooks must return None")


def capture_time_hooks(c: Any, guard: Optional[Callable[[], None]] = None) -> Dict[str, Dict[int, Callable[[Any], None]]]:
    """What a graph maker is handed for ``c``: its planned hooks, acting on ``c.module`` whatever module the
    graph maker passes them (TE passes the wrapper it captures), then ``guard`` after the pre-forward hooks."""
    module = c.module
    hooks = {k: {hid: (lambda _given, fn=fn: fn(module)) for hid, fn in plan.items()} for k, plan in c.plan.items()}
    if guard is not None:
        hooks.setdefault("forward_pre_hooks", {})[PARAMS_GUARD] = lambda _given: guard()
    return hooks


def check_graph_maker_preconditions(order: Sequence[Any]) -> None:
    """What TE's and PyTorch's graph makers check before any work: no hook left on a captured module."""
    for c in order:
        left = {d: len(getattr(c.module, d)) for d in HOOK_DICTS if getattr(c.module, d)}
        if left:
            raise RuntimeError(
                f"graphed callable {c.name} still has hooks {left} when passed to the graph maker; modules must not "
                "have hooks registered at the time they are passed (capture-time hooks run outside the capture)"
            )


def te_backward(out: Any, inputs: Sequence[torch.Tensor]) -> None:
    """Backward as TE's graph maker runs it: ``torch.autograd.backward`` of ``out`` (ones as output gradients)
    into ``.grad`` of ``inputs`` (the graph's inputs that require grad), cleared before and restored after;
    not ``torch.autograd.grad``."""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    saved = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs])
    finally:
        for t, g in zip(inputs, saved):
            t.grad = g


def run_te_schedule(callables: Sequence[Callable[..., Any]], sample_args: Sequence[Sequence[Any]],
                    hooks: Sequence[HookDicts], *, num_warmup_iters: int, region: Callable[[], ContextManager[Any]],
                    sample_kwargs: Optional[Sequence[Mapping[str, Any]]] = None,
                    grad_inputs: Optional[Callable[[int], Sequence[torch.Tensor]]] = None) -> None:
    """TE's ``make_graphed_callables`` schedule without graphs.

    Per warmup iteration, then once more for the capture pass: every callable's forward in order, then every
    backward in reverse order. Each forward and backward runs between its callable's capture-time hooks
    (``hooks[i]``, called with ``callables[i]``): ``forward_pre_hooks``, forward, ``forward_hooks``;
    ``backward_pre_hooks``, backward, ``backward_hooks``. In the capture pass the forwards and backwards (never
    the hooks) run inside ``region()`` (the engine's simulated capture). Backward is :func:`te_backward` into
    the static inputs and ``grad_inputs(i)`` (default: the callable's parameters when the schedule started,
    which TE makes the graph's inputs).
    """
    kwargs = list(sample_kwargs) if sample_kwargs is not None else [{} for _ in callables]
    if grad_inputs is None:
        taken = [tuple(f.parameters()) if isinstance(f, nn.Module) else () for f in callables]
        grad_inputs = taken.__getitem__
    for it in range(num_warmup_iters + 1):
        capturing = it == num_warmup_iters
        outs = []
        for i, f in enumerate(callables):
            run_hooks(hooks[i].get("forward_pre_hooks", {}), f)
            with region() if capturing else contextlib.nullcontext():
                outs.append(f(*sample_args[i], **kwargs[i]))
            run_hooks(hooks[i].get("forward_hooks", {}), f)
        for i in reversed(range(len(callables))):
            run_hooks(hooks[i].get("backward_pre_hooks", {}), callables[i])
            inputs = list(sample_args[i]) + list(kwargs[i].values()) + list(grad_inputs(i))
            with region() if capturing else contextlib.nullcontext():
                te_backward(outs[i], inputs)
            run_hooks(hooks[i].get("backward_hooks", {}), callables[i])


def unit_groups(order: Sequence[Any]) -> List[List[Any]]:
    """Consecutive callables of one engine unit, in order (a callable without a unit is a group of its own)."""
    groups: List[List[Any]] = []
    for c in order:
        if groups and c.unit is not None and groups[-1][0].unit is c.unit:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def capture_te(order: List[Any], wrappers: Mapping[Any, Any], hooks: Sequence[HookDicts], *, te: Any,
               num_warmup_iters: int, clone_param_grads: bool, install: Install, pool_for: PoolFor,
               extra: Optional[Mapping[str, Any]] = None) -> None:
    """TE backend: one ``make_graphed_callables`` call for every callable, ``hooks[i]`` as its capture-time hooks.

    ``te``: ``transformer_engine.pytorch`` (``capture.te.require_te``); ``extra``: more keyword arguments for TE
    (the offloader's warmup hooks).
    """
    te.make_graphed_callables(
        tuple(wrappers[c] for c in order),
        tuple(c.sample_args for c in order),
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=True,
        sample_kwargs=tuple({} for _ in order),
        clone_param_grads_on_return=clone_param_grads,
        capture_time_hooks=list(hooks),  # one entry per callable, in order
        **dict(extra or {}),
        **pool_for(order),
    )
    for c in order:
        install(c, wrappers[c], wrappers[c].forward)


def capture_torch(order: List[Any], wrappers: Mapping[Any, Any], *, num_warmup_iters: int, install: Install,
                  pool_for: PoolFor, unit_scope: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
    """torch backend: ``torch.cuda.make_graphed_callables`` takes no capture-time hooks and warms up and captures
    in one call, so one call per engine unit (:func:`unit_groups`) with that unit's hooks around it: unsharded
    before, reduced after. ``unit_scope``: the engine's "one unit at a time" mode ([Note: the engine
    contract] item 8), entered around all calls."""
    with unit_scope():
        for group in unit_groups(order):
            for key in ("forward_pre_hooks", "backward_pre_hooks"):
                for c in group:
                    run_hooks(c.plan[key], c.module)
            with te_capture_flag():  # TE modules inside must stay graph-safe, as under TE's own graph maker
                torch.cuda.make_graphed_callables(
                    tuple(wrappers[c] for c in group),
                    tuple(c.sample_args for c in group),
                    num_warmup_iters=num_warmup_iters,
                    allow_unused_input=True,
                    **pool_for(group),
                )
            for key in ("forward_hooks", "backward_hooks"):
                for c in group:
                    run_hooks(c.plan[key], c.module)
    for c in order:
        install(c, wrappers[c], wrappers[c].forward)


def capture_protocol(order: List[Any], wrappers: Mapping[Any, Any], hooks: Sequence[HookDicts], *,
                     num_warmup_iters: int, install: Install, region: Callable[[], ContextManager[Any]]) -> None:
    """protocol backend: TE's schedule (:func:`run_te_schedule`) with the hooks TE would be handed, no graphs;
    a :class:`ProtocolReplay` of each wrapper stands in for its graph."""
    check_graph_maker_preconditions(order)
    run_te_schedule([wrappers[c] for c in order], [c.sample_args for c in order], hooks,
                    num_warmup_iters=num_warmup_iters, region=region,
                    grad_inputs=lambda i: order[i].capture_params)
    for c in order:
        install(c, wrappers[c], ProtocolReplay(wrappers[c]))


def _on_module(fn: Callable[[nn.Module], Any], module: nn.Module) -> Callable[[nn.Module], Any]:
    """``fn`` in the hooks' ``fn(module)`` form, called with ``module`` whatever module it is handed."""
    def run(_callable_module: nn.Module) -> Any:
        return fn(module)

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def plan_hooks(order: Sequence[Any], unit_plan: Optional[Callable[[Any], HookDicts]]) -> None:
    """Compose each callable's capture-time hooks (``c.plan``) from its own (``c.extracted.capture_time``) and,
    for a callable inside an engine unit, the unit's handlers: ``unit_plan(unit)``, the engine's plan of the
    hooks on the unit's module (read once per unit and capture)."""
    by_unit: Dict[int, List[Any]] = {}
    for c in order:
        c.plan = {k: dict(v) for k, v in c.extracted.capture_time.items()}
        if c.unit is not None and c.module is not c.unit:
            by_unit.setdefault(id(c.unit), []).append(c)
    for group in by_unit.values():
        assert unit_plan is not None, "a callable inside a unit needs the engine's plan"
        unit = group[0].unit
        # The unit's handlers run on the unit, whichever callable's schedule calls them (the graph maker hands
        # each hook its callable's module; NVIDIA's _post_forward, for one, releases the module it is given).
        plan = {key: {hid: _on_module(fn, unit) for hid, fn in hooks.items()}
                for key, hooks in unit_plan(unit).items()}
        first, last = group[0], group[-1]
        # [Note: one unit, several callables] The unit unshards before its first callable's forward
        # and reshards after its last; backward runs in reverse, so it unshards before the last
        # callable's backward and reduces after the first's. Each handler runs once per pass.
        first.plan["forward_pre_hooks"].update(plan["forward_pre_hooks"])
        last.plan["forward_hooks"].update(plan["forward_hooks"])
        last.plan["backward_pre_hooks"].update(plan["backward_pre_hooks"])
        first.plan["backward_hooks"].update(plan["backward_hooks"])


def check_params(c: Any, engine_name: str) -> None:
    """The parameter guard, after the capture-time pre-forward: the module's parameters are still the ones the
    graph maker took (``c.capture_params``, the graph's inputs)."""
    now = tuple(c.module.parameters())
    if len(now) != len(c.capture_params) or any(a is not b for a, b in zip(now, c.capture_params)):
        swapped = [n for (n, p), q in zip(c.module.named_parameters(), c.capture_params) if p is not q]
        raise RuntimeError(
            f"fsdp_cudagraph: cannot capture {c.name}: its pre-forward hooks registered other parameter "
            f"tensors ({(swapped or ['the set of parameters'])[:3]}) than the module had when the graph "
            "maker was called, which are the graph's inputs; a replay's gradients would reach no parameter "
            f"the optimizer sees. The engine adapter of {engine_name} must register, in prepare_capture(), the "
            "parameters its forward reads (see [Note: the engine contract], item 6)")


class ProtocolReplay:
    """The protocol backend's 'graph': the module's own forward, counted, reached through ``__call__``."""

    def __init__(self, module: nn.Module) -> None:
        # What the graph makers capture: the module's forward as it stands (an instance override included).
        self.forward = module.forward
        self.replays = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.replays += 1
        return self.forward(*args, **kwargs)

    def reset(self) -> None:
        self.replays = 0


def restore_forward(c: Any) -> None:
    """Undo a graph maker's ``forward`` replacement: back to the module's own override (``c.own_forward``, when
    ``c.had_forward_attr``), or to the class's."""
    if c.had_forward_attr:
        c.module.__dict__["forward"] = c.own_forward
    else:
        c.module.__dict__.pop("forward", None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_breakdown(order: Sequence[Any], graph_bytes: int, reserved0: int) -> Dict[str, int]:
    """[Note: where graph memory goes] Read-only arithmetic over what capture kept; it changes nothing.

    Both graph makers keep, for the graphs' lifetime: each callable's static inputs (the sample args: the
    replay copies new inputs into them), the activations its forward graph saved for its backward graph, its
    static outputs and incoming-gradient buffers, and one static gradient per parameter (the backward graph
    writes it at a fixed address; TE returns a clone of it, torch the buffer). Eagerly the activations are
    alive at the peak too, but a layer's parameter gradients live only from its backward to its unit's
    reduce-scatter: the static ones, every graphed layer's at once, are what graphs add on top of the eager
    peak (with the static inputs and pool fragmentation). Weights of TE modules with
    ``fuse_wgrad_accumulation=True`` have none: their backward graph writes into the engine's gradient buffer.
    """
    if not torch.cuda.is_available():
        return {}
    inputs = sum(_nbytes(t) for c in order for t in (c.sample_args or ()))
    seen, grads = set(), 0
    for c in order:
        for m in c.module.modules():
            fused = bool(getattr(m, "fuse_wgrad_accumulation", False))
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen and not (fused and p.dim() >= 2):
                    seen.add(id(p))
                    grads += _nbytes(p)
    return {"static_input_bytes": inputs, "param_grad_bytes": grads,
            "other_bytes": graph_bytes - grads,
            "reserved_growth_bytes": torch.cuda.memory_reserved() - reserved0}
