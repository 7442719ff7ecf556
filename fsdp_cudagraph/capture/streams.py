"""Keep a training loop that runs on the default CUDA stream capturable.

[Note: the default stream and graph capture]
Autograd remembers, in every node, the CUDA stream that was current when the node was created, and in
backward it synchronises each node's stream with the streams of its inputs. The ``AccumulateGrad`` node of
a parameter is created once, on the stream of the first step that used the parameter, and lives as long as
any autograd graph points at it -- in a normal loop, for ever: the previous step's ``loss`` still holds its
graph when the next forward reuses the node. When a capture (TE's or PyTorch's graph maker) later runs a
backward through such a node, autograd makes the node's stream wait on the capturing stream. If that stream
is the legacy default stream, CUDA refuses (``operation would make the legacy stream depend on a capturing
blocking stream``) and the capture is lost. Any other stream is simply forked into the capture and joined
back, which is legal.

So the loop must never create those nodes on the legacy default stream. We do what Megatron-LM does at
start-up when graphs are on: :func:`use_side_stream` moves this thread's current stream to one side stream
per device (after making it wait for the work already queued), and :class:`~fsdp_cudagraph.PartialCudaGraphs`
calls it when it is built, before the eager steps that precede capture. The thread stays there (like
Megatron, and so that a later capture after ``delete()`` works too); everything keeps its ordering because
every later kernel, collective and copy is queued on that one stream. torch >= 2.13 also has
``torch.autograd.graph.set_override_stale_capture_stream``, which rewrites such stale streams during a
capture; :func:`stale_stream_override` turns it on around our captures where it exists.

What cannot be handled on torch < 2.13: training steps that ran on the legacy stream *before* the side
stream was installed left nodes behind that may still be alive. :func:`legacy_stream_hazard` names that case
so that ``capture()`` refuses it before touching CUDA state, with the one-line fix (build
``PartialCudaGraphs`` before the first training step, or call ``fsdp_cudagraph.use_side_stream()`` at
start-up).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, Optional, Sequence

import torch

__all__ = ["use_side_stream", "on_legacy_default_stream", "leave_legacy_stream", "stale_stream_override",
           "legacy_stream_hazard", "graph_backend"]

logger = logging.getLogger(__name__)

#: The CUDA namespace used here; tests put a stand-in with the same five functions in its place.
_cuda: Any = torch.cuda

#: device index -> the side stream that this process trains on once graphs are in use.
_side_streams: Dict[int, Any] = {}


def _device_index(device: Optional[torch.device]) -> int:
    if device is None or device.index is None:
        return _cuda.current_device()
    return device.index


def graph_backend(backend: Optional[str], device: torch.device, allowed: Sequence[str]) -> str:
    """``backend`` checked against ``allowed`` (a subset of ``config.BACKENDS``, see [Note: backends]), or, when
    None, the one the model's ``device`` runs: 'torch' (real graphs) on a CUDA device, else 'protocol'."""
    if backend is None:
        backend = "torch" if device.type == "cuda" else "protocol"
    if backend not in allowed:
        if backend == "cuda":
            hint = "'cuda' is now spelled 'torch' (PyTorch's CUDA graphs); pass backend='torch'"
        elif backend == "te":
            hint = ("TransformerEngine captures per-layer graphs only (PartialCudaGraphs, LengthBucketGraphs); "
                    "pass 'torch' for PyTorch's CUDA graphs")
        else:
            hint = "pass 'torch' for real graphs, 'protocol' for the CPU schedule, or None to choose by the model's device"
        raise ValueError(f"backend={backend!r} is not one of {tuple(allowed)}; {hint}")
    if backend in ("te", "torch") and device.type != "cuda":
        raise ValueError(f"backend={backend!r} needs a model on a CUDA device, this one is on {device}; "
                         "use backend='protocol' on CPU")
    return backend


def on_legacy_default_stream(device: Optional[torch.device] = None) -> bool:
    """True when CUDA exists and this thread's current stream on ``device`` is the legacy default stream."""
    if not _cuda.is_available():
        return False
    index = _device_index(device)
    return _cuda.current_stream(index) == _cuda.default_stream(index)


def use_side_stream(device: Optional[torch.device] = None) -> Optional[Any]:
    """Make this thread's current CUDA stream a side stream (see [Note: the default stream and graph capture]).

    Idempotent. Returns the side stream, or None without CUDA. If the current stream is already not the
    legacy default stream (the user runs on a stream of their own), it is left alone and returned. Work
    already queued on the default stream stays ordered before everything queued afterwards.
    """
    if not _cuda.is_available():
        return None
    index = _device_index(device)
    current = _cuda.current_stream(index)
    if current != _cuda.default_stream(index):
        return current
    side = _side_streams.get(index)
    if side is None:
        side = _side_streams[index] = _cuda.Stream(index)
        logger.info("fsdp_cudagraph: training on a side CUDA stream of device %d from now on (graph capture "
                    "cannot join the legacy default stream)", index)
    side.wait_stream(current)
    _cuda.set_stream(side)
    return side


@contextlib.contextmanager
def stale_stream_override() -> Iterator[None]:
    """Let autograd redirect stale (non-capturing) node streams to the capturing stream, where torch can."""
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if setter is None:
        yield
        return
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    previous = bool(getter()) if callable(getter) else False
    setter(True)
    try:
        yield
    finally:
        setter(previous)


def has_stale_stream_override() -> bool:
    return hasattr(torch.autograd.graph, "set_override_stale_capture_stream")


def leave_legacy_stream(device: Optional[torch.device], *, forward_calls: int) -> int:
    """:func:`use_side_stream` if this thread is on the legacy default stream of ``device``; returns
    ``forward_calls`` (the model's forward passes so far, which ran there) in that case, else 0: what
    :func:`legacy_stream_hazard` is later given."""
    if not on_legacy_default_stream(device):
        return 0
    use_side_stream(device)
    return forward_calls


def legacy_stream_hazard(*, steps_before_side_stream: int, built: str = "PartialCudaGraphs") -> Optional[str]:
    """The reason a capture would fail on stale legacy-stream autograd nodes, or None when it cannot.

    ``steps_before_side_stream``: forward passes the model ran while this thread was on the legacy default
    stream, before :func:`use_side_stream` (0 when the side stream came first). ``built``: the graph object
    whose construction moved the thread (the fix names it).
    """
    if steps_before_side_stream <= 0 or has_stale_stream_override():
        return None
    return (
        f"the model ran {steps_before_side_stream} forward pass(es) on the default CUDA stream before "
        f"{built} was built; autograd keeps parameter nodes from those steps that would pull the "
        "legacy stream into the capture (cudaErrorStreamCaptureImplicit) on torch "
        f"{torch.__version__} (< 2.13). Fix: build {built} before the first training step, or call "
        "fsdp_cudagraph.use_side_stream() once at start-up (or upgrade to torch >= 2.13)"
    )
