"""Activation offloading: chosen submodules keep what they save for backward in host memory, graphed or not.

Lifecycle (eager)::

    offloader = ActivationOffloader(model, modules=["attn", "mlp"])   # or ActivationOffloader.from_config
    for step ...: loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    offloader.delete()                                                 # modules run their own forward again

With partial graphs, ``PartialCudaGraphs(model, config)`` builds the offloader from
``config.activation_offload_modules`` (or ``..._module_patterns``) and drives it around capture (see
[Note: offloading inside partial graphs]). What is copied, on which streams, into which host buffers, and
the hazards: ``offload/host_copies.py``, [Note: activation offloading].

Recording and plan. The first grad-enabled forward after the offloader is built offloads every group and
records each one's (module name, call index) and copy sizes, in forward order (:class:`GroupRecord`). At
the next forward (or at capture) ``fraction`` keeps the last ``floor(n * (1 - fraction))`` of the ``n``
groups that copied anything on the device. Groups never recorded run without offloading (one warning).

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
import enum
import fnmatch
import functools
import logging
import math
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fsdp_cudagraph.capture.state import is_capturing

from fsdp_cudagraph.config import module_tag
from fsdp_cudagraph.engines.contract import EngineAdapter
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.offload.host_copies import GroupRecord, HostBufferPool, _Group, _unpack

__all__ = [
    "ActivationOffloader", "HostBufferPool", "GroupRecord", "OffloadState", "select_offload_modules",
    "check_graph_boundaries", "offloader_for", "graph_maker", "te_warmup_hooks", "DEFAULT_MIN_OFFLOAD_BYTES",
]

logger = logging.getLogger(__name__)

#: Smaller copies stay on the device: their launch and join cost more than the memory they free.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20


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
        chosen = [(n, m) for n, m in named if module_tag(m) in tags]
        missing = sorted(set(tags) - {module_tag(m) for _, m in chosen})
        if missing:
            present = sorted({t for _, m in named if (t := module_tag(m))})
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
        model: a model an engine wraps (e.g. :class:`megatron_fsdp.MegatronFSDP`) or a plain module; its forward starts an
            iteration. A graph kind passes the model's adapter instead (``adapter_for(model)``, resolved once there).
        modules / module_patterns: the modules to offload, by ``cuda_graph_module`` tag or by pattern.
        fraction: in (0, 1]: keep the last ``floor(n * (1 - fraction))`` of the ``n`` recorded groups on the device.
        graphed: the graphed callables ((name, module) pairs from the same root) for the boundary rule.
        min_offload_bytes: smaller copies stay on the device.

    Lifecycle: built before the training steps (the first one is recorded) -> eager steps -> optionally
    :meth:`graph_maker` around a capture -> :meth:`delete`. The host pool and copy streams live as long as it.
    """

    def __init__(self, model: Union[nn.Module, EngineAdapter], *, modules: Sequence[Any] = (), module_patterns: Sequence[str] = (),
                 fraction: float = 1.0, graphed: Sequence[Tuple[str, nn.Module]] = (),
                 min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction={fraction!r} must be a number in (0, 1]; 1.0 offloads every group")
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes={min_offload_bytes!r} must be an int >= 0")
        engine = model if isinstance(model, EngineAdapter) else adapter_for(model)
        root = engine.root
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
        #: The previous eager group of this forward (backward prefetches it; see _Group.prev).
        self._last_eager: Optional[weakref.ref] = None
        self._warned: set = set()
        taken = [n for n, m in self.selected if hasattr(m.__dict__.get("forward"), "_activation_offloader")]
        if taken:
            raise ValueError(f"modules {taken} are already offloaded by another ActivationOffloader (e.g. one that "
                             "PartialCudaGraphs built from the config); delete() it first, or use only one")
        self._handles = [engine.model.register_forward_pre_hook(self._begin_iteration)]  # the wrapper: its forward
        self._installed: List[Tuple[nn.Module, bool, Any, Any]] = []
        for name, module in self.selected:
            self._install(name, module)

    @classmethod
    def from_config(cls, model: Union[nn.Module, EngineAdapter], config: Any, *, graphed: Sequence[Tuple[str, nn.Module]] = ()) -> "ActivationOffloader":
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

        forward._activation_offloader = self  # type: ignore[attr-defined]
        module.forward = forward
        self._installed.append((module, had, previous, forward))

    def _begin_iteration(self, module: nn.Module, args: Any) -> None:
        if self.state is not OffloadState.EAGER or not torch.is_grad_enabled():
            return
        if not self.planned and self.records:
            self._make_plan()
        self._counts.clear()
        self._last_eager = None
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
        if not group.capture:
            group.prev, self._last_eager = self._last_eager, weakref.ref(group)
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


def offloader_for(engine: EngineAdapter, config: Any, graphed: Sequence[Tuple[str, nn.Module]]) -> Optional[ActivationOffloader]:
    """The offloader ``config`` asks for (None when offloading is off) over the adapter a graph kind resolved."""
    if not (config.activation_offload_modules or config.activation_offload_module_patterns):
        return None
    return ActivationOffloader.from_config(engine, config, graphed=graphed)


def graph_maker(offloader: Optional[ActivationOffloader]) -> contextlib.AbstractContextManager:
    """:meth:`ActivationOffloader.graph_maker`, or nothing without an offloader."""
    return offloader.graph_maker() if offloader is not None else contextlib.nullcontext()


def te_warmup_hooks(offloader: Optional[ActivationOffloader]) -> Dict[str, Callable[[], None]]:
    """Keyword arguments for TE's ``make_graphed_callables`` (none without an offloader)."""
    if offloader is None:
        return {}
    return {"pre_warmup_hook": offloader.pre_warmup_hook, "post_warmup_hook": offloader.post_warmup_hook}
