"""Fused weight-gradient accumulation: TE's weight-gradient GEMMs write into the unit's gradient buffer.

[Note: fused weight gradients]
A TransformerEngine module built with ``fuse_wgrad_accumulation=True`` does not return its weights'
gradients: its backward asks each weight for a ``main_grad`` tensor and lets the wgrad GEMM write there (in
the tensor's dtype, fp32 here). The protocol TE reads (``transformer_engine/pytorch/module/linear.py``,
``layernorm_linear.py``, ``layernorm_mlp.py``, ``grouped_linear.py``, 2.20) is three attributes of the weight:

- ``__fsdp_param__`` present: TE calls ``weight.get_main_grad()`` at backward time (Megatron-FSDP's lazy
  form), not at forward;
- ``get_main_grad()``: here the weight's view of the unit's unsharded gradient buffer (the reduce-scatter's
  input), so the GEMM writes where the engine's gradient fold would have copied the bf16 gradient;
- ``overwrite_main_grad=True``: the GEMM overwrites (``beta = 0``) instead of adding, so the buffer needs no
  zeroing first. A buffer slot holds another unit's bytes before this unit's backward.

What this removes per step: the bf16 weight gradient (written by the GEMM, read by the fold: 4 bytes per
parameter), the fold's cast copy (6 bytes), and under partial CUDA graphs the graph's parameter-gradient
outputs (TE's static buffers and autograd's copy of them: memory of the size of every graphed weight in bf16,
and 4 bytes per parameter per step). The gradient is the GEMM's fp32 result, not its bf16 rounding, so the
numbers differ from the unfused run (eager and graphed fused runs are bit-identical to each other).

Overwriting is right when each weight reaches its GEMM exactly once per backward of its unit:

- twice (a module called twice in one forward): the second call of ``get_main_grad()`` raises, before the
  second GEMM would overwrite the first one's gradient (in an eager step: a graph maker's warmup backwards
  write gradients that are dropped, see ``graph_maker_running``, and capture needs eager steps first);
- never (a module skipped in this step): the fold zeroes the weight's view, as it zeroes an absent gradient.

"Reached" is counted by the calls of ``get_main_grad()`` in this backward. A replay of a CUDA graph calls no
Python, so the graph layer tells the engine which modules it replayed (``note_replay``, from the forward that
starts the replay); a weight written under capture counts as written when its module's graph replayed.
The GEMM writes during the unit's backward, so the unit's gradient buffer is claimed at its pre-backward (the
previous user of a shared slot finishes its reduce-scatter first), not at its post-backward as the fold does.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from ._common import Unit
from ._reduce import open_grad_buffer

__all__ = ["FusedWeightGrads", "fusable_weights"]


def fusable_weights(module: nn.Module, params: List[nn.Parameter]) -> List[Tuple[int, nn.Module]]:
    """``(index into params, owning module)`` of every matrix weight whose module follows TE's protocol.

    A module follows it when it has a ``fuse_wgrad_accumulation`` attribute (every TE GEMM module has one,
    True or False); its own parameters of two or more dimensions are the GEMM weights (norm weights and
    biases are vectors and keep ordinary gradients). Parameters of nested units are not in ``params``.
    """
    index = {id(p): i for i, p in enumerate(params)}
    out: List[Tuple[int, nn.Module]] = []
    for m in module.modules():
        if not hasattr(m, "fuse_wgrad_accumulation"):
            continue
        for p in m.parameters(recurse=False):
            i = index.get(id(p))
            if i is not None and p.dim() >= 2:
                out.append((i, m))
    return out


class FusedWeightGrads:
    """One unit's weights under fused weight-gradient accumulation ([Note: fused weight gradients])."""

    def __init__(self, unit: Unit, owners: List[Tuple[int, nn.Module]]) -> None:
        self.unit = unit
        self.owners = owners
        n = len(unit.params)
        self.calls = [0] * n
        #: Weights whose GEMM wrote under a CUDA-graph capture: a replay of their module writes them again.
        self.captured: Set[int] = set()
        #: Weights a replay wrote in this step (reset at the unit's pre-forward).
        self.replayed: Set[int] = set()
        self._by_module: Dict[int, Tuple[int, ...]] = {}
        for i, _ in owners:
            p = unit.params[i]
            p.__fsdp_param__ = True  # type: ignore[attr-defined]
            p.overwrite_main_grad = True  # type: ignore[attr-defined]
            p.get_main_grad = functools.partial(self.main_grad, i)  # type: ignore[attr-defined]

    def any_fused(self) -> bool:
        """Whether a module of the unit fuses now (the flag may be set after ``fully_shard``)."""
        return any(m.fuse_wgrad_accumulation for _, m in self.owners)

    def main_grad(self, i: int) -> torch.Tensor:
        """``weight.get_main_grad()``: the view TE's GEMM overwrites; counts the call (see the Note)."""
        unit = self.unit
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing:
            if not unit.grad_buffer.allocated:
                raise RuntimeError(
                    f"[rank {unit.engine.rank}] megatron_fsdp: TE asked for the main_grad of "
                    f"{unit.layout.names[i]} (unit {unit.name}) inside a CUDA-graph capture before the unit's "
                    "pre-backward claimed its gradient buffer; the graph would write an unallocated buffer. Run "
                    "the unit's pre-backward handler before capturing its backward (capture_time_hooks)"
                )
        else:
            open_grad_buffer(unit, hold=True)
        self.calls[i] += 1
        # A graph maker's warmup iterations may run several backwards between two of the engine's handlers
        # (torch's runs all of them inside one call); what they write is dropped, so only real steps count.
        if self.calls[i] > 1 and not unit.engine.graph_maker_running:
            module = dict(self.owners).get(i)
            raise RuntimeError(
                f"[rank {unit.engine.rank}] megatron_fsdp: weight {unit.layout.names[i]} of unit {unit.name} "
                f"reached its gradient GEMM {self.calls[i]} times in one backward (its module "
                f"{type(module).__name__} ran more than once in the forward). Under fuse_wgrad_accumulation=True "
                "the engine lets TE overwrite the weight's gradient once per backward, so a second write would "
                "drop the first one's gradient. Set fuse_wgrad_accumulation=False on that module, or call it "
                "once per forward"
            )
        if capturing:
            self.captured.add(i)
        return unit.grad_views[i]

    def note_replay(self, module: nn.Module) -> None:
        """A CUDA graph of ``module`` (the unit or one of its submodules) replays in this step."""
        key = id(module)
        idx = self._by_module.get(key)
        if idx is None:
            ids = {id(p) for p in module.parameters()}
            idx = self._by_module[key] = tuple(i for i, _ in self.owners if id(self.unit.params[i]) in ids)
        self.replayed.update(i for i in idx if i in self.captured)

    def written(self) -> List[bool]:
        """Per parameter of the unit: its gradient is already in the gradient buffer (this backward)."""
        out = [False] * len(self.calls)
        for i, _ in self.owners:
            out[i] = self.calls[i] > 0 or i in self.replayed
        return out

    def end_backward(self) -> None:
        """After the unit's fold: forget this backward's calls and the ``main_grad`` TE left on the weights."""
        self.calls = [0] * len(self.calls)
        self.replayed.clear()
        for i, _ in self.owners:
            self.unit.params[i].__dict__.pop("main_grad", None)

    def forget_captures(self) -> None:
        """Before a new capture: weights the earlier graphs wrote are no longer written by a replay."""
        self.captured.clear()
        self.replayed.clear()
        self._by_module.clear()
