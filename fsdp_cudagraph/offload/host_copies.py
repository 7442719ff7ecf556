"""The copy mechanics of activation offloading: host pool, group records, pack/unpack hooks, copy streams.

Used by :class:`~fsdp_cudagraph.offload.offloader.ActivationOffloader` (lifecycle, recording and plan, and
[Note: offloading inside partial graphs] are there).

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
the current stream, the host-to-device stream waits for it, copies and records an event, and the current
stream waits for the event. Outside captures it also starts the reload of the eager group that ran before it
in forward (the one backward needs next, if it ran on the same stream): one group of prefetch, so the copy
overlaps this group's backward, for one more group's memory. Inside a capture nothing is prefetched (a fork
must be joined within the same capture).

Host pool (:class:`HostBufferPool`). Buffers keyed by (shape, dtype) -- here ``((nbytes,), uint8)`` --
pinned when the device is CUDA, reset every iteration so that the same buffers come back in the same
order; a buffer returns to the pool when every saved tensor of its copy is gone (after backward).

Hazards: autograd does not check the version of saved tensors that pass hooks, so the offloader does: a
saved tensor modified in place inside its group raises at the group's end (its copy could race the
write), one kept on the device is checked at unpack. A tensor modified in place after its group ended was
copied before the write, so backward gets the value autograd saved. Keep only detached losses across
iterations: a live autograd graph keeps its host buffers and the pool grows. Not combined with activation
checkpointing of the same modules. ``copy.deepcopy`` of a model with an offloader attached copies the
instance ``forward``, which still runs the original module: ``delete()`` the offloader first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Deque, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from fsdp_cudagraph.capture.state import is_capturing

__all__ = ["HostBufferPool", "GroupRecord"]

#: The CUDA caching allocator's block alignment: span copies keep their source's alignment modulo this.
_ALIGN = 512

_Key = Tuple[Tuple[int, ...], torch.dtype]


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


class CopyContext(Protocol):
    """What a group needs of its offloader (``ActivationOffloader`` is one): named here, so that this module
    does not import the offloader that imports it."""

    device: torch.device
    streams: Optional[Tuple[torch.cuda.Stream, torch.cuda.Stream]]
    pool: "HostBufferPool"
    min_offload_bytes: int


class _Group:
    """One running group: the pack/unpack hooks of one call of an offloaded module (see the Note)."""

    def __init__(self, off: CopyContext, module: nn.Module, record: GroupRecord, *, recording: bool,
                 capture: bool) -> None:
        self.off, self.record, self.recording, self.capture = off, record, recording, capture
        self.keep = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
        self.copies: List[_Copy] = []
        self.pending: List[_Saved] = []
        self.by_range: Dict[Tuple[int, int, int, int], _Copy] = {}
        self.cursor: Dict[int, int] = {}
        self.forked = False
        self.reloaded = False
        #: The eager group that ran before this one in forward (a weak reference): its reload starts when
        #: this group's does, so that it overlaps this group's backward. None inside captures.
        self.prev: Optional[Any] = None
        #: Set while a started reload may still be in flight (CUDA): the first unpack waits for it.
        self.ready: Optional[Any] = None
        self.unpacked = False
        #: The stream forward ran on (CUDA): a prefetch allocates on the current stream, so only a group of
        #: the same stream is prefetched (its buffers are then freed on the stream that uses them).
        self.stream = torch.cuda.current_stream(off.device) if off.streams is not None else None

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
        if not self.unpacked:
            self.unpacked = True
            if not self.reloaded:
                self._start_reload()
            prev = self.prev() if self.prev is not None else None
            if prev is not None and not prev.reloaded and prev.stream == self.stream:
                prev._start_reload()  # prefetch: the group backward needs next overlaps this one's backward
        if self.ready is not None:
            torch.cuda.current_stream(self.off.device).wait_event(self.ready)
            self.ready = None
        buf = s.copy.device_buf
        return torch.empty(0, dtype=s.dtype, device=buf.device).set_(buf.untyped_storage(), s.offset, s.size, s.stride)

    def _start_reload(self) -> None:
        """Bring all the group's copies back on the copy stream; its first unpack waits for them (``ready``)."""
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
                self.ready = torch.cuda.Event()
                self.ready.record(h2d)
        else:
            for b, c in zip(bufs, self.copies):
                b.copy_(c.host)
        for b, c in zip(bufs, self.copies):
            c.device_buf = b
