"""The alignment checker's recorder: where, inside one training step, do an eager and a graphed run part?

[Note: localising a mismatch]
Comparing losses says *that* two runs differ, not *where*. The recorder hooks every graphed callable (in
both runs, with the same hooks, registered for one step at a time and never while a capture runs, so the
capture does not see them as unknown hooks) and records, in the order they happen:

- ``input``: each tensor argument of a callable (before it runs);
- ``output``: each tensor the callable returns (for a replay: the graph's output buffers, read before
  the next replay can overwrite them);
- ``loss``: the step's loss;
- ``grad_output`` / ``grad_input``: each gradient arriving at a callable's outputs and leaving through its
  inputs, in backward order;
- ``main_grad``: the reduced gradient shard of each optimizer parameter after backward.

Each record is a fingerprint computed on the device (the tensor's bits read as integers, summed plain and
position-weighted, plus shape and dtype), so memory stays small and the comparison is exact up to
fingerprint collisions. The first record, in the eager run's order, whose fingerprint differs names the
callable and the phase: an ``output`` after equal ``input``\\ s is the callable itself computing differently;
an ``input`` that differs while every earlier record agreed means the difference starts outside the
graphed callables; a ``grad_input`` after an equal ``grad_output`` is the callable's backward.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fsdp_cudagraph.capture.args import flatten

__all__ = ["fingerprint", "StepRecorder", "first_divergence", "describe_divergence"]

Key = Tuple[Any, ...]
Record = Tuple[Key, Tuple[Any, ...]]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bits (plain and position-weighted), on ``t``'s device; equal tensors, equal sums."""
    t = t.detach()
    if t.dtype == torch.bool:
        bits = t.to(torch.int8)
    elif t.is_floating_point() or t.is_complex():
        bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    else:
        bits = t
    b = bits.reshape(-1).to(torch.int64)
    w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64)
    return torch.stack([b.sum(), (b * w).sum()])


class StepRecorder:
    """Fingerprints of one training step's activity around the watched callables (see the module note).

    Lifecycle per step: :meth:`start` (registers hooks), the user's forward, :meth:`loss`, backward,
    :meth:`grads` (main gradients, before the optimizer step), :meth:`stop` (removes hooks, returns the
    records with fingerprints on the CPU).
    """

    def __init__(self, modules: Sequence[Tuple[str, nn.Module]]) -> None:
        self.modules = list(modules)
        self._handles: List[Any] = []
        self._records: List[Tuple[Key, Tuple[Any, ...], torch.Tensor]] = []
        self._calls: Dict[str, int] = {}

    def _add(self, key: Key, t: torch.Tensor) -> None:
        self._records.append((key, (tuple(t.shape), str(t.dtype)), fingerprint(t)))

    def _grad_hook(self, key: Key):
        def hook(grad: torch.Tensor) -> None:
            self._add(key, grad)

        return hook

    def start(self) -> None:
        self._records, self._calls = [], {}
        for name, module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def pre(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            occ = self._calls.get(name, 0)
            self._calls[name] = occ + 1
            for i, t in enumerate(flatten((args, kwargs))[0]):
                self._add(("input", name, occ, i), t)
                if t.requires_grad:
                    t.register_hook(self._grad_hook(("grad_input", name, occ, i)))

        return pre

    def _post(self, name: str):
        def post(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            occ = self._calls[name] - 1
            for i, t in enumerate(flatten(output)[0]):
                self._add(("output", name, occ, i), t)
                if t.requires_grad:
                    t.register_hook(self._grad_hook(("grad_output", name, occ, i)))

        return post

    def loss(self, loss: torch.Tensor) -> None:
        self._add(("loss",), loss)

    def grads(self, named_params: Sequence[Tuple[str, torch.Tensor]]) -> None:
        for name, p in named_params:
            g = p.grad
            if g is not None:
                # A DTensor gradient (FSDP2, NVIDIA Megatron-FSDP) is recorded as this rank's shard: records are
                # compared rank by rank, and fingerprint() of the DTensor itself raises (its position weights
                # are a plain tensor: "got mixed torch.Tensor and DTensor").
                self._add(("main_grad", name), g.to_local() if hasattr(g, "to_local") else g)

    def stop(self) -> List[Record]:
        for h in self._handles:
            h.remove()
        self._handles = []
        if not self._records:
            return []
        fps = torch.stack([fp for _, _, fp in self._records]).cpu()
        out = [(key, (meta, tuple(fps[i].tolist()))) for i, (key, meta, _) in enumerate(self._records)]
        self._records = []
        return out


def first_divergence(eager: List[List[Record]], graphed: List[List[Record]]) -> Optional[Tuple[int, Key, str]]:
    """(step, record key, what) of the first record, in eager order, that the graphed run lacks or changes."""
    for step, (e, g) in enumerate(zip(eager, graphed)):
        got = dict(g)
        for key, value in e:
            if key not in got:
                return step, key, "missing in the graphed run"
            if got[key] != value:
                what = "shape/dtype differ" if got[key][0] != value[0] else "values differ"
                return step, key, what
        extra = [k for k, _ in g if k not in dict(e)]
        if extra:
            return step, extra[0], "only in the graphed run"
    return None


def describe_divergence(key: Key, what: str) -> Tuple[Optional[str], str]:
    """(callable to blame or None, a sentence) for a divergence record key."""
    kind = key[0]
    if kind == "loss":
        return None, (f"the loss differs ({what}) while every graphed callable's inputs and outputs agreed: the "
                      "difference starts after the last graphed callable (eager code, e.g. the head or the loss)")
    if kind == "main_grad":
        return None, (f"the reduced gradient of {key[1]} differs ({what}) while every gradient at the graphed "
                      "callables agreed: a parameter gradient inside a callable (weight gradient) or the "
                      "reduction differs")
    name, occ, idx = key[1], key[2], key[3]
    call = f"call {occ}, tensor {idx}"
    if kind == "output":
        return name, (f"the output of {name} differs ({what}; {call}) while its inputs and everything before "
                      "agreed: its graph computes differently from its eager forward")
    if kind == "input":
        return None, (f"the input of {name} differs ({what}; {call}) while every earlier graphed callable "
                      "agreed: the difference starts outside the graphed callables (eager code before it, or "
                      "parameters updated in an earlier step)")
    if kind == "grad_output":
        return None, (f"the gradient arriving at {name}'s output differs ({what}; {call}) while the forward "
                      "agreed: the difference starts in backward after the graphed callables (eager code)")
    return name, (f"the gradient leaving {name} through its input differs ({what}; {call}) while the gradient "
                  "arriving at its outputs agreed: its backward graph computes differently")
