"""Gradient reduction of one FSDP unit: claim its unsharded gradient buffer, fold the parameter gradients
into it, reduce-scatter (or all-reduce) it asynchronously, and retire the result into the fp32 main gradient.

The unit calls :func:`reduce_grads` from its post-backward; the engine keeps one :class:`_PendingReduce` in
flight and retires it (``MegatronFSDP.add_pending_reduce`` / ``retire_reduces``). Whether the collective
averages or the fold pre-scales is decided once per engine by :func:`reduce_by_average`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _collectives as C
from ._common import ShardingStrategy, Unit
from ._flat import FlatLayout, _Buffer

__all__ = ["reduce_by_average", "reduce_grads", "open_grad_buffer", "release_grad_slot"]


def reduce_by_average(backend: str, world_size: int, grad_dtype: torch.dtype) -> bool:
    """Whether the gradient collectives average (``ReduceOp.AVG``) instead of summing pre-scaled gradients.

    [Note: averaging in the collective] The engine reduces the mean of the ranks' gradients. Summing
    gradients that the fold multiplied by ``1/world`` costs a pass over every unsharded gradient (read and
    write, in the buffer's dtype) before each reduction. NCCL's AVG on floating-point data is that same
    pre-multiplication, done as the collective loads each rank's input (``ncclDevPreMulSum`` with the scalar
    ``1/nranks`` rounded to the data's dtype), so no pass is needed. The bits are those of the pre-scale when
    the factor rounds the same in both: fp32 and fp64 (torch multiplies fp32 by ``float(1/world)`` too), and
    fp16 or bf16 only when ``world`` is a power of two (an exact factor; otherwise NCCL would round it to the
    half type while torch multiplies in fp32). Other cases keep the pre-scale. One rank needs neither; Gloo
    has no AVG for these collectives.
    """
    if world_size == 1 or backend != "nccl":
        return False
    if grad_dtype in (torch.float32, torch.float64):
        return True
    return grad_dtype in (torch.float16, torch.bfloat16) and world_size & (world_size - 1) == 0


def open_grad_buffer(unit: Unit, *, hold: bool = False) -> None:
    """Claim the unsharded gradient buffer: a shared slot's previous user finishes its reduction first.

    ``hold``: TE writes into it during this unit's backward ([Note: fused weight gradients]); no other unit
    may take the slot until this unit's post-backward (a unit nested in this one would).
    """
    gbuf = unit.grad_buffer
    if hold and unit.is_root and gbuf.kind == "slot":
        raise RuntimeError(
            f"[rank {unit.engine.rank}] megatron_fsdp: a TE module of the root unit writes its weight gradient "
            f"during the backward (fuse_wgrad_accumulation=True), but when fully_shard ran none did, so the root "
            f"borrows gradient slot {gbuf.slot} for its end-of-backward reduction ([Note: the root's gradients in "
            "a slot]) and cannot hold it through the backward. Set fuse_wgrad_accumulation before fully_shard "
            "(or make that module part of a unit)"
        )
    if gbuf.kind == "slot":
        holders = unit.engine.grad_slot_holder
        holder = holders.get(gbuf.slot)
        if holder is not None and holder is not unit:
            raise RuntimeError(
                f"[rank {unit.engine.rank}] megatron_fsdp: unit {unit.name} needs gradient slot {gbuf.slot} while "
                f"unit {holder.name}'s TE modules still write their weight gradients into it (its backward has "
                "not finished: the units are nested). Fused weight-gradient accumulation needs units that do not "
                f"nest: set fuse_wgrad_accumulation=False on the TE modules of unit {holder.name}, or make the "
                "nested module part of its parent unit"
            )
        unit.engine.retire_reduces(slot=gbuf.slot)  # the previous user of this slot must have finished reducing
        if hold:
            holders[gbuf.slot] = unit
    gbuf.allocate(f"the gradient buffer of unit {unit.name}")


def release_grad_slot(unit: Unit) -> None:
    """Let other units claim the gradient slot this unit held through its backward (fused weight gradients)."""
    gbuf = unit.grad_buffer
    if gbuf is not None and unit.engine.grad_slot_holder.get(gbuf.slot) is unit:
        del unit.engine.grad_slot_holder[gbuf.slot]


def reduce_grads(unit: Unit, grads: List[Optional[torch.Tensor]], written: Optional[List[bool]] = None) -> None:
    """Fold the unit's parameter gradients into its gradient buffer and start their reduction (post-backward)."""
    eng = unit.engine
    gbuf = unit.grad_buffer
    open_grad_buffer(unit)
    flat = gbuf.tensor[: unit.grad_numel]
    done = written or [False] * len(grads)  # already in the buffer ([Note: fused weight gradients])
    copy_views: List[torch.Tensor] = []
    copies: List[torch.Tensor] = []
    written_views: List[torch.Tensor] = []
    added: List[Tuple[torch.Tensor, torch.Tensor]] = []  # a written weight's ordinary gradient, from another use
    for v, g, w in zip(unit.grad_views, grads, done):
        if w:
            written_views.append(v)
            if g is not None:
                added.append((v, g))
        elif g is not None:
            copy_views.append(v)
            copies.append(g)
    with torch.no_grad():
        # [Note: the gradient fold] Copy (and cast) each gradient into its view, zero what no gradient
        # covers (absent gradients, the alignment gaps: a slot holds other units' bytes), then pre-scale
        # by 1/world_size so that the SUM collective yields the mean over ranks (unless the collective
        # averages: [Note: averaging in the collective]). The same bits as zeroing
        # the buffer and adding alpha * grad (0 + round(alpha * g) == round(g * alpha)) in 6 bytes per bf16
        # gradient instead of 14 (a zero pass and a mixed-dtype add), and no scale pass on one rank.
        # Gradients TE already wrote into the buffer are kept (a weight that also got an ordinary
        # gradient, through another use, has it added).
        if copies:
            torch._foreach_copy_(copy_views, copies)
        for v, g in added:
            v.add_(g)
        holes = _grad_holes(unit, gbuf, [g is None and not w for g, w in zip(grads, done)])
        if holes:
            torch._foreach_zero_(holes)
        if unit.grad_scale != 1.0:
            torch._foreach_mul_(copy_views + written_views, unit.grad_scale)
    for p in unit.params:
        p.grad = None
    if unit.tp_sum_numel:
        # [Note: tensor parallelism] in _tensor.py: gradients of the parameters replicated over TP under sequence
        # parallelism are partial sums per TP rank; summed over TP here, before the data-parallel reduction.
        tp_work = C.all_reduce(flat[: unit.tp_sum_numel], eng.tp_topology.tp_group,
                               f"sequence-parallel gradients of unit {unit.name} over the tensor-parallel group")
        if tp_work is not None:
            tp_work.wait()
    accumulate = unit._bound_main_grad() is not None
    if eng.strategy is ShardingStrategy.NO_SHARD:
        work = C.all_reduce(flat, unit.group, f"gradients of unit {unit.name}", average=unit.reduce_average)
        out, adopt = flat, False
    else:
        # [Note: no collective at one rank]: the reduce-scatter of one rank is a copy of the buffer, which the
        # result can read in place wherever it is folded into a main gradient rather than kept as one (not under
        # HSDP: the all-reduce across replicas runs on the reduced shard while the buffer's slot is reused)
        in_place = C.is_one_rank(unit.group) and not eng.hsdp.hybrid and flat.shape == unit.main_shard.shape
        if eng.reduce_dtype != eng.main_grad_dtype:
            # [Note: reducing in another dtype] The buffer and the collective are in reduce_dtype (e.g. bf16);
            # the reduced shard lands in a reduce_dtype tensor of its own (at one rank: the buffer itself, above),
            # and retire() casts it into the fp32 main gradient: a new one, the kept one (graphs), or added into
            # the bound one (micro-batches), so that accumulation and the optimizer stay in main_grad_dtype.
            out = flat if in_place else torch.empty_like(unit.main_shard, dtype=eng.reduce_dtype)
            adopt = False
        elif in_place and accumulate:  # added into the bound main gradient from the buffer itself
            out, adopt = flat, False
        else:
            kept = unit._main_grad_data if unit._main_grad_kept is not None else None
            out = torch.empty_like(unit.main_shard, dtype=eng.main_grad_dtype) if accumulate or kept is None else kept
            adopt = not accumulate and kept is None
        work = C.reduce_scatter(out, flat, unit.group, f"gradients of unit {unit.name}", average=unit.reduce_average)
    eng.add_pending_reduce(_PendingReduce(unit, work, out, accumulate, adopt))


def _grad_holes(unit: Unit, gbuf: _Buffer, absent: List[bool]) -> List[torch.Tensor]:
    """Views of ``gbuf`` that the fold must zero (see [Note: the gradient fold]); cached per absent-pattern."""
    key = tuple(absent)
    if key not in unit._holes:
        unit._holes[key] = [gbuf.tensor[a:b] for a, b in _gaps(unit.layout, absent)]
    return unit._holes[key]


def _gaps(layout: FlatLayout, absent: Sequence[bool]) -> List[Tuple[int, int]]:
    """``(start, end)`` element ranges of ``layout``'s flat that no present gradient covers, merged."""
    ranges: List[Tuple[int, int]] = []
    cursor = 0
    for off, n, gone in zip(layout.offsets, layout.numels, absent):
        end = off + n
        start = off if gone else end
        if cursor < off:
            ranges.append((cursor, off))
        if start < end:
            ranges.append((start, end))
        cursor = max(cursor, end)
    if cursor < layout.total_numel:
        ranges.append((cursor, layout.total_numel))
    merged: List[Tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged



class _PendingReduce:
    __slots__ = ("unit", "work", "out", "accumulate", "adopt", "launched", "holds_buffer")

    def __init__(self, unit: Unit, work: Optional[dist.Work], out: torch.Tensor, accumulate: bool,
                 adopt: bool) -> None:
        #: ``adopt``: ``out`` was allocated for this reduction and becomes the unit's new main gradient
        self.unit, self.work, self.out, self.accumulate, self.adopt = unit, work, out, accumulate, adopt
        #: HSDP: the all-reduce across replicas has been issued (``work`` is now that all-reduce)
        self.launched = False
        #: the collective in flight still reads the unit's gradient buffer (the reduce-scatter, or no_shard's
        #: all-reduces, which reduce the buffer itself)
        self.holds_buffer = True

    def launch(self) -> None:
        """HSDP: once the shard group's reduction is done, start the all-reduce of its result across replicas.

        [Note: hybrid sharding] in _hsdp.py. Waits for the reduce-scatter (a stream wait on NCCL), so a sharded
        strategy's gradient buffer is free from here on (``holds_buffer`` False: the slot may be reused while
        the all-reduce runs on the reduced shard); no_shard's all-reduce reduces the buffer itself and keeps it.
        """
        if self.launched:
            return
        unit = self.unit
        replicate = unit.engine.replicate_group
        assert replicate is not None, "launch() is for hybrid sharding"
        if self.work is not None:
            self.work.wait()
        self.launched = True
        self.work = C.all_reduce(self.out, replicate, f"gradients of unit {unit.name} across replicas")
        if self.out.data_ptr() != unit.grad_buffer.tensor.data_ptr():
            self.holds_buffer = False
            unit.grad_buffer.free()

    def retire(self) -> None:
        """Wait for the collective(s) and fold the result into the unit's fp32 main gradient."""
        unit = self.unit
        if unit.engine.hsdp.hybrid:
            self.launch()
        if self.work is not None:
            self.work.wait()
        with torch.no_grad():
            grad, data = unit.main_grad, unit._main_grad_data
            if self.accumulate:
                data.add_(self.out)
            elif unit._main_grad_kept is not None:
                if self.out is not data:
                    data.copy_(self.out)
            else:  # a new main gradient ([Note: main gradients live like .grad]); a buffer's bytes are copied out
                grad = unit._new_main_grad(self.out if self.adopt else self.out.to(unit.engine.main_grad_dtype, copy=True))
        unit.main_shard.grad = grad
        unit.grad_buffer.free()
