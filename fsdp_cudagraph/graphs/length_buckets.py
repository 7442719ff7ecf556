"""Length buckets: CUDA graphs of callables whose inputs vary in length along one dimension.

Lifecycle::

    graphs = LengthBucketGraphs(fsdp_model, config, buckets=Buckets.powers_of_two(4096, min_size=256),
                                length_args={"x": 0, "segment_ids": LengthArg(0, pad_value=-1)})
    for step in range(num_steps):
        if step == config.cuda_graph_warmup_steps:
            graphs.capture()             # one graph per bucket and callable, largest bucket first
        loss = loss_fn(fsdp_model(patches, cu_seqlens), labels); loss.backward(); optimizer.step(); ...
    graphs.delete()

[Note: length buckets]
A graph replays one shape. A vision encoder's input is a packed sequence of image patches whose total
length changes every step (Qwen3-VL concatenates all images of a sample, batch 1). Megatron-Bridge PR 2334
pads everything to one maximum length and replaces the per-image ``cu_seqlens`` by a mask over the whole
padded sequence; that wastes compute on short inputs and lets every image attend to every other one. Here:

- Buckets. ``Buckets`` (``capture/buckets.py``) holds ascending lengths; a call of length ``n`` is padded to the
  smallest bucket ``>= n`` along each *length argument*'s dimension (``LengthArg(dim, pad_value)``), and every
  tensor of the output is cut back to ``n`` along ``output_dim``. A call already at a bucket length is not
  copied, so a model may pad once before its layers (as the PR does) and every layer replays without copies.
- One graph per bucket. One :class:`PartialCudaGraphs`, built with this object and never captured itself, is
  the capture core (hook extraction, the FSDP handlers run around warmup and capture by the schedules of
  ``capture/schedules.py``, the address checks); each bucket hands it its own callables, whose sample args are
  built from the recorded eager call, padded or cut to the bucket. The buckets share memory
  pools (``torch.cuda.graph_pool_handle()``), largest bucket first so that the smaller ones fit in memory it
  already reserved: backend ``te`` uses one pool for everything (TE captures all forwards, then all backwards
  in reverse, the order of replay); backend ``torch`` captures one FSDP unit per ``make_graphed_callables``
  call, so a pool shared across units would hand one unit's saved activations to the next unit's capture
  while both are live at replay. There each unit (group of callables of one unit) has one pool, shared by
  all buckets.
- Per-sequence attention. Graph inputs can only be tensors of fixed shape, and ``cu_seqlens`` changes length
  with the number of images. We pass *segment ids* instead: one int per token (its image), padded with
  ``-1``, so that padding is one more segment. The attention builds the block-diagonal mask
  ``segment_ids[:, None] == segment_ids[None, :]`` inside the graph (:func:`block_diagonal_mask`) and hands
  it to ``scaled_dot_product_attention``. Real tokens never see padding or another image; padded tokens
  attend to each other only, so no row is fully masked (no NaN). A one-dimensional input keeps the "one
  varying dimension" contract (a [L, L] mask would vary in two) and costs ``L`` ints per graph input
  instead of ``L*L`` static mask elements per callable and bucket.
- Gradients. The loss reads only the unpadded outputs, and padding is isolated by the mask and by row-wise
  layers, so padded positions get exactly zero gradient (the backward of every masked score is zero).
- Past the largest bucket the call runs eagerly (one warning; ``cuda_graph_strict_signature`` raises).

[Note: replays that share a pool]
A shared pool is safe when graphs replay in the order they were captured and no two are live at once.
Within a bucket that is the training order (forwards in capture order, backwards in reverse); across
buckets it needs each bucket's forward to meet its backward before another bucket's forward runs. A
forward twice before one backward (two micro-batches, or an evaluation forward in the middle of a step)
would overwrite saved activations of the pending graph. So each grad-enabled replay stays *pending* until
its backward starts (or its autograd graph is freed), and a replay whose pool holds a pending replay of
another bucket, or of the same or a later callable, runs eagerly instead (one warning; strict mode raises).

Hazards (beyond PartialCudaGraphs'): the callable's real outputs must not depend on padded positions
(row-wise layers, attention masked by segment ids); constants of the call (e.g. a ``max_seqlen`` int) must
not depend on the length, or every call runs eagerly with a SignatureChangedWarning; outputs are static
buffers overwritten by the next replay of the same bucket.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fsdp_cudagraph.config import BACKENDS, CudaGraphConfig
from fsdp_cudagraph.graphs.partial import PartialCudaGraphs
from fsdp_cudagraph.capture import args as _args
from fsdp_cudagraph.capture import recipe as _recipe
from fsdp_cudagraph.capture import schedules as _schedules
from fsdp_cudagraph.capture.schedules import CaptureReport, GraphedCallable
from fsdp_cudagraph.capture.buckets import Buckets, pad_to

__all__ = ["LengthBucketGraphs", "LengthArg", "LengthBucketsReport", "BucketCaptureReport", "BucketReplayConflictWarning",
           "segment_ids_from_cu_seqlens", "block_diagonal_mask", "LengthSpec", "unpad_output"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- length buckets
# What LengthBucketGraphs pads, cuts and tracks; see [Note: length buckets].


@dataclasses.dataclass(frozen=True)
class LengthArg:
    """An argument that varies in length along ``dim``; padded with ``pad_value`` up to the bucket."""

    dim: int = 0
    pad_value: Union[int, float] = 0


# ---------------------------------------------------------------------------------------------- attention helpers


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-token sequence index (int64, ``[total]``) of a packed batch described by ``cu_seqlens`` ([N + 1]).

    No host sync: token ``t`` belongs to the sequence ``i`` with ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``.
    Values are checked only on CPU (a check on the GPU would synchronise); ``cu_seqlens[-1]`` must be ``total``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [num_sequences + 1] starting at 0, got shape "
                         f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
    if cu_seqlens.device.type == "cpu":
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens={cu_seqlens.tolist()} must start at 0, never decrease and end at the "
                             f"number of tokens ({total})")
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).long()


def block_diagonal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[L, L]`` mask, True where query and key share a segment (``attn_mask`` of SDPA: True attends).

    Padding carries one segment id of its own (``-1``), so padded tokens attend to each other only: every row
    has a True entry, and no real token sees a padded one.
    """
    return segment_ids[:, None] == segment_ids[None, :]


# ---------------------------------------------------------------------------------------------- call shapes


class LengthSpec:
    """The length arguments of one callable, resolved against its forward's parameter names."""

    def __init__(self, name: str, fn: Callable[..., Any], length_args: Mapping[str, LengthArg], output_dim: int):
        self.name = name
        names = _args.arg_names(fn)
        self.items = [(n, names.index(n) if n in names else None, a.dim, a.pad_value) for n, a in length_args.items()]
        self.output_dim = output_dim

    def _get(self, args: Sequence[Any], kwargs: Mapping[str, Any], pos: Optional[int], name: str) -> Any:
        return args[pos] if pos is not None and pos < len(args) else kwargs.get(name)

    def length(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
        """The call's length; raises when the length arguments disagree or none is given."""
        n, first = None, None
        for name, pos, dim, _ in self.items:
            t = self._get(args, kwargs, pos, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"length-bucketed callable {self.name}: length argument `{name}` is a "
                                f"{type(t).__name__}, not a tensor; length_args name tensor arguments only")
            m = t.shape[dim]
            if n is None:
                n, first = m, name
            elif m != n:
                raise ValueError(f"length-bucketed callable {self.name}: `{name}` has length {m} along dim {dim} but "
                                 f"`{first}` has {n}; the length arguments of one call must have one length")
        if n is None:
            raise ValueError(f"length-bucketed callable {self.name} was called without any of its length arguments "
                             f"{[i[0] for i in self.items]}; pass them, or fix length_args")
        return n

    def resize(self, args: Sequence[Any], kwargs: Mapping[str, Any], size: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The call with every length argument padded (or, for sample args, cut) to ``size``."""
        args, kwargs = list(args), dict(kwargs)
        for name, pos, dim, value in self.items:
            in_args = pos is not None and pos < len(args)
            t = args[pos] if in_args else kwargs.get(name)
            if t is None:
                continue
            t = t.narrow(dim, 0, size) if t.shape[dim] > size else pad_to(t, size, dim, value)
            if in_args:
                args[pos] = t
            else:
                kwargs[name] = t
        return tuple(args), kwargs


def unpad_output(out: Any, n: int, dim: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out.narrow(dim, 0, n)
    leaves, sig = _args.flatten(out)
    return _args.rebuild(sig, [t.narrow(dim, 0, n) for t in leaves])


# ---------------------------------------------------------------------------------------------- pending replays


@dataclasses.dataclass(eq=False)
class PendingReplay:
    name: str
    order: int
    bucket: int
    #: weakref to the ReplayDone hook on the replay's autograd node: dead once the step's autograd graph is freed.
    hook: Any = None
    done: bool = False

    def alive(self) -> bool:
        return not self.done and self.hook is not None and self.hook() is not None


class ReplayDone:
    """Pre-hook on a replay's autograd node: its backward is starting, so the replay is no longer pending."""

    __slots__ = ("pending", "__weakref__")

    def __init__(self, pending: PendingReplay) -> None:
        self.pending = pending

    def __call__(self, grad_outputs: Any) -> None:
        self.pending.done = True


class BucketReplayConflictWarning(RuntimeWarning):
    """A replay would have overwritten memory a pending replay still needs; the call ran eagerly."""


@dataclasses.dataclass
class BucketCaptureReport:
    """One bucket's capture: time, graph memory (allocated by live graph tensors) and pool growth (reserved)."""

    bucket: int
    capture_seconds: float
    graph_memory_bytes: int
    reserved_bytes: int
    report: CaptureReport


@dataclasses.dataclass
class LengthBucketsReport:
    backend: str
    callables: List[str]
    #: In capture order (largest bucket first).
    buckets: List[BucketCaptureReport]
    num_pools: int
    capture_seconds: float


# ---------------------------------------------------------------------------------------------- per-bucket capture


@dataclasses.dataclass(eq=False)
class _Bucket:
    """One bucket's capture: its callables (sample args padded or cut to the bucket), what the schedule installed
    for each (the capture wrapper and a per-bucket dispatcher) and each callable's pre-replay address check."""

    bucket: int
    callables: List[GraphedCallable]
    wrappers: Dict[str, _args.CallWrapper] = dataclasses.field(default_factory=dict)
    dispatchers: Dict[str, _args.Dispatcher] = dataclasses.field(default_factory=dict)
    checks: List[Callable[..., None]] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------- the public class


class LengthBucketGraphs:
    """Per-layer CUDA graphs, one per length bucket, of callables whose inputs vary in length along one dimension.

    Args:
        model: a :class:`megatron_fsdp.MegatronFSDP` (needs ``fsdp_double_buffer`` and
            ``fsdp_db_use_persist_buf_on_alloc_fail``) or a plain module.
        config: selects the callables as for :class:`PartialCudaGraphs` (``cuda_graph_modules=[]``: the FSDP
            units); ``cuda_graph_strict_signature=True`` raises where a call would otherwise run eagerly.
        buckets: a :class:`Buckets`, a list of lengths, or an int ``n`` for ``Buckets.powers_of_two(n,
            min_size=min(n, 64))`` (lengths below 64 share one graph: tiny graphs cost capture time, not compute).
        length_args: the callables' arguments that vary in length, by forward parameter name: ``{"x": 0}``
            (dimension 0, padded with 0) or ``{"segment_ids": LengthArg(0, pad_value=-1)}``. All must have one
            length per call.
        output_dim: every tensor the callable returns varies in length along this dimension and is cut back.
        backend: ``torch`` (``torch.cuda.make_graphed_callables``), ``te`` or ``protocol`` (the same schedule
            without graphs, on CPU); default from ``config.cuda_graph_impl``.

    Lifecycle: build before the first training step (it moves the thread off the legacy default CUDA stream,
    as PartialCudaGraphs does), run at least one eager step (it records each callable's call), ``capture()``,
    train, ``delete()``. ``stats`` counts calls, real and padded tokens per bucket, eager fallbacks.
    See [Note: length buckets] and [Note: replays that share a pool].
    """

    def __init__(self, model: nn.Module, config: CudaGraphConfig, *, buckets: Union[Buckets, Sequence[int], int],
                 length_args: Mapping[str, Union[int, LengthArg]], output_dim: int = 0,
                 backend: Optional[str] = None) -> None:
        if isinstance(buckets, int) and not isinstance(buckets, bool):
            buckets = Buckets.powers_of_two(buckets, min_size=min(buckets, 64))
        elif not isinstance(buckets, Buckets):
            buckets = Buckets(buckets)
        if not length_args:
            raise ValueError("length_args is empty; name the arguments that vary in length, e.g. {'x': 0}")
        self.length_args: Dict[str, LengthArg] = {}
        for name, spec in length_args.items():
            if isinstance(spec, int) and not isinstance(spec, bool):
                spec = LengthArg(spec)
            if not isinstance(spec, LengthArg):
                raise TypeError(f"length_args[{name!r}]={spec!r} must be a dimension (int) or a LengthArg(dim, pad_value)")
            self.length_args[name] = spec
        backend = config.backend if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; with backend=None set cuda_graph_impl "
                             "to 'transformer_engine' or 'local'")
        if config.activation_offload_modules or config.activation_offload_module_patterns:
            raise NotImplementedError("activation offloading inside length-bucketed graphs is not supported; drop "
                                      "activation_offload_modules/activation_offload_module_patterns, or use "
                                      "PartialCudaGraphs")
        if config.fp8_recipe is not None:
            raise NotImplementedError(f"fp8_recipe={config.fp8_recipe!r} with length-bucketed graphs is not supported: "
                                      "each bucket's sequence length would have to meet TE's FP8 GEMM rule and each "
                                      "bucket's capture would save and restore the scaling state on its own; use "
                                      "PartialCudaGraphs with one padded length, or train the bucketed model in bf16")
        self.model, self.config, self.buckets, self.output_dim, self.backend = model, config, buckets, output_dim, backend
        # The capture core, built once (the machine and engine checks, the selection, the side stream), never
        # captured itself: capture() hands it one ordered set of callables per bucket. TE attention matching
        # needs a PartialCudaGraphs' own recording of the eager steps: inert here ("warn").
        self._core = PartialCudaGraphs(model, config, backend=backend, attention_backend="warn")
        self._core.stop_recording()  # the calls are recorded below, whatever the grad mode
        #: The engine contract, as the core resolved it.
        self.engine = self._core.engine
        self._modules: Dict[str, nn.Module] = {c.name: c.module for c in self._core.callables}
        self._calls: Dict[str, Tuple[Tuple[torch.Tensor, ...], Any]] = {}
        self._order: List[str] = []
        self._recorders = [m.register_forward_pre_hook(self._recorder(n), with_kwargs=True)
                           for n, m in self._modules.items()]
        self._captures: List[_Bucket] = []
        self._checks: List[Any] = []
        self._dispatchers: Dict[str, _LengthDispatcher] = {}
        self._pending: Dict[str, List[PendingReplay]] = {}
        self._overflow_warned = self._conflict_warned = False
        self.captured = False
        self.report: Optional[LengthBucketsReport] = None
        #: bucket -> {"calls", "real_tokens", "padded_tokens"}; "eager_overflow" / "eager_conflict": call counts.
        self.stats: Dict[Any, Any] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {b: {"calls": 0, "real_tokens": 0, "padded_tokens": 0} for b in self.buckets.sizes}
        self.stats.update(eager_overflow=0, eager_conflict=0)

    def padding_overhead(self) -> float:
        """Padded tokens / real tokens over the graphed calls counted in ``stats`` (0.0 when none)."""
        real = sum(self.stats[b]["real_tokens"] for b in self.buckets.sizes)
        return sum(self.stats[b]["padded_tokens"] for b in self.buckets.sizes) / real if real else 0.0

    def _recorder(self, name: str):
        def record(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            if name not in self._order:
                self._order.append(name)
            self._calls[name] = _args.record_call(args, kwargs)

        return record

    # ------------------------------------------------------------------ capture
    def capture(self) -> LengthBucketsReport:
        """Capture every selected callable once per bucket, largest bucket first. Undoes itself on failure."""
        if self.captured:
            raise RuntimeError("capture() was already called; delete() and build a new LengthBucketGraphs to capture again")
        self._core.check_capturable()
        missing = [n for n in self._modules if n not in self._calls]
        if missing:
            raise RuntimeError(f"callables {missing[:5]} did not run in an eager step before capture, so their calls are "
                               "unknown; run at least one eager training step before capture()")
        order = self._order + [n for n in self._modules if n not in self._order]
        specs = {n: LengthSpec(n, self._modules[n].forward, self.length_args, self.output_dim) for n in order}
        templates = {n: _args.rebuild(self._calls[n][1], self._calls[n][0]) for n in order}
        for n in order:
            self._check_template(n, specs[n], *templates[n])
        for h in self._recorders:
            h.remove()
        self._recorders = []
        pool_key = self._pool_keys(order)
        pools: Dict[str, Any] = {}
        reports: List[BucketCaptureReport] = []
        t0 = time.perf_counter()
        try:
            for bucket in sorted(self.buckets.sizes, reverse=True):
                reserved0 = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
                b, rep = self._capture_bucket(bucket, order, specs, templates, pools, pool_key)
                self._check_outputs(b, bucket)
                self._check_addresses(self._captures[0], b)
                reserved = (torch.cuda.memory_reserved() - reserved0) if torch.cuda.is_available() else 0
                reports.append(BucketCaptureReport(bucket, rep.capture_seconds, rep.graph_memory_bytes, reserved, rep))
                logger.info("fsdp_cudagraph: bucket %d captured in %.3f s (graph memory %d B, pool growth %d B)",
                            bucket, rep.capture_seconds, rep.graph_memory_bytes, reserved)
        except BaseException:
            self._undo()
            raise
        first = self._captures[0]
        for c, check in zip(first.callables, first.checks):  # one address check per callable serves every bucket
            self._checks.append(c.module.register_forward_pre_hook(check))
            d = _LengthDispatcher(self, c.name, c.module, specs[c.name], order.index(c.name), pool_key[c.name],
                                  {b.bucket: b.dispatchers[c.name] for b in self._captures},
                                  first.wrappers[c.name].eager_forward)
            self._dispatchers[c.name] = d
            c.module.forward = d
        self._calls = {}  # each bucket's sample args live on in its graphs (torch's static inputs); drop the templates
        self.captured = True
        self.report = LengthBucketsReport(self.backend, order, reports, len(pools), time.perf_counter() - t0)
        return self.report

    def _capture_bucket(self, bucket: int, order: List[str], specs: Dict[str, LengthSpec], templates: Dict[str, Any],
                        pools: Dict[str, Any], pool_key: Dict[str, str]) -> Tuple[_Bucket, CaptureReport]:
        """Capture every callable for one bucket with the core's schedule: sample args from the recorded calls,
        padded or cut to the bucket; results kept (not installed); memory pools shared across buckets."""
        core = self._core
        by_name = {c.name: c for c in core.callables}
        callables = []
        for n in order:
            leaves, sig = _args.record_call(*specs[n].resize(*templates[n], bucket))
            callables.append(GraphedCallable(name=n, module=by_name[n].module, unit=by_name[n].unit, sample_args=leaves,
                                       sample_kwargs={}, signature=sig))
        core.check_callables(callables)
        b = _Bucket(bucket, callables)

        def install(c: GraphedCallable, wrapper: _args.CallWrapper, graphed: Any) -> None:
            b.wrappers[c.name] = wrapper
            b.dispatchers[c.name] = _args.Dispatcher(c.module, c.name, graphed, wrapper, wrapper.eager_forward,
                                                     strict=self.config.cuda_graph_strict_signature,
                                                     on_replay=core._on_replay(c))

        def pool_for(group: List[GraphedCallable]) -> Dict[str, Any]:
            key = pool_key[group[0].name]
            if key not in pools:
                pools[key] = torch.cuda.graph_pool_handle()
            return {"pool": pools[key]}

        seconds, mem, reserved0, unknown = core.capture_order(callables, install=install, pool_for=pool_for)
        self._captures.append(b)  # captured: from here on _undo() gives its modules back
        b.checks = [core.arm_address_check(c) for c in callables]
        return b, CaptureReport(self.backend, list(order), seconds, mem, unknown, {},
                                _schedules.memory_breakdown(callables, mem, reserved0))

    def _check_template(self, name: str, spec: LengthSpec, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        given = [n for n, pos, _, _ in spec.items if spec._get(args, kwargs, pos, n) is not None]
        if not given:
            raise ValueError(f"length_args {list(self.length_args)} name no argument of {name}'s recorded call "
                             f"(its forward takes {_args.arg_names(self._modules[name].forward)}); name its "
                             "varying tensor arguments")
        spec.length(args, kwargs)  # the lengths agree

    def _check_outputs(self, cap: _Bucket, bucket: int) -> None:
        for name, w in cap.wrappers.items():
            for path, node in _args._walk(w.out_sig, "output"):
                if node[0] == _args._TENSOR and (len(node[1]) <= self.output_dim or node[1][self.output_dim] != bucket):
                    raise NotImplementedError(
                        f"length-bucketed callable {name} returned `{path}` of shape {tuple(node[1])} for bucket "
                        f"{bucket}; every output must vary in length along output_dim={self.output_dim} (it is cut "
                        "back to the call's length). Graph a callable whose outputs are per token, or set output_dim")

    def _check_addresses(self, first: _Bucket, cap: _Bucket) -> None:
        """One address check serves every bucket: the parameters must sit where they sat for the first bucket."""
        for c, oc in zip(first.callables, cap.callables):
            if oc.replay_ptrs != c.replay_ptrs:
                raise RuntimeError(f"fsdp_cudagraph: the parameters (or gradient buffer) of {c.name} moved between the "
                                   f"captures of buckets {first.bucket} and {cap.bucket}; length buckets need "
                                   "address-stable parameters (fsdp_double_buffer and fsdp_db_use_persist_buf_on_alloc_fail)")

    def _pool_keys(self, order: List[str]) -> Dict[str, str]:
        """Callable -> its pool: one for all with TE; with torch one per capture call (consecutive callables of
        one FSDP unit), as [Note: length buckets] explains. The protocol backend keys like torch (for the guard)."""
        if self.backend == "te":
            return {n: "all" for n in order}
        keys: Dict[str, str] = {}
        prev_unit, key = object(), ""
        for n in order:
            unit = self.engine.unit_of(self._modules[n])
            if unit is None or unit is not prev_unit:
                key = n
            keys[n] = key
            prev_unit = unit
        return keys

    # ------------------------------------------------------------------ replay-time policy
    def _select(self, n: int, name: str) -> Optional[int]:
        size = self.buckets.select(n)
        if size is None and (self.config.cuda_graph_strict_signature or not self._overflow_warned):
            self._overflow_warned = True
            self.buckets.select_or_fallback(n, what=f"length-bucketed callable {name}",
                                            strict=self.config.cuda_graph_strict_signature)
        return size

    def _may_replay(self, d: "_LengthDispatcher", bucket: int) -> bool:
        pending = self._pending.get(d.pool_key)
        if not pending:
            return True
        pending[:] = [p for p in pending if p.alive()]
        clash = next((p for p in pending if p.bucket != bucket or p.order >= d.order), None)
        if clash is None:
            return True
        msg = (f"graphed callable {d.name} (bucket {bucket}) was called while the replay of {clash.name} (bucket "
               f"{clash.bucket}) still awaits its backward; they share a memory pool, so replaying now would "
               "overwrite what that backward reads ([Note: replays that share a pool]). Run backward before the "
               "next forward, or free the pending graph")
        if self.config.cuda_graph_strict_signature:
            raise RuntimeError(msg)
        if not self._conflict_warned:
            self._conflict_warned = True
            warnings.warn(f"fsdp_cudagraph: {msg}; this call (and any such call) runs eagerly", BucketReplayConflictWarning,
                          stacklevel=4)
        return False

    def _track(self, d: "_LengthDispatcher", bucket: int, out: Any) -> None:
        """Mark a grad-enabled replay pending until its backward starts (see [Note: replays that share a pool]).

        A pre-hook on the output's autograd node ends it; the node's death (the step's graph freed without a
        backward) ends it too, through a weak reference to the hook. The output itself is left untouched.
        """
        if not torch.is_grad_enabled():
            return
        leaves = [out] if isinstance(out, torch.Tensor) else _args.flatten(out)[0]
        node = next((t.grad_fn for t in leaves if t.grad_fn is not None), None)
        if node is None:
            return
        pending = PendingReplay(d.name, d.order, bucket)
        hook = ReplayDone(pending)
        node.register_prehook(hook)
        pending.hook = weakref.ref(hook)
        self._pending.setdefault(d.pool_key, []).append(pending)

    # ------------------------------------------------------------------ delete
    def delete(self) -> None:
        """Reset every bucket's graphs, give their memory back, and return the modules to eager (hooks as before)."""
        for h in self._checks + self._recorders:
            h.remove()
        self._checks, self._recorders = [], []
        self._undo()
        self._core.delete()
        self._dispatchers, self._pending, self._calls = {}, {}, {}
        self.captured = False

    def _undo(self) -> None:
        for cap in reversed(self._captures):  # the first bucket last: its callables recorded the modules' own forward
            for w in cap.wrappers.values():
                reset = w.__dict__.get("reset")
                if callable(reset):
                    reset()
            for c in cap.callables:
                _schedules.restore_forward(c)
                for attr in ("reset", "backward_dw"):
                    c.module.__dict__.pop(attr, None)
                c.sample_args = None
        self._captures = []
        _recipe.free_memory(cuda=torch.cuda.is_available())


class _LengthDispatcher:
    """A length-bucketed module's ``forward``: pad to the bucket, replay its graph (or run eagerly), cut back.

    The hot path: read the length, pick the bucket, pad the length arguments (no copy at a bucket length),
    the per-bucket :class:`_args.Dispatcher` (signature check, replay), the pending check, and a narrow.
    """

    def __init__(self, owner: LengthBucketGraphs, name: str, module: nn.Module, spec: LengthSpec, order: int,
                 pool_key: str, per_bucket: Dict[int, _args.Dispatcher], eager: Callable[..., Any]) -> None:
        self.owner, self.name, self.module, self.spec = owner, name, module, spec
        self.order, self.pool_key, self.per_bucket, self.eager = order, pool_key, per_bucket, eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        n = self.spec.length(args, kwargs)
        bucket = owner._select(n, self.name)
        if bucket is None:
            owner.stats["eager_overflow"] += 1
            return self.eager(*args, **kwargs)
        if not owner._may_replay(self, bucket):
            owner.stats["eager_conflict"] += 1
            return self.eager(*args, **kwargs)
        if n != bucket:
            args, kwargs = self.spec.resize(args, kwargs, bucket)
        inner = self.per_bucket[bucket]
        replays = inner.replays
        out = inner(*args, **kwargs)
        if inner.replays != replays:
            owner._track(self, bucket, out)
            s = owner.stats[bucket]
            s["calls"] += 1
            s["real_tokens"] += n
            s["padded_tokens"] += bucket - n
        return out if n == bucket else unpad_output(out, n, self.spec.output_dim)
