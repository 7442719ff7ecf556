"""Bytes a rank moves through its links in one step, by collective kind, counted as the collectives are issued.

[Note: counting a step's bytes]
:func:`count_collectives` wraps, for the duration of a ``with`` block, the functions the engines and the MoE
call: ``torch.distributed``'s ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce`` and
``all_to_all_single`` (FSDP2, the expert exchange of ``apps/moe_ep.py``, our engine's all-reduces), and our
engine's bound ``megatron_fsdp._collectives._all_gather_single`` / ``_reduce_scatter_single`` (bound at import,
so patched where they live; torch 2.13's ``all_gather_single``/``reduce_scatter_single`` too). Each call adds
what crosses this rank's links under a ring (or pairwise) algorithm:

- all-gather of an ``N``-byte output over ``W`` ranks: ``N (W-1)/W``; reduce-scatter of an ``N``-byte input:
  ``N (W-1)/W``; all-reduce of ``N`` bytes: ``2 N (W-1)/W``;
- all-to-all: the bytes this rank sends to the other ranks (its own split stays);
- nothing for a group of one rank (our engine copies locally there and calls no collective).

Tensor parallelism: a call whose group is ``tp_group`` (the model's tensor-parallel group, given to
:func:`count_collectives`) counts under ``tp_<kind>`` instead, and the reference GPT's sequence-parallel
all-gathers and reduce-scatters (``fsdp_cudagraph.apps.tp``'s ``_all_gather_single`` / ``_reduce_scatter_single``,
and megatron-core's ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` in ``tensor_parallel.mappings``,
``tensor_parallel.layers`` and ``utils``, bound at import) are patched where they live, so a TP step splits into
the TP collectives inside the layers (and the engine's all-reduce of the ``sequence_parallel`` gradients over TP)
and FSDP's over the data-parallel group.
DTensor's TP collectives (FSDP2 + ``parallelize_module``) are torch's functional collectives
(``torch.ops._c10d_functional``), which this counter does not see: an FSDP2 TP row holds FSDP2's bytes only.

Only calls made from Python during the block count: a collective inside a replayed CUDA graph is not seen
(partial graphs hold none: FSDP's collectives and the all-to-alls run eagerly between them). The counts are of
this rank; :func:`reduce_max` gives the largest over the ranks (the all-to-all's splits differ by rank).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["KINDS", "count_collectives", "reduce_max"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "tp_all_gather", "tp_reduce_scatter",
         "tp_all_reduce")


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all_sent(first: torch.Tensor, second: torch.Tensor, args: Dict[str, Any]) -> int:
    """Bytes ``all_to_all_single(output, input, output_split_sizes, input_split_sizes)`` sends to other ranks."""
    group = args.get("group")
    w, splits = _size(group), args.get("input_split_sizes")
    if not splits:
        return _nbytes(second) * (w - 1) // w
    row = _nbytes(second) // max(second.shape[0], 1)
    me = dist.get_rank(group)
    return sum(n for q, n in enumerate(splits) if q != me) * row


def _ring(kind: str) -> Callable[[torch.Tensor, Optional[torch.Tensor], Dict[str, Any]], int]:
    factor = 2 if kind == "all_reduce" else 1

    def nbytes(first: torch.Tensor, second: Optional[torch.Tensor], args: Dict[str, Any]) -> int:
        w = _size(args.get("group"))
        # all_gather(output, input): the output; reduce_scatter(output, input): the input; all_reduce(tensor)
        t = second if kind == "reduce_scatter" else first
        return factor * _nbytes(t) * (w - 1) // w

    return nbytes


def _measure(kind: str, fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> Tuple[int, Any]:
    """The call's arguments by name (callers pass them positionally or by keyword), then the kind's bytes and the
    call's group (None: the default group)."""
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **kwargs).arguments
    names = list(sig.parameters)
    nbytes = _MEASURES[kind](bound[names[0]], bound.get(names[1]) if len(names) > 1 else None, bound)
    return nbytes, bound.get("group")


class _State:
    """Set while a counted call runs, so that a counted function calling another counted name counts once."""

    inside = False


counted_state = _State()

_MEASURES = {"all_gather": _ring("all_gather"), "reduce_scatter": _ring("reduce_scatter"),
             "all_reduce": _ring("all_reduce"), "all_to_all": _all_to_all_sent}


@contextlib.contextmanager
def count_collectives(tp_group: Optional[dist.ProcessGroup] = None) -> Iterator[Dict[str, int]]:
    """``with count_collectives() as moved:`` ... ``moved[kind]`` is this rank's bytes (see the Note);
    ``tp_group``: calls over this group count under ``tp_<kind>``."""
    import megatron_fsdp._collectives as ours
    from fsdp_cudagraph.apps import tp as tp_layers

    moved: Dict[str, int] = {k: 0 for k in KINDS}
    targets = [(dist, "all_gather_into_tensor", "all_gather"), (dist, "all_gather_single", "all_gather"),
               (dist, "reduce_scatter_tensor", "reduce_scatter"), (dist, "reduce_scatter_single", "reduce_scatter"),
               (dist, "all_reduce", "all_reduce"), (dist, "all_to_all_single", "all_to_all"),
               (ours, "_all_gather_single", "all_gather"), (ours, "_reduce_scatter_single", "reduce_scatter"),
               (tp_layers, "_all_gather_single", "all_gather"),
               (tp_layers, "_reduce_scatter_single", "reduce_scatter")]
    try:  # megatron-core's sequence-parallel gathers and scatters (mcore70b), bound at import
        from megatron.core import utils as mcore_utils
        from megatron.core.tensor_parallel import layers as mcore_layers, mappings as mcore_mappings
    except ImportError:
        pass
    else:
        targets += [(m, f"dist_{kind}_func", kind) for m in (mcore_mappings, mcore_layers)
                    for kind in ("all_gather", "reduce_scatter")]
        targets.append((mcore_utils, "dist_all_gather_func", "all_gather"))
    saved = []
    for owner, name, kind in targets:
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def counted(*args: Any, _fn: Callable[..., Any] = fn, _kind: str = kind, **kwargs: Any) -> Any:
            if not counted_state.inside:
                nbytes, group = _measure(_kind, _fn, args, kwargs)
                moved[f"tp_{_kind}" if tp_group is not None and group is tp_group else _kind] += nbytes
            counted_state.inside = True
            try:
                return _fn(*args, **kwargs)
            finally:
                counted_state.inside = False

        saved.append((owner, name, fn))
        setattr(owner, name, counted)
    try:
        yield moved
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)



def reduce_max(moved: Dict[str, int], device: torch.device) -> Dict[str, int]:
    """The largest count of each kind over the default group's ranks (every rank must call it)."""
    t = torch.tensor([moved.get(k, 0) for k in KINDS], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(KINDS, t.tolist())}
