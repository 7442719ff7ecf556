"""Shape buckets: one static graph per bucket, inputs padded up to the smallest bucket that fits.

A CUDA graph replays fixed shapes. Callables whose inputs vary along one dimension (a packed sequence of
image patches, a batch of requests, a token count) get one graph per bucket size; each call is padded up to
the smallest bucket that holds it and its outputs are cut back. Past the largest bucket the call runs
eagerly (once-per-size warning), or raises in strict mode. This module holds only the policy and the
padding: the graph kinds that use it decide what padding means for their calls and masks, and keep their own
types (``graphs/length_buckets.py``: the length arguments, call shapes, pending replays and attention helpers;
``graphs/inference.py``: the batch padding).
"""

from __future__ import annotations

import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["Buckets", "BucketOverflowWarning", "pad_to", "unpad", "sizes_of"]


class BucketOverflowWarning(UserWarning):
    """A call was larger than the largest bucket and ran eagerly."""


class Buckets:
    """An ascending set of sizes along one dimension.

    Build with explicit ``sizes``, or :meth:`powers_of_two` (``min_size``, 2 x, ... up to ``max_size``, which is
    always included) or :meth:`halving` (``max_size``, ``max_size // 2``, ... ``num`` sizes, Megatron's policy for
    inference batch sizes). :meth:`select` gives the smallest bucket that fits, or None past the largest.
    """

    def __init__(self, sizes: Iterable[int]) -> None:
        sizes = list(sizes)
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
        if not sizes or bad:
            raise ValueError(f"bucket sizes {sizes} must be a non-empty list of positive ints (bad: {bad}); e.g. "
                             "Buckets.powers_of_two(max_size)")
        self.sizes: Tuple[int, ...] = tuple(sorted(set(sizes)))
        self._warned: set = set()

    @classmethod
    def powers_of_two(cls, max_size: int, min_size: int = 1) -> "Buckets":
        if max_size < 1 or min_size < 1 or min_size > max_size:
            raise ValueError(f"powers_of_two(max_size={max_size}, min_size={min_size}): need 1 <= min_size <= max_size")
        sizes, s = [], 1
        while s < max_size:
            if s >= min_size:
                sizes.append(s)
            s *= 2
        return cls(sizes + [max_size])

    @classmethod
    def halving(cls, max_size: int, num: int) -> "Buckets":
        if max_size < 1 or num < 1:
            raise ValueError(f"halving(max_size={max_size}, num={num}): need max_size >= 1 and num >= 1")
        sizes = [max_size]
        while len(sizes) < num and sizes[-1] > 1:
            sizes.append(sizes[-1] // 2)
        return cls(sizes)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def select(self, n: int) -> Optional[int]:
        """The smallest bucket >= ``n``, or None when ``n`` exceeds the largest."""
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def select_or_fallback(self, n: int, *, what: str, strict: bool = False) -> Optional[int]:
        """:meth:`select`, and past the largest bucket a warning (once per size) or, when ``strict``, a ValueError."""
        size = self.select(n)
        if size is None:
            msg = (f"{what}: size {n} exceeds the largest bucket {self.max_size} (buckets {list(self.sizes)}); it runs "
                   "eagerly. Add a larger bucket to graph it")
            if strict:
                raise ValueError(msg.replace("it runs eagerly", "refused in strict mode"))
            if n not in self._warned:
                self._warned.add(n)
                warnings.warn(msg, BucketOverflowWarning, stacklevel=3)
        return size

    def __repr__(self) -> str:
        return f"Buckets({list(self.sizes)})"


def pad_to(x: torch.Tensor, size: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """``x`` padded with ``value`` along ``dim`` up to ``size`` (a new tensor; ``x`` itself if already that size)."""
    n = x.shape[dim]
    if n > size:
        raise ValueError(f"pad_to: dimension {dim} has size {n}, larger than the target {size}")
    if n == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - n
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def unpad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The first ``n`` entries of ``x`` along ``dim`` (a view)."""
    return x.narrow(dim, 0, n)


def sizes_of(xs: Sequence[torch.Tensor], dim: int) -> List[int]:
    return [int(x.shape[dim]) for x in xs]
