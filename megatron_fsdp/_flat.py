"""Flat buffers: where a unit's parameters sit in its flat buffers, and the buffers themselves."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._common import check_not_capturing

__all__ = ["ALIGN_NUMEL", "FlatLayout"]

#: Each parameter starts at a multiple of this many elements in the flat buffers, so that every
#: parameter view is 128-byte aligned in bf16 (vectorised kernels and cuBLAS want aligned pointers).
ALIGN_NUMEL = 64


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class FlatLayout:
    """Where each parameter of a unit sits in the unit's flat buffers, and how the flat is sharded."""

    def __init__(self, names: Sequence[str], params: Sequence[nn.Parameter], world_size: int) -> None:
        self.names = list(names)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets: List[int] = []
        cursor = 0
        for n in self.numels:
            self.offsets.append(cursor)
            cursor = _round_up(cursor + n, ALIGN_NUMEL)
        # An empty layout (e.g. the frozen region of a unit without frozen parameters) takes no space.
        self.total_numel = _round_up(cursor, ALIGN_NUMEL * world_size) if self.names else 0
        self.shard_numel = self.total_numel // world_size

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]


class _Buffer:
    """A flat tensor that is either persistent, a double-buffer slot, or allocated on demand.

    An on-demand buffer keeps one tensor object (so parameter views built on it stay valid) and grows and
    shrinks its storage; a slot or persistent buffer never moves.
    """

    def __init__(self, kind: str, tensor: torch.Tensor, slot: Optional[int] = None) -> None:
        assert kind in ("persistent", "slot", "dynamic")
        self.kind, self.tensor, self.slot = kind, tensor, slot
        self._nbytes = tensor.numel() * tensor.element_size()
        # A dynamic buffer starts allocated so that views can be built on it; the unit frees it after.

    @property
    def allocated(self) -> bool:
        return self.kind != "dynamic" or self.tensor.untyped_storage().size() > 0

    def allocate(self, what: str) -> None:
        if self.kind == "dynamic" and not self.allocated:
            check_not_capturing(f"allocation of {what}")
            self.tensor.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        if self.kind == "dynamic" and self.allocated:
            self.tensor.untyped_storage().resize_(0)


class _Works:
    """Several collectives waited on as one (a unit with frozen parameters gathers two regions)."""

    __slots__ = ("works",)

    def __init__(self, works: List[Optional[dist.Work]]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
