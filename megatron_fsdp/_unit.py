"""One FSDP unit: the flat buffers of one module's parameters, their all-gathers, and the unit's state machine.

Lifecycle of a unit in one training step (ZeRO-3, ``optim_grads_params``)::

    pre_forward    unshard: all-gather the compute shard into the unshard buffer; prefetch the next unit
    post_forward   reshard: release the unshard buffer (a double-buffer slot keeps its bytes until reused)
    pre_backward   unshard again (often already done by the next unit's prefetch); prefetch the previous unit
    post_backward  add the parameter gradients into the unsharded fp32 gradient buffer, reduce-scatter it
                   asynchronously into the fp32 main-gradient shard, reshard

The other strategies keep the compute parameters unsharded, so their unshard only re-installs parameters
after an optimizer step, and ``no_shard`` all-reduces instead of reduce-scattering. Activation checkpointing
adds a fifth phase, ``pre_recompute``: a forward that runs again inside the unit's backward
([Note: recompute]). The module hooks that call these phases are in ``_unit_hooks.py``; the post-backward
reduction (gradient fold, reduce-scatter, main gradient) in ``_reduce.py``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _collectives as C
from . import _fp8
from ._common import COMPUTING, Engine, ShardingStrategy, TrainingState, is_capturing, phase
from ._flat import FlatLayout, _Buffer, _Works
from ._fused_wgrad import FusedWeightGrads, fusable_weights
from ._reduce import open_grad_buffer, reduce_grads, release_grad_slot

logger = logging.getLogger(__name__)


class FSDPUnit:
    """The sharded state of one FSDP unit (or of the root: everything no unit claims).

    [Note: two regions]
    A unit's flat buffers hold its trainable parameters first (the *trainable region*: what the optimizer
    steps and what the gradient buffer covers), then its frozen parameters (``requires_grad=False`` when
    ``fully_shard`` ran: the *frozen region*). Each region is padded and sharded evenly on its own, so the
    trainable region's reduce-scatter and optimizer shard are exactly those of a unit without frozen
    parameters. Frozen values live in an fp32 store of their own (``frozen_shard``) that no optimizer sees;
    they are gathered with the unit (a second all-gather) and never get a gradient buffer.

    [Note: parameters outside forward]
    Module parameters are views into the unit's unshard buffer. Outside the unit's forward and backward
    they are not authoritative: the fp32 main shards are. With an on-demand (``dynamic``) buffer, ZeRO-3
    without double buffering, the buffer's storage is freed after each use; the parameters then point at a
    NaN placeholder of their own shape (a 0-stride expand of one element), so a read outside forward gives
    NaN and an in-place write raises, where a view on freed storage would crash the process. Slot and
    persistent buffers keep their addresses for CUDA-graph replay, so their parameters stay views: between
    steps they hold the last gathered values (possibly another unit's, in a shared slot). Read values with
    ``model.state_dict()`` or inside ``model.summon_full_params()``; the module-level ``state_dict`` and
    ``load_state_dict`` of the wrapped model refuse outside those (see ``_state_dict.py``).
    """

    def __init__(
        self,
        *,
        engine: Engine,
        name: str,
        module: nn.Module,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        index: int,
        is_root: bool,
        expert: bool = False,
    ) -> None:
        self.engine = engine
        self.name = (name or "<root>") + (" [experts]" if expert else "")
        self.module = module
        self.index = index
        self.is_root = is_root
        #: The expert bucket of a unit ([Note: expert parallelism] in _expert.py): sharded and reduced over the
        #: expert-data-parallel group instead of the engine's group.
        self.is_expert = expert
        #: The other bucket over the same module (dense <-> expert), prefetched with this one; None if none.
        self.partner: Optional["FSDPUnit"] = None
        topo = engine.expert_topology if expert else None
        #: this rank's place and the number of ranks in the group that shards this unit
        self.shard_rank = topo.edp_rank if topo is not None else engine.rank
        self.shard_size = topo.edp_size if topo is not None else engine.world_size
        trainable = [(n, p) for n, p in zip(names, params) if p.requires_grad]
        frozen = [(n, p) for n, p in zip(names, params) if not p.requires_grad]
        #: Trainable compute parameters, in the order of ``layout`` and of ``grad_views``.
        self.params: List[nn.Parameter] = [p for _, p in trainable]
        #: Frozen compute parameters, in the order of ``frozen_layout``.
        self.frozen_params: List[nn.Parameter] = [p for _, p in frozen]
        self.all_params: List[nn.Parameter] = self.params + self.frozen_params
        self.layout = FlatLayout([n for n, _ in trainable], self.params, self.shard_size)
        self.frozen_layout = FlatLayout([n for n, _ in frozen], self.frozen_params, self.shard_size)
        #: Tensor parallelism ([Note: tensor parallelism] in _tensor.py): the trainable region starts with the
        #: parameters whose gradients are summed over TP (``[0, tp_sum_numel)``), then the other parameters
        #: replicated over TP (up to ``tp_replicated_numel``), then the TP shards. (0, whole region) without TP.
        self.tp_sum_numel, self.tp_replicated_numel = 0, self.layout.total_numel
        if getattr(engine, "tp_topology", None) is not None:
            from ._tensor import region_ends

            self.tp_sum_numel, self.tp_replicated_numel = region_ends(self.layout, self.params)
        self.state = TrainingState.IDLE
        self.param_buffer: Optional[_Buffer] = None
        self.grad_buffer: Optional[_Buffer] = None
        self.param_views: List[torch.Tensor] = []
        self.grad_views: List[torch.Tensor] = []
        self.pending_ag: Optional[Any] = None  # a Work, or _Works for two regions
        #: The unshard buffer holds this unit's current parameters (a slot may hold another unit's).
        self.data_valid = False
        self.installed_version = -1
        self.installed_frozen_version = -1
        #: A forward of this unit ran again during backward (activation checkpointing recomputes it).
        self.recomputed = False
        self.hook_handles: List[torch.utils.hooks.RemovableHandle] = []
        self.main_shard: nn.Parameter  # set by init_storage
        #: The main gradient ([Note: main gradients live like .grad]): held weakly (``main_shard.grad`` owns
        #: it) until :meth:`keep_main_grad`, strongly after.
        self._main_grad_ref: Optional[Callable[[], Optional[torch.Tensor]]] = None
        self._main_grad_kept: Optional[torch.Tensor] = None
        self.frozen_shard: torch.Tensor
        #: ZeRO-3 with a compute dtype other than the main one: each unshard casts the fp32 shards straight
        #: into this rank's part of the gather buffer and gathers in place ([Note: cast on gather]).
        self._cast_on_gather = False
        #: with ``keep_compute_shard``: the compute-dtype copies of the main and frozen shards (allocated at their
        #: first eager gather) and whether each holds the cast of its shard as it is now ([Note: cast on gather])
        self._kept: Dict[str, torch.Tensor] = {}
        self._kept_fresh: Dict[str, bool] = {"main": False, "frozen": False}
        #: NaN placeholders of the parameters' shapes (dynamic unshard buffers only), and whether the
        #: parameters currently point at their buffer views (True) or at the placeholders (False).
        self._placeholders: List[torch.Tensor] = []
        self._views_installed = True
        #: absent-gradient pattern -> views of the gradient buffer the fold zeroes ([Note: the gradient fold])
        self._holes: Dict[Tuple[bool, ...], List[torch.Tensor]] = {}
        #: TE weights that may write their gradients into the gradient buffer ([Note: fused weight gradients]);
        #: None when the unit has no module that follows TE's protocol.
        owners = fusable_weights(module, self.params)
        self.fused: Optional[FusedWeightGrads] = FusedWeightGrads(self, owners) if owners else None
        #: TE FP8 weights among the trainable parameters ([Note: FP8 parameter all-gather] in _fp8.py): how the
        #: unshard buffer is carved and gathered; None for a unit without them.
        ops = next((o for o in map(_fp8.ops_for, self.params) if o is not None), None)
        self.fp8: Optional[_fp8.Fp8Plan] = None
        if ops is not None:
            itemsize = torch.empty((), dtype=engine.compute_dtype).element_size()
            self.fp8 = _fp8.Fp8Plan.build(ops, self.layout, self.params, world=self.shard_size, rank=self.shard_rank,
                                          itemsize=itemsize)

    # ------------------------------------------------------------------ set-up
    @property
    def group(self) -> dist.ProcessGroup:
        """The group that shards this unit: the engine's, or the expert-data-parallel group for an expert bucket."""
        eng = self.engine
        return eng.expert_topology.edp_group if self.is_expert else eng.group

    @property
    def grad_scale(self) -> float:
        """What the gradient fold multiplies by before a summing collective: the engine's, or for an expert bucket
        one over the whole data-parallel size ([Note: expert parallelism] in _expert.py, Gradient averaging)."""
        return 1.0 / self.engine.dp_world_size if self.is_expert else self.engine.grad_scale

    @property
    def reduce_average(self) -> bool:
        """Whether the gradient collective averages (never for experts: AVG would divide by the EDP size)."""
        return False if self.is_expert else self.engine.reduce_average

    @property
    def numel(self) -> int:
        """Elements of the unshard buffer: the trainable region, then the frozen region."""
        return self.layout.total_numel + self.frozen_layout.total_numel

    @property
    def param_numel(self) -> int:
        """Compute-dtype elements of the unshard buffer: ``numel``, or the FP8 carving's ([Note: FP8 parameter
        all-gather] in _fp8.py: two byte planes, the other parameters' views and their staging area)."""
        return self.fp8.buffer_numel if self.fp8 is not None else self.numel

    @property
    def grad_numel(self) -> int:
        """Elements of the unsharded gradient buffer: the trainable region only."""
        return self.layout.total_numel

    @property
    def names(self) -> List[str]:
        """Every parameter's name (as in the unwrapped module), in the order of ``all_params``."""
        return self.layout.names + self.frozen_layout.names

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat`` (laid out like the unshard buffer) for every parameter, as ``all_params``."""
        t = self.layout.total_numel
        return self.layout.views(flat[:t]) + self.frozen_layout.views(flat[t : self.numel])

    def _local(self, region: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        eng = self.engine
        if eng.strategy.shards_optimizer:
            s = layout.shard_numel
            region = region[self.shard_rank * s : (self.shard_rank + 1) * s]
        return region.detach().clone().to(eng.main_param_dtype)

    def init_storage(self, full_flat_fp32: torch.Tensor, param_buffer: _Buffer, grad_buffer: _Buffer) -> None:
        """Take the unit's initial values (already identical on all ranks) and build its buffers."""
        from ._clip import make_no_gradients  # a leaf module; imported here to keep _unit's imports short

        eng = self.engine
        t = self.layout.total_numel
        self.main_shard = nn.Parameter(self._local(full_flat_fp32[:t], self.layout), requires_grad=True)
        self.main_shard._megatron_fsdp_unit = self  # type: ignore[attr-defined]  # read by the optimizer guard
        self.frozen_shard = self._local(full_flat_fp32[t : self.numel], self.frozen_layout)
        self._cast_on_gather = eng.strategy.shards_params and eng.compute_dtype != eng.main_param_dtype
        self.param_buffer, self.grad_buffer = param_buffer, grad_buffer
        pb = param_buffer.tensor[: self.numel]
        if not eng.strategy.shards_params:
            pb.copy_(full_flat_fp32)  # unsharded strategies start installed
            self.data_valid = True
            self.installed_version = self.main_shard._version
            self.installed_frozen_version = self.frozen_shard._version
        # FP8 weights are bound to their bytes in the buffer; the views of the others are placed by the plan
        self.param_views = self.fp8.bind(param_buffer.tensor, self.params) if self.fp8 is not None else self.views(pb)
        self.grad_views = self.layout.views(grad_buffer.tensor[: self.grad_numel])
        with torch.no_grad():
            for p, v in self._viewed():
                # [Note: parameter views] Each module parameter becomes a fixed view into the unit's
                # unshard buffer, so replacing the buffer's bytes (all-gather) is all an unshard does, and
                # the parameter keeps the same address as long as the buffer does. `.data` assignment
                # keeps the parameter's own version counter, so in-place all-gathers into the buffer do
                # not invalidate tensors that autograd saved in forward.
                p.data = v
            for p in self.all_params:
                p.grad = None
        #: what ``.grad`` of ``params`` holds after backward ([Note: compute parameters hold no gradient], _clip.py)
        self.no_gradients: List[torch.Tensor] = make_no_gradients(self)
        grad_buffer.free()
        if param_buffer.kind == "dynamic":
            nan = torch.full((), float("nan"), dtype=eng.compute_dtype, device=eng.device)
            self._placeholders = [nan.expand(v.shape) for v in self.param_views]
        if eng.strategy.shards_params:
            param_buffer.free()
            self._install_placeholders()

    # ------------------------------------------------------------------ main gradient
    # [Note: main gradients live like .grad]
    # A unit's fp32 main gradient is created by the first reduction of a step that finds ``main_shard.grad``
    # unbound, and the unit refers to it only weakly: ``main_shard.grad`` owns it, so
    # ``optimizer.zero_grad(set_to_none=True)`` frees it as it frees any ``.grad``, and the forward and the
    # early backward of the next step run without the model's fp32 gradients allocated (4 bytes a parameter
    # shard; FSDP2 frees its sharded gradients the same way). ``zero_grad(set_to_none=False)`` zeroes it in
    # place and keeps it bound: the next reduction adds into it. A captured step (full-iteration graph) writes
    # its main gradients at fixed addresses, so after capture :meth:`keep_main_grad` holds them strongly and
    # every later reduction, eager or replayed, writes into those, until the last such graph is deleted
    # (graph_contract.release_main_grads). Allocated inside the capture, they come from the graph's pool,
    # where the step's activations were freed before the backward wrote them.
    @property
    def main_grad(self) -> Optional[torch.Tensor]:
        """The fp32 main gradient as the optimizer sees it (``main_shard.grad`` when bound), or None.

        For sharded strategies on several ranks an alias whose norms raise ([Note: local norms], _clip.py).
        """
        if self._main_grad_kept is not None:
            return self._main_grad_kept
        return self._main_grad_ref() if self._main_grad_ref is not None else None

    @property
    def _main_grad_data(self) -> Optional[torch.Tensor]:
        """The main gradient's storage as a plain tensor, for the engine's own arithmetic (no dispatch)."""
        g = self.main_grad
        return None if g is None else getattr(g, "_megatron_fsdp_data", g)

    def _new_main_grad(self, data: torch.Tensor) -> torch.Tensor:
        """Make ``data`` the unit's main gradient, held weakly; returns the tensor to bind as ``main_shard.grad``."""
        from ._clip import guard_local_norms  # a leaf module; imported here to keep _unit's imports short

        eng = self.engine
        grad = data
        if eng.strategy.shards_optimizer and self.shard_size > 1:
            grad = guard_local_norms(data, self)
            grad._megatron_fsdp_data = data  # type: ignore[attr-defined]
        self._main_grad_ref = weakref.ref(grad)
        return grad

    def keep_main_grad(self) -> None:
        """Hold the current main gradient strongly: every later reduction writes into it (a graph reads it)."""
        if self._main_grad_kept is None:
            self._main_grad_kept = self.main_grad

    def release_main_grad(self) -> None:
        """Back to weak: the kept main gradient lives on while bound, and the next step after it is unbound
        makes a new one."""
        kept, self._main_grad_kept = self._main_grad_kept, None
        if kept is not None:
            self._main_grad_ref = weakref.ref(kept)

    def _bound_main_grad(self) -> Optional[torch.Tensor]:
        """``main_shard.grad`` if bound (the engine's main gradient), None if unbound; raises for a stranger."""
        g = self.main_shard.grad
        if g is None or g is self.main_grad:
            return g
        raise RuntimeError(
            f"[rank {self.engine.rank}] megatron_fsdp: main_shard.grad of unit {self.name} is a tensor the engine did "
            f"not create (shape {tuple(g.shape)}, dtype {g.dtype}); a reduction adds into the engine's own main "
            "gradient and would drop it. Leave .grad as the engine binds it, or set it to None (zero_grad()) "
            "to start from zero"
        )

    def _install_placeholders(self) -> None:
        """Point the parameters at their NaN placeholders (on-demand buffers, once freed)."""
        if self._placeholders and self._views_installed:
            for p, ph in zip(self.all_params, self._placeholders):
                p.data = ph
            self._views_installed = False

    def _install_views(self) -> None:
        if not self._views_installed:
            for p, v in self._viewed():
                p.data = v
            self._views_installed = True

    def _viewed(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its view of the unshard buffer) for every parameter that is one (not the FP8 weights)."""
        return [(p, v) for p, v in zip(self.all_params, self.param_views) if v is not None]

    def buffer_addresses(self) -> Dict[str, Optional[int]]:
        """Data pointers of the unshard and unsharded-gradient buffers (None while not allocated)."""
        pb, gb = self.param_buffer, self.grad_buffer
        return {
            "param": pb.tensor.data_ptr() if pb is not None and pb.allocated else None,
            "grad": gb.tensor.data_ptr() if gb is not None and gb.allocated else None,
            "param_slot": pb.slot if pb is not None else None,
        }

    def param_addresses(self) -> Tuple[int, ...]:
        """Where each parameter's values sit: a plain parameter's data, an FP8 weight's bytes, transpose and scale (the
        tensors a graph's replay check compares, ``_fp8.replay_tensors``)."""
        if self.fp8 is None:
            return tuple(p.data_ptr() for p in self.all_params)
        return tuple(t.data_ptr() for n, p in zip(self.names, self.all_params) for _, t in _fp8.replay_tensors(n, p))

    # ------------------------------------------------------------------ unshard / reshard
    def mark_stale(self) -> None:
        """The next unshard re-installs every region from the shards (and quantizes FP8 weights again): after the
        shards changed where no version counter shows it (an optimizer step, fused or graphed; a load)."""
        self.installed_version = -1
        self.installed_frozen_version = -1

    def _install_if_stale(self) -> None:
        """Bring compute parameters up to date with the fp32 main (and frozen) shards after a step or load."""
        main_new = self.main_shard._version != self.installed_version
        frozen_new = self.frozen_shard._version != self.installed_frozen_version
        if not (main_new or frozen_new):
            return
        if main_new and self.fp8 is not None:
            self.fp8.fresh = False  # the kept FP8 bytes are of older values: [Note: one quantization a step]
        if main_new:
            self._kept_fresh["main"] = False  # the kept compute-dtype copy too ([Note: cast on gather])
        if frozen_new:
            self._kept_fresh["frozen"] = False
        eng = self.engine
        t, pb = self.grad_numel, self.param_buffer.tensor
        works: List[Optional[dist.Work]] = []
        regions = (
            (main_new, self.main_shard, 0, t, f"unit {self.name}"),
            (frozen_new, self.frozen_shard, t, self.numel, f"frozen parameters of unit {self.name}"),
        )
        with torch.no_grad():
            for new, main, lo, hi, what in regions:
                if not new or lo == hi or eng.strategy.shards_params:
                    continue  # ZeRO-3 reads the main shards at its next gather
                if eng.strategy is ShardingStrategy.NO_SHARD:
                    pb[lo:hi].copy_(main)
                else:
                    works.append(C.all_gather(pb[lo:hi], main.detach().to(eng.compute_dtype), self.group, what))
        if eng.strategy.shards_params:
            self.data_valid = False  # the next unshard all-gathers the new values
        if works:
            self.pending_ag = works[0] if len(works) == 1 else _Works(works)
        self.installed_version = self.main_shard._version
        self.installed_frozen_version = self.frozen_shard._version

    def unshard(self) -> None:
        """Start making this unit's compute parameters available (asynchronous; see wait_unshard)."""
        self._install_if_stale()
        if not self.engine.strategy.shards_params or self.pending_ag is not None:
            return
        buf = self.param_buffer
        if buf.kind == "slot":
            owner = self.engine.slot_owner[buf.slot]
            if owner is self and self.data_valid:
                return
            if owner is not None and owner is not self:
                if owner.state in COMPUTING:
                    raise RuntimeError(
                        f"[rank {self.engine.rank}] megatron_fsdp: unit {self.name} needs double-buffer slot {buf.slot}, "
                        f"but unit {owner.name} still computes in it ({owner.state.name}); units that run inside one "
                        "another (or out of plan order) must not share a slot: make the inner module part of the outer "
                        "unit, or turn fsdp_double_buffer off"
                    )
                owner.wait_unshard()  # an all-gather of the old owner still in flight must land first
                owner.data_valid = False
            self.engine.slot_owner[buf.slot] = self
        elif self.data_valid and buf.allocated:
            return
        buf.allocate(f"the unshard buffer of unit {self.name}")
        self._install_views()
        t = self.grad_numel
        works: List[Optional[dist.Work]] = []
        if self.fp8 is not None:  # [Note: FP8 parameter all-gather] in _fp8.py; finished in wait_unshard
            works += self.fp8.gather(buf.tensor, self.main_shard.detach(), self.params, self.group,
                                     lambda out, shard, what: C.all_gather(out, shard, self.group, what),
                                     f"unit {self.name}")
        elif t:
            works.append(self._gather(buf.tensor[:t], self.main_shard.detach(), f"unit {self.name}", "main"))
        if self.numel > t:
            works.append(self._gather(buf.tensor[t : self.numel], self.frozen_shard,
                                      f"frozen parameters of unit {self.name}", "frozen"))
        # an FP8 unit always leaves a pending gather: its unpacking runs in wait_unshard, also at one rank
        self.pending_ag = works[0] if len(works) == 1 and self.fp8 is None else _Works(works)
        self.data_valid = True

    def _gather(self, out: torch.Tensor, shard: torch.Tensor, what: str, region: str) -> Optional[dist.Work]:
        """All-gather one region (``main`` or ``frozen``) of the unit from this rank's fp32 ``shard`` into ``out``
        (its gather buffer).

        [Note: cast on gather]
        By default ZeRO-3 keeps no compute-dtype copy of its shards (that copy would cost 2 bytes per parameter
        for the whole run: 1.5 GiB of an 822 M-parameter model on one rank). When the dtypes differ, the shard is
        cast straight into this rank's part of ``out`` and the all-gather runs in place (NCCL and Gloo take an
        input that is the output's own rank slice; with one rank it moves nothing). The cast is the same
        rounding the copy made before, so the gathered values are the same bits; it runs at every gather
        (forward and backward, of every micro-batch) on the current stream, ordered after whatever last read the
        slot. Measured on one H200 (Llama-3-8B-shaped, 16 layers, four micro-batches a step): 41.6 ms a step of
        casts, where NVIDIA Megatron-FSDP, which keeps bf16 parameters beside its fp32 mains, casts once a step
        (12.2 ms).
        ``fully_shard(keep_compute_shard=True)`` makes the other trade: each region keeps its cast in a
        compute-dtype tensor of the shard's size, refreshed at the first gather after the main (or frozen) shard
        changed, on the signal that refreshes ZeRO-1/2's compute parameters (the version counter, the optimizer
        step post-hook, a load: ``_install_if_stale``), and the all-gather reads it. The same bits as casting at
        every gather; what is saved is the fp32 read and the cast of every later gather of the step. A unit with
        an unshard buffer of its own (the root; with the option, every unit whose shard group has one rank, whose
        shard is the whole unit: no double-buffer slot then) keeps no copy: its buffer holds the cast from one
        change of the shards to the next, and it gathers once a step anyway. A gather inside a capture (a
        full-iteration graph) casts as without the copy: the refresh is a host decision, and a captured one
        would be replayed whether or not the shard changed.
        """
        if not self._cast_on_gather:
            return C.all_gather(out, shard, self.group, what)
        if self.engine.keep_compute_shard and self.param_buffer.kind != "persistent" and not is_capturing():
            kept = self._kept.get(region)
            if kept is None:
                kept = self._kept[region] = torch.empty(shard.shape, dtype=out.dtype, device=out.device)
            if not self._kept_fresh[region]:
                with torch.no_grad():
                    kept.copy_(shard)
                self._kept_fresh[region] = True
            return C.all_gather(out, kept, self.group, what)
        n = shard.numel()
        local = out[self.shard_rank * n : (self.shard_rank + 1) * n]
        with torch.no_grad():
            local.copy_(shard)
        return C.all_gather(out, local, self.group, what)

    def wait_unshard(self) -> None:
        if self.pending_ag is not None:
            self.pending_ag.wait()
            self.pending_ag = None
            if self.fp8 is not None:
                self.fp8.finish(self.param_buffer.tensor, self.params)

    def reshard(self) -> None:
        if not self.engine.strategy.shards_params or self.is_root and self.state is not TrainingState.IDLE:
            return
        if self.param_buffer.kind == "dynamic":
            self.wait_unshard()
            self.param_buffer.free()
            self.data_valid = False
            self._install_placeholders()  # [Note: parameters outside forward]
        # A slot or persistent buffer keeps its bytes: if nothing overwrites it before this unit's
        # backward, the pre-backward unshard is free (the last unit of forward relies on this).

    # ------------------------------------------------------------------ the four phases
    def pre_forward(self, *_: Any) -> None:
        """Unshard for forward and prefetch the next unit. Takes and ignores the module (TE's hook form)."""
        eng = self.engine
        if self.state is TrainingState.BACKWARD or (eng.in_backward and self.state is TrainingState.FORWARD_DONE):
            self._pre_recompute()
            return
        if self.state in COMPUTING or (self.state is TrainingState.FORWARD_DONE and eng.in_root_forward):
            # [Note: one forward per unit per step] A second forward of a unit in one root forward would take
            # its double-buffer slot back from the unit prefetched into it, and its backward would run the
            # unit's handlers twice against one prefetch plan: refused, like a re-entrant call.
            raise RuntimeError(
                f"[rank {eng.rank}] megatron_fsdp: unit {self.name} entered forward while in state "
                f"{self.state.name}; a unit may run forward once per backward (no re-entrant or repeated "
                "calls of one FSDP unit in a step; split the module into separate units instead). Activation "
                "checkpointing, which re-runs the forward during backward, is supported"
            )
        eng.record("pre_forward", self)
        if self.fused is not None:
            self.fused.replayed.clear()  # a replay of this step notes itself after this hook
        with phase(f"FSDP::pre_forward {self.name}"):
            self.unshard()
            self.wait_unshard()
            self.state = TrainingState.FORWARD
            eng.note_forward(self)
            if eng.prefetch:
                self._prefetch(eng.neighbour(self, +1), backward=False)

    def _pre_recompute(self) -> None:
        """A forward during backward: activation checkpointing recomputes this unit for its backward.

        [Note: recompute] Non-reentrant checkpointing (``use_reentrant=False``) recomputes once the unit's
        backward has begun (state BACKWARD: pre-backward ran on the output gradient); reentrant
        checkpointing ran the first forward without grad, registered no backward hooks, and recomputes
        inside its own backward (state FORWARD_DONE while the engine is in backward). Either way the unit
        is unsharded (again, for a dynamic buffer; its slot is re-claimed under double buffering), enters
        BACKWARD, and stays unsharded after the recomputed forward, because its backward follows at once.
        """
        eng = self.engine
        eng.record("pre_recompute", self)
        with phase(f"FSDP::pre_recompute {self.name}"):
            self.recomputed = True
            first = self.state is not TrainingState.BACKWARD
            self.unshard()
            self.wait_unshard()
            self.state = TrainingState.BACKWARD
            if first:
                self._prefetch_backward()

    def post_forward(self, *_: Any) -> None:
        if self.state is TrainingState.BACKWARD:
            return  # a recomputed forward ([Note: recompute]): the unit's backward follows at once
        self.engine.record("post_forward", self)
        with phase(f"FSDP::post_forward {self.name}"):
            self.state = TrainingState.FORWARD_DONE
            self.reshard()

    def pre_backward(self, *_: Any) -> None:
        """Unshard for backward and prefetch the previous unit (reverse forward order)."""
        if self.state is TrainingState.BACKWARD:
            return
        eng = self.engine
        eng.record("pre_backward", self)
        with phase(f"FSDP::pre_backward {self.name}"):
            self.unshard()
            self.wait_unshard()
            self.state = TrainingState.BACKWARD
            if self.fused is not None and self.fused.any_fused():
                open_grad_buffer(self, hold=True)  # TE's GEMMs write into it during this backward
            self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        eng = self.engine
        if eng.prefetch:
            self._prefetch(eng.neighbour(self, -1), backward=True)

    def _prefetch(self, unit: Optional["FSDPUnit"], *, backward: bool) -> None:
        """Start gathering ``unit`` and its other bucket, if it has one ([Note: expert parallelism] in _expert.py:
        a layer's dense and expert buckets compute together, so the layer's neighbour gathers both)."""
        for u in (unit, unit.partner if unit is not None else None):
            if u is not None and u is not self and u.can_prefetch(backward=backward):
                u.unshard()

    def post_backward(self, *_: Any) -> None:
        """Reduce this unit's parameter gradients (if any) and reshard. Safe to call once per backward."""
        if self.state is TrainingState.IDLE:
            return
        self.engine.record("post_backward", self)
        with phase(f"FSDP::post_backward {self.name}"):
            if self.frozen_params:
                self._check_frozen_grads()
            grads = [p.grad for p in self.params]
            # While a graph maker warms up and captures, its backwards run on sample gradients and leave no
            # `.grad` behind (TE and torch clear or never set it), so nothing reaches the main gradients; the
            # weights TE wrote into the buffer are dropped the same way.
            written = self.fused.written() if self.fused is not None and not self.engine.graph_maker_running else None
            if any(g is not None for g in grads) or (written is not None and any(written)):
                reduce_grads(self, grads, written)
            if self.fused is not None:
                self.fused.end_backward()
                release_grad_slot(self)
            self.state = TrainingState.IDLE
            self.reshard()

    def _check_frozen_grads(self) -> None:
        late = [n for n, p in zip(self.frozen_layout.names, self.frozen_params) if p.grad is not None]
        if late:
            for p in self.frozen_params:
                p.grad = None
            raise RuntimeError(
                f"[rank {self.engine.rank}] megatron_fsdp: parameters {late[:5]} of unit {self.name} were frozen "
                "(requires_grad=False) when fully_shard ran and now have gradients; fully_shard fixes which "
                "parameters train. Set requires_grad before fully_shard (shard the model again to change it)"
            )

    def can_prefetch(self, *, backward: bool) -> bool:
        """Whether a prefetch of this unit may take its slot from the unit holding it.

        Not while that unit still computes in it (the running unit itself, or an enclosing unit when units
        nest), nor, in backward, while that unit's backward is still to come: the prefetch would only make
        it gather again. In plan order with prefetch depth 1 neither happens; nested units need both.
        """
        buf = self.param_buffer
        if buf.kind != "slot":
            return True
        owner = self.engine.slot_owner[buf.slot]
        if owner is None or owner is self:
            return True
        return owner.state not in (COMPUTING + (TrainingState.FORWARD_DONE,) if backward else COMPUTING)
