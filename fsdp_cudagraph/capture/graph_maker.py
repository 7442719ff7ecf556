"""What the graph layer hands a graph maker, and the graph maker's schedule as the CPU protocol backend runs it.

A captured callable (``graphs.partial._Callable``) is read here only through ``module``, ``sample_args``,
``sample_kwargs`` and ``capture_params``: capture-time hook dicts in TE's form, the graph makers' precondition
(no hook left on a captured module), TE's backward (``torch.autograd.backward`` into ``.grad`` of the graph's
inputs, cleared before and restored after), and the parameters' post-accumulate-grad hooks parked while a
graph maker runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from fsdp_cudagraph.hooks import HOOK_DICTS

__all__ = ["parked_grad_hooks", "run_hooks", "on_module", "check_graph_maker_preconditions", "te_backward"]


@contextlib.contextmanager
def parked_grad_hooks(order: List[Any]) -> Iterator[None]:
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


def run_hooks(hooks: Dict[int, Any], module: nn.Module) -> None:
    for fn in hooks.values():
        if fn(module) is not None:
            raise RuntimeError("capture-time hooks must return None")


def on_module(plan: Dict[str, Dict[int, Any]], module: nn.Module) -> Dict[str, Dict[int, Any]]:
    """A callable's capture-time hooks (same keys and ids) that run on ``module`` whatever TE passes them."""
    return {k: {hid: (lambda _given, fn=fn: fn(module)) for hid, fn in hooks.items()} for k, hooks in plan.items()}


def check_graph_maker_preconditions(order: List[Any]) -> None:
    """What TE's and PyTorch's graph makers check before any work: no hook left on a captured module."""
    for c in order:
        left = {d: len(getattr(c.module, d)) for d in HOOK_DICTS if getattr(c.module, d)}
        if left:
            raise RuntimeError(
                f"graphed callable {c.name} still has hooks {left} when passed to the graph maker; modules must not "
                "have hooks registered at the time they are passed (capture-time hooks run outside the capture)"
            )


def te_backward(c: Any, out: Any) -> None:
    """Backward as TE's graph maker runs it: ``torch.autograd.backward`` into ``.grad`` of the static inputs
    and parameters (cleared before, restored after), not ``torch.autograd.grad``."""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in list(c.sample_args) + list(c.sample_kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    inputs += [p for p in c.capture_params if p.requires_grad]  # taken when the graph maker was called, as TE does
    if not outs:
        return
    saved = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs])
    finally:
        for t, g in zip(inputs, saved):
            t.grad = g
