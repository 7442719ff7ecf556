"""The optimizer step of a full-iteration run in its own CUDA graph, with optional sync-free clipping.

Used by :class:`~fsdp_cudagraph.FullIterationCudaGraph` (``graph_optimizer=True``); see its
[Note: frozen host decisions]. What a replay relies on, and what is checked before each replay:

- the optimizer's hyperparameters are those of capture: a Python value (a float ``lr`` that a scheduler
  changed) raises; a device tensor (``lr=torch.tensor(..., device="cuda")``, updated in place) is read by
  the graph, so schedulers work with tensor learning rates;
- every parameter's ``.grad`` is the tensor it was at capture (the engine's main gradient): an optimizer
  replay after ``zero_grad(set_to_none=True)``, or without a step before it, raises instead of stepping
  with stale gradients;
- ``max_norm`` is the one of capture (clipping, with its all-reduce, is inside the graph);
- after a replay the engine is told that the main shards changed (a graph moves no version counter).

Optimizers with a ``capturable`` option must have it on (``torch.optim.Adam(..., capturable=True)``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from fsdp_cudagraph.engines.contract import StaticStepEngine

from fsdp_cudagraph.capture import recipe as _recipe

__all__ = ["OptimizerGraph", "FullIterationReport"]

_PHASE = "the optimizer step"


@dataclasses.dataclass
class FullIterationReport:
    """What one capture of a whole-step graph did (full-iteration train/eval graphs and the optimizer graph).

    Defined here, in the lower of the two modules, so that ``full_iteration`` imports ``optimizer`` and not back.
    """

    kind: str
    backend: str
    capture_seconds: float
    graph_memory_bytes: int
    num_micro_batches: int
    #: the engine's collectives inside the graph, in launch order (the same on every rank)
    collectives: List[str]
    #: units whose main gradients the captured step writes (train graphs)
    units_with_grads: List[str]



class OptimizerGraph:
    """``step(optimizer, max_norm)``: eager while ``enabled`` is False or during ``warmup`` calls, then graphed.

    ``agree(log, what)`` checks that every rank captured the same collectives (the owner's cross-rank check).
    On the ``protocol`` backend every "replay" runs the step eagerly after the same checks.
    """

    def __init__(self, step: StaticStepEngine, *, engine_name: str, backend: str, warmup: int, enabled: bool,
                 agree: Callable[[List[str], str], None]) -> None:
        self.static = step
        self.engine_name = engine_name
        self.backend = backend
        self.warmup_left = warmup
        self.enabled = enabled
        self.agree = agree
        self.optimizer: Any = None
        self.graph: Any = None
        self.captured = False
        self.hyper: List[Dict[str, Any]] = []
        self.params: List[torch.Tensor] = []
        self.grads: List[Optional[torch.Tensor]] = []
        self.max_norm: Optional[float] = None
        self.norm: Optional[torch.Tensor] = None
        self.replays = 0
        self.report: Any = None

    def step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError("optimizer_step() got another optimizer than before; one FullIterationCudaGraph graphs one "
                             "optimizer (build the optimizer once, before training)")
        if max_norm is not None and self.static.clip_grad_norm() is None:
            raise NotImplementedError(f"optimizer_step(max_norm=...) needs the engine's global-norm clipping, which "
                                      f"{self.engine_name} does not offer; clip in forward_step's caller, or pass "
                                      "max_norm=None")
        self.optimizer = optimizer
        if not self.enabled or not self.captured and self.warmup_left > 0:
            if self.enabled:
                self.warmup_left -= 1  # the eager steps also create the state the graph will update in place
            norm = self._clip_and_step(optimizer, max_norm)
            return norm.clone() if norm is not None else None
        if not self.captured:
            self._capture(optimizer, max_norm)
        return self._replay(optimizer, max_norm)

    def reset(self) -> None:
        """Drop the graph (``delete()``)."""
        graph, self.graph = self.graph, None
        _recipe.reset_graph(graph)
        self.captured = False
        self.norm = None

    def _clip_and_step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
        norm = self.static.clip_grad_norm()(max_norm) if max_norm is not None else None
        optimizer.step()
        return norm

    def _capture(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> None:
        for i, group in enumerate(optimizer.param_groups):
            if self.backend == "torch" and group.get("capturable") is False:
                raise ValueError(
                    f"optimizer param group {i} has capturable=False; a graphed optimizer step needs "
                    f"torch.optim.{type(optimizer).__name__}(..., capturable=True) (with lr as a device tensor to "
                    "change it after capture), or FullIterationCudaGraph(..., graph_optimizer=False)")
        self.hyper = [_hyperparameters(g) for g in optimizer.param_groups]
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads = [p.grad for p in self.params]
        self.max_norm = max_norm
        t0 = time.perf_counter()
        log: List[str] = []
        if self.backend == "torch":
            device = self.static.device
            torch.cuda.synchronize(device)
            # clipping all-reduces the ranks' norms: a collective inside this graph too
            self.graph, self.norm = _recipe.capture_graph(
                lambda: self._clip_and_step(optimizer, max_norm), device=device, phase=_PHASE,
                guard=lambda: self.static.static_capture_guard(allow_collectives=True, collective_log=log))
            self.agree(log, _PHASE)
        self.captured = True
        n = sum(g is not None for g in self.grads)
        self.report = FullIterationReport("optimizer", self.backend, time.perf_counter() - t0, 0, 0, log,
                                          [f"{n} of {len(self.params)} parameters with gradients"])

    def _replay(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
        if max_norm != self.max_norm:
            raise RuntimeError(f"optimizer_step(max_norm={max_norm}) but the optimizer graph was captured with "
                               f"max_norm={self.max_norm}; the graph replays the captured clipping. Pass the same value "
                               "every step (or build a new FullIterationCudaGraph)")
        for i, (group, hyper) in enumerate(zip(optimizer.param_groups, self.hyper)):
            now = _hyperparameters(group)
            changed = [k for k in set(hyper) | set(now) if not _same_value(hyper.get(k), now.get(k))]
            if changed:
                k = sorted(changed)[0]
                raise RuntimeError(
                    f"optimizer param group {i}: {k} changed from {hyper.get(k)!r} to {now.get(k)!r} after the optimizer "
                    "step was captured; the graph replays the captured value. Pass it as a device tensor and update "
                    "it in place (e.g. lr=torch.tensor(1e-4, device='cuda'); schedulers then fill_() it), or set "
                    "graph_optimizer=False")
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                raise RuntimeError(
                    "optimizer_step(): a parameter's .grad is not the tensor the optimizer graph reads (it was "
                    f"{'unbound' if p.grad is None else 'replaced'} since capture); the graph would step with stale "
                    "gradients. Call step() before optimizer_step(), and optimizer.zero_grad() only after it")
        if self.backend == "torch":
            self.graph.replay()
            norm = self.norm
        else:
            norm = self._clip_and_step(optimizer, max_norm)
        self.replays += 1
        self.static.mark_params_stale()  # a replay changes the main shards behind their version counters
        return norm.clone() if norm is not None else None


def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's settings without its parameters: Python values by value, tensors by identity."""
    return {k: v for k, v in group.items() if k != "params"}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a setting that does not compare: changed unless it is the same object
        return a is b
