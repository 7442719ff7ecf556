"""The CPU shims of :mod:`fsdp_cudagraph.apps.mcore_gpt`: megatron-core's GPTModel on the host (Gloo ranks).

megatron-core calls a few CUDA-only functions that do not touch the model's math at any TP or EP size with no
dropout (the current device, CUDA streams and events, the CUDA RNG tracker's fork, the alltoall dispatcher's host copy of
its split sizes); :func:`cpu_shims` replaces each with its host equivalent while it is entered. The app's
``--device cpu`` and the CPU tests enter it; a checker factory on a machine without CUDA installs it for the
rest of the process (:func:`shims_for_factory`); :func:`check_device` refuses a CPU build outside it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional

import torch

__all__ = ["cpu_shims", "shims_for_factory", "check_device"]

logger = logging.getLogger(__name__)


class _HostStream:
    """What megatron-core's alltoall dispatcher asks of a CUDA stream, on the host: work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_HostEvent":
        return _HostEvent()


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` for a tensor already on the host (see :func:`cpu_shims`)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


_SHIMS_ACTIVE = False


@contextlib.contextmanager
def cpu_shims() -> Iterator[List[str]]:
    """Let megatron-core's GPTModel (local spec) train on the CPU; yields the names replaced, restored on exit.

    megatron-core calls CUDA-only functions that have no effect on the model's math at any TP or EP size with no
    dropout; each is replaced by its host equivalent:

    - ``torch.cuda.current_device`` returns ``"cpu"``: RoPE, the router and (TP > 1) the sequence-parallel
      all-gather's buffer (megatron-core's global memory buffer) place tensors on "the current device";
    - ``CudaRNGStatesTracker.fork`` is a no-op context: it switches the CUDA RNG state around attention
      dropout, which is 0 here (the tracker needs CUDA to hold a state at all);
    - ``torch.cuda.Stream``, ``torch.cuda.current_stream``, ``torch.cuda.stream``: the alltoall dispatcher copies
      the per-expert counts to the host on a side stream and waits on an event; on the host the copy is
      already done when it returns;
    - the alltoall dispatcher's ``maybe_move_tensor_to_cpu``: it turns a CUDA tensor of split sizes into a host
      (numpy) array and leaves any other tensor as it is, so on the host the all-to-all's split sizes (EP > 1)
      would stay tensors, which ``all_to_all_single`` refuses; the shim does its host part: ``.numpy()`` when
      asked for numpy, the tensor otherwise.

    Nothing numerical is replaced: routing, permutation, experts, attention and the loss are megatron-core's.
    """
    global _SHIMS_ACTIVE
    try:
        from megatron.core.tensor_parallel import random as tp_random
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError as exc:
        raise ImportError(f"cpu_shims needs megatron-core ({type(exc).__name__}: {exc}); install it with: "
                          "pip install 'megatron-core==0.19.2'") from exc

    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "Stream", torch.cuda.Stream),
             (torch.cuda, "current_stream", torch.cuda.current_stream),
             (torch.cuda, "stream", torch.cuda.stream),
             (tp_random.CudaRNGStatesTracker, "fork", tp_random.CudaRNGStatesTracker.fork),
             (token_dispatcher, "maybe_move_tensor_to_cpu", token_dispatcher.maybe_move_tensor_to_cpu)]
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *a, **k: _HostStream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    _SHIMS_ACTIVE = True
    try:
        yield [f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in saved]
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _SHIMS_ACTIVE = False


_PERMANENT_SHIMS: Optional[contextlib.ExitStack] = None


def shims_for_factory(device: torch.device) -> None:
    """A checker factory on the CPU (``python -m fsdp_cudagraph.check --device cpu``) has no scope to enter
    :func:`cpu_shims` around: on a machine without CUDA, where nothing can call CUDA anyway, they are installed
    for the rest of the process (with a warning); on a machine with CUDA ``mcore_gpt.build`` refuses instead."""
    global _PERMANENT_SHIMS
    if device.type != "cpu" or _SHIMS_ACTIVE or torch.cuda.is_available():
        return
    _PERMANENT_SHIMS = contextlib.ExitStack()
    names = _PERMANENT_SHIMS.enter_context(cpu_shims())
    logger.warning("mcore_gpt: megatron-core on the CPU; replaced for the rest of this process: %s", names)


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not _SHIMS_ACTIVE:
        raise RuntimeError(
            "megatron-core's GPTModel on device cpu calls CUDA-only functions (torch.cuda.current_device, CUDA "
            "streams, the CUDA RNG tracker); run inside fsdp_cudagraph.apps.mcore_gpt.cpu_shims() (the app's "
            "--device cpu does), or use a GPU")
