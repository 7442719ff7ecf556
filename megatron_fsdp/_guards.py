"""Guards that turn silent misuse of a sharded model into clear errors.

- **The wrong optimizer parameters.** Module parameters of a sharded model are compute views that the
  engine refills from the fp32 main shards; the engine folds their gradients into its own buffers and
  clears them. An optimizer over ``model.parameters()`` therefore sees no gradient and trains nothing,
  silently. A process-wide optimizer step pre-hook (installed by the first ``fully_shard``) refuses any
  optimizer step whose parameter groups hold such a compute view, naming the fix. The check is cached per
  optimizer and redone when its groups change size; it also refuses a step after a parameter's
  ``requires_grad`` changed since ``fully_shard`` (the unit plan fixed which parameters train).
- **Optimizers that update the main shards without moving their version counters.** The engine refreshes a
  unit's compute parameters when its main shard's version counter moved (``_unit._install_if_stale``).
  torch's fused Adam/AdamW (``fused=True``) and any optimizer writing through ``.data`` update the shards in
  place without moving it, so the next forward would silently compute with the weights of before the step.
  A process-wide optimizer step post-hook marks the units whose main shards the optimizer holds stale after
  every step, whatever kernel the optimizer used.
- **A plain optimizer state dict loaded into other shards.** ``optimizer.state_dict()`` of an optimizer over
  ``model.optimizer_parameters()`` holds this rank's shards (``exp_avg`` of the shard's length). torch loads it
  into any optimizer with as many parameters, whatever their sizes, and the next step fails deep inside the
  optimizer with a size mismatch (or, where sizes happen to agree, trains on other ranks' moments). The step
  pre-hook registers a ``load_state_dict`` pre-hook on every optimizer that steps main shards, and checks the
  state of such an optimizer at its first step (a load before the first step): state whose size is not the
  main shard's is refused, naming the sharded checkpoint path (``model.optimizer_state_dict`` and DCP).
- **Calls that bypass the wrapper.** ``model.module(x)`` would skip the root's unshard and refresh; a
  forward-pre hook on the wrapped module refuses it. (Calls of a unit's submodules outside the unit are
  refused by the unit's call guards, ``_unit.make_call_guard``.)
- **A backward through an older forward** and **gradients that reach a unit after its backward**: see
  [Note: one backward per forward] below.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._clip import holds_gradient
from ._common import Engine

__all__ = [
    "install_optimizer_guard",
    "mark_compute_params",
    "guard_direct_calls",
    "stale_backward_error",
    "check_stray_gradients",
]

_state: Dict[str, Any] = {"handle": None, "post_handle": None}
#: optimizer -> (group sizes when checked, engines whose main shards it steps, units whose main shards it steps)
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[Tuple[int, ...], list, list]]" = (
    weakref.WeakKeyDictionary()
)
#: optimizers that step main shards and carry the load_state_dict pre-hook (``_check_loaded_state``)
_load_guarded: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def mark_compute_params(engine: Engine) -> None:
    """Tag every module parameter of ``engine`` as a compute view (read by the optimizer guard)."""
    ref = weakref.ref(engine)
    for u in engine.all_units():
        for name, p in zip(u.names, u.all_params):
            p._megatron_fsdp_compute = (ref, name, u.name)  # type: ignore[attr-defined]


def install_optimizer_guard() -> None:
    """Register the process-wide optimizer step pre- and post-hooks once (idempotent)."""
    if _state["handle"] is None:
        _state["handle"] = register_optimizer_step_pre_hook(_check_optimizer)
    if _state["post_handle"] is None:
        _state["post_handle"] = register_optimizer_step_post_hook(_mark_stepped_units_stale)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    cached = _checked.get(optimizer)
    if cached is None or cached[0] != sizes:
        engines: Dict[int, Any] = {}
        units = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                tag = getattr(p, "_megatron_fsdp_compute", None)
                if tag is not None and tag[0]() is not None:
                    _refuse_compute_param(optimizer, tag)
                unit = getattr(p, "_megatron_fsdp_unit", None)
                if unit is not None:
                    engines[id(unit.engine)] = unit.engine
                    units.append(weakref.ref(unit))
        if units:  # it steps main shards: their state must be this rank's shards' (a load before this step)
            _check_shard_state(optimizer, [(p, optimizer.state.get(p, {})) for g in optimizer.param_groups
                                           for p in g["params"]], loading=False)
            if optimizer not in _load_guarded:  # and a later load is checked when it happens
                optimizer.register_load_state_dict_pre_hook(_check_loaded_state)
                _load_guarded.add(optimizer)
        cached = (sizes, [weakref.ref(e) for e in engines.values()], units)
        _checked[optimizer] = cached
    for ref in cached[1]:
        engine = ref()
        if engine is not None:
            _check_requires_grad(engine)


def _mark_stepped_units_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a step: the units whose main shards ``optimizer`` holds re-install their compute parameters before
    their next use, whether or not the step moved the shards' version counters (see the module docstring).
    The pre-hook of the same step filled the cache; an optimizer that skipped it (no step pre-hooks) is read now.
    """
    cached = _checked.get(optimizer)
    if cached is None or cached[0] != tuple(len(g["params"]) for g in optimizer.param_groups):
        _check_optimizer(optimizer, args, kwargs)
        cached = _checked[optimizer]
    for ref in cached[2]:
        unit = ref()
        if unit is not None:
            unit.mark_stale()


def _check_loaded_state(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """``load_state_dict`` pre-hook: refuse saved state whose sizes are not this rank's main shards'."""
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)):
        return None  # torch refuses other group sizes itself, with its own message
    saved_state = state_dict.get("state", {})
    pairs = [(p, saved_state.get(i, {})) for s, g in zip(saved_groups, optimizer.param_groups)
             for i, p in zip(s["params"], g["params"])]
    _check_shard_state(optimizer, pairs, loading=True)
    return None


def _check_shard_state(optimizer: torch.optim.Optimizer, pairs: List[Tuple[torch.Tensor, Dict[str, Any]]], *,
                       loading: bool) -> None:
    """Refuse per-parameter optimizer state that belongs to other shards (``pairs``: main shard, its state).

    A state tensor is compared with the optimizer's own state of the same name where it has one (an optimizer
    that stepped); otherwise a vector of more than one element must have the main shard's length (element-wise
    state, e.g. Adam's moments: what ``model.optimizer_state_dict`` handles). Other state is left alone.
    """
    for p, state in pairs:
        unit = getattr(p, "_megatron_fsdp_unit", None)
        if unit is None:
            continue
        own = optimizer.state.get(p, {}) if loading else {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            current = own.get(key)
            if isinstance(current, torch.Tensor):
                want = tuple(current.shape)
            elif value.dim() == 1 and value.numel() > 1:
                want = tuple(p.shape)
            else:
                continue
            if tuple(value.shape) != want:
                _refuse_foreign_shard_state(optimizer, unit, key, tuple(value.shape), want, loading)


def _refuse_foreign_shard_state(optimizer: torch.optim.Optimizer, unit: Any, key: str, got: Tuple[int, ...],
                                want: Tuple[int, ...], loading: bool) -> None:
    engine, name = unit.engine, type(optimizer).__name__
    what = (f"{name}.load_state_dict() got state {key!r}" if loading
            else f"{name} was loaded, before its first step, with state {key!r}")
    raise ValueError(
        f"[rank {engine.rank}] megatron_fsdp: {what} of shape {got} for the main shard of unit {unit.name}, which "
        f"needs shape {want} here (world size {engine.world_size}, strategy {engine.strategy.value}). A plain "
        "optimizer.state_dict() holds one rank's shards: it loads only into the same model sharded the same way "
        "(same world size and strategy, each rank its own file). To load at another world size or strategy, save "
        "model.optimizer_state_dict(optimizer) with torch.distributed.checkpoint.save, and load it with "
        "torch.distributed.checkpoint.load into model.optimizer_state_dict(optimizer), then "
        "model.load_optimizer_state_dict(optimizer, state)"
    )


def _refuse_compute_param(optimizer: torch.optim.Optimizer, tag: Tuple[Any, str, str]) -> None:
    engine = tag[0]()
    raise ValueError(
        f"[rank {engine.rank}] megatron_fsdp: {type(optimizer).__name__} steps parameter {tag[1]}, a compute view of "
        f"FSDP unit {tag[2]} that the engine refills from its fp32 main shard and whose gradient it consumes: this "
        "optimizer would train nothing. Build the optimizer over model.optimizer_parameters() (the fp32 main "
        "shards), not model.parameters() or model.module.parameters()"
    )


def _check_requires_grad(engine: Engine) -> None:
    for u in engine.all_units():
        for name, p in zip(u.layout.names, u.params):
            if not p.requires_grad:
                raise RuntimeError(
                    f"[rank {engine.rank}] megatron_fsdp: parameter {name} of unit {u.name} was trainable when "
                    "fully_shard ran and has requires_grad=False now; the optimizer would still step its main shard "
                    "(momentum, weight decay). Freeze parameters before fully_shard (shard the model again to "
                    "change which parameters train)"
                )


def guard_direct_calls(engine: Engine) -> torch.utils.hooks.RemovableHandle:
    """Refuse ``engine.module(...)`` called other than through the wrapper's forward."""
    ref = weakref.ref(engine)

    def fsdp_root_call_guard(module: nn.Module, args: Tuple[Any, ...]) -> Optional[Any]:
        eng = ref()
        if eng is not None and not eng._in_root_forward:
            raise RuntimeError(
                f"[rank {eng.rank}] megatron_fsdp: the sharded {type(module).__name__} was called directly "
                "(model.module(...)); call the MegatronFSDP wrapper instead (model(...)): it gathers the root's "
                "parameters and refreshes them after optimizer steps"
            )
        return None

    fsdp_root_call_guard._megatron_fsdp_role = "root_call_guard"  # type: ignore[attr-defined]
    return engine.module.register_forward_pre_hook(fsdp_root_call_guard)


# [Note: one backward per forward]
# A unit gathers its parameters for a forward, again for the backward of that forward, and reduces the
# gradients of its parameters once, when its backward ends. Two backward passes that overlap break that:
#
# - ``out1 = model(a); out2 = model(b); (f(out1) + f(out2)).backward()`` (or a backward of ``out1`` after
#   ``model(b)``): the second forward started a new step, so the first graph's backward hooks meet units
#   already reduced and resharded. Its unit backward would compute with NaN placeholders or with another
#   unit's double-buffer slot, and its parameter gradients would arrive after the reduction. Every backward
#   hook remembers which forward with gradients registered it (``num_grad_forwards``) and refuses when a
#   later one has run: the error names both and the fix. Forwards without gradients (evaluation under
#   ``no_grad``) register nothing and count nothing, so evaluating between a forward and its backward is fine,
#   and a forward with gradients whose output is dropped is simply superseded.
# - A unit parameter used outside its unit (e.g. read functionally in the root's forward, before the unit
#   runs): its gradient lands in ``param.grad`` after the unit reduced, so it would be dropped (the next
#   step resets such leftovers, as it does after a step that raised). At the end of every backward the
#   engine checks that no compute parameter still holds a gradient, and refuses the step before the
#   optimizer could use the incomplete main gradients. One pass over the trainable parameters per backward,
#   no allocation.


def stale_backward_error(engine: Engine, forward_index: int, where: str) -> RuntimeError:
    """The error for a backward hook of forward ``forward_index`` reached after a later forward with gradients."""
    return RuntimeError(
        f"[rank {engine.rank}] megatron_fsdp: backward reached {where} from forward #{forward_index} with "
        f"gradients, but forward #{engine.num_grad_forwards} has run since; FSDP units gather and reduce once per "
        "forward-backward pair, so this backward would compute with resharded parameters and reduce its "
        "gradients late. Call backward on each output before the next forward with gradients (gradients "
        "accumulate across backward calls), or put both batches into one forward; run forwards whose output "
        "needs no backward under torch.no_grad()"
    )


def check_stray_gradients(engine: Engine) -> None:
    """At the end of a backward: refuse gradients that reached a compute parameter after its unit reduced."""
    for u in engine.all_units():
        for p in u.params:
            if holds_gradient(p):
                _refuse_stray_gradients(engine)


def _refuse_stray_gradients(engine: Engine) -> None:
    stray = [(n, u.name) for u in engine.all_units() for n, p in zip(u.layout.names, u.params) if holds_gradient(p)]
    for u in engine.all_units():
        for p in u.params:
            p.grad = None  # the next step starts clean; the main gradients of this one are incomplete
    names = ", ".join(f"{n} (unit {un})" for n, un in stray[:5])
    raise RuntimeError(
        f"[rank {engine.rank}] megatron_fsdp: parameters {names}{' ...' if len(stray) > 5 else ''} received gradients "
        "after their unit's backward had reduced; they were used outside their unit's forward (e.g. read "
        "directly in another module's forward), where they hold placeholder, stale or another unit's values. Use "
        "a unit's parameters only inside that unit's forward: move the use into the unit, or keep the parameter "
        "outside the units (in the root). This step's main gradients are incomplete: call optimizer.zero_grad() "
        "before the next step"
    )
