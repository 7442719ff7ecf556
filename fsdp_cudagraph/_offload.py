"""Activation offloading: chosen submodules keep what they save for backward in host memory, graphed or not.

Lifecycle (eager)::

    offloader = ActivationOffloader(model, modules=["attn", "mlp"])   # or ActivationOffloader.from_config
    for step ...: loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    offloader.delete()                                                 # modules run their own forward again

With partial graphs, ``PartialCudaGraphs(model, config)`` builds the offloader from
``config.activation_offload_modules`` (or ``..._module_patterns``) and drives it around capture (see
[Note: offloading inside partial graphs]).

[Note: activation offloading]
A *group* is one call of an offloaded module's forward. The offloader replaces the module's ``forward`` by
an instance attribute that runs the original forward inside ``torch.autograd.graph.saved_tensors_hooks``,
so every tensor autograd saves inside it passes our pack hook. What is copied is the saved tensor's
*storage bytes*: the whole storage when the tensor spans at least half of it, else the tensor's span, its
start aligned down to 512 bytes. Unpacking rebuilds the tensor with its exact size, strides, storage offset
and alignment, and views of one storage saved in one group share one copy: offloading is a copy, bit for
bit, and backward kernels see the layout they would have seen. Kept on the device (pack returns the tensor
itself, with its version): parameters and anything sharing their storage, module buffers, leaves that
require grad (e.g. a graph's static inputs: nothing would be freed), tensor subclasses, other devices,
copies under ``min_offload_bytes``, and tensors that share storage with the group's outputs (they stay
alive anyway; the copy already made for them is dropped).

Streams. Pack: the device-to-host stream waits for the current stream (whatever it is: the graph layer may
have moved this thread to a side stream), then copies; the source stays referenced until the group ends,
where the current stream waits for the copy stream and the references go. There is no ``record_stream``,
and it is the same code in a capture: the wait forks the copy stream into the capture and the group end
joins it back. Unpack: the group's first unpack brings all its copies back: destinations are allocated on
the current stream, the host-to-device stream waits for it, copies, and the current stream waits for it.

Host pool (:class:`HostBufferPool`). Buffers keyed by (shape, dtype) -- here ``((nbytes,), uint8)`` --
pinned when the device is CUDA, reset every iteration so that the same buffers come back in the same
order; a buffer returns to the pool when every saved tensor of its copy is gone (after backward).

Recording and plan. The first grad-enabled forward after the offloader is built offloads every group and
records each one's (module name, call index) and copy sizes, in forward order (:class:`GroupRecord`). At
the next forward (or at capture) ``fraction`` keeps the last ``floor(n * (1 - fraction))`` of the ``n``
groups that copied anything on the device. Groups never recorded run without offloading (one warning).

Hazards: autograd does not check the version of saved tensors that pass hooks, so the offloader does: a
saved tensor modified in place inside its group raises at the group's end (its copy could race the
write), one kept on the device is checked at unpack. A tensor modified in place after its group ended was
copied before the write, so backward gets the value autograd saved. Keep only detached losses across
iterations: a live autograd graph keeps its host buffers and the pool grows. Not combined with activation
checkpointing of the same modules.

[Note: offloading inside partial graphs]
- Boundary rule: a group must lie wholly inside one graphed callable or wholly outside graphs; an
  offloaded module that contains a graphed callable is refused (ValueError naming both).
- Warmup rule: the recorded eager iteration gives the sizes, so capture needs one eager step first.
- The graph maker's warmup runs groups plainly (TE's ``pre_warmup_hook`` / ``post_warmup_hook``; PyTorch's
  graph maker, which has none, is told apart by ``is_capturing()``); its capture offloads.
- No host allocation during a capture (pinning memory queries events, which a capture forbids): before
  the graph maker runs, the groups inside graphed callables get host buffers reserved from their recorded
  sizes; capture takes them by size and they become graph-owned: the captured copies write and read them
  at every replay, and they never go back to the pool while the graphs live. Python that runs such a group
  after capture (the protocol backend's replay, an eager fallback) copies what the capture copied, into
  the same buffers in the same order, and keeps anything else on the device.
- A capture not driven by the graph layer (a user's, a full-iteration graph) raises RuntimeError.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import fnmatch
import functools
import logging
import math
import threading
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron_fsdp import MegatronFSDP, is_capturing

__all__ = [
    "ActivationOffloader", "HostBufferPool", "GroupRecord", "OffloadState", "select_offload_modules",
    "check_graph_boundaries", "offloader_for", "graph_maker", "te_warmup_hooks", "DEFAULT_MIN_OFFLOAD_BYTES",
]

logger = logging.getLogger(__name__)

#: Smaller copies stay on the device: their launch and join cost more than the memory they free.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20
#: The CUDA caching allocator's block alignment: span copies keep their source's alignment modulo this.
_ALIGN = 512

_Key = Tuple[Tuple[int, ...], torch.dtype]


class OffloadState(enum.Enum):
    """Where the offloader is; groups behave per state (see [Note: offloading inside partial graphs])."""

    #: Training steps (also the eager steps before capture): groups offload through the eager pool.
    EAGER = "eager"
    #: A graph maker's warmup (between TE's pre_warmup_hook and post_warmup_hook): groups run plainly.
    WARMUP = "warmup"
    #: Inside a graph maker after its warmup: groups under a capture use reserved buffers; others run plainly.
    CAPTURE = "capture"
    #: After delete(): the modules run their own forward again.
    DELETED = "deleted"


class HostBufferPool:
    """Persistent host buffers for offloaded activations, keyed by (shape, dtype).

    Lifecycle: :meth:`acquire` hands out a free buffer or allocates one (pinned when ``pin_memory``);
    :meth:`release` gives it back; :meth:`reset` (every iteration) lines the free buffers up in allocation
    order, so that the same buffers come back in the same order; :meth:`clear` drops everything and turns
    later releases into no-ops. Thread-safe (backward releases buffers from autograd's threads).

    Hazard: allocating is refused while a (real or simulated) capture is under way; reserve buffers before.
    """

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._all: Dict[_Key, List[torch.Tensor]] = {}
        self._free: Dict[_Key, Deque[torch.Tensor]] = {}
        self._in_use: set = set()
        self._closed = False
        self.num_allocations = 0
        self.allocated_bytes = 0
        self.num_acquires = 0

    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            self.num_acquires += 1
            free = self._free.get(key)
            if free:
                buf = free.popleft()
                self._in_use.add(id(buf))
                return buf
        if is_capturing():
            raise RuntimeError(
                f"activation offloading: a host buffer of shape {key[0]} and dtype {dtype} was requested while a "
                "CUDA graph is being captured; pinning memory during a capture is illegal. Host buffers for a "
                "capture are reserved from the recorded eager iteration: the graphed callable saved something "
                "the eager step did not"
            )
        buf = torch.empty(key[0], dtype=dtype, pin_memory=self.pin_memory)
        with self._lock:
            self._all.setdefault(key, []).append(buf)
            self._free.setdefault(key, collections.deque())
            self._in_use.add(id(buf))
            self.num_allocations += 1
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._closed:
                return
            if id(buf) not in self._in_use:
                raise RuntimeError("activation offloading: a host buffer was released twice or is not from this pool")
            self._in_use.discard(id(buf))
            self._free[(tuple(buf.shape), buf.dtype)].append(buf)

    def reset(self) -> None:
        """Line the free buffers up in allocation order (buffers still in use stay out)."""
        with self._lock:
            for key, bufs in self._all.items():
                self._free[key] = collections.deque(b for b in bufs if id(b) not in self._in_use)

    def clear(self) -> None:
        with self._lock:
            self._all.clear()
            self._free.clear()
            self._in_use.clear()
            self._closed = True

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def buffers(self) -> List[torch.Tensor]:
        """Every buffer the pool ever allocated, in allocation order per key (for tests and reports)."""
        return [b for bufs in self._all.values() for b in bufs]


@dataclasses.dataclass(eq=False)
class GroupRecord:
    """One group of the recorded iteration: a call of an offloaded module, in forward order."""

    name: str
    #: Which call of that module within the iteration (0 for modules that run once per forward).
    index: int
    #: The graphed callable the module lies in (None: outside graphs).
    graphed_in: Optional[str]
    #: Bytes of each host copy it made in the recorded iteration, in order.
    nbytes: List[int] = dataclasses.field(default_factory=list)
    #: Of those, bytes whose copy was dropped at the group's end (they shared storage with its outputs).
    dropped_bytes: int = 0
    #: The plan's decision (``fraction`` keeps the last groups on the device).
    offload: bool = True
    #: During a graph maker call: host buffers reserved for its capture, by size.
    reserved: Optional[Dict[int, Deque[torch.Tensor]]] = None
    #: After capture: the graph-owned host buffers its captured copies use, by size, in capture order.
    captured: Optional[Dict[int, List[torch.Tensor]]] = None

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


class _Copy:
    """Host copy of a byte range of one device storage; shared by the saved views of that storage in a group."""

    __slots__ = ("host", "start", "nbytes", "pool", "device_buf")

    def __init__(self, host: torch.Tensor, start: int, nbytes: int, pool: Optional[HostBufferPool]) -> None:
        self.host, self.start, self.nbytes, self.pool = host, start, nbytes, pool  # pool None: graph-owned
        self.device_buf: Optional[torch.Tensor] = None

    def __del__(self) -> None:
        if self.pool is not None:
            try:
                self.pool.release(self.host)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class _Saved:
    """What the pack hook returns: a view recipe into a _Copy, or the tensor kept on the device."""

    __slots__ = ("group", "copy", "dtype", "size", "stride", "offset", "tensor", "version")

    def __init__(self, group: "_Group", tensor: torch.Tensor, copy: Optional[_Copy] = None, offset: int = 0) -> None:
        # A detached alias (same storage and version counter): holding a saved *output* itself would tie it to
        # its own grad_fn in a cycle through C++ that no garbage collector breaks (autograd avoids the same).
        self.group, self.copy, self.tensor, self.version = group, copy, tensor.detach(), tensor._version
        self.dtype, self.size, self.stride, self.offset = tensor.dtype, tensor.size(), tensor.stride(), offset


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.group.unpack(saved)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class _Group:
    """One running group: the pack/unpack hooks of one call of an offloaded module (see the Note)."""

    def __init__(self, off: "ActivationOffloader", module: nn.Module, record: GroupRecord, *, recording: bool,
                 capture: bool) -> None:
        self.off, self.record, self.recording, self.capture = off, record, recording, capture
        self.keep = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
        self.copies: List[_Copy] = []
        self.pending: List[_Saved] = []
        self.by_range: Dict[Tuple[int, int, int, int], _Copy] = {}
        self.cursor: Dict[int, int] = {}
        self.forked = False
        self.reloaded = False

    # -------------------------------------------------------------- forward
    def pack(self, t: torch.Tensor) -> _Saved:
        off = self.off
        if (type(t) is not torch.Tensor or t.layout is not torch.strided or t.device != off.device
                or t.numel() == 0 or (t.is_leaf and t.requires_grad)):
            return _Saved(self, t)
        storage = t.untyped_storage()
        ptr, total = storage.data_ptr(), storage.nbytes()
        if ptr in self.keep:
            return _Saved(self, t)
        el = t.element_size()
        lo = t.storage_offset() * el
        hi = lo + el * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        start, end = (0, total) if 2 * (hi - lo) >= total else (lo - lo % _ALIGN, hi)
        version = t._version
        copy = self.by_range.get((ptr, version, 0, total)) or self.by_range.get((ptr, version, start, end))
        if copy is None:
            host = self._host_buffer(end - start) if end - start >= off.min_offload_bytes else None
            if host is None:
                return _Saved(self, t)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (end - start,), (1,))
            copy = self._copy_out(src, start, *host)
            self.by_range[(ptr, version, start, end)] = copy
        saved = _Saved(self, t, copy, (lo - copy.start) // el)
        self.pending.append(saved)
        return saved

    def _host_buffer(self, nbytes: int) -> Optional[Tuple[torch.Tensor, bool]]:
        """(buffer, graph-owned) for the next copy; None: keep the tensor on the device."""
        rec = self.record
        if self.capture:
            bufs = (rec.reserved or {}).get(nbytes)
            if not bufs:
                raise RuntimeError(
                    f"activation offloading: group {rec.name}[{rec.index}] saved {nbytes} bytes under capture that "
                    f"the recorded eager iteration did not (recorded sizes {sorted(rec.nbytes)}); host buffers "
                    "cannot be pinned during a capture. The graphed callable saves different tensors under capture "
                    "than eagerly; leave this module out of activation_offload_modules"
                )
            buf = bufs.popleft()
            rec.captured.setdefault(nbytes, []).append(buf)
            return buf, True
        if rec.captured is not None:  # Python running a captured group again: what the graph copies, where it does
            owned = rec.captured.get(nbytes, ())
            i = self.cursor.get(nbytes, 0)
            if i >= len(owned):
                return None
            self.cursor[nbytes] = i + 1
            return owned[i], True
        return self.off.pool.acquire((nbytes,), torch.uint8), False

    def _copy_out(self, src: torch.Tensor, start: int, host: torch.Tensor, owned: bool) -> _Copy:
        nbytes = src.numel()
        streams = self.off.streams
        if streams is not None:
            d2h = streams[0]
            d2h.wait_stream(torch.cuda.current_stream(self.off.device))  # after the kernel that wrote src
            with torch.cuda.stream(d2h):
                host.copy_(src, non_blocking=True)
            self.forked = True
        else:
            host.copy_(src)
        copy = _Copy(host, start, nbytes, None if owned else self.off.pool)
        self.copies.append(copy)
        if self.recording:
            self.record.nbytes.append(nbytes)
        return copy

    def finish(self, outputs: Any, *, failed: bool) -> None:
        """Group end: join the copy stream, drop the device references; check in-place writes (not when failed)."""
        pending, self.pending, self.by_range = self.pending, [], {}
        if self.forked:
            torch.cuda.current_stream(self.off.device).wait_stream(self.off.streams[0])
        if failed:
            for s in pending:
                s.tensor = None
            return
        out_storages = {t.untyped_storage().data_ptr() for t in _tensors(outputs)}
        modified = [s for s in pending if s.tensor._version != s.version]
        for s in pending:
            if s.tensor.untyped_storage().data_ptr() in out_storages:
                s.copy = None  # an output's storage stays alive anyway: keep the tensor, drop the copy
            else:
                s.tensor = None
        used = {id(s.copy) for s in pending if s.copy is not None}
        if self.recording:
            self.record.dropped_bytes += sum(c.nbytes for c in self.copies if id(c) not in used)
        self.copies = [c for c in self.copies if id(c) in used]
        if modified:
            s = modified[0]
            raise RuntimeError(
                f"activation offloading: a tensor that module {self.record.name} saved for backward (shape "
                f"{tuple(s.size)}, {s.dtype}) was modified in place later in the same forward; autograd refuses "
                "this without offloading too, and the copy to host could race the write. Use an out-of-place "
                "operation, or leave this module out of the offloaded modules"
            )

    # -------------------------------------------------------------- backward
    def unpack(self, s: _Saved) -> torch.Tensor:
        if s.copy is None:
            if s.tensor._version != s.version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"a tensor of shape {tuple(s.size)} saved inside offloaded module {self.record.name} is at version "
                    f"{s.tensor._version}; expected version {s.version} instead"
                )
            return s.tensor
        if not self.reloaded:
            self._reload()
        buf = s.copy.device_buf
        return torch.empty(0, dtype=s.dtype, device=buf.device).set_(buf.untyped_storage(), s.offset, s.size, s.stride)

    def _reload(self) -> None:
        """The group's first unpack brings all its copies back (on the copy stream, joined before use)."""
        self.reloaded = True
        dev = self.off.device
        bufs = [torch.empty(c.nbytes, dtype=torch.uint8, device=dev) for c in self.copies]
        streams = self.off.streams
        if streams is not None and bufs:
            h2d, current = streams[1], torch.cuda.current_stream(dev)
            h2d.wait_stream(current)  # the destinations were allocated on the current stream
            with torch.cuda.stream(h2d):
                for b, c in zip(bufs, self.copies):
                    b.copy_(c.host, non_blocking=True)
            current.wait_stream(h2d)
        else:
            for b, c in zip(bufs, self.copies):
                b.copy_(c.host)
        for b, c in zip(bufs, self.copies):
            c.device_buf = b


def select_offload_modules(root: nn.Module, modules: Sequence[Any] = (),
                           patterns: Sequence[str] = ()) -> List[Tuple[str, nn.Module]]:
    """The (qualified name, module) pairs to offload: by ``cuda_graph_module`` tag or by pattern, in module order.

    Patterns are :func:`fnmatch.fnmatchcase` globs over qualified names (``"layers.*.attn"``) or exact class
    names, as for ``cuda_graph_module_patterns``. Nested selections are refused (one group per call).
    """
    tags = [getattr(m, "value", m) for m in modules]
    named = [(n, m) for n, m in root.named_modules() if n]
    if tags and patterns:
        raise ValueError(f"activation_offload_modules={tags} and activation_offload_module_patterns={list(patterns)} "
                         "are exclusive; use the tags for tagged models and patterns only for untagged ones")
    if patterns:
        chosen = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) or type(m).__name__ == p for p in patterns)]
        if not chosen:
            raise ValueError(f"activation_offload_module_patterns={list(patterns)} match no submodule of "
                             f"{type(root).__name__}; give qualified-name globs (e.g. 'layers.*.mlp') or class names")
    elif tags:
        chosen = [(n, m) for n, m in named if getattr(type(m), "cuda_graph_module", None) in tags]
        missing = sorted(set(tags) - {getattr(type(m), "cuda_graph_module", None) for _, m in chosen})
        if missing:
            present = sorted({t for _, m in named if (t := getattr(type(m), "cuda_graph_module", None))})
            raise ValueError(f"activation_offload_modules includes {missing} but no submodule of {type(root).__name__} "
                             f"is tagged so (tags present: {present}); drop them, or use activation_offload_module_patterns")
    else:
        raise ValueError("activation offloading needs activation_offload_modules (tags) or "
                         "activation_offload_module_patterns; both are empty")
    names = [n for n, _ in chosen]
    for a in names:
        for b in names:
            if b.startswith(a + "."):
                raise ValueError(f"offloaded modules {a!r} and {b!r} are nested; offload one or the other")
    return chosen


def check_graph_boundaries(selected: Sequence[Tuple[str, nn.Module]],
                           graphed: Sequence[Tuple[str, nn.Module]]) -> Dict[str, Optional[str]]:
    """Apply the boundary rule; return each offloaded module's graphed callable (None: outside graphs).

    A group may lie wholly inside one graphed callable or wholly outside graphs. An offloaded module that
    contains a graphed callable would run part of its forward inside a graph and part outside, so that its
    groups would differ between eager steps and replays: refused.
    """
    inside: Dict[str, Optional[str]] = {}
    for name, _ in selected:
        inside[name] = None
        for g, _ in graphed:
            if name == g or name.startswith(g + "."):
                inside[name] = g
            elif g.startswith(name + "."):
                raise ValueError(
                    f"offloaded module {name!r} contains the graphed callable {g!r}: an offload group must lie wholly "
                    "inside one graphed callable or wholly outside graphs (its tensors cross the graph boundary). "
                    f"Offload {g!r} or other submodules of {name!r} instead, or graph {name!r} whole"
                )
    return inside


class ActivationOffloader:
    """Offload what chosen submodules save for backward to host memory (see [Note: activation offloading]).

    Args:
        model: a :class:`megatron_fsdp.MegatronFSDP` or a plain module; its forward starts an iteration.
        modules / module_patterns: the modules to offload, by ``cuda_graph_module`` tag or by pattern.
        fraction: in (0, 1]: keep the last ``floor(n * (1 - fraction))`` of the ``n`` recorded groups on the device.
        graphed: the graphed callables ((name, module) pairs from the same root) for the boundary rule.
        min_offload_bytes: smaller copies stay on the device.

    Lifecycle: built before the training steps (the first one is recorded) -> eager steps -> optionally
    :meth:`graph_maker` around a capture -> :meth:`delete`. The host pool and copy streams live as long as it.
    """

    def __init__(self, model: nn.Module, *, modules: Sequence[Any] = (), module_patterns: Sequence[str] = (),
                 fraction: float = 1.0, graphed: Sequence[Tuple[str, nn.Module]] = (),
                 min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction={fraction!r} must be a number in (0, 1]; 1.0 offloads every group")
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes={min_offload_bytes!r} must be an int >= 0")
        root = model.module if isinstance(model, MegatronFSDP) else model
        self.selected = select_offload_modules(root, modules, module_patterns)
        self.graphed_in = check_graph_boundaries(self.selected, graphed)
        self.fraction = float(fraction)
        self.min_offload_bytes = min_offload_bytes
        param = next(iter(root.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        #: (device-to-host, host-to-device) copy streams; None on CPU, where copies are synchronous.
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else None
        self.pool = HostBufferPool(pin_memory=device.type == "cuda")
        self.state = OffloadState.EAGER
        #: The recorded iteration's groups, in forward order.
        self.records: List[GroupRecord] = []
        self._by_key: Dict[Tuple[str, int], GroupRecord] = {}
        self.planned = False
        self._counts: Dict[str, int] = {}
        self._warned: set = set()
        self._handles = [model.register_forward_pre_hook(self._begin_iteration)]
        self._installed: List[Tuple[nn.Module, bool, Any, Any]] = []
        for name, module in self.selected:
            self._install(name, module)

    @classmethod
    def from_config(cls, model: nn.Module, config: Any, *, graphed: Sequence[Tuple[str, nn.Module]] = ()) -> "ActivationOffloader":
        """Build from a :class:`~fsdp_cudagraph.CudaGraphConfig` (its ``activation_offload_*`` fields)."""
        return cls(model, modules=config.activation_offload_modules,
                   module_patterns=config.activation_offload_module_patterns,
                   fraction=config.activation_offload_fraction, graphed=graphed,
                   min_offload_bytes=config.activation_offload_min_bytes)

    # -------------------------------------------------------------- install / iterate
    def _install(self, name: str, module: nn.Module) -> None:
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(name, module, original, args, kwargs)

        module.forward = forward
        self._installed.append((module, had, previous, forward))

    def _begin_iteration(self, module: nn.Module, args: Any) -> None:
        if self.state is not OffloadState.EAGER or not torch.is_grad_enabled():
            return
        if not self.planned and self.records:
            self._make_plan()
        self._counts.clear()
        self.pool.reset()

    def _make_plan(self) -> None:
        eligible = [r for r in self.records if r.total_bytes > 0]
        num_kept = math.floor(len(eligible) * (1.0 - self.fraction) + 1e-9)
        for r in self.records:
            r.offload = r.total_bytes > 0
        for r in eligible[len(eligible) - num_kept:] if num_kept else ():
            r.offload = False
        self.planned = True
        logger.info("activation offloading: %d of %d groups offload %.1f MiB per iteration (fraction %s)",
                    sum(r.offload for r in self.records), len(self.records), self.planned_bytes / 2**20, self.fraction)

    @property
    def planned_bytes(self) -> int:
        """Host bytes the planned groups copied in the recorded iteration (what offloading frees, at most)."""
        return sum(r.total_bytes - r.dropped_bytes for r in self.records if r.offload)

    def _enter(self, name: str, module: nn.Module) -> Optional[_Group]:
        """The group for this call, or None when it runs plainly (see OffloadState)."""
        state = self.state
        if state in (OffloadState.WARMUP, OffloadState.DELETED) or not torch.is_grad_enabled():
            return None
        capturing = is_capturing()
        if state is OffloadState.CAPTURE and not capturing:
            return None  # PyTorch's graph maker warms up inside the same call
        if state is OffloadState.EAGER and capturing:
            raise RuntimeError(
                f"activation offloading: offloaded module {name} ran inside a CUDA graph capture that PartialCudaGraphs "
                "does not drive (a user capture or a full-iteration graph); offloading supports eager steps and "
                "per-layer graphs (cuda_graph_impl 'local' or 'transformer_engine')"
            )
        index = self._counts.get(name, 0)
        self._counts[name] = index + 1
        record = self._by_key.get((name, index))
        if state is OffloadState.CAPTURE:
            if record is None:
                raise RuntimeError(f"activation offloading: module {name} (call {index}) ran under capture but not in the "
                                   "recorded eager iteration; run the same forward eagerly before capture")
            return _Group(self, module, record, recording=False, capture=True) if record.offload else None
        if not self.planned:
            record = GroupRecord(name, index, self.graphed_in[name])
            self.records.append(record)
            self._by_key[(name, index)] = record
            return _Group(self, module, record, recording=True, capture=False)
        if record is None:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("activation offloading: module %s ran %d times in a forward, more than in the recorded "
                               "iteration; the extra calls keep their tensors on the device", name, index + 1)
            return None
        return _Group(self, module, record, recording=False, capture=False) if record.offload else None

    def _run(self, name: str, module: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Any:
        group = self._enter(name, module)
        if group is None:
            return forward(*args, **kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack):
                out = forward(*args, **kwargs)
        except BaseException:
            group.finish(None, failed=True)
            raise
        group.finish(out, failed=False)
        return out

    # -------------------------------------------------------------- graphs
    @contextlib.contextmanager
    def graph_maker(self) -> Iterator[None]:
        """Around a graph maker call: reserve host buffers for the groups inside graphed callables, capture them.

        On success the buffers the capture used become graph-owned (until :meth:`delete`); on failure they
        and the unused reservations go back to the pool, and the groups run eagerly as before.
        """
        if self.state is not OffloadState.EAGER:
            raise RuntimeError(f"activation offloading: graph_maker() in state {self.state.value}; one capture at a time")
        if not self.planned:
            if not self.records:
                raise RuntimeError(
                    "activation offloading: no eager iteration was recorded before capture, so the host buffers of the "
                    "captured groups are unknown; run at least one eager training step first (cuda_graph_warmup_steps "
                    ">= 1) with PartialCudaGraphs built before it"
                )
            self._make_plan()
        graphed = [r for r in self.records if r.offload and r.graphed_in is not None]
        ok = False
        try:
            for r in graphed:
                r.reserved, r.captured = collections.defaultdict(collections.deque), {}
                for n in r.nbytes:
                    r.reserved[n].append(self.pool.acquire((n,), torch.uint8))
            self.state = OffloadState.CAPTURE
            self._counts.clear()
            yield
            ok = True
        finally:
            self.state = OffloadState.EAGER
            self._counts.clear()
            for r in graphed:
                leftover = [b for q in (r.reserved or {}).values() for b in q]
                if not ok:
                    leftover += [b for bufs in (r.captured or {}).values() for b in bufs]
                    r.captured = None
                for b in leftover:
                    self.pool.release(b)
                r.reserved = None

    def pre_warmup_hook(self) -> None:
        """TE's ``pre_warmup_hook``: the graph maker's warmup runs groups plainly."""
        if self.state is OffloadState.CAPTURE:
            self.state = OffloadState.WARMUP

    def post_warmup_hook(self) -> None:
        """TE's ``post_warmup_hook``: offloading is on again for the capture."""
        if self.state is OffloadState.WARMUP:
            self.state = OffloadState.CAPTURE

    @property
    def captured_bytes(self) -> int:
        """Bytes of graph-owned host buffers (the copies replays make)."""
        return sum(b.numel() for r in self.records for bufs in (r.captured or {}).values() for b in bufs)

    # -------------------------------------------------------------- delete
    def delete(self) -> None:
        """Give the modules their own forward back, drop the host pool. Delete live graphs first."""
        if self.state is OffloadState.DELETED:
            return
        moved = [m for m, _, _, ours in self._installed if m.__dict__.get("forward") is not ours]
        if moved:
            names = [n for n, m in self.selected if any(m is x for x in moved)]
            raise RuntimeError(f"activation offloading: the forward of {names} was replaced after offloading was attached "
                               "(live graphs?); delete the graphs first, then the offloader")
        for module, had, previous, _ in self._installed:
            if had:
                module.__dict__["forward"] = previous
            else:
                del module.__dict__["forward"]
        for h in self._handles:
            h.remove()
        self._installed, self._handles = [], []
        for r in self.records:
            r.captured = None
        self.pool.clear()
        self.state = OffloadState.DELETED


def offloader_for(model: nn.Module, config: Any, graphed: Sequence[Tuple[str, nn.Module]]) -> Optional[ActivationOffloader]:
    """The offloader ``config`` asks for (None when offloading is off); the graph layer's entry point."""
    if not (config.activation_offload_modules or config.activation_offload_module_patterns):
        return None
    return ActivationOffloader.from_config(model, config, graphed=graphed)


def graph_maker(offloader: Optional[ActivationOffloader]) -> contextlib.AbstractContextManager:
    """:meth:`ActivationOffloader.graph_maker`, or nothing without an offloader."""
    return offloader.graph_maker() if offloader is not None else contextlib.nullcontext()


def te_warmup_hooks(offloader: Optional[ActivationOffloader]) -> Dict[str, Callable[[], None]]:
    """Keyword arguments for TE's ``make_graphed_callables`` (none without an offloader)."""
    if offloader is None:
        return {}
    return {"pre_warmup_hook": offloader.pre_warmup_hook, "post_warmup_hook": offloader.post_warmup_hook}
