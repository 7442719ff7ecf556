"""One FSDP unit: the flat buffers of one module's parameters, their collectives, and the unit's hooks.

Lifecycle of a unit in one training step (ZeRO-3, ``optim_grads_params``)::

    pre_forward    unshard: all-gather the compute shard into the unshard buffer; prefetch the next unit
    post_forward   reshard: release the unshard buffer (a double-buffer slot keeps its bytes until reused)
    pre_backward   unshard again (often already done by the next unit's prefetch); prefetch the previous unit
    post_backward  add the parameter gradients into the unsharded fp32 gradient buffer, reduce-scatter it
                   asynchronously into the fp32 main-gradient shard, reshard

The other strategies keep the compute parameters unsharded, so their unshard only re-installs parameters
after an optimizer step, and ``no_shard`` all-reduces instead of reduce-scattering.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _collectives as C
from ._common import COMPUTING, ShardingStrategy, TrainingState, check_not_capturing, phase

if TYPE_CHECKING:
    from ._fully_shard import MegatronFSDP

logger = logging.getLogger(__name__)

#: Each parameter starts at a multiple of this many elements in the flat buffers, so that every
#: parameter view is 128-byte aligned in bf16 (vectorised kernels and cuBLAS want aligned pointers).
ALIGN_NUMEL = 64


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class FlatLayout:
    """Where each parameter of a unit sits in the unit's flat buffers, and how the flat is sharded."""

    def __init__(self, names: Sequence[str], params: Sequence[nn.Parameter], world_size: int) -> None:
        self.names = list(names)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets: List[int] = []
        cursor = 0
        for n in self.numels:
            self.offsets.append(cursor)
            cursor = _round_up(cursor + n, ALIGN_NUMEL)
        self.total_numel = _round_up(max(cursor, 1), ALIGN_NUMEL * world_size)
        self.shard_numel = self.total_numel // world_size

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def fingerprint(self) -> Tuple[Any, ...]:
        return (tuple(self.names), tuple(tuple(s) for s in self.shapes), self.total_numel)


class _Buffer:
    """A flat tensor that is either persistent, a double-buffer slot, or allocated on demand.

    An on-demand buffer keeps one tensor object (so parameter views built on it stay valid) and grows and
    shrinks its storage; a slot or persistent buffer never moves.
    """

    def __init__(self, kind: str, tensor: torch.Tensor, slot: Optional[int] = None) -> None:
        assert kind in ("persistent", "slot", "dynamic")
        self.kind, self.tensor, self.slot = kind, tensor, slot
        self._nbytes = tensor.numel() * tensor.element_size()
        # A dynamic buffer starts allocated so that views can be built on it; the unit frees it after.

    @property
    def allocated(self) -> bool:
        return self.kind != "dynamic" or self.tensor.untyped_storage().size() > 0

    def allocate(self, what: str) -> None:
        if self.kind == "dynamic" and not self.allocated:
            check_not_capturing(f"allocation of {what}")
            self.tensor.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        if self.kind == "dynamic" and self.allocated:
            self.tensor.untyped_storage().resize_(0)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs the unit's post-backward handler.

    Its backward runs once the gradients of the unit's inputs exist; autograd runs AccumulateGrad nodes
    first (highest priority), so the unit's parameter gradients are in ``param.grad`` by then.
    """

    @staticmethod
    def forward(ctx: Any, unit: "FSDPUnit", *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        ctx.unit.post_backward()
        return (None,) + grads


def _grad_tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(obj, dict):
        return [t for t in obj.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    return []


class FSDPUnit:
    """The sharded state of one FSDP unit (or of the root: everything no unit claims)."""

    def __init__(
        self,
        *,
        engine: "MegatronFSDP",
        name: str,
        module: nn.Module,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        index: int,
        is_root: bool,
    ) -> None:
        self.engine = engine
        self.name = name or "<root>"
        self.module = module
        self.params = list(params)
        self.index = index
        self.is_root = is_root
        self.layout = FlatLayout(names, params, engine.world_size)
        self.state = TrainingState.IDLE
        self.param_buffer: Optional[_Buffer] = None
        self.grad_buffer: Optional[_Buffer] = None
        self.param_views: List[torch.Tensor] = []
        self.grad_views: List[torch.Tensor] = []
        self.pending_ag: Optional[dist.Work] = None
        #: The unshard buffer holds this unit's current parameters (a slot may hold another unit's).
        self.data_valid = False
        self.installed_version = -1
        self.hook_handles: List[torch.utils.hooks.RemovableHandle] = []
        self.main_shard: nn.Parameter  # set by init_storage, with the two below
        self.main_grad: torch.Tensor
        self.compute_shard: torch.Tensor
        self._separate_compute_shard = False

    # ------------------------------------------------------------------ set-up
    @property
    def numel(self) -> int:
        return self.layout.total_numel

    def init_storage(self, full_flat_fp32: torch.Tensor, param_buffer: _Buffer, grad_buffer: _Buffer) -> None:
        """Take the unit's initial values (already identical on all ranks) and build its buffers."""
        eng = self.engine
        shard = self.layout.shard_numel
        start = eng.rank * shard if eng.strategy.shards_optimizer else 0
        length = shard if eng.strategy.shards_optimizer else self.layout.total_numel
        main = full_flat_fp32[start : start + length].detach().clone().to(eng.main_param_dtype)
        self.main_shard = nn.Parameter(main, requires_grad=True)
        self.main_grad = torch.zeros_like(main, dtype=eng.main_grad_dtype)
        # ZeRO-3 all-gathers from a compute-dtype copy of the shard, or from the main shard itself when the
        # dtypes agree.
        self._separate_compute_shard = eng.strategy.shards_params and eng.compute_dtype != eng.main_param_dtype
        if self._separate_compute_shard:
            self.compute_shard = torch.empty(shard, dtype=eng.compute_dtype, device=eng.device)
        else:
            self.compute_shard = self.main_shard.detach()
        self.param_buffer, self.grad_buffer = param_buffer, grad_buffer
        pb = param_buffer.tensor[: self.numel]
        if not eng.strategy.shards_params:
            pb.copy_(full_flat_fp32)  # unsharded strategies start installed
            self.data_valid = True
            self.installed_version = self.main_shard._version
        self.param_views = self.layout.views(pb)
        self.grad_views = self.layout.views(grad_buffer.tensor[: self.numel])
        grad_buffer.free()
        if eng.strategy.shards_params:
            param_buffer.free()
        with torch.no_grad():
            for p, v in zip(self.params, self.param_views):
                # [Note: parameter views] Each module parameter becomes a fixed view into the unit's
                # unshard buffer, so replacing the buffer's bytes (all-gather) is all an unshard does, and
                # the parameter keeps the same address as long as the buffer does. `.data` assignment
                # keeps the parameter's own version counter, so in-place all-gathers into the buffer do
                # not invalidate tensors that autograd saved in forward.
                p.data = v
                p.grad = None

    def buffer_addresses(self) -> Dict[str, Optional[int]]:
        """Data pointers of the unshard and unsharded-gradient buffers (None while not allocated)."""
        pb, gb = self.param_buffer, self.grad_buffer
        return {
            "param": pb.tensor.data_ptr() if pb is not None and pb.allocated else None,
            "grad": gb.tensor.data_ptr() if gb is not None and gb.allocated else None,
            "param_slot": pb.slot if pb is not None else None,
        }

    def param_addresses(self) -> Tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.params)

    # ------------------------------------------------------------------ unshard / reshard
    def _install_if_stale(self) -> None:
        """Bring compute parameters up to date with the fp32 main shard after an optimizer step or load."""
        if self.main_shard._version == self.installed_version:
            return
        eng = self.engine
        with torch.no_grad():
            if self._separate_compute_shard:
                self.compute_shard.copy_(self.main_shard)
            if eng.strategy.shards_params:
                self.data_valid = False  # the next unshard all-gathers the new values
            elif eng.strategy is ShardingStrategy.NO_SHARD:
                self.param_buffer.tensor[: self.numel].copy_(self.main_shard)
            else:
                cast = self.main_shard.detach().to(eng.compute_dtype)
                self.pending_ag = C.all_gather(
                    self.param_buffer.tensor[: self.numel], cast, eng.group, f"unit {self.name}"
                )
        self.installed_version = self.main_shard._version

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
        self.pending_ag = C.all_gather(buf.tensor[: self.numel], self.compute_shard, self.engine.group, f"unit {self.name}")
        self.data_valid = True

    def wait_unshard(self) -> None:
        if self.pending_ag is not None:
            self.pending_ag.wait()
            self.pending_ag = None

    def reshard(self) -> None:
        if not self.engine.strategy.shards_params or self.is_root and self.state is not TrainingState.IDLE:
            return
        if self.param_buffer.kind == "dynamic":
            self.wait_unshard()
            self.param_buffer.free()
            self.data_valid = False
        # A slot or persistent buffer keeps its bytes: if nothing overwrites it before this unit's
        # backward, the pre-backward unshard is free (the last unit of forward relies on this).

    # ------------------------------------------------------------------ the four phases
    def pre_forward(self, *_: Any) -> None:
        """Unshard for forward and prefetch the next unit. Takes and ignores the module (TE's hook form)."""
        eng = self.engine
        if self.state in COMPUTING:
            raise RuntimeError(
                f"[rank {eng.rank}] megatron_fsdp: unit {self.name} entered forward while in state "
                f"{self.state.name}; a unit may run forward once per backward (no re-entrant or repeated "
                "calls of one FSDP unit in a step; split the module into separate units instead)"
            )
        eng.record("pre_forward", self)
        with phase(f"FSDP::pre_forward {self.name}"):
            self.unshard()
            self.wait_unshard()
            self.state = TrainingState.FORWARD
            eng.note_forward(self)
            if eng.prefetch:
                nxt = eng.neighbour(self, +1)
                if nxt is not None and nxt.can_prefetch(backward=False):
                    nxt.unshard()

    def post_forward(self, *_: Any) -> None:
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
            if eng.prefetch:
                prv = eng.neighbour(self, -1)
                if prv is not None and prv.can_prefetch(backward=True):
                    prv.unshard()

    def post_backward(self, *_: Any) -> None:
        """Reduce this unit's parameter gradients (if any) and reshard. Safe to call once per backward."""
        if self.state is TrainingState.IDLE:
            return
        self.engine.record("post_backward", self)
        with phase(f"FSDP::post_backward {self.name}"):
            grads = [p.grad for p in self.params]
            if any(g is not None for g in grads):
                self._reduce_grads(grads)
            self.state = TrainingState.IDLE
            self.reshard()

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

    # ------------------------------------------------------------------ gradients
    def _reduce_grads(self, grads: List[Optional[torch.Tensor]]) -> None:
        eng = self.engine
        gbuf = self.grad_buffer
        if gbuf.kind == "slot":
            eng.retire_reduces(slot=gbuf.slot)  # the previous user of this slot must have finished reducing
        gbuf.allocate(f"the gradient buffer of unit {self.name}")
        flat = gbuf.tensor[: self.numel]
        present_views = [v for v, g in zip(self.grad_views, grads) if g is not None]
        present = [g for g in grads if g is not None]
        with torch.no_grad():
            flat.zero_()
            # Pre-scale by 1/world_size so that the SUM collective yields the mean over ranks.
            torch._foreach_add_(present_views, present, alpha=eng.grad_scale)
        for p in self.params:
            p.grad = None
        accumulate = self.main_shard.grad is not None
        if eng.strategy is ShardingStrategy.NO_SHARD:
            work = C.all_reduce(flat, eng.group, f"gradients of unit {self.name}")
            out = flat
        else:
            out = torch.empty_like(self.main_grad) if accumulate else self.main_grad
            work = C.reduce_scatter(out, flat, eng.group, f"gradients of unit {self.name}")
        eng.add_pending_reduce(_PendingReduce(self, work, out, accumulate))


class _PendingReduce:
    __slots__ = ("unit", "work", "out", "accumulate")

    def __init__(self, unit: FSDPUnit, work: Optional[dist.Work], out: torch.Tensor, accumulate: bool) -> None:
        self.unit, self.work, self.out, self.accumulate = unit, work, out, accumulate

    def retire(self) -> None:
        """Wait for the collective and fold its result into the unit's fp32 main gradient."""
        if self.work is not None:
            self.work.wait()
        unit = self.unit
        with torch.no_grad():
            if self.accumulate:
                unit.main_grad.add_(self.out)
            elif self.out is not unit.main_grad:
                unit.main_grad.copy_(self.out)
        unit.main_shard.grad = unit.main_grad
        unit.grad_buffer.free()


def make_unit_hooks(unit: FSDPUnit) -> Tuple[Callable, Callable, Callable, Callable]:
    """The unit's four module hooks, in registration order: two forward-pre hooks, two forward hooks.

    [Note: hook sentinels]
    The hooks that register backward handlers carry the inner handler as an attribute, so a graph layer
    can run the handler itself around a captured backward while leaving the registration out:
    ``_cuda_graph_backward_handler`` on the forward-pre hook that wraps inputs (post-backward: reduce
    and reshard), ``_cuda_graph_backward_pre_handler`` on the forward hook that hooks outputs
    (pre-backward: unshard). ``_megatron_fsdp_role`` names every hook for readers and tests.
    """

    def fsdp_pre_forward(module: nn.Module, args: Tuple[Any, ...]) -> None:
        unit.pre_forward()

    def fsdp_register_post_backward(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        if not torch.is_grad_enabled():
            return None
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not idx and not keys:
            return None  # the final callback reduces this unit instead
        wrapped = _PostBackward.apply(unit, *[args[i] for i in idx], *[kwargs[k] for k in keys])
        new_args = list(args)
        for j, i in enumerate(idx):
            new_args[i] = wrapped[j]
        new_kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            new_kwargs[k] = wrapped[len(idx) + j]
        return tuple(new_args), new_kwargs

    def fsdp_post_forward(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        unit.post_forward()

    def fsdp_register_pre_backward(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled():
            return None
        tensors = _grad_tensors(output)
        if len(tensors) == 1:
            tensors[0].register_hook(_pre_backward_tensor_hook(unit))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, _pre_backward_tensor_hook(unit), mode="any")
        return None

    fsdp_pre_forward._megatron_fsdp_role = "pre_forward"  # type: ignore[attr-defined]
    fsdp_register_post_backward._megatron_fsdp_role = "register_post_backward"  # type: ignore[attr-defined]
    fsdp_register_post_backward._cuda_graph_backward_handler = unit.post_backward  # type: ignore[attr-defined]
    fsdp_post_forward._megatron_fsdp_role = "post_forward"  # type: ignore[attr-defined]
    fsdp_register_pre_backward._megatron_fsdp_role = "register_pre_backward"  # type: ignore[attr-defined]
    fsdp_register_pre_backward._cuda_graph_backward_pre_handler = unit.pre_backward  # type: ignore[attr-defined]
    for h in (fsdp_pre_forward, fsdp_register_post_backward, fsdp_post_forward, fsdp_register_pre_backward):
        h._megatron_fsdp_unit = unit  # type: ignore[attr-defined]
    return fsdp_pre_forward, fsdp_register_post_backward, fsdp_post_forward, fsdp_register_pre_backward


def _pre_backward_tensor_hook(unit: FSDPUnit) -> Callable[[Any], None]:
    def hook(_grad: Any) -> None:
        unit.pre_backward()

    return hook
