"""What a whole-step capture cannot contain: host synchronisations and CPU tensors, found and named.

[Note: host syncs in a captured step]
A CUDA graph replays kernels; the Python that ran while the step was captured does not run again. Whatever
the step read back from the GPU on the host while it was captured (``loss.item()``, ``if (x > 0).any():``,
``t.tolist()``, ``x[mask]`` whose output size depends on the data, ``torch.nonzero``) was read once, at
capture, and is frozen into the graph; CUDA refuses most such reads during a capture anyway, with an error
(``operation not permitted when stream is capturing``) that names no operation. A CPU tensor mixed into a
device operation is read on the host at capture and frozen the same way, silently.

Two nets, one error (:class:`HostSyncError`, naming the operation and the line of user code):

1. :class:`CaptureSafetyCheck`, a dispatch mode that the full-iteration layer runs around its eager warmup
   steps (on the CPU protocol backend, also around its capture). It sees every ATen operation and refuses
   those that read device values on the host, boolean-mask indexing, copies between host and device, and
   CPU tensors mixed with device tensors. It only looks: the operations run unchanged, so the warmup steps
   compute exactly what they compute without it.
2. During the capture itself, :func:`sync_debug_errors` sets ``torch.cuda.set_sync_debug_mode("error")`` so
   that synchronising calls the first net does not know raise in Python before CUDA sees them, and
   :func:`translate_capture_error` turns those, and CUDA's capture errors, into the same kind of message.

What neither net can see: Python values (a step counter, a config flag) that the step branches on. They
are read at capture like everything else; the graph replays the branch taken then.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["HostSyncError", "CaptureSafetyCheck", "sync_debug_errors", "translate_capture_error", "user_location",
           "rng_restored", "rehearsal"]

#: What torch's sync debug mode says when a synchronising call is made in mode "error".
SYNC_DEBUG_MARK = "called a synchronizing CUDA operation"
#: Fragments of CUDA's errors for operations that a capture forbids, or that invalidated it.
_CAPTURE_MARKS = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCapture",
    "operation failed due to a previous error during capture",
    "CUDA_ERROR_STREAM_CAPTURE",
)
_LEGACY_MARK = "legacy stream"

#: ATen operations (overload packet names) that read device data on the host, with why.
_SYNC_OPS = {
    "_local_scalar_dense": "reads a tensor's value on the host (Tensor.item(), float()/int()/bool() of a tensor, "
                           "or a Python if/while on a tensor)",
    "is_nonzero": "reads a tensor's truth value on the host (a Python if/while/and/or on a tensor)",
    "equal": "(torch.equal) returns a Python bool, read from the device on the host",
    "nonzero": "(torch.nonzero) has an output size that depends on the data, read on the host",
    "masked_select": "has an output size that depends on the data, read on the host",
    "_unique": "(torch.unique) has an output size that depends on the data, read on the host",
    "_unique2": "(torch.unique) has an output size that depends on the data, read on the host",
    "unique_dim": "(torch.unique) has an output size that depends on the data, read on the host",
    "unique_consecutive": "has an output size that depends on the data, read on the host",
    "unique_dim_consecutive": "has an output size that depends on the data, read on the host",
}
_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ENGINE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_fsdp") + os.sep
_THIS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _library_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR) or path.startswith(_ENGINE_DIR):
        return True
    # our private modules (the graph machinery) are library; model.py, train.py and scripts are user code
    return path.startswith(_THIS_DIR) and os.path.basename(path).startswith("_")


def user_location(frames: Sequence[traceback.FrameSummary]) -> str:
    """``file:line in function: source`` of the innermost frame outside torch and this library."""
    for fs in reversed(list(frames)):
        if not _library_frame(fs.filename) and "<frozen" not in fs.filename:
            line = (fs.line or "").strip()
            return f"{fs.filename}:{fs.lineno} in {fs.name}" + (f": `{line}`" if line else "")
    return "an unknown line (no frame outside torch and fsdp_cudagraph)"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class HostSyncError(RuntimeError):
    """A captured (or to-be-captured) step did something a CUDA graph cannot replay: a host read, a CPU tensor.

    Attributes: ``operation`` (e.g. ``aten._local_scalar_dense``), ``location`` (the user's line), ``phase``.
    """

    def __init__(self, operation: str, why: str, location: str, phase: str) -> None:
        self.operation, self.location, self.phase = operation, location, phase
        super().__init__(
            f"[rank {_rank()}] fsdp_cudagraph: {phase} cannot be captured in a CUDA graph: {operation} {why}, at "
            f"{location}. A full-iteration graph replays kernels only, so a value read on the host would be "
            "frozen at its capture-time value, or the capture fails. Fix: keep the step on the device (torch.where "
            "or masks instead of a Python branch on a tensor, return tensors instead of calling .item(), build "
            "index tensors on the device, pass per-step values as tensors in the step's inputs), or train this "
            "model with partial graphs (PartialCudaGraphs) or eagerly."
        )


class CaptureSafetyCheck(TorchDispatchMode):
    """Refuse, with :class:`HostSyncError`, the ATen operations a captured step must not contain.

    Args:
        device: the model's device. On CUDA, CPU tensors mixed into device operations and host<->device
            copies are refused too; on CPU (the protocol backend) only the host-read operations can be seen.
        phase: names the step in the message (e.g. ``"the training step"``).

    Pass-through otherwise: every operation runs as without the mode. Costs some microseconds of Python per
    operation, so it is meant for the few eager steps before a capture, not for every step.

    [Note: dispatch modes and torch.compile]
    A function compiled by ``torch.compile`` that is called while a Python dispatch mode is active is given up
    by Dynamo for the rest of the process: from then on it runs as plain Python, also with no mode active
    (torch 2.13, reproduced on CPU by ``tests/graphs/test_full_iteration.py``). TransformerEngine compiles its
    bias+GeLU fusion this way (``jit_fuser``), and the unfused eager path rounds differently; one host-sync
    check therefore changed the last bits of every later TE ``LayerNormMLP`` step in the process (the one
    full-iteration row that differed from eager, H100, 2026-11-24). The check therefore runs with
    ``torch.compiler.set_stance("force_eager")``: compiled functions run their Python, where the check sees
    their operations too, and their compiled code stays in use once the check ends. The checked pass itself
    computes as uncompiled eager code, which is why the full-iteration layer checks a rehearsal whose
    results it throws away ([Note: the host-sync rehearsal]).
    """

    def __init__(self, device: torch.device, phase: str) -> None:
        super().__init__()
        self.device = device
        self.phase = phase
        self._stance: List[Any] = []

    def __enter__(self) -> "CaptureSafetyCheck":
        stance = torch.compiler.set_stance("force_eager")
        stance.__enter__()
        self._stance.append(stance)
        try:
            return super().__enter__()
        except BaseException:
            self._stance.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._stance.pop().__exit__(None, None, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        problem = self._problem(func, args, kwargs)
        if problem is not None:
            raise HostSyncError(str(func), problem, user_location(traceback.extract_stack()[:-1]), self.phase)
        return func(*args, **kwargs)

    def _problem(self, func: Any, args: Any, kwargs: Any) -> Optional[str]:
        name = func.overloadpacket.__name__
        why = _SYNC_OPS.get(name)
        if why is not None:
            return why
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            # overloads Tensor(repeats) and self_Tensor(self, repeats, dim); self_int(self, 2) is static
            repeats = args[1] if len(args) > 1 else (args[0] if args else None)
            if isinstance(repeats, torch.Tensor):
                return "with tensor repeats and no output_size has an output size that depends on the data"
        if name in _INDEX_OPS and len(args) > 1:
            index = [t for t in tree_leaves(args[1]) if isinstance(t, torch.Tensor)]
            if any(t.dtype == torch.bool for t in index):
                return "with a boolean mask has an output size that depends on the data, read on the host"
        if self.device.type == "cpu":
            return None
        tensors: List[torch.Tensor] = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # Integer CPU tensors are how ATen passes RNG seeds and offsets to attention kernels (flash attention
        # returns them on the host even without dropout): metadata, not user data. Floating-point and bool
        # CPU tensors next to device tensors are values the step computes with.
        on_cpu = any(t.device.type == "cpu" and (t.is_floating_point() or t.dtype == torch.bool) for t in tensors)
        on_dev = any(t.device.type != "cpu" for t in tensors)
        if name == "_to_copy" and tensors:
            target = kwargs.get("device")
            src = args[0].device.type if isinstance(args[0], torch.Tensor) else None
            if target is not None and torch.device(target).type == "cpu" and src not in (None, "cpu"):
                return "copies a device tensor to the host (.cpu(), .tolist(), .numpy())"
            if target is not None and torch.device(target).type != "cpu" and src == "cpu":
                return "copies a CPU tensor to the device inside the step (its values are frozen at capture)"
        if on_cpu and on_dev:
            return "mixes a CPU tensor with device tensors (the CPU value is read on the host at capture and frozen)"
        return None


@contextlib.contextmanager
def rng_restored(device: torch.device, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
    """Put back, on exit, the CPU generator's state, ``device``'s default CUDA generator's (on CUDA) and those of
    ``generators``: what a discarded rehearsal of a step drew leaves no trace ([Note: the host-sync rehearsal])."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    extra = [g.get_state() for g in generators]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        for g, st in zip(generators, extra):
            g.set_state(st)


@contextlib.contextmanager
def rehearsal(device: torch.device, phase: str, *, start: Optional[Callable[[], None]] = None,
              generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
    """A discarded rehearsal of a step under :class:`CaptureSafetyCheck`: ``start()`` (the step's starting state),
    then the block under the check; every generator the step draws from is put back on exit.

    [Note: the host-sync rehearsal] The check is a dispatch mode that only looks, yet a step computed
    under it runs the functions a library compiled with ``torch.compile`` (TE's bias+GeLU fusion) as
    uncompiled Python, which rounds differently ([Note: dispatch modes and torch.compile]; that is also
    why the check forces eager mode, or Dynamo would give those functions up for the whole process).
    So the check never runs on a step whose results count: it runs on a rehearsal of the step right before
    capture, from the same starting state (the full-iteration graph's ``start`` is the engine's
    ``begin_static_step``: gradients are replaced, not added), with every random generator the step draws
    from put back afterwards; then the step runs again, plainly, as every other warmup step does. Costs one
    extra forward and backward, once per capture; a step with Python side effects sees that step twice.
    """
    with rng_restored(device, generators):
        if start is not None:
            start()
        with CaptureSafetyCheck(device, phase):
            yield


@contextlib.contextmanager
def sync_debug_errors(enabled: bool = True) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block (a no-op without CUDA); restored in finally."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _chain(exc: BaseException) -> List[BaseException]:
    """``exc`` and the exceptions it was raised from or during, newest first."""
    out: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and all(e is not o for o in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def translate_capture_error(exc: BaseException, *, phase: str) -> Optional[BaseException]:
    """An error that names the cause and the fix for a capture that failed with ``exc``, or None to keep ``exc``.

    Looks through the chain of exceptions (a failed capture often raises a second error when it ends): a
    :class:`HostSyncError` is returned as it is; torch's sync-debug error and CUDA's capture errors become a
    :class:`HostSyncError` or a RuntimeError naming the user's line.
    """
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, HostSyncError):
            return e
    for e in reversed(chain):  # the original error first: its traceback reaches the user's line
        msg = str(e)
        where = user_location(traceback.extract_tb(e.__traceback__)) if e.__traceback__ is not None else "?"
        if SYNC_DEBUG_MARK in msg:
            return HostSyncError("a synchronising CUDA call", "makes the host wait for the GPU", where, phase)
        if "CUDAGeneratorImpl" in msg and "captur" in msg:
            return RuntimeError(
                f"[rank {_rank()}] fsdp_cudagraph: {phase} read the CUDA random-number generator's state on the host "
                f"while being captured ({msg.splitlines()[0]}), at {where}. A graph cannot replay that read. The usual "
                "cause is activation checkpointing with torch.utils.checkpoint's default preserve_rng_state=True: pass "
                "preserve_rng_state=False when the checkpointed code draws no random numbers (no dropout), and keep "
                "torch.cuda.get_rng_state/manual_seed out of the step; extra generators the step uses go to "
                "FullIterationCudaGraph(generators=...)."
            )
        if _LEGACY_MARK in msg and "captur" in msg:
            return RuntimeError(
                f"[rank {_rank()}] fsdp_cudagraph: {phase} could not be captured: autograd state from a step that "
                f"ran on the legacy default CUDA stream is still alive ({msg.splitlines()[0]}), at {where}. Build "
                "FullIterationCudaGraph before the first training step (it moves this thread to a side stream) and "
                "keep no reference to an earlier step's loss or outputs; torch >= 2.13 handles this by itself."
            )
        if any(m in msg for m in _CAPTURE_MARKS):
            return RuntimeError(
                f"[rank {_rank()}] fsdp_cudagraph: CUDA refused an operation while {phase} was being captured "
                f"({msg.splitlines()[0]}), at {where}: typically a copy from pageable CPU memory or a CPU tensor "
                "moved to the device inside the step, an allocation outside PyTorch's allocator, or a host "
                "synchronisation. Move such work out of the step (pass the data as step inputs), or train with "
                "partial graphs or eagerly."
            )
    return None
