"""Pure collective functions: one place that picks the torch API that exists on this torch version.

torch 2.13 renames ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``all_gather_single``/
``reduce_scatter_single`` (the old names warn); torch 2.11 has only the old names. Every call is
asynchronous and returns the ``Work`` handle; ``Work.wait()`` makes the current CUDA stream wait on NCCL
(no host sync) and blocks the host on Gloo. Each call passes the capture guard as a collective
(``check_not_capturing(..., collective=True)``): refused inside a capture unless a full-iteration graph
switched the guard to ``CaptureGuardMode.ALLOW_COLLECTIVES``.

[Note: no collective at one rank]
A group of one rank (one GPU, or HSDP's shard group at one GPU per replica) moves nothing: its all-gather and
reduce-scatter are a copy (none when input and output are one tensor, as in the cast-on-gather), its all-reduce
and broadcast leave the tensor as it is (SUM and AVG of one value are that value). Through torch.distributed
each still costs its Python wrappers, a backend call and a ``Work`` (about 0.06-0.08 ms of host time per call
measured on CPU, and a kernel on the GPU), three or more per unit and step. So at one rank these functions do the
copy on the current stream, the same bits as the collective, and return ``None`` on the CPU (the copy is done)
or, for CUDA tensors, a ``_LocalCopy`` whose ``wait()`` does what NCCL's does for a consumer on another stream
(makes it wait for the issuing stream) and nothing on the issuing stream itself. The capture guard is passed
first all the same, so a collective where none may run is refused at every world size. The engine asks
:func:`is_one_rank` to skip a copy where the result can be read in place: a gradient reduce-scatter whose result is
added into the main gradient (gradient accumulation) or cast out of a lower reduce dtype reads the gradient buffer
itself (not under HSDP, whose all-reduce across replicas reads the reduced shard while the buffer is reused): 8
bytes an fp32 element less a micro-batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._common import check_not_capturing

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "backend_for"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _one_rank(group: dist.ProcessGroup) -> bool:
    return group.size() == 1


def is_one_rank(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s collectives are local copies ([Note: no collective at one rank])."""
    return _one_rank(group)


class _LocalCopy:
    """What a one-rank all-gather or reduce-scatter of CUDA tensors returns: the copy ran on the issuing stream,
    and ``wait()`` orders the waiting thread's current stream after it when that is another stream, the
    guarantee NCCL's ``Work.wait()`` gives (on the issuing stream itself there is nothing to wait for)."""

    __slots__ = ("stream",)

    def __init__(self, stream: "torch.cuda.Stream") -> None:
        self.stream = stream

    def wait(self) -> bool:
        current = torch.cuda.current_stream(self.stream.device)
        if current != self.stream:
            current.wait_stream(self.stream)
        return True


def _copy_at_one_rank(output: torch.Tensor, source: torch.Tensor) -> Optional[_LocalCopy]:
    """[Note: no collective at one rank]: the one rank's collective as a copy (none in place)."""
    if output.data_ptr() != source.data_ptr() or output.shape != source.shape:
        with torch.no_grad():
            output.copy_(source)
    return _LocalCopy(torch.cuda.current_stream(output.device)) if output.is_cuda else None


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, what: str
               ) -> "Optional[dist.Work | _LocalCopy]":
    check_not_capturing(f"all-gather of {what}", collective=True)
    if _one_rank(group):
        return _copy_at_one_rank(output, shard)
    return _all_gather_single(output, shard, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, what: str, *,
                   average: bool = False) -> "Optional[dist.Work | _LocalCopy]":
    """SUM, or with ``average`` the backend's AVG (NCCL only; see [Note: averaging in the collective])."""
    check_not_capturing(f"reduce-scatter of {what}", collective=True)
    if _one_rank(group):
        return _copy_at_one_rank(output, full)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return _reduce_scatter_single(output, full, op=op, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, what: str, *, average: bool = False,
               maximum: bool = False) -> Optional[dist.Work]:
    """SUM, or the backend's AVG (``average``) or MAX (``maximum``); nothing at one rank."""
    check_not_capturing(f"all-reduce of {what}", collective=True)
    if _one_rank(group):
        return None
    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def broadcast(tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup, what: str) -> None:
    check_not_capturing(f"broadcast of {what}", collective=True)
    if _one_rank(group):
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank), group=group)


def backend_for(group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that carries ``device``'s tensors in ``group``: ``"nccl"`` or ``"gloo"`` (or another name).

    ``init_process_group()`` without a backend makes both and reports ``"undefined"``; a backend string such as
    ``"cpu:gloo,cuda:nccl"`` names one per device type. Either way CUDA tensors go to NCCL and CPU ones to
    Gloo, which is what the engine's collectives need to know.
    """
    name = dist.get_backend(group)
    if name == "undefined":
        return "nccl" if device.type == "cuda" else "gloo"
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return per_device.get(device.type, name)
    return name
