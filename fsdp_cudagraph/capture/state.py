"""The graph layer's own capture state: whether a graph of ours is being captured on this thread.

Activation offloading must know whether the graph maker is capturing (it offloads then, and must not pin
host memory). That is the graph layer's fact, not an engine's: under any engine, or none, a real capture is
torch's capture state, and the CPU protocol backend's stand-in is :func:`simulated_capture`, which every
graph kind enters around its simulated capture passes (beside the engine's own guard, reached through its
adapter).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["is_capturing", "simulated_capture"]

_state = threading.local()


def is_capturing() -> bool:
    """True while the current CUDA stream captures a graph, or inside :func:`simulated_capture` on this thread."""
    if getattr(_state, "simulated", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """Make :func:`is_capturing` true on this thread for the block (the protocol backend's capture pass)."""
    previous = getattr(_state, "simulated", False)
    _state.simulated = True
    try:
        yield
    finally:
        _state.simulated = previous
