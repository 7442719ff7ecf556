"""Forward-only CUDA graphs for evaluation and generation: ``inference_cuda_graph_scope`` ``layer`` / ``block``.

Lifecycle::

    graphs = InferenceCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local"),
                                 batch_buckets=Buckets.powers_of_two(8))
    model.eval()
    with torch.no_grad():
        for tokens, targets in eval_batches:
            loss = loss_fn(graphs(tokens), targets)   # padded to a bucket, graphed, cut back to the real rows
    model.train()                                     # training (with or without PartialCudaGraphs) goes on
    graphs.delete()                                   # graphs reset, memory given back

``model`` is a :class:`megatron_fsdp.MegatronFSDP` or a plain module. ``graphs(*args, **kwargs)`` is
``model(*args, **kwargs)`` with graphs: the first call of a new padded shape runs
``cuda_graph_num_warmup_iters`` eager warmups and captures, later calls replay.

Scopes:
- ``layer``: one forward-only graph per layer (the FSDP units, or ``layer_modules``) per padded shape. The
  code between layers (embeddings, head) runs eagerly, and so do the engine's hooks: each layer's
  pre-forward (all-gather) and post-forward (reshard) fire around its replay exactly as in an eager
  forward ([Note: layer graphs inside the layer's call]).
- ``block``: the whole forward in one graph per padded shape. Under ``megatron_fsdp`` the graph holds the
  engine's work too, collectives included (ZeRO-3 all-gathers; the engine's side is [Note: the static
  schedule] in ``megatron_fsdp/graph_contract.py``).
- ``none``: ``graphs(...)`` is ``model(...)``.

Padding: [Note: inference buckets and padding] (:class:`BatchPadding`, below).

[Note: one memory pool]
All graphs of one instance share one CUDA memory pool. A graph captured later may take memory that an
earlier one used for temporaries, so a graph's outputs are valid until a graph captured before it replays.
That never happens within one call: graphs replay in the order they were captured (a layer called twice in
one forward runs its second call eagerly), and the call's outputs are cloned before they are returned.

[Note: inference graphs beside training]
Nothing here changes training state: layer graphs leave every hook in place (they are captured inside the
layer's call), parameters keep their addresses (checked before every replay), and the engine's host state
after a block replay is what an eager evaluation leaves, or safer (units idle, nothing gathered, compute
parameters re-installed from the unchanged main shards before the next training step). Gradients, main
gradients, optimizer state and the training graphs (their own memory pools) are not touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.config import WHOLE_STEP_BACKENDS, CudaGraphConfig, InferenceCudaGraphScope
from fsdp_cudagraph.engines.contract import FORWARD_ONLY_BUFFERS, StaticStepEngine, per_layer_engine, static_step_engine
from fsdp_cudagraph.engines.registry import adapter_for
from fsdp_cudagraph.capture import args as _args
from fsdp_cudagraph.capture import protocol as _protocol
from fsdp_cudagraph.capture import streams as _streams
from fsdp_cudagraph.capture.buckets import Buckets, pad_to, unpad
from fsdp_cudagraph.capture import recipe as _recipe
from fsdp_cudagraph.capture.capture_safety import CaptureSafetyCheck

__all__ = ["InferenceCudaGraphs", "InferenceCapture", "INFERENCE_BACKENDS", "GraphLimitWarning"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- inference padding


class BatchPadding:
    """How InferenceCudaGraphs pads a call's tensors to its buckets and cuts the outputs back.

    [Note: inference buckets and padding]
    A graph replays one shape. Calls are padded at the END of the batch dimension (dim 0 of every tensor
    argument that has one) up to the smallest of ``batch_buckets`` that holds them, and every output tensor is
    cut back to the real rows (outputs must therefore carry the batch in dim 0; others are refused). Rows of a
    transformer are independent, so padding rows never changes the real rows in exact arithmetic, and with a
    given kernel the values of the other rows never reach a real row. Calls whose batch exceeds the largest
    bucket run eagerly, unpadded (one ``BucketOverflowWarning`` per size; ``cuda_graph_strict_signature``
    raises instead). All other dimensions are keyed exactly: each distinct shape gets its own graphs, at most
    ``max_graph_sets`` of them (then eager, with one warning). ``seq_buckets`` also pads dim 1 at the end, for
    causal models only (later positions never reach earlier ones); it is opt-in because attention then reduces
    over a longer, masked key range, which may change the real positions' last bits (measured: docs/graph-kinds.md,
    "Buckets and padding").
    """

    def __init__(self, batch_buckets: Buckets, seq_buckets: Optional[Buckets], pad_value: Union[int, float]) -> None:
        self.batch_buckets, self.seq_buckets, self.pad_value = batch_buckets, seq_buckets, pad_value

    def check_causal(self, root: Any, causal: Optional[bool]) -> None:
        """Refuse ``seq_buckets`` unless the model is causal (declared by ``root`` or by ``causal=True``)."""
        # A model may declare itself causal with a bounded number of positions (the reference GPT does:
        # ``causal = True`` and ``max_positions``, the size of its positional embedding); the graph layer reads
        # the declaration instead of importing the application's class.
        seq_buckets = self.seq_buckets
        assert seq_buckets is not None
        if getattr(root, "causal", None) is True and isinstance(getattr(root, "max_positions", None), int):
            n = root.max_positions
            name = type(root).__name__
            if seq_buckets.max_size > n:
                raise ValueError(
                    f"seq_buckets={list(seq_buckets.sizes)} pads sequences up to {seq_buckets.max_size}, but "
                    f"the {name}'s positional embedding has {n} positions (max_positions={n}); drop the larger "
                    f"buckets (largest <= {n}) or build the model with more positions")
            if causal is False:
                raise ValueError(f"causal=False with seq_buckets: the {name} declares causal=True; drop causal=False")
            return
        if causal is not True:
            raise ValueError(
                f"seq_buckets={list(seq_buckets.sizes)} with causal={causal}: padding positions at the end of a "
                f"sequence leaves the real positions unchanged only in a causal model ({type(root).__name__} is "
                "not known to be one); pass causal=True if position i never attends to later positions, or drop "
                "seq_buckets (every sequence length then gets graphs of its own)")

    def sizes(self, leaves: List[torch.Tensor]) -> Tuple[int, Optional[int]]:
        """The call's batch size (dim 0) and, with ``seq_buckets``, its sequence length (dim 1)."""
        batched = [t for t in leaves if t.dim() >= 1]
        if not batched:
            raise ValueError("InferenceCudaGraphs: no tensor argument has a batch dimension (dim 0) to pad")
        batch = int(batched[0].shape[0])
        if any(int(t.shape[0]) != batch for t in batched):
            raise ValueError(f"InferenceCudaGraphs: tensor arguments disagree on the batch size (dim 0): "
                             f"{[tuple(t.shape) for t in batched]}; every tensor argument with dimensions must carry "
                             "the batch in dim 0 (0-dim tensors are passed as they are)")
        if self.seq_buckets is None:
            return batch, None
        seqd = [t for t in batched if t.dim() >= 2]
        if not seqd or any(int(t.shape[1]) != int(seqd[0].shape[1]) for t in seqd):
            raise ValueError(f"InferenceCudaGraphs with seq_buckets: tensor arguments must share the sequence length "
                             f"in dim 1, got {[tuple(t.shape) for t in batched]}")
        return batch, int(seqd[0].shape[1])

    def pad(self, t: torch.Tensor, batch: int, seq: Optional[int]) -> torch.Tensor:
        """``t`` padded at the end to ``batch`` rows (and ``seq`` positions with ``seq_buckets``)."""
        if t.dim() == 0:
            return t
        t = pad_to(t, batch, 0, self.pad_value)
        if self.seq_buckets is not None and t.dim() >= 2:
            t = pad_to(t, seq, 1, self.pad_value)
        return t

    def cut(self, out_leaves: Sequence[torch.Tensor], real: Tuple[int, Optional[int]],
            padded: Tuple[int, Optional[int]], model_name: str) -> List[torch.Tensor]:
        """Fresh copies of the outputs cut back from the ``padded`` (batch, seq) to the ``real`` ones."""
        (batch, seq), (padded_batch, padded_seq) = real, padded
        cut = []
        for i, t in enumerate(out_leaves):
            if t.dim() == 0 or t.shape[0] != padded_batch or (
                    self.seq_buckets is not None and (t.dim() < 2 or t.shape[1] != padded_seq)):
                raise NotImplementedError(
                    f"InferenceCudaGraphs: output tensor {i} of {model_name} has shape {tuple(t.shape)}, "
                    f"without the padded batch {padded_batch} in dim 0"
                    + (f" and the padded length {padded_seq} in dim 1" if self.seq_buckets is not None else "")
                    + "; padded rows could not be cut out of it. Return per-row outputs (e.g. logits) and reduce "
                    "them (e.g. the loss) outside the graphed call")
            t = unpad(t, batch, 0)
            if self.seq_buckets is not None:
                t = unpad(t, seq, 1)
            cut.append(t.clone())
        return cut

    def agree(self, leaves: Sequence[torch.Tensor], batch: Optional[int], seq: Optional[int], *, device: torch.device,
              group: Any, rank: int) -> Tuple[Optional[int], Optional[int]]:
        """The padded (batch, seq) every rank of ``group`` uses for this call (the largest; None on every rank when
        one rank's call fits no bucket). Block graphs hold collectives: every rank must replay (or run eagerly)
        the same graph at the same call, so the shapes outside the padded dimensions must agree too."""
        skip = 1 if self.seq_buckets is None else 2  # the dimensions that are padded, and so may differ
        rest = repr([(tuple(t.shape[skip:]) if t.dim() else (), str(t.dtype)) for t in leaves])
        digest = int.from_bytes(hashlib.sha1(rest.encode()).digest()[:7], "big")
        none = 1 << 40  # "no bucket" wins the maximum: if one rank runs eagerly, all do
        vals = torch.tensor([none if batch is None else batch, seq or 0, digest, -digest], dtype=torch.int64,
                            device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
        b, s, hi, neg_lo = vals.tolist()
        if hi != -neg_lo:
            raise ValueError(
                f"[rank {rank}] InferenceCudaGraphs: the ranks called a block graph of a sharded model with "
                "different shapes outside the padded dimensions; its collectives must run on every rank together. "
                "Pass the same shapes on every rank (only the padded dimensions may differ), or use "
                "inference_cuda_graph_scope='layer'")
        if b == none:
            return None, None
        return b, (s if self.seq_buckets is not None else None)

#: torch: torch.cuda.graph; protocol: the same schedule without graphs (CPU): "capture" and every "replay" run
#: the captured function under the engine's (simulated) capture guard, and a replay must issue what the capture did
#: ([Note: backends] in config.py).
INFERENCE_BACKENDS = WHOLE_STEP_BACKENDS


class GraphLimitWarning(UserWarning):
    """A call had a new shape after ``max_graph_sets`` shapes had graphs: it ran eagerly."""


@dataclasses.dataclass
class InferenceCapture:
    """One capture: which callable, for which padded call, how long it took and the graph memory it took."""

    name: str
    shape: str
    seconds: float
    graph_memory_bytes: int
    collectives: List[str]


@dataclasses.dataclass(eq=False)
class _Graph:
    """One captured callable for one call signature: static inputs, static outputs and the graph."""

    name: str
    body: Callable[[], Tuple[List[torch.Tensor], Any]]
    static_in: List[torch.Tensor]
    static: bool  # block graph of an engine: a static step (engine work and collectives inside)
    graph: Any = None
    static_out: List[torch.Tensor] = dataclasses.field(default_factory=list)
    out_sig: Any = None
    params: Tuple[torch.Tensor, ...] = ()
    param_ptrs: Tuple[int, ...] = ()
    collectives: List[str] = dataclasses.field(default_factory=list)
    replays: int = 0


@dataclasses.dataclass(eq=False)
class _Layer:
    name: str
    module: nn.Module
    graphs: Dict[Any, _Graph] = dataclasses.field(default_factory=dict)
    calls: int = 0
    warned: bool = False


_MISSING = object()


class InferenceCudaGraphs:
    """Forward-only CUDA graphs of a model for evaluation and generation, keyed by padded shape buckets.

    Args:
        model: a :class:`megatron_fsdp.MegatronFSDP` or a plain module, on its device.
        config: the :class:`CudaGraphConfig`; ``inference_cuda_graph_scope`` picks the scope (``layer`` is the
            default with ``cuda_graph_impl='local'``), ``cuda_graph_num_warmup_iters`` the eager warmups before
            each capture, ``cuda_graph_strict_signature`` raises instead of running oversized calls eagerly.
        batch_buckets: padded batch sizes (dim 0), e.g. ``Buckets.powers_of_two(8)``.
        seq_buckets: optional padded sequence lengths (dim 1, padded at the end); needs a causal model: the
            reference GPT, or any model declaring ``causal = True`` and ``max_positions``) or ``causal=True``.
        causal: declare that position ``i``'s outputs never depend on positions after ``i``.
        layer_modules: classes (or class names) of the layers for ``layer`` scope; default the FSDP units, or
            the model's ``unit_class`` (the reference GPT's blocks).
        backend: ``torch`` (default for a CUDA model) or ``protocol`` (default on CPU; no graphs).
        pad_value: the value padded rows are filled with (a valid token id for token inputs).
        max_graph_sets: distinct padded call shapes that get graphs; further shapes run eagerly.

    Calls need ``torch.no_grad()`` (or inference mode) and ``model.eval()``. Hazards: ``model``'s
    parameters must stay where they are while the graphs exist (checked before every replay; with
    ``megatron_fsdp``, ZeRO-3 needs ``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``);
    Python side effects inside a graphed forward (a hook on a submodule of a layer, a counter) happen at
    capture only; a ``block`` graph of a sharded model on several ranks holds collectives, so every rank must
    call it together (the padded batch is agreed across ranks per call, other shapes must match).
    Streams: on CUDA, building it moves this thread off the legacy default stream (``capture/streams.py``).
    """

    def __init__(self, model: nn.Module, config: CudaGraphConfig, *, batch_buckets: Buckets,
                 seq_buckets: Optional[Buckets] = None, causal: Optional[bool] = None,
                 layer_modules: Optional[Sequence[Union[Type[nn.Module], str]]] = None,
                 backend: Optional[str] = None, pad_value: Union[int, float] = 0, max_graph_sets: int = 16) -> None:
        if not isinstance(config, CudaGraphConfig):
            raise TypeError(f"config must be a CudaGraphConfig, got {type(config).__name__}")
        if not isinstance(batch_buckets, Buckets) or (seq_buckets is not None and not isinstance(seq_buckets, Buckets)):
            raise TypeError("batch_buckets (and seq_buckets) must be fsdp_cudagraph.capture.buckets.Buckets, e.g. "
                            "Buckets.powers_of_two(8)")
        if isinstance(max_graph_sets, bool) or not isinstance(max_graph_sets, int) or max_graph_sets < 1:
            raise ValueError(f"max_graph_sets={max_graph_sets!r} must be an int >= 1")
        #: The engine contract (a plain module's adapter without an engine); refuses an engine's inner module, naming
        #: the object to pass.
        self.engine = per_layer_engine(adapter_for(model), "InferenceCudaGraphs")
        #: The engine's static step (contract item 9), where it has one: block graphs then hold its work.
        self.step = self.engine.static_step()
        self._has_static_step = isinstance(self.step, StaticStepEngine)
        self.model = model
        self.root = self.engine.root
        self.config = config
        self.scope = InferenceCudaGraphScope(config.inference_cuda_graph_scope)
        self.batch_buckets, self.seq_buckets = batch_buckets, seq_buckets
        self.pad_value = pad_value
        self.max_graph_sets = max_graph_sets
        self.rank = self.engine.rank
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.backend = _streams.graph_backend(backend, self.device, INFERENCE_BACKENDS)
        self._padding = BatchPadding(batch_buckets, seq_buckets, pad_value)
        if seq_buckets is not None:
            self._padding.check_causal(self.root, causal)
        if self.scope is not InferenceCudaGraphScope.NONE:
            what = f"inference_cuda_graph_scope='{self.scope}'"
            if self._has_static_step:
                # [Note: fixed addresses] in engines/contract.py: a forward-only graph reads the unshard buffers only.
                self.step.require_fixed_buffers(what, FORWARD_ONLY_BUFFERS)
            elif self.engine.unit_modules():
                # Units that gather in hooks, and no static step to fix where they gather to: refused, naming both.
                static_step_engine(self.engine, what)
        self._layers: List[_Layer] = self._select_layers(layer_modules) if self.scope is InferenceCudaGraphScope.LAYER else []
        #: block graphs of an engine hold its work, collectives included, as a static step (graph_contract.py)
        self._static = self.scope is InferenceCudaGraphScope.BLOCK and self._has_static_step
        self._agree = self._static and self.step.world_size > 1
        self._blocks: Dict[Any, _Graph] = {}
        self._keys: set = set()
        self._limit_warned = False
        self._pool = None
        self.captures: List[InferenceCapture] = []
        self.counters = {"graphed_calls": 0, "eager_calls": 0, "captures": 0, "replays": 0}
        self.deleted = False
        if self.backend == "torch" and self.scope is not InferenceCudaGraphScope.NONE:
            config.check_runtime()
            self._pool = torch.cuda.graph_pool_handle()
            _streams.use_side_stream(self.device)

    # ------------------------------------------------------------------ set-up
    def _select_layers(self, layer_modules: Optional[Sequence[Union[Type[nn.Module], str]]]) -> List[_Layer]:
        if layer_modules is None:
            wanted = {id(u) for u in self.engine.unit_modules()}
            if wanted:
                chosen = [(n, m) for n, m in self.root.named_modules() if id(m) in wanted]
            elif isinstance(getattr(type(self.root), "unit_class", None), property):
                cls = self.root.unit_class
                chosen = [(n, m) for n, m in self.root.named_modules() if type(m) is cls]
            else:
                raise ValueError(
                    f"inference_cuda_graph_scope='layer' on an unwrapped {type(self.root).__name__}: name the layer "
                    "classes with layer_modules=[MyLayer] (a megatron_fsdp model uses its units)")
        else:
            specs = list(layer_modules)
            chosen = [(n, m) for n, m in self.root.named_modules() if n and any(
                (type(m).__name__ == s) if isinstance(s, str) else isinstance(m, s) for s in specs)]
        if not chosen:
            raise ValueError(f"layer_modules={layer_modules} match no submodule of {type(self.root).__name__}")
        names = [n for n, _ in chosen]
        nested = [(a, b) for a in names for b in names if b.startswith(a + ".")]
        if nested:
            raise ValueError(f"layers {nested[0][0]!r} and {nested[0][1]!r} are nested; graph one or the other")
        return [_Layer(n, m) for n, m in chosen]

    # ------------------------------------------------------------------ public API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)``, padded to a bucket and graphed; outputs cut back to the real rows."""
        if self.deleted:
            raise RuntimeError("InferenceCudaGraphs called after delete(); build a new one, or call the model directly")
        if torch.is_grad_enabled():
            raise RuntimeError("InferenceCudaGraphs runs forward only: call it under torch.no_grad() (or "
                               "torch.inference_mode()); train with the model itself")
        if self.model.training:
            raise RuntimeError("InferenceCudaGraphs needs the model in eval mode: call model.eval() before evaluating "
                               "(and model.train() after)")
        if self.scope is InferenceCudaGraphScope.NONE:
            self.counters["eager_calls"] += 1
            return self.model(*args, **kwargs)
        if not torch.is_inference_mode_enabled():
            return self._call(args, kwargs)
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: static buffers are written in place
            return self._call(args, kwargs)

    def delete(self) -> None:
        """Reset every graph and give its memory back; the model stays as it was. Idempotent.

        Call it before changing the model (parameters, modules) or when done evaluating; to graph again, build
        a new instance. The thread stays on its side stream.
        """
        if self.deleted:
            return
        if self.backend == "torch":
            torch.cuda.synchronize(self.device)
        for g in self._all_graphs():
            _recipe.reset_graph(g.graph)
            g.graph, g.static_in, g.static_out, g.body = None, [], [], None  # type: ignore[assignment]
        self._blocks.clear()
        for layer in self._layers:
            layer.graphs.clear()
        self._keys.clear()
        self._pool = None
        self.deleted = True
        _recipe.free_memory(cuda=self.backend == "torch")

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (layer scope: layers x shapes; block scope: shapes)."""
        return sum(1 for _ in self._all_graphs())

    # ------------------------------------------------------------------ one call
    def _call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        leaves, sig = _args.flatten((args, kwargs))
        batch, seq = self._padding.sizes(leaves)
        # with collectives in the graph, every rank decides together: a refusal comes after the agreement
        strict = self.config.cuda_graph_strict_signature and not self._agree
        padded_batch = self.batch_buckets.select_or_fallback(batch, what="InferenceCudaGraphs batch", strict=strict)
        padded_seq = None
        if self.seq_buckets is not None and padded_batch is not None:
            padded_seq = self.seq_buckets.select_or_fallback(seq, what="InferenceCudaGraphs sequence length",
                                                             strict=strict)
            if padded_seq is None:
                padded_batch = None
        if self._agree:
            padded_batch, padded_seq = self._padding.agree(leaves, padded_batch, padded_seq, device=self.device,
                                                           group=self.step.process_group, rank=self.rank)
            if padded_batch is None and self.config.cuda_graph_strict_signature:
                raise ValueError(f"[rank {self.rank}] InferenceCudaGraphs: a rank's call exceeds the largest bucket "
                                 f"(batch buckets {list(self.batch_buckets.sizes)}); refused in strict mode on every rank")
        if padded_batch is None:
            self.counters["eager_calls"] += 1
            return self.model(*args, **kwargs)
        pleaves = [self._padding.pad(t, padded_batch, padded_seq) for t in leaves]
        pargs, pkwargs = _args.rebuild(sig, pleaves)
        key = _args.flatten((pargs, pkwargs))[1]
        if key not in self._keys:
            if len(self._keys) >= self.max_graph_sets:
                if not self._limit_warned:
                    self._limit_warned = True
                    warnings.warn(GraphLimitWarning(
                        f"InferenceCudaGraphs: {self.max_graph_sets} padded call shapes already have graphs "
                        f"(max_graph_sets); this and further new shapes run eagerly (warned once). Use buckets "
                        "(seq_buckets for sequence lengths) or raise max_graph_sets"), stacklevel=3)
                self.counters["eager_calls"] += 1
                return self.model(*args, **kwargs)
            self._keys.add(key)
        self.counters["graphed_calls"] += 1
        if self.scope is InferenceCudaGraphScope.BLOCK:
            out_leaves, out_sig = self._block(key, pleaves)
        else:
            out_leaves, out_sig = _args.flatten(self._layered(pargs, pkwargs))
        cut = self._padding.cut(out_leaves, (batch, seq), (padded_batch, padded_seq), type(self.root).__name__)
        return _args.rebuild(out_sig, cut)

    # ------------------------------------------------------------------ block scope
    def _block(self, key: Any, leaves: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Any]:
        g = self._blocks.get(key)
        if g is None:
            model = self.model
            g = self._capture("model", lambda *a, **kw: model(*a, **kw), key, leaves,
                              tuple(self.model.parameters()), static=self._static)
            self._blocks[key] = g
        return list(self._replay(g, leaves)), g.out_sig

    # ------------------------------------------------------------------ layer scope
    def _layered(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        saved = []
        try:
            for layer in self._layers:
                own = layer.module.__dict__.get("forward", _MISSING)
                saved.append((layer.module, own))
                layer.calls = 0
                layer.module.forward = self._route(layer, _args.eager_forward(layer.module))
            return self.model(*args, **kwargs)
        finally:
            for module, own in saved:
                if own is _MISSING:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = own

    def _route(self, layer: _Layer, eager: Callable[..., Any]) -> Callable[..., Any]:
        """The layer's forward during one call: [Note: layer graphs inside the layer's call]."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            layer.calls += 1
            if layer.calls > 1:  # a second call in one forward would overwrite the first call's static outputs
                if not layer.warned:
                    layer.warned = True
                    logger.warning("fsdp_cudagraph: layer %s ran more than once in one forward; its later calls run "
                                   "eagerly", layer.name)
                return eager(*args, **kwargs)
            leaves, sig = _args.flatten((args, kwargs))
            g = layer.graphs.get(sig)
            if g is None:
                g = self._capture(layer.name, eager, sig, leaves, tuple(layer.module.parameters()), static=False)
                layer.graphs[sig] = g
            return _args.rebuild(g.out_sig, self._replay(g, leaves))

        return forward

    # [Note: layer graphs inside the layer's call]
    # A layer's graph is captured, and replayed, from inside the layer's own __call__: the replacement
    # forward above runs after the layer's forward-pre hooks (the engine's unshard and prefetch) and before its
    # forward hooks (the reshard), and what it captures is the layer's eager forward, never __call__. So every
    # hook of the layer fires around warmup, capture and every replay, outside the graph, exactly as in an
    # eager forward, and no hook dict is ever touched (training graphs keep theirs). Hooks of the layer's
    # submodules run inside the capture: at capture only. On the protocol backend the capture guard is on
    # while the layer's forward runs, so a collective that leaked into it (a nested unit) raises.

    # ------------------------------------------------------------------ capture and replay
    def _capture(self, name: str, fn: Callable[..., Any], sig: Any, leaves: List[torch.Tensor],
                 params: Tuple[torch.Tensor, ...], *, static: bool) -> _Graph:
        what = f"the inference graph of {name}"
        static_in = [t.detach().clone() for t in leaves]

        def body() -> Tuple[List[torch.Tensor], Any]:
            a, kw = _args.rebuild(sig, static_in)
            return _args.flatten(fn(*a, **kw))

        g = _Graph(name, body, static_in, static)
        step = self.step
        bound = step.grads_bound() if static else frozenset()
        start = (lambda: step.begin_static_step(replace_grads=False)) if static else (lambda: None)
        meter = _recipe.CaptureMeter(self.device, cuda=self.backend == "torch")
        try:
            num_warmup = self.config.cuda_graph_num_warmup_iters
            for i in range(num_warmup):  # the last warmup under the host-sync check
                start()
                with CaptureSafetyCheck(self.device, what) if i == num_warmup - 1 else contextlib.nullcontext():
                    body()
            start()
            if self.backend == "torch":
                g.graph, (g.static_out, g.out_sig) = _recipe.capture_graph(
                    body, device=self.device, phase=what, pool=self._pool,
                    guard=lambda: self._guard(static, g.collectives))
            else:
                with self._capture_pass(static, g.collectives):
                    g.static_out, g.out_sig = body()
                g.graph = _protocol.ProtocolGraph(
                    what, rank=self.rank, run=lambda log: self._protocol_run(g, log), start=start,
                    collectives=g.collectives, decisions={"output structure": _args._strip(g.out_sig)},
                    outputs=g.static_out)
        except BaseException as exc:
            _recipe.raise_translated(exc, what)
            raise
        finally:
            if static:  # as after a replay; a failed capture ran nothing that counts
                step.end_static_step(bound=bound)
        g.params, g.param_ptrs = params, _recipe.addresses(params)
        shape = ", ".join(str(tuple(t.shape)) for t in leaves)
        self.captures.append(InferenceCapture(name, shape, meter.seconds(), meter.memory(), list(g.collectives)))
        self.counters["captures"] += 1
        logger.debug("fsdp_cudagraph: captured %s for (%s) in %.3f s", what, shape, self.captures[-1].seconds)
        return g

    def _replay(self, g: _Graph, leaves: List[torch.Tensor]) -> List[torch.Tensor]:
        if _recipe.addresses(g.params) != g.param_ptrs:  # the replay address check: one tuple comparison
            _recipe.refuse_moved(g.params, g.param_ptrs, who=f"the inference graph of {g.name}", rank=self.rank,
                                 fix="Do not reassign parameters while inference graphs exist: delete() them and "
                                     "build a new InferenceCudaGraphs")
        step = self.step
        if g.static:
            step.quiesce()  # an eager collective still in flight would race with the graph
            bound = step.grads_bound()
        for s, t in zip(g.static_in, leaves):
            if t is not s:
                s.copy_(t)
        try:
            g.graph.replay()  # protocol backend: checked against the capture (capture/protocol.py)
        finally:
            if g.static:
                step.end_static_step(bound=bound)
        g.replays += 1
        self.counters["replays"] += 1
        return g.static_out

    def _protocol_run(self, g: _Graph, log: List[str]) -> Tuple[List[torch.Tensor], Dict[str, Any]]:
        """A protocol replay's run of the captured function: its outputs and their structure."""
        with self._capture_pass(g.static, log):
            out, out_sig = g.body()
        return out, {"output structure": _args._strip(out_sig)}

    def _guard(self, static: bool, log: List[str]) -> Any:
        """The engine's guard around a capture: collectives captured in a static (block) graph, refused otherwise."""
        return (self.step.static_capture_guard(allow_collectives=static, collective_log=log)
                if self._has_static_step else contextlib.nullcontext())

    def _capture_pass(self, static: bool, log: List[str]) -> Any:
        """The protocol backend's capture pass: our capture flag, the engine's simulated capture and its guard."""
        return _protocol.capture_pass(self.engine.simulated_capture(), self._guard(static, log))

    def _all_graphs(self) -> List[_Graph]:
        return list(self._blocks.values()) + [g for layer in self._layers for g in layer.graphs.values()]
