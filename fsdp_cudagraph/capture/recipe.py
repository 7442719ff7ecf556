"""The one raw capture recipe of the whole-step graph kinds: ``capture_graph(body, ...) -> torch.cuda.CUDAGraph``.

Full-iteration train/eval graphs, the optimizer graph and inference graphs each capture a Python callable
into one ``torch.cuda.CUDAGraph``. They used to spell the recipe out three times and the copies had drifted;
[Note: one capture recipe] says which differences were needs (kept as arguments) and which were drift
(removed). Per-layer graphs (``graphs/partial.py``) do not come here: their graph makers (TE's or
PyTorch's ``make_graphed_callables``) own their capture; their schedules are in ``capture/schedules.py``.

Knows no engine: the engine's capture guard comes in as a context-manager factory (``guard``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import time
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fsdp_cudagraph.capture import streams as _streams
from fsdp_cudagraph.capture.attention import te_capture_flag
from fsdp_cudagraph.capture.capture_safety import sync_debug_errors, translate_capture_error

__all__ = ["capture_graph", "raise_translated", "agree_collectives", "barrier", "reset_graph", "free_memory",
           "CaptureMeter", "check_generators", "addresses", "refuse_moved"]


def capture_graph(body: Callable[[], Any], *, device: torch.device, phase: str,
                  guard: Optional[Callable[[], ContextManager[Any]]] = None, pool: Any = None,
                  generators: Sequence[torch.Generator] = (), te_flag: bool = True,
                  sync_debug: bool = True) -> "tuple[torch.cuda.CUDAGraph, Any]":
    """Capture ``body()`` into a new CUDA graph; returns ``(graph, what body returned)``.

    Args:
        body: the work to capture, called once, inside the capture.
        device: the CUDA device; the capture runs on this thread's current stream of it (see the Note).
        phase: what is being captured, in words ("the training step"): error messages name it.
        guard: the engine's capture guard, a factory of a context manager entered around the capture
            (e.g. ``lambda: capture_guard(ALLOW_COLLECTIVES, collective_log=log)``); None: no guard.
        pool: a memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``), or None.
        generators: CUDA generators besides the default one that ``body`` draws from, registered with
            the graph so that each replay advances them as an eager run would.
        te_flag: raise TransformerEngine's capture flag (a no-op without TE).
        sync_debug: ``torch.cuda.set_sync_debug_mode("error")`` inside the capture, so that a host sync
            is named instead of freezing its capture-time value.

    Errors: a failure inside the capture is translated by :func:`capture_safety.translate_capture_error`
    (the cause and the fix, for ``phase``) and raised from the original. Nothing is retried.

    [Note: one capture recipe]
    The three former copies (full-iteration, inference, optimizer) differed in three ways:
    - Stream. Full-iteration and optimizer captured on the thread's current stream (a side stream since
      the graph object was built, ``capture/streams.py``) under ``stale_stream_override``; inference
      passed no stream, so torch captured on a private stream of its own. That was drift, not a need:
      the inference object moves the thread to a side stream as the others do, capturing there keeps
      the capture ordered with the eager work queued before it, and the override is inert for work
      without autograd. Every capture now runs on the current stream with the override on.
    - TE's capture flag. Full-iteration and inference raised it, the optimizer did not. Drift: TE modules
      read the flag to stay graph-safe, and a step without TE modules never reads it (the flag is a
      no-op without TE). Raised by default everywhere; ``te_flag=False`` is kept for a caller that
      must capture TE modules in their eager mode.
    - Pool and generators. Needs: inference shares one pool across its graphs (``pool``), the training
      step registers the user's extra generators (``generators``); both stay arguments.
    Error translation was done by each caller around more than the capture (warmup, the protocol
    backend); it is done here for the capture, and callers that translate a wider block call
    :func:`raise_translated`, which leaves an error translated here as it is.
    """
    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        graph.register_generator_state(gen)
    stream = torch.cuda.current_stream(device)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_streams.stale_stream_override())
            if guard is not None:
                stack.enter_context(guard())
            if te_flag:
                stack.enter_context(te_capture_flag())
            stack.enter_context(torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"))
            stack.enter_context(sync_debug_errors(sync_debug))
            out = body()
    except BaseException as exc:
        raise_translated(exc, phase)
        raise
    return graph, out


def raise_translated(exc: BaseException, phase: str) -> None:
    """Raise the translation of a capture error ``exc`` (from ``exc``) when there is one; else return.

    Idempotent: an error this function raised is not translated again by a caller's wider ``except``.
    """
    if getattr(exc, "_fsdp_cudagraph_translated", False):
        return
    translated = translate_capture_error(exc, phase=phase)
    if translated is not None and translated is not exc:
        translated._fsdp_cudagraph_translated = True  # type: ignore[attr-defined]
        raise translated from exc


def agree_collectives(log: Sequence[str], what: str, *, rank: int, world_size: int, group: Any) -> None:
    """Every rank of ``group`` must have captured the same collectives (``log``), in the same order, else replays
    pair unrelated collectives or hang; raises RuntimeError on every rank otherwise. Call right after capture."""
    if world_size == 1:
        return
    mine = (hashlib.sha1("\n".join(log).encode()).hexdigest(), len(log))
    everyone: List[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        raise RuntimeError(
            f"[rank {rank}] fsdp_cudagraph: the ranks captured different collectives for {what} (counts "
            f"per rank {[n for _, n in everyone]}); replays would pair unrelated collectives or hang. Every rank must "
            "run the same units in the same order with the same number of micro-batches")


def barrier(group: Any, *, device: torch.device, nccl: bool) -> None:
    """Wait for every rank of ``group`` before a capture (nothing runs during capture; this keeps logs readable)."""
    if nccl:
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def reset_graph(graph: Any) -> None:
    """Give a captured graph's memory back (``CUDAGraph.reset``); None (the protocol backend's) is left alone."""
    reset = getattr(graph, "reset", None)
    if callable(reset):
        reset()


def free_memory(cuda: bool) -> None:
    """After graphs were dropped: collect what referenced their memory, then return the cached blocks (on CUDA)."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


class CaptureMeter:
    """Wall seconds since it was made, and the CUDA memory allocated on ``device`` since then (0 unless ``cuda``):
    what a capture report gives as its time and graph memory."""

    def __init__(self, device: torch.device, *, cuda: bool) -> None:
        self.device, self.cuda = device, cuda
        self.t0 = time.perf_counter()
        self.mem0 = torch.cuda.memory_allocated(device) if cuda else 0

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def memory(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.mem0 if self.cuda else 0


def check_generators(generators: Sequence[torch.Generator], *, cuda: bool) -> None:
    """Extra generators need ``CUDAGraph.register_generator_state`` (:func:`capture_graph`'s ``generators``)."""
    if generators and cuda and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        raise NotImplementedError(f"generators= needs CUDAGraph.register_generator_state, missing in torch "
                                  f"{torch.__version__}; upgrade torch, or pass no generators")


_data_ptr = torch.Tensor.data_ptr


def addresses(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """The data addresses of ``tensors``: taken at capture, and compared with the capture's before each replay
    (the replay address check; nothing else is built on that path)."""
    return tuple(map(_data_ptr, tensors))


def refuse_moved(tensors: Sequence[torch.Tensor], captured: Tuple[int, ...], *, who: str, rank: int, fix: str) -> None:
    """Raise the replay address check's RuntimeError: ``tensors`` (a graph's parameters) are no longer at the
    addresses ``captured`` (from :func:`addresses`); names the first that moved, ``who`` would replay, and ``fix``."""
    moved = next(i for i, (t, ptr) in enumerate(zip(tensors, captured)) if t.data_ptr() != ptr)
    raise RuntimeError(
        f"[rank {rank}] fsdp_cudagraph: {who} would replay with parameter {moved} at {tensors[moved].data_ptr():#x}, "
        f"but it was captured at {captured[moved]:#x}; replay would read stale memory. {fix}")
