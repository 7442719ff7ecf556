"""Vocabulary shared by the engine's modules: strategies, training states, the capture guard, logging."""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import Any, Iterator, List, Optional, Union

import torch
import torch.distributed as dist

#: The engine (``megatron_fsdp.MegatronFSDP``) and one of its units (``FSDPUnit``) as the engine's parts
#: annotate them: the parts (clipping, state dicts, checkpoints, guards) are imported by the facade, so they
#: never import it back, not even for annotations (the package's import graph stays a tree).
Engine = Any
Unit = Any

__all__ = [
    "phase",
    "ShardingStrategy",
    "TrainingState",
    "is_capturing",
    "simulated_capture",
    "check_not_capturing",
    "CaptureGuardMode",
    "capture_guard",
    "capture_guard_mode",
    "log_rank0",
]

logger = logging.getLogger("megatron_fsdp")


class ShardingStrategy(str, enum.Enum):
    """What each rank keeps a shard of (Megatron-FSDP's ``zero_dp_strategy`` names).

    Every strategy averages gradients over the data-parallel group; they differ in what is sharded.
    """

    #: Nothing sharded: replicated parameters, all-reduced gradients, full optimizer state (plain DDP).
    NO_SHARD = "no_shard"
    #: ZeRO-1: optimizer state and main parameters sharded; each unit keeps a persistent full gradient
    #: buffer that is reduce-scattered after backward; compute parameters stay unsharded.
    OPTIM = "optim"
    #: ZeRO-2: as ``optim``, but the full gradient buffer is transient (double buffer or freed after the
    #: reduce-scatter); compute parameters stay unsharded.
    OPTIM_GRADS = "optim_grads"
    #: ZeRO-3: compute parameters too are sharded, all-gathered before forward and before backward and
    #: released after each.
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, value: Union[str, "ShardingStrategy"]) -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(s.value for s in cls)
        raise ValueError(f"sharding_strategy={value!r} is not one of: {valid}; pass one of those names")

    @property
    def shards_params(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS

    @property
    def shards_optimizer(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD


class TrainingState(enum.Enum):
    """Where a unit is in the step. Entered as commented; checked to catch hooks firing out of order."""

    #: Before the unit's forward this step, and again once its post-backward has finished.
    IDLE = enum.auto()
    #: Entered in pre-forward (parameters unsharded), left in post-forward.
    FORWARD = enum.auto()
    #: Entered in post-forward; the unit waits for the gradient of its outputs.
    FORWARD_DONE = enum.auto()
    #: Entered in pre-backward (parameters unsharded again), left in post-backward.
    BACKWARD = enum.auto()


#: States in which a unit computes with its unshard buffer, which nothing may overwrite meanwhile.
COMPUTING = (TrainingState.FORWARD, TrainingState.BACKWARD)

_simulated = threading.local()


def is_capturing() -> bool:
    """True while the current CUDA stream captures a graph, or inside :func:`simulated_capture`."""
    if getattr(_simulated, "active", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """Make :func:`is_capturing` true on this thread: the CPU protocol backend's stand-in for a capture."""
    previous = getattr(_simulated, "active", False)
    _simulated.active = True
    try:
        yield
    finally:
        _simulated.active = previous


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------------- capture guard
class CaptureGuardMode(enum.Enum):
    """What the engine lets a CUDA graph capture contain (see [Note: no FSDP work inside a graph])."""

    #: The default (partial graphs): inside a capture, refuse collectives and on-demand allocations; the
    #: graph layer runs the engine's hooks outside the capture.
    REFUSE = "refuse"
    #: Full-iteration graphs: collectives are captured into the graph (every rank captures the same
    #: launches and replays them together); on-demand allocations stay refused, because a buffer that is
    #: freed and reallocated between steps would not be at the address the graph replays.
    ALLOW_COLLECTIVES = "allow_collectives"


# Process-wide, not thread-local: in backward, autograd runs the engine's hooks on its own device threads,
# which must see the mode that the capturing thread set (CUDA allows one capture at a time per process).
_guard: dict = {"mode": CaptureGuardMode.REFUSE, "log": None}


def capture_guard_mode() -> CaptureGuardMode:
    """The current :class:`CaptureGuardMode` (``REFUSE`` unless inside :func:`capture_guard`)."""
    return _guard["mode"]


@contextlib.contextmanager
def capture_guard(mode: CaptureGuardMode, *, collective_log: Optional[List[str]] = None) -> Iterator[None]:
    """Switch the capture guard to ``mode`` for the block; the previous mode is restored in ``finally``.

    ``collective_log``: when a list, every collective the engine issues in the block appends its description
    (``"all-gather of unit layers.0"``), captured or not: what a graph layer compares across ranks and
    between capture and replay. Hazard: process-wide state; do not run two captures concurrently.
    """
    if not isinstance(mode, CaptureGuardMode):
        raise TypeError(f"capture_guard mode must be a CaptureGuardMode, got {type(mode).__name__} {mode!r}")
    previous = dict(_guard)
    _guard["mode"], _guard["log"] = mode, collective_log
    try:
        yield
    finally:
        _guard.update(previous)


def check_not_capturing(what: str, *, collective: bool = False) -> None:
    """Raise RuntimeError if a collective or an allocation is requested inside a graph capture.

    [Note: no FSDP work inside a graph]
    A collective captured into a per-layer CUDA graph replays with the buffers and the communicator state of
    the capture, outside the engine's schedule; an unshard buffer allocated during capture comes from the
    graph's private pool and moves on the next allocation. Both corrupt training silently, so by default
    (``CaptureGuardMode.REFUSE``) the engine refuses them loudly, and the partial-graph layer runs FSDP hooks
    outside capture (TE's ``capture_time_hooks``). A full-iteration graph captures the whole step, so the
    engine's collectives belong inside it (``ALLOW_COLLECTIVES``, ``collective=True``); allocations of
    on-demand buffers stay refused in every mode.
    """
    log = _guard["log"]
    if collective and log is not None:
        log.append(what)
    if is_capturing() and not (collective and _guard["mode"] is CaptureGuardMode.ALLOW_COLLECTIVES):
        fix = (
            "capture through fsdp_cudagraph (partial graphs run FSDP hooks outside the capture; "
            "FullIterationCudaGraph captures the step with collectives allowed)"
            if collective
            else "full-iteration graphs need address-stable buffers: pass fsdp_double_buffer=True and "
            "fsdp_db_use_persist_buf_on_alloc_fail=True to fully_shard"
        )
        raise RuntimeError(
            f"[rank {_rank()}] megatron_fsdp: {what} was requested while a CUDA graph is being captured "
            f"(capture guard mode {_guard['mode'].value}). FSDP collectives and unshard allocations must run "
            f"outside graphs unless the whole step is captured; {fix}, or remove the FSDP hook from the "
            "captured callable."
        )


# ---------------------------------------------------------------------------------------------- end capture guard
_NULL = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler runs, else a shared no-op (saves ~6 us per phase)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NULL


def log_rank0(level: int, msg: str, *args: object) -> None:
    """Log on rank 0 only (or always, without a process group)."""
    if _rank() == 0:
        logger.log(level, msg, *args)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to ``dtype``.

    A container in which nothing is cast is returned itself, not a copy: a caller that passes a list or dict
    for the model to fill in (outputs, caches) still sees what the model put there.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        items = [_cast_floating(v, dtype) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        items = {k: _cast_floating(v, dtype) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    return value
