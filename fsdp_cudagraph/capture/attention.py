"""TransformerEngine attention: the same kernel family eagerly and under capture, or a loud report.

[Note: attention backends under capture]
TE's ``DotProductAttention`` picks its backend (FlashAttention, cuDNN FusedAttention, or the unfused
PyTorch path) on each new set of ``AttentionParams``, and one of the params is ``cuda_graph`` (TE's
"a graph is being captured" flag). Some configurations are not graph-safe: with cuDNN <= 9.15.0, causal
masks, bshd/sbhd layouts, training and a key length that is not a multiple of 128, TE turns FusedAttention
off under capture. Eager steps then run cuDNN and the graph runs UnfusedDotProductAttention: different
numerics, no error. Nothing is wrong with either kernel; what is wrong is a graphed run that silently
computes something else than the eager steps it replaced.

:class:`AttentionBackendMatcher` wraps TE's selector while it is installed. For calls made inside the
watched modules (the graphed callables) it asks TE twice, as eager and as under capture, records both,
and -- with ``force=True`` -- returns the capture choice, so that the eager steps before capture already
run the kernels the graph will replay. ``PartialCudaGraphs`` installs one (policy ``match_graph``, the
default) when it is built, so the whole graphed run uses one backend; an eager baseline that must be
bit-equal to it installs the same with :func:`~fsdp_cudagraph.match_graph_attention`. The other policies
keep TE's eager choice and, at capture, ``warn`` or refuse (``error``) when the two differ.

TE caches its last selection in a module-level dict and reselects only when the params change; the matcher
marks that cache stale around each watched call, so that calls inside and outside the watched modules
never reuse each other's choice. That costs one selection per watched call while the matcher is
installed (the eager steps before capture), none after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.capture.te import HAS_TE

__all__ = [
    "ATTENTION_POLICIES", "AttentionBackendMatcher", "attention_notice", "before_capture", "check_policy",
    "describe_selection", "mismatch_message", "notice_once", "te_attention_namespace", "te_capture_flag",
]

logger = logging.getLogger(__name__)

#: match_graph: eager steps of graphed callables use the backend TE picks under capture;
#: warn / error: keep TE's eager choice; at capture, warn about or refuse a difference.
ATTENTION_POLICIES = ("match_graph", "warn", "error")


@dataclasses.dataclass
class TEAttention:
    """The three TE objects the matcher touches (tests pass stand-ins)."""

    #: module whose ``get_attention_backend(params)`` TE's DotProductAttention calls through the attribute
    utils: Any
    #: module holding the ``_attention_backends`` selection cache
    dpa_module: Any
    #: the DotProductAttention class, to find the attention modules inside a callable
    dpa_class: type


def te_attention_namespace() -> Optional[TEAttention]:
    """TE's attention selector, cache and class, or None without TE (or with a TE that moved them)."""
    if not HAS_TE:
        return None
    try:  # pragma: no cover - needs TE
        import transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention as dpa_module
        import transformer_engine.pytorch.attention.dot_product_attention.utils as utils
    except ImportError as exc:  # pragma: no cover
        logger.warning("fsdp_cudagraph: TE attention modules not found (%s); attention backends are not checked", exc)
        return None
    return TEAttention(utils, dpa_module, dpa_module.DotProductAttention)  # pragma: no cover


def describe_selection(selection: Sequence[Any]) -> str:
    """A readable name for TE's ``get_attention_backend`` result."""
    use_flash, flash_backend, use_fused, fused_backend, use_unfused = selection[:5]
    if use_flash:
        return f"FlashAttention ({flash_backend})" if flash_backend is not None else "FlashAttention"
    if use_fused:
        name = getattr(fused_backend, "name", None) or f"sub-backend {int(fused_backend)}"
        return f"FusedAttention ({name})"
    if use_unfused:
        return "UnfusedDotProductAttention"
    return "none"


class AttentionBackendMatcher:
    """Watch (and with ``force``, align) TE attention backend selection inside some modules.

    Args:
        modules: name -> module; selections made while one of them runs forward are watched.
        force: return TE's under-capture choice for watched calls (policy ``match_graph``).
        te: TE's objects; default :func:`te_attention_namespace` (the matcher is inert without TE).

    Lifecycle: built -> (eager steps: watched, recorded) -> :meth:`remove_hooks` before a capture (graph
    makers refuse modules with hooks) -> :meth:`uninstall`. Hazard: the selector is a process-wide
    attribute; matchers stack, and one that is uninstalled out of order turns itself into a pass-through.
    """

    def __init__(self, modules: Dict[str, nn.Module], *, force: bool, te: Optional[TEAttention] = None) -> None:
        self.force = force
        self.te = te if te is not None else te_attention_namespace()
        #: callable name -> {"eager": TE's eager choice, "graph": its choice under capture, "eager_used": ran}
        self.selections: Dict[str, Dict[str, str]] = {}
        self._current: List[str] = []
        self._hooks: List[Any] = []
        self._original: Optional[Callable[[Any], Any]] = None
        self._active = False
        if self.te is None:
            return
        watched = {n: m for n, m in modules.items() if any(isinstance(x, self.te.dpa_class) for x in m.modules())}
        if not watched:
            return
        self._original = self.te.utils.get_attention_backend
        self.te.utils.get_attention_backend = self._select
        self._active = True
        for name, module in watched.items():
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._exit, always_call=True))
        self._invalidate_cache()

    @property
    def installed(self) -> bool:
        return self._active

    def _invalidate_cache(self) -> None:
        cache = getattr(self.te.dpa_module, "_attention_backends", None)
        if isinstance(cache, dict):
            cache["backend_selection_requires_update"] = True

    def _enter(self, name: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: Tuple[Any, ...]) -> None:
            self._current.append(name)
            self._invalidate_cache()

        return enter

    def _exit(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        if self._current:
            self._current.pop()
        self._invalidate_cache()

    def _select(self, params: Any) -> Any:
        original = self._original
        assert original is not None
        if not self._active or not self._current or getattr(params, "cuda_graph", True):
            return original(params)  # outside watched modules, or TE itself is capturing
        eager = original(params)
        graph = original(dataclasses.replace(params, cuda_graph=True))
        chosen = graph if self.force else eager
        self.selections[self._current[-1]] = {
            "eager": describe_selection(eager),
            "graph": describe_selection(graph),
            "eager_used": describe_selection(chosen),
        }
        return chosen

    def mismatches(self) -> Dict[str, Dict[str, str]]:
        """Callables whose TE attention picks a different backend eagerly than under capture."""
        return {n: s for n, s in self.selections.items() if s["eager"] != s["graph"]}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._current = []

    def uninstall(self) -> None:
        """Remove the hooks and give TE its selector back (a pass-through if another matcher wrapped ours)."""
        self.remove_hooks()
        if not self._active:
            return
        self._active = False
        if self.te.utils.get_attention_backend == self._select:
            self.te.utils.get_attention_backend = self._original
        self._invalidate_cache()


def mismatch_message(mismatches: Dict[str, Dict[str, str]], policy: str) -> str:
    """The warning or error text for callables whose eager and under-capture attention backends differ."""
    rows = "; ".join(f"{n}: eager {s['eager']}, under capture {s['graph']}" for n, s in sorted(mismatches.items()))
    head = (
        f"TE attention would run a different backend eagerly than in the graph ({rows}). TE disables some "
        "backends under CUDA graph capture (e.g. cuDNN FusedAttention with cuDNN <= 9.15.0, causal masks and a "
        "key length that is not a multiple of 128), so eager and graphed training would not be bit-identical. "
    )
    if policy == "match_graph":
        return head + ("The eager steps of these callables use the graph's backend from the moment "
                       "PartialCudaGraphs was built; for an eager baseline to match, wrap it in "
                       "fsdp_cudagraph.match_graph_attention(model, config). To keep TE's eager backend instead, "
                       "pad the sequence to a multiple of 128 or use cuDNN > 9.15.")
    return head + ("Fix: pad the sequence length to a multiple of 128, use a newer cuDNN, or build PartialCudaGraphs "
                   "with attention_backend='match_graph' (the default) so that eager steps use the graph's backend "
                   "(or set NVTE_FUSED_ATTN=0 for every run).")


#: The notices this process gave (see :func:`notice_once`).
_NOTICES_GIVEN: Set[str] = set()


def notice_once(log: logging.Logger, line: str, *, detail: str = "", rank: Optional[int] = None) -> bool:
    """Log ``line`` at WARNING once per process, on rank 0 only; ``detail`` goes to this module's logger at DEBUG.

    A notice that every rank would print the same way (the same model, TE and cuDNN everywhere) is one line of the
    job's output, not one per rank per build. ``rank``: default the global rank, 0 without a process group.
    Returns whether the line was logged. The detail is logged on every rank, each time, at DEBUG.
    """
    if detail:
        logger.debug("%s", detail)
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0 or line in _NOTICES_GIVEN:
        return False
    _NOTICES_GIVEN.add(line)
    log.warning("%s", line)
    return True


def attention_notice(mismatches: Dict[str, Dict[str, str]], policy: str, log: logging.Logger, *,
                     rank: Optional[int] = None) -> bool:
    """The one-line notice for callables whose eager and under-capture TE attention backends differ.

    One WARNING line, once per process and on rank 0 (:func:`notice_once`); the full text of
    :func:`mismatch_message`, which names every callable, at DEBUG on ``fsdp_cudagraph.capture.attention``.
    """
    pairs = sorted({(s["eager"], s["graph"]) for s in mismatches.values()})
    backends = "; ".join(f"eager {e}, under capture {g}" for e, g in pairs)
    what = ("eager steps use the graph's backend (attention_backend='match_graph')" if policy == "match_graph"
            else "eager steps keep TE's choice, so eager and graphed runs are not bit-identical")
    line = (f"fsdp_cudagraph: TE attention would run a different backend eagerly than in the graph for "
            f"{len(mismatches)} callable(s) ({backends}); {what}; to avoid it, pad the sequence to a multiple of "
            "128 or use cuDNN > 9.15 (details: logger fsdp_cudagraph.capture.attention at DEBUG)")
    return notice_once(log, line, detail=mismatch_message(mismatches, policy), rank=rank)


def check_policy(policy: str) -> None:
    """Refuse an ``attention_backend`` that is not one of :data:`ATTENTION_POLICIES` (ValueError naming them)."""
    if policy not in ATTENTION_POLICIES:
        raise ValueError(f"attention_backend={policy!r} is not one of {ATTENTION_POLICIES}; 'match_graph' runs "
                         "the eager steps with the attention backend the graph will use")


def before_capture(matcher: AttentionBackendMatcher, policy: str, log: logging.Logger, *,
                   notice: Sequence[str] = ATTENTION_POLICIES) -> None:
    """Right before a capture: under policy ``error`` refuse the mismatches ``matcher`` saw (RuntimeError); under a
    policy in ``notice``, log :func:`attention_notice` (one line, rank 0, once per process)."""
    mismatched = matcher.mismatches()
    if mismatched and policy == "error":
        raise RuntimeError("fsdp_cudagraph: cannot capture: " + mismatch_message(mismatched, "error"))
    if mismatched and policy in notice:
        attention_notice(mismatched, policy, log)


@contextlib.contextmanager
def te_capture_flag() -> Iterator[None]:
    """Tell TE modules that a capture is under way while torch's graph maker captures them.

    TE's own ``make_graphed_callables`` raises this flag around its warmup and capture; TE modules read it to
    stay graph-safe (attention backend choice, FP8 bookkeeping). PyTorch's graph maker does not know about
    it, so the ``torch`` backend raises it itself. A no-op without TE.
    """
    if not HAS_TE:
        yield
        return
    import transformer_engine.pytorch.graph as te_graph  # pragma: no cover - needs TE

    te_graph.set_capture_start()  # pragma: no cover
    try:  # pragma: no cover
        yield
    finally:  # pragma: no cover
        te_graph.set_capture_end()
