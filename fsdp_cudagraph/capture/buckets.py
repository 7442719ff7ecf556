"""Shape buckets: one static graph per bucket, inputs padded up to the smallest bucket that fits.

A CUDA graph replays fixed shapes. Callables whose inputs vary along one dimension (a packed sequence of
image patches, a batch of requests, a token count) get one graph per bucket size; each call is padded up to
the smallest bucket that holds it and its outputs are cut back. Past the largest bucket the call runs
eagerly (once-per-size warning), or raises in strict mode. This module holds only the policy and the
padding: the graph kinds that use it (length buckets for training, inference graphs) decide what padding
means for their masks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from fsdp_cudagraph.capture import args as _args

__all__ = ["Buckets", "BucketOverflowWarning", "pad_to", "unpad", "LengthArg", "LengthSpec", "unpad_output",
           "segment_ids_from_cu_seqlens", "block_diagonal_mask", "PendingReplay", "ReplayDone", "BatchPadding"]


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


# ---------------------------------------------------------------------------------------------- length buckets
# What LengthBucketGraphs (graphs/length_buckets.py) pads, cuts and tracks; see its [Note: length buckets].


@dataclasses.dataclass(frozen=True)
class LengthArg:
    """An argument that varies in length along ``dim``; padded with ``pad_value`` up to the bucket."""

    dim: int = 0
    pad_value: Union[int, float] = 0


# ---------------------------------------------------------------------------------------------- attention helpers


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-token sequence index (int64, ``[total]``) of a packed batch described by ``cu_seqlens`` ([N + 1]).

    No host sync: token ``t`` belongs to the sequence ``i`` with ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``.
    Values are checked only on CPU (a check on the GPU would synchronise); ``cu_seqlens[-1]`` must be ``total``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [num_sequences + 1] starting at 0, got shape "
                         f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
    if cu_seqlens.device.type == "cpu":
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens={cu_seqlens.tolist()} must start at 0, never decrease and end at the "
                             f"number of tokens ({total})")
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).long()


def block_diagonal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[L, L]`` mask, True where query and key share a segment (``attn_mask`` of SDPA: True attends).

    Padding carries one segment id of its own (``-1``), so padded tokens attend to each other only: every row
    has a True entry, and no real token sees a padded one.
    """
    return segment_ids[:, None] == segment_ids[None, :]


# ---------------------------------------------------------------------------------------------- call shapes


class LengthSpec:
    """The length arguments of one callable, resolved against its forward's parameter names."""

    def __init__(self, name: str, fn: Callable[..., Any], length_args: Mapping[str, LengthArg], output_dim: int):
        self.name = name
        names = _args.arg_names(fn)
        self.items = [(n, names.index(n) if n in names else None, a.dim, a.pad_value) for n, a in length_args.items()]
        self.output_dim = output_dim

    def _get(self, args: Sequence[Any], kwargs: Mapping[str, Any], pos: Optional[int], name: str) -> Any:
        return args[pos] if pos is not None and pos < len(args) else kwargs.get(name)

    def length(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
        """The call's length; raises when the length arguments disagree or none is given."""
        n, first = None, None
        for name, pos, dim, _ in self.items:
            t = self._get(args, kwargs, pos, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"length-bucketed callable {self.name}: length argument `{name}` is a "
                                f"{type(t).__name__}, not a tensor; length_args name tensor arguments only")
            m = t.shape[dim]
            if n is None:
                n, first = m, name
            elif m != n:
                raise ValueError(f"length-bucketed callable {self.name}: `{name}` has length {m} along dim {dim} but "
                                 f"`{first}` has {n}; the length arguments of one call must have one length")
        if n is None:
            raise ValueError(f"length-bucketed callable {self.name} was called without any of its length arguments "
                             f"{[i[0] for i in self.items]}; pass them, or fix length_args")
        return n

    def resize(self, args: Sequence[Any], kwargs: Mapping[str, Any], size: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The call with every length argument padded (or, for sample args, cut) to ``size``."""
        args, kwargs = list(args), dict(kwargs)
        for name, pos, dim, value in self.items:
            in_args = pos is not None and pos < len(args)
            t = args[pos] if in_args else kwargs.get(name)
            if t is None:
                continue
            t = t.narrow(dim, 0, size) if t.shape[dim] > size else pad_to(t, size, dim, value)
            if in_args:
                args[pos] = t
            else:
                kwargs[name] = t
        return tuple(args), kwargs


def unpad_output(out: Any, n: int, dim: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out.narrow(dim, 0, n)
    leaves, sig = _args.flatten(out)
    return _args.rebuild(sig, [t.narrow(dim, 0, n) for t in leaves])


# ---------------------------------------------------------------------------------------------- pending replays


@dataclasses.dataclass(eq=False)
class PendingReplay:
    name: str
    order: int
    bucket: int
    #: weakref to the ReplayDone hook on the replay's autograd node: dead once the step's autograd graph is freed.
    hook: Any = None
    done: bool = False

    def alive(self) -> bool:
        return not self.done and self.hook is not None and self.hook() is not None


class ReplayDone:
    """Pre-hook on a replay's autograd node: its backward is starting, so the replay is no longer pending."""

    __slots__ = ("pending", "__weakref__")

    def __init__(self, pending: PendingReplay) -> None:
        self.pending = pending

    def __call__(self, grad_outputs: Any) -> None:
        self.pending.done = True


# ---------------------------------------------------------------------------------------------- inference padding


class BatchPadding:
    """How InferenceCudaGraphs pads a call's tensors to its buckets and cuts the outputs back.

    [Note: inference buckets and padding]
    A graph replays one shape. Calls are padded at the END of the batch dimension (dim 0 of every tensor
    argument that has one) up to the smallest of ``batch_buckets`` that holds them, and every output tensor is
    cut back to the real rows (outputs must therefore carry the batch in dim 0; others are refused). Rows of a
    transformer are independent, so padding rows never changes the real rows in exact arithmetic, and with a
    given kernel the values of the other rows never reach a real row. Calls whose batch exceeds the largest
    bucket run eagerly, unpadded (one ``BucketOverflowWarning`` per size; ``cuda_graph_strict_signature``
    raises instead). All other dimensions are keyed exactly: each distinct shape gets its own graphs, at most
    ``max_graph_sets`` of them (then eager, with one warning). ``seq_buckets`` also pads dim 1 at the end, for
    causal models only (later positions never reach earlier ones); it is opt-in because attention then reduces
    over a longer, masked key range, which may change the real positions' last bits (measured in docs/design.md).
    """

    def __init__(self, batch_buckets: Buckets, seq_buckets: Optional[Buckets], pad_value: Union[int, float]) -> None:
        self.batch_buckets, self.seq_buckets, self.pad_value = batch_buckets, seq_buckets, pad_value

    def check_causal(self, root: Any, causal: Optional[bool]) -> None:
        """Refuse ``seq_buckets`` unless the model is causal (declared by ``root`` or by ``causal=True``)."""
        # A model may declare itself causal with a bounded number of positions (the reference GPT does:
        # ``causal = True`` and ``max_positions``, the size of its positional embedding); the graph layer reads
        # the declaration instead of importing the application's class.
        seq_buckets = self.seq_buckets
        assert seq_buckets is not None
        if getattr(root, "causal", None) is True and isinstance(getattr(root, "max_positions", None), int):
            n = root.max_positions
            name = type(root).__name__
            if seq_buckets.max_size > n:
                raise ValueError(
                    f"seq_buckets={list(seq_buckets.sizes)} pads sequences up to {seq_buckets.max_size}, but "
                    f"the {name}'s positional embedding has {n} positions (max_positions={n}); drop the larger "
                    f"buckets (largest <= {n}) or build the model with more positions")
            if causal is False:
                raise ValueError(f"causal=False with seq_buckets: the {name} declares causal=True; drop causal=False")
            return
        if causal is not True:
            raise ValueError(
                f"seq_buckets={list(seq_buckets.sizes)} with causal={causal}: padding positions at the end of a "
                f"sequence leaves the real positions unchanged only in a causal model ({type(root).__name__} is "
                "not known to be one); pass causal=True if position i never attends to later positions, or drop "
                "seq_buckets (every sequence length then gets graphs of its own)")

    def sizes(self, leaves: List[torch.Tensor]) -> Tuple[int, Optional[int]]:
        """The call's batch size (dim 0) and, with ``seq_buckets``, its sequence length (dim 1)."""
        batched = [t for t in leaves if t.dim() >= 1]
        if not batched:
            raise ValueError("InferenceCudaGraphs: no tensor argument has a batch dimension (dim 0) to pad")
        batch = int(batched[0].shape[0])
        if any(int(t.shape[0]) != batch for t in batched):
            raise ValueError(f"InferenceCudaGraphs: tensor arguments disagree on the batch size (dim 0): "
                             f"{[tuple(t.shape) for t in batched]}; every tensor argument with dimensions must carry "
                             "the batch in dim 0 (0-dim tensors are passed as they are)")
        if self.seq_buckets is None:
            return batch, None
        seqd = [t for t in batched if t.dim() >= 2]
        if not seqd or any(int(t.shape[1]) != int(seqd[0].shape[1]) for t in seqd):
            raise ValueError(f"InferenceCudaGraphs with seq_buckets: tensor arguments must share the sequence length "
                             f"in dim 1, got {[tuple(t.shape) for t in batched]}")
        return batch, int(seqd[0].shape[1])

    def pad(self, t: torch.Tensor, batch: int, seq: Optional[int]) -> torch.Tensor:
        """``t`` padded at the end to ``batch`` rows (and ``seq`` positions with ``seq_buckets``)."""
        if t.dim() == 0:
            return t
        t = pad_to(t, batch, 0, self.pad_value)
        if self.seq_buckets is not None and t.dim() >= 2:
            t = pad_to(t, seq, 1, self.pad_value)
        return t

    def cut(self, out_leaves: Sequence[torch.Tensor], real: Tuple[int, Optional[int]],
            padded: Tuple[int, Optional[int]], model_name: str) -> List[torch.Tensor]:
        """Fresh copies of the outputs cut back from the ``padded`` (batch, seq) to the ``real`` ones."""
        (batch, seq), (padded_batch, padded_seq) = real, padded
        cut = []
        for i, t in enumerate(out_leaves):
            if t.dim() == 0 or t.shape[0] != padded_batch or (
                    self.seq_buckets is not None and (t.dim() < 2 or t.shape[1] != padded_seq)):
                raise NotImplementedError(
                    f"InferenceCudaGraphs: output tensor {i} of {model_name} has shape {tuple(t.shape)}, "
                    f"without the padded batch {padded_batch} in dim 0"
                    + (f" and the padded length {padded_seq} in dim 1" if self.seq_buckets is not None else "")
                    + "; padded rows could not be cut out of it. Return per-row outputs (e.g. logits) and reduce "
                    "them (e.g. the loss) outside the graphed call")
            t = unpad(t, batch, 0)
            if self.seq_buckets is not None:
                t = unpad(t, seq, 1)
            cut.append(t.clone())
        return cut

    def agree(self, leaves: Sequence[torch.Tensor], batch: Optional[int], seq: Optional[int], *, device: torch.device,
              group: Any, rank: int) -> Tuple[Optional[int], Optional[int]]:
        """The padded (batch, seq) every rank of ``group`` uses for this call (the largest; None on every rank when
        one rank's call fits no bucket). Block graphs hold collectives: every rank must replay (or run eagerly)
        the same graph at the same call, so the shapes outside the padded dimensions must agree too."""
        skip = 1 if self.seq_buckets is None else 2  # the dimensions that are padded, and so may differ
        rest = repr([(tuple(t.shape[skip:]) if t.dim() else (), str(t.dtype)) for t in leaves])
        digest = int.from_bytes(hashlib.sha1(rest.encode()).digest()[:7], "big")
        none = 1 << 40  # "no bucket" wins the maximum: if one rank runs eagerly, all do
        vals = torch.tensor([none if batch is None else batch, seq or 0, digest, -digest], dtype=torch.int64,
                            device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
        b, s, hi, neg_lo = vals.tolist()
        if hi != -neg_lo:
            raise ValueError(
                f"[rank {rank}] InferenceCudaGraphs: the ranks called a block graph of a sharded model with "
                "different shapes outside the padded dimensions; its collectives must run on every rank together. "
                "Pass the same shapes on every rank (only the padded dimensions may differ), or use "
                "inference_cuda_graph_scope='layer'")
        if b == none:
            return None, None
        return b, (s if self.seq_buckets is not None else None)
