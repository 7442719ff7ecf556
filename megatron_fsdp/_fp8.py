"""FP8 parameters: a unit whose weights are TransformerEngine FP8 tensors gathers them as FP8 bytes.

[Note: FP8 parameter all-gather]
A model built under TE's ``quantized_model_init`` (primary FP8 weights: each ``Linear`` weight is a
``Float8Tensor`` whose bytes the GEMMs read directly) needs no bf16 copy of those weights at all. The engine
keeps the fp32 main shards as always (the optimizer's, the checkpoints'), and each unshard

1. quantizes this rank's piece of every FP8 weight from its fp32 main shard, with the scale of the *whole*
   weight: the amax of each piece, one ``MAX`` all-reduce of all the unit's amaxes over the sharding group,
   the scale from it (the steps of TE's ``quantize_master_weights``, which Megatron's distributed optimizer calls,
   with a row-wise cast: [Note: a row-wise cast of the shard pieces]), written into the unit's FP8 shard (one byte
   a shard element, kept);
2. all-gathers those bytes: 1 byte a weight element instead of 2;
3. gathers the unit's other parameters (norm weights, biases: a few thousand elements a layer) in the compute
   dtype through a small staging area, and copies them into their views;
4. on Hopper, writes each weight's transpose (the column-wise copy TE's dgrad GEMM reads) into a second byte
   plane of the same buffer.

So the bytes on the wire halve, and for bf16 weights (``params_dtype=torch.bfloat16``) the values are those TE's
own forward computes from the bf16 weight: the fp32 main is rounded to the weight's dtype before the amax is
taken, as current scaling of the bf16 weight does (``torch.equal``, every loss and main parameter, on 1 and 2 H200s:
tests/gpu/scripts/fp8_gather.py, with TE's helper doing the cast at 90e3a98 and a91a27a, and with the row-wise cast
that replaced it at 392c87b). The unit's flat layout,
main shard, gradient buffer and reduce-scatter are the same as without FP8: only the unshard buffer is carved
differently (:class:`Fp8Plan`).

Fixed addresses: a weight's ``_data`` and ``_transpose`` are views of the unit's unshard buffer, a double-buffer
slot, bound at set-up and again after every gather; its ``_scale_inv`` is a tensor TE updates in place. A graph
captured over the unit reads the same bytes every replay, as it reads the bf16 parameter views of other units.

[Note: one quantization a step]
A unit's gathers send the bytes its last quantization made, kept in the unit's FP8 shard, for as long as the main
shard is unchanged: the backward's gathers (ZeRO-3 gathers the weights again) and, with gradient accumulation, the
forwards and backwards of every later micro-batch of the step. Only the first forward after the main shard changed
quantizes. The signal is the one that refreshes ZeRO-1/2 compute parameters (``_unit._install_if_stale``, run before
every unshard): the main shard's version counter, and the optimizer step post-hook that marks the units an
optimizer holds stale after every ``step()``, whatever its kernel (fused Adam moves no version counter). A
checkpoint loaded into the main shards marks them stale too, as does ``reset_step_state``.
Values cannot differ from quantizing at every gather: between two changes of the main shard every quantization
would read the same fp32 values and reduce the same amaxes. What is spared is the cast and, above all, the amax
``MAX`` all-reduce: a blocking collective on the communicator the reduce-scatters use, which made the compute stream
wait behind the previous unit's reduce-scatter at every backward prefetch (on 2 x H200 at the Llama-3-8B shape: 29
ms of reduce-scatter exposed a step against 9 without FP8 weights, and 36 ms of the GPU idle), and once a
micro-batch in forward. The project's graphed optimizer step marks the units stale after every replay
(``mark_params_stale``). Hazard, the one ZeRO-1/2 already has: main shards written behind the engine's back (through
``.data`` outside ``optimizer.step()``, or by an optimizer graph of the user's own) are not seen, unless
``model.reset_step_state()`` is called after the write. Whole-step graphs capture the decision of their capture step
(the first micro-batch quantizes, the others do not), which is the decision of every replayed step. Cost: one byte a
parameter shard element, kept for the run.

What is refused, each with the fix (:func:`problems`): a recipe other than current scaling (delayed scaling's
weight scales live in the autocast's state, block scaling's in per-block tables, neither checked here yet),
FP8 weights that are frozen (or frozen parameters beside them), FP8 weights built in another dtype than the compute
dtype or, in one unit, with different scale rules (:meth:`QuantizedOps.unit_problem`), expert (EP) or
tensor-parallel units with FP8 weights, and strategies other than ``optim_grads_params`` with double buffering (the
path gathers into fixed slots).

The TE calls sit behind :class:`QuantizedOps`, one object per kind of quantized parameter, found by
:func:`ops_for`. TE's is registered on first use; tests register a stand-in built on torch's float8 dtypes
(TE's kernels need CUDA), which follows the same contract.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _collectives as C
from ._flat import ALIGN_NUMEL, FlatLayout, _round_up

__all__ = ["QuantizedOps", "register_ops", "ops_for", "is_quantized", "replay_tensors", "initial_values", "Fp8Plan",
           "problems"]


class QuantizedOps:
    """What the engine needs of one kind of quantized parameter (TE's ``Float8Tensor``, or a test's stand-in)."""

    name = "quantized"

    def matches(self, p: torch.Tensor) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def problem(self, p: torch.Tensor) -> Optional[str]:
        """Why the engine cannot gather this parameter as FP8 bytes (None if it can)."""
        return None

    def unit_problem(self, params: Sequence[torch.Tensor]) -> Optional[str]:
        """Why these weights (one unit's, every one of this kind) cannot be quantized together (None if they can)."""
        return None

    def initial_values(self, p: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """The parameter's high-precision values, to start the fp32 main shard from."""
        raise NotImplementedError

    def needs_transpose(self, p: torch.Tensor) -> bool:
        """Whether the GEMMs read a column-wise (transposed) copy that the unshard must write."""
        return False

    def bind(self, p: torch.Tensor, data: torch.Tensor, transpose: Optional[torch.Tensor]) -> None:  # pragma: no cover
        """Make ``data`` (uint8, the parameter's shape) its FP8 bytes and ``transpose`` (or None) its column-wise
        copy."""
        raise NotImplementedError

    def quantize(self, params: Sequence[torch.Tensor], pieces: Sequence[Optional[torch.Tensor]],
                 offsets: Sequence[Optional[int]], outs: Sequence[Optional[torch.Tensor]],
                 group: dist.ProcessGroup) -> None:  # pragma: no cover - interface
        """Every rank, every parameter in the same order: ``pieces[i]`` (fp32, flat) is this rank's piece of
        ``params[i]`` starting at element ``offsets[i]`` (None: no piece here). Reduce the amaxes over ``group``,
        set each parameter's scale, and write each piece's FP8 bytes into ``outs[i]`` (uint8, the piece's size)."""
        raise NotImplementedError

    def after_gather(self, params: Sequence[torch.Tensor]) -> None:
        """The bytes of every parameter are in place: write what else the GEMMs read (transposes)."""

    def tensors(self, p: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """(what, tensor) of every tensor a GEMM reads from ``p`` by address: a graph's replay check compares them."""
        return [(what, t) for what, t in (("FP8 bytes", getattr(p, "_data", None)),
                                          ("transpose", getattr(p, "_transpose", None)),
                                          ("scale_inv", getattr(p, "_scale_inv", None))) if t is not None]


_registered: List[QuantizedOps] = []


def register_ops(ops: QuantizedOps) -> Callable[[], None]:
    """Add a kind of quantized parameter; returns a function that removes it again."""
    _registered.append(ops)
    return lambda: _registered.remove(ops) if ops in _registered else None


def _te_ops() -> Optional[QuantizedOps]:
    # TE registers only if the program already imported it: a model with TE FP8 weights did.
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    for ops in _registered:
        if isinstance(ops, _TEOps):
            return ops
    ops = _TEOps()
    _registered.append(ops)
    return ops


def ops_for(p: torch.Tensor) -> Optional[QuantizedOps]:
    """The ops of ``p``'s kind of quantized parameter, or None for a plain tensor."""
    if type(p) in (torch.Tensor, nn.Parameter):
        return None
    _te_ops()  # registers TE's ops once the program has imported TE
    return next((ops for ops in _registered if ops.matches(p)), None)


def is_quantized(p: torch.Tensor) -> bool:
    return ops_for(p) is not None


def replay_tensors(name: str, p: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs a graph reads of parameter ``name``: itself, or a quantized weight's bytes, transpose and
    scale (:meth:`QuantizedOps.tensors`), each of which must stay where it was at capture."""
    ops = ops_for(p)
    return [(name, p)] if ops is None else [(f"{name} ({what})", t) for what, t in ops.tensors(p)]


def initial_values(p: torch.Tensor) -> torch.Tensor:
    """What the fp32 main shard starts from: a plain parameter's values, a quantized one's high-precision values."""
    ops = ops_for(p)
    return p.detach() if ops is None else ops.initial_values(p)


class _TEOps(QuantizedOps):
    """TransformerEngine's ``Float8Tensor`` with current scaling (``Float8CurrentScalingQuantizer``)."""

    name = "TransformerEngine Float8Tensor"

    def __init__(self) -> None:
        from transformer_engine.pytorch.tensor import QuantizedTensor
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Tensor

        self._quantized, self._float8, self._current = QuantizedTensor, Float8Tensor, Float8CurrentScalingQuantizer

    def matches(self, p: torch.Tensor) -> bool:
        return isinstance(p, self._quantized)

    def problem(self, p: torch.Tensor) -> Optional[str]:
        q = getattr(p, "_quantizer", None)
        if isinstance(p, self._float8) and isinstance(q, self._current):
            return None
        return (f"a {type(p).__name__} with {type(q).__name__}: the FP8 parameter all-gather supports TE's current "
                "scaling (Float8CurrentScaling) weights only; build the model under te.quantized_model_init(recipe="
                "Float8CurrentScaling()), or without quantized_model_init (bf16 weights, which TE quantizes in "
                "forward under any recipe)")

    def unit_problem(self, params: Sequence[torch.Tensor]) -> Optional[str]:
        settings = {(int(q.dtype), q.force_pow_2_scales, q.amax_epsilon) for q in (p._get_quantizer() for p in params)}
        if len(settings) > 1:
            return ("FP8 weights whose quantizers differ in FP8 dtype, force_pow_2_scales or amax_epsilon (one scale "
                    "rule a unit, TE's quantize_master_weights rule); build them under one recipe")
        return None

    def initial_values(self, p: torch.Tensor) -> torch.Tensor:
        hp = getattr(p, "_high_precision_init_val", None)
        return hp if hp is not None else p.dequantize(dtype=torch.float32)

    def needs_transpose(self, p: torch.Tensor) -> bool:
        from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

        return not is_non_tn_fp8_gemm_supported()

    def bind(self, p: torch.Tensor, data: torch.Tensor, transpose: Optional[torch.Tensor]) -> None:
        p._data = data  # its own bytes are dropped: the main shard holds the values, the first unshard writes these
        p._transpose = transpose
        p._transpose_invalid = True

    def quantize(self, params: Sequence[torch.Tensor], pieces: Sequence[Optional[torch.Tensor]],
                 offsets: Sequence[Optional[int]], outs: Sequence[Optional[torch.Tensor]],
                 group: dist.ProcessGroup) -> None:
        """TE's ``quantize_master_weights`` for current scaling, step for step, except the cast: row-wise only.

        [Note: a row-wise cast of the shard pieces] TE's helper casts each piece with a ``Float8Quantizer`` that
        also wants the column-wise (transposed) copy. A piece is a flat run of elements, so the cast-transpose kernel
        sees a [1, N] matrix: its general kernel, about 70 times slower than a plain cast (250 ms of a 864 ms step at
        the Llama-3-8B shape on 4 x H200, more than the FP8 GEMMs saved), for a transpose that is dropped (the
        transposes are made whole after the gather, :meth:`after_gather`). The bytes are the same: a cast is
        elementwise, ``fp8(x * scale)``, whichever kernel runs it.
        """
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        first = params[0]._get_quantizer()  # one for all: unit_problem checked they agree
        device = params[0].device
        amaxes = torch.zeros(len(params), dtype=torch.float32, device=device)
        high: List[Optional[torch.Tensor]] = []
        for i, (p, piece) in enumerate(zip(params, pieces)):
            if hasattr(p, "clear_high_precision_init_val"):
                p.clear_high_precision_init_val()  # the main shards hold the values now
            # rounded to the weight's dtype first, as TE rounds a bf16 weight's fp32 main before quantizing it
            hp = None if piece is None or not piece.numel() else piece.to(p.dtype)
            high.append(hp)
            if hp is not None:
                tex.compute_amax(hp, amaxes[i : i + 1])
        work = C.all_reduce(amaxes, group, "the amaxes of FP8 weights", maximum=True)  # the whole weight's amax
        if work is not None:
            work.wait()
        scales = [torch.empty(1, dtype=torch.float32, device=device) for _ in params]
        # compared as integers: the quantizer's dtype may be TE's Python enum or the extension's, which are not equal
        # to each other as objects
        max_fp8 = {int(tex.DType.kFloat8E4M3): 448.0, int(tex.DType.kFloat8E5M2): 57344.0}.get(int(first.dtype))
        if max_fp8 is None:
            raise ValueError(f"FP8 weights of dtype {first.dtype}: the FP8 all-gather casts to E4M3 or E5M2 only")
        multi_tensor_applier(tex.multi_tensor_compute_scale_and_scale_inv,
                             torch.zeros(1, dtype=torch.int, device=device),
                             [[amaxes[i : i + 1] for i in range(len(params))], scales,
                              [p._scale_inv.view(1) for p in params]],
                             max_fp8, first.force_pow_2_scales, first.amax_epsilon)
        for p, hp, out, scale in zip(params, high, outs, scales):
            if hp is None or out is None:
                continue
            cast = Float8Quantizer(scale=scale, amax=torch.Tensor(), fp8_dtype=p._fp8_dtype, rowwise=True,
                                   columnwise=False)
            cast.update_quantized(hp, cast.create_tensor_from_data(out.view(-1), p.dtype))

    def after_gather(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            p._transpose_invalid = True
            if p._transpose is not None:
                p._create_transpose()  # into the bound view: TE's fp8_transpose(out=...)


# ---------------------------------------------------------------------------------------------------- the plan


@dataclass
class _Piece:
    """Elements ``[lo, hi)`` of parameter ``index`` (of the unit's trainable parameters) on one rank."""

    index: int
    lo: int
    hi: int


@dataclass
class Fp8Plan:
    """How one unit's unshard buffer is carved when some of its trainable parameters are FP8 weights.

    Buffer, in bytes from its start: the FP8 plane (one byte per element of the unit's flat layout, so each
    weight's bytes sit at its layout offset and the in-place all-gather of the plane is the layout's), the
    transpose plane (the same size; only when the GEMMs need transposes), then in compute-dtype elements the
    other parameters' views (``tail``, each at an aligned offset) and the staging area of their all-gather
    (``world`` chunks of ``stage_numel``: rank ``r``'s chunk holds its pieces of them, in layout order).
    """

    ops: QuantizedOps
    layout: FlatLayout
    world: int
    rank: int
    itemsize: int
    fp8: List[int]  # indices (in the unit's trainable parameters) of the FP8 weights
    other: List[int]  # indices of the rest
    transpose: bool
    #: per rank, its pieces of the FP8 weights and of the other parameters (layout order)
    fp8_pieces: List[List[_Piece]] = field(default_factory=list)
    other_pieces: List[List[_Piece]] = field(default_factory=list)
    tail_offsets: List[int] = field(default_factory=list)
    tail_numel: int = 0
    stage_numel: int = 0
    #: index -> (bytes, transpose) views of the buffer each FP8 weight is bound to (set by :meth:`bind`)
    bound: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=dict)
    #: this rank's FP8 bytes (one a shard element), kept between gathers: [Note: one quantization a step]
    shard: Optional[torch.Tensor] = None
    #: ``shard`` holds the quantization of the main shard as it is now (cleared when the main shard changes)
    fresh: bool = False

    @staticmethod
    def build(ops: QuantizedOps, layout: FlatLayout, params: Sequence[torch.Tensor], *, world: int, rank: int,
              itemsize: int) -> "Fp8Plan":
        fp8 = [i for i, p in enumerate(params) if ops_for(p) is ops]
        is_fp8 = set(fp8)
        other = [i for i in range(len(params)) if i not in is_fp8]
        plan = Fp8Plan(ops, layout, world, rank, itemsize, fp8, other,
                       transpose=any(ops.needs_transpose(params[i]) for i in fp8))
        s = layout.shard_numel
        for r in range(world):
            lo_r, hi_r = r * s, (r + 1) * s
            pieces: Tuple[List[_Piece], List[_Piece]] = ([], [])
            for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
                lo, hi = max(off, lo_r), min(off + n, hi_r)
                if lo < hi:
                    pieces[0 if i in is_fp8 else 1].append(_Piece(i, lo - off, hi - off))
            plan.fp8_pieces.append(pieces[0])
            plan.other_pieces.append(pieces[1])
        cursor = 0
        for i in other:
            plan.tail_offsets.append(cursor)
            cursor = _round_up(cursor + layout.numels[i], ALIGN_NUMEL)
        plan.tail_numel = cursor
        plan.stage_numel = _round_up(max((sum(p.hi - p.lo for p in ps) for ps in plan.other_pieces), default=0), 8)
        return plan

    @property
    def plane_bytes(self) -> int:
        return self.layout.total_numel

    @property
    def planes_numel(self) -> int:
        """Compute-dtype elements the byte planes take (aligned)."""
        nbytes = self.plane_bytes * (2 if self.transpose else 1)
        return _round_up(-(-nbytes // self.itemsize), ALIGN_NUMEL)

    @property
    def buffer_numel(self) -> int:
        """Compute-dtype elements of the unit's unshard buffer."""
        return self.planes_numel + self.tail_numel + self.world * self.stage_numel

    # ------------------------------------------------------------------ views of a buffer
    def planes(self, buf: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raw = buf[: self.planes_numel].view(torch.uint8)
        n = self.plane_bytes
        return raw[:n], (raw[n : 2 * n] if self.transpose else None)

    def tail(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.planes_numel : self.planes_numel + self.tail_numel]

    def stage(self, buf: torch.Tensor) -> torch.Tensor:
        start = self.planes_numel + self.tail_numel
        return buf[start : start + self.world * self.stage_numel]

    def bind(self, buf: torch.Tensor, params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Bind every FP8 weight to its bytes in ``buf``; return the views the other parameters take (None for
        an FP8 weight), in parameter order."""
        plane, tplane = self.planes(buf)
        lay = self.layout
        with torch.no_grad():
            for i in self.fp8:
                off, n, shape = lay.offsets[i], lay.numels[i], lay.shapes[i]
                data = plane[off : off + n].view(shape)
                t = None
                if tplane is not None and self.ops.needs_transpose(params[i]):
                    tshape = (shape[-1],) + tuple(shape[:-1]) if len(shape) else shape
                    t = tplane[off : off + n].view(tshape)
                self.bound[i] = (data, t)
                self.ops.bind(params[i], data, t)
        views: List[Optional[torch.Tensor]] = [None] * len(params)
        tail = self.tail(buf)
        for i, o in zip(self.other, self.tail_offsets):
            views[i] = tail[o : o + lay.numels[i]].view(lay.shapes[i])
        return views

    # ------------------------------------------------------------------ the gather
    def gather(self, buf: torch.Tensor, main: torch.Tensor, params: Sequence[torch.Tensor], group: dist.ProcessGroup,
               all_gather: Callable[[torch.Tensor, torch.Tensor, str], Any], what: str) -> List[Any]:
        """Steps 1-3 of [Note: FP8 parameter all-gather]: quantize this rank's pieces (unless the kept bytes are
        those of the main shard as it is: [Note: one quantization a step]), start the two all-gathers (returns their
        works); :meth:`finish` unpacks once they are waited on."""
        plane, _ = self.planes(buf)
        s, r = self.layout.shard_numel, self.rank
        start = r * s
        if self.shard is None:
            self.shard = torch.zeros(s, dtype=plane.dtype, device=plane.device)
        if not self.fresh:
            self._quantize(main, params, group)
        works = [all_gather(plane, self.shard, f"FP8 weights of {what}")]
        if self.stage_numel:
            stage = self.stage(buf)
            local = stage[r * self.stage_numel : (r + 1) * self.stage_numel]
            pos = 0
            with torch.no_grad():
                for p in self.other_pieces[r]:
                    g = self.layout.offsets[p.index] + p.lo
                    n = p.hi - p.lo
                    local[pos : pos + n].copy_(main[g - start : g - start + n])
                    pos += n
            works.append(all_gather(stage, local, f"non-FP8 parameters of {what}"))
        return works

    def _quantize(self, main: torch.Tensor, params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        """Step 1: this rank's piece of every FP8 weight, from its main shard, into :attr:`shard`."""
        assert self.shard is not None
        start = self.rank * self.layout.shard_numel
        mine = {p.index: p for p in self.fp8_pieces[self.rank]}
        fp8_params, pieces, offsets, outs = [], [], [], []
        for i in self.fp8:
            fp8_params.append(params[i])
            p = mine.get(i)
            if p is None:  # no piece of this weight here: it still takes part in the amax reduction
                pieces.append(None)
                offsets.append(None)
                outs.append(None)
                continue
            g = self.layout.offsets[i] + p.lo - start  # the piece's place in this rank's shard
            pieces.append(main[g : g + (p.hi - p.lo)])
            offsets.append(p.lo)
            outs.append(self.shard[g : g + (p.hi - p.lo)])
        with torch.no_grad():
            self.ops.quantize(fp8_params, pieces, offsets, outs, group)
        self.fresh = True

    def finish(self, buf: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """Step 3's unpacking and step 4, once the gathers landed (on the stream that waited for them)."""
        with torch.no_grad():
            if self.stage_numel:
                stage, tail = self.stage(buf), self.tail(buf)
                where = dict(zip(self.other, self.tail_offsets))
                for r, ps in enumerate(self.other_pieces):
                    pos = r * self.stage_numel
                    for p in ps:
                        n = p.hi - p.lo
                        o = where[p.index] + p.lo
                        tail[o : o + n].copy_(stage[pos : pos + n])
                        pos += n
            for i, (data, t) in self.bound.items():
                # bound again each time: a weight whose bytes something replaced (TE drops row-wise data it thinks
                # unused) reads the buffer again, never stale bytes of its own
                self.ops.bind(params[i], data, t)
            self.ops.after_gather([params[i] for i in self.fp8])

    def wire_bytes(self) -> int:
        """Bytes one unshard all-gathers: the FP8 plane and the staging area."""
        return self.plane_bytes + self.world * self.stage_numel * self.itemsize


def problems(*, unit: str, names: Sequence[str], params: Sequence[torch.Tensor],
             frozen: Sequence[Tuple[str, torch.Tensor]], expert: bool, tensor_parallel: bool, strategy: str,
             shards_params: bool, double_buffer: bool, hybrid: bool, compute_dtype: torch.dtype) -> List[str]:
    """Why this unit's FP8 weights cannot be gathered as FP8 bytes, each with the fix (empty: they can)."""
    out: List[str] = []
    fit: Dict[int, Tuple[QuantizedOps, List[torch.Tensor]]] = {}  # by kind, the weights each kind can gather
    for n, p in zip(names, params):
        ops = ops_for(p)
        if ops is None:
            continue
        why = ops.problem(p)
        if why:
            out.append(f"parameter {n} of unit {unit} is {why}")
            continue
        fit.setdefault(id(ops), (ops, []))[1].append(p)
        if p.dtype != compute_dtype:
            # the engine presents every parameter in the compute dtype; an FP8 weight keeps the dtype it was built
            # with (TE refuses a forward whose input dtype differs: "Data types for parameters must match")
            out.append(f"FP8 weight {n} of unit {unit} was built in {p.dtype} and the engine computes in "
                       f"{compute_dtype}; build the FP8 layers in the compute dtype (TE: params_dtype={compute_dtype} "
                       "under quantized_model_init), or pass compute_dtype to match")
    for ops, weights in fit.values():
        why = ops.unit_problem(weights)
        if why:
            out.append(f"unit {unit} has {why}")
    late = [n for n, p in frozen if is_quantized(p)]
    if late:
        out.append(f"parameters {late[:3]} of unit {unit} are frozen FP8 weights; the FP8 all-gather covers trainable "
                   "weights only: build frozen layers without quantized_model_init, or train them")
    plain = [n for n, p in frozen if not is_quantized(p)]
    if plain:
        out.append(f"unit {unit} has FP8 weights and frozen parameters {plain[:3]}, which the FP8 all-gather does not "
                   "carve yet; freeze them in another unit, or train them")
    where = "an expert (EP) unit" if expert else "a tensor-parallel unit" if tensor_parallel else None
    if where:
        out.append(f"unit {unit} is {where} with FP8 weights, which the FP8 all-gather does not support yet; build "
                   "those layers without quantized_model_init (TE then quantizes their bf16 weights in forward)")
    if hybrid:
        out.append("FP8 weights with hybrid sharding (HSDP) are not supported yet; shard over one group, or build the "
                   "model without quantized_model_init")
    if not (shards_params and double_buffer):
        out.append(f"sharding_strategy={strategy!r} with fsdp_double_buffer={double_buffer}: FP8 weights are gathered "
                   "into fixed double-buffer slots; use sharding_strategy='optim_grads_params' with "
                   "fsdp_double_buffer=True, or build the model without quantized_model_init")
    return out
