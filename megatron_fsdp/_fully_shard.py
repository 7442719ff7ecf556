"""``fully_shard``: the public API and the root wrapper, ``MegatronFSDP``. Planning (units, buffers, hooks) is in
``_plan.py``; one unit's state machine in ``_unit.py``, its hooks in ``_unit_hooks.py`` and its gradient
reduction in ``_reduce.py``; state dicts, DCP and clipping delegate to ``_state_dict.py``, ``_dcp.py`` and
``_clip.py``."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before any group exists: [Note: the engine does not keep its group alive]
from torch import nn
from torch.autograd import Variable

from torch.distributed.device_mesh import DeviceMesh

from . import _clip, _dcp, _guards, _hsdp, _state_dict
from ._collectives import backend_for
from ._common import COMPUTING, ShardingStrategy, TrainingState, _cast_floating, is_capturing, log_rank0, phase
from ._plan import UnitPlanning, UnitSpec
from ._reduce import _PendingReduce, reduce_by_average
from ._unit import FSDPUnit
from ._unit_hooks import _grad_tensors

__all__ = ["fully_shard", "MegatronFSDP"]

logger = logging.getLogger(__name__)


def fully_shard(
    module: nn.Module,
    *,
    fsdp_unit_modules: Sequence[UnitSpec],
    sharding_strategy: Union[str, ShardingStrategy] = ShardingStrategy.OPTIM_GRADS_PARAMS,
    process_group: Optional[dist.ProcessGroup] = None,
    mesh: Optional[DeviceMesh] = None,
    replicate_group: Optional[dist.ProcessGroup] = None,
    shard_group: Optional[dist.ProcessGroup] = None,
    compute_dtype: Optional[torch.dtype] = None,
    main_grad_dtype: torch.dtype = torch.float32,
    reduce_dtype: Optional[torch.dtype] = None,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    fsdp_double_buffer_numel: Optional[int] = None,
    prefetch: bool = True,
) -> "MegatronFSDP":
    """Shard ``module`` over ``process_group`` and return the wrapper to train with.

    Args:
        module: the model, already on its device (a CUDA device with NCCL, CPU with Gloo). Every rank
            must build it the same way; rank 0's initial values are broadcast.
        fsdp_unit_modules: module classes (or class names) whose instances become FSDP units, e.g. the
            transformer layer. Parameters that no unit owns form the root unit.
        sharding_strategy: ``no_shard``, ``optim``, ``optim_grads`` or ``optim_grads_params`` (ZeRO-3).
        process_group: the data-parallel group (default: the world).
        mesh: hybrid sharding (HSDP), as FSDP2 takes it: a 2-D ``DeviceMesh`` ``(replicate, shard)``.
            Parameters, gradients and optimizer state are sharded within dimension 1 (``shard``, e.g. the GPUs
            of one node); the reduced gradient shards are then all-reduced over dimension 0 (``replicate``,
            e.g. across nodes), and gradients are averaged over all ``replicate x shard`` ranks
            ([Note: hybrid sharding] in _hsdp.py). A 1-D mesh is the same as ``process_group=mesh.get_group()``.
        replicate_group, shard_group: the same as ``mesh``, given as the two process groups this rank
            belongs to (both or neither; not with ``mesh`` or ``process_group``).
        compute_dtype: dtype of the parameters that forward and backward see (e.g. ``torch.bfloat16``);
            default: the parameters' own dtype. Main parameters and optimizer state stay fp32. When given, the
            root forward's floating-point tensor inputs are cast to it too (integer and bool inputs are not).
        main_grad_dtype: dtype of the main gradients, the sharded gradients the optimizer reads (fp32).
        reduce_dtype: dtype of the unsharded gradient buffers and of the reduction over ranks; default
            ``main_grad_dtype``. ``torch.bfloat16`` halves the gradient buffers and the reduce-scatter's bytes;
            each reduced shard is then cast into the fp32 main gradient, so accumulation over micro-batches and
            the optimizer stay fp32 ([Note: reducing in another dtype]). Not bit-identical to an fp32
            reduction: the gradients are rounded to bf16 before the ranks' sum, and the sum is rounded too.
        fsdp_double_buffer: unshard buffers of units live in two fixed slots (units alternate between them
            by forward-order parity) and unsharded-gradient buffers in one, so every unit always uses the
            same addresses (what CUDA-graph replay needs).
        fsdp_db_use_persist_buf_on_alloc_fail: a unit larger than a slot gets a persistent buffer of its
            own instead of an error.
        fsdp_double_buffer_numel: elements per slot; default the largest unit's size.
        prefetch: all-gather the next unit (forward) or the previous unit (backward) while the current
            unit computes.

    Lifecycle: build the optimizer over ``model.optimizer_parameters()`` (fp32 main shards; an optimizer
    over ``model.parameters()`` is refused at its first step); call ``model(...)``, ``loss.backward()``
    (repeat for gradient accumulation), optionally ``model.clip_grad_norm_(max_norm)``,
    ``optimizer.step()``, ``optimizer.zero_grad()``. Compute parameters are refreshed from the main shards
    lazily, before each unit's next unshard (an optimizer step bumps the shards' version counters).
    Parameters with ``requires_grad=False`` at this call are frozen: sharded and gathered for compute,
    never given a gradient buffer or an optimizer shard. Checkpoints: ``state_dict()`` /
    ``load_state_dict()`` (full fp32, the unwrapped model's keys; a collective), ``sharded_state_dict()``
    and ``optimizer_state_dict(optimizer)`` for ``torch.distributed.checkpoint`` (any world size).

    Hazards: a unit runs forward once per backward (activation checkpointing's recompute excepted);
    parameters may not be shared between units; outside forward the module's parameters are not
    authoritative (NaN placeholders for on-demand ZeRO-3 buffers, possibly another unit's values in a
    double-buffer slot): read them through ``state_dict()`` or ``summon_full_params()``; call the
    wrapper, not ``model.module``.
    """
    return MegatronFSDP(
        module,
        fsdp_unit_modules=fsdp_unit_modules,
        sharding_strategy=sharding_strategy,
        process_group=process_group,
        mesh=mesh,
        replicate_group=replicate_group,
        shard_group=shard_group,
        compute_dtype=compute_dtype,
        main_grad_dtype=main_grad_dtype,
        reduce_dtype=reduce_dtype,
        fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        fsdp_double_buffer_numel=fsdp_double_buffer_numel,
        prefetch=prefetch,
    )


class MegatronFSDP(UnitPlanning, _clip.GradientMethods, nn.Module):
    """A fully-sharded data-parallel wrapper (see :func:`fully_shard`); gradient methods (clipping, norms,
    ``zero_grad``) in _clip.py."""

    def __init__(
        self,
        module: nn.Module,
        *,
        fsdp_unit_modules: Sequence[UnitSpec],
        sharding_strategy: Union[str, ShardingStrategy],
        process_group: Optional[dist.ProcessGroup],
        compute_dtype: Optional[torch.dtype],
        main_grad_dtype: torch.dtype,
        reduce_dtype: Optional[torch.dtype],
        fsdp_double_buffer: bool,
        fsdp_db_use_persist_buf_on_alloc_fail: bool,
        fsdp_double_buffer_numel: Optional[int],
        prefetch: bool,
        mesh: Optional[DeviceMesh] = None,
        replicate_group: Optional[dist.ProcessGroup] = None,
        shard_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.strategy = ShardingStrategy.parse(sharding_strategy)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "megatron_fsdp.fully_shard needs an initialised process group: call "
                "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPU) first (torchrun sets the "
                "environment it reads)"
            )
        # The shard group carries every sharding collective; a replicate group (HSDP) adds one all-reduce of
        # the reduced gradients ([Note: hybrid sharding] in _hsdp.py).
        self.hsdp = hsdp = _hsdp.resolve(process_group=process_group, mesh=mesh, replicate_group=replicate_group,
                                         shard_group=shard_group)
        group = hsdp.shard_group
        # A weak reference: torch.distributed owns the group ([Note: the engine does not keep its group alive]).
        self._group_ref = weakref.ref(group)
        #: rank and size within the shard group (the data-parallel group when not hybrid)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        #: every data-parallel rank: replicate x shard (what the gradients are averaged over)
        self.dp_world_size = self.world_size * hsdp.replicate_size
        if self.rank < 0:
            raise ValueError(
                f"process_group does not contain global rank {dist.get_rank()}; pass the data-parallel group "
                "this rank belongs to"
            )
        self.prefetch = prefetch
        self.fsdp_double_buffer = fsdp_double_buffer
        self.fsdp_db_use_persist_buf_on_alloc_fail = fsdp_db_use_persist_buf_on_alloc_fail
        if fsdp_db_use_persist_buf_on_alloc_fail and not fsdp_double_buffer:
            raise ValueError(
                "fsdp_db_use_persist_buf_on_alloc_fail=True needs fsdp_double_buffer=True (it decides what "
                "happens to units that do not fit the double buffer); enable both or neither"
            )

        params = list(module.parameters())
        if not params:
            raise ValueError("fully_shard got a module without parameters; there is nothing to shard")
        self.device = params[0].device
        for n, p in module.named_parameters():
            if p.device != self.device:
                raise ValueError(
                    f"parameter {n} is on {p.device} but {params[0].device} holds the first parameter; move the "
                    "whole model to one device before fully_shard"
                )
        #: the backend of this model's device in the group ("nccl" on CUDA, "gloo" on CPU; see backend_for)
        self.backend = backend = backend_for(self.group, self.device)
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(
                f"the process group's backend is {backend!r} but the model is on {self.device}; use 'nccl' with "
                "a model on its CUDA device, 'gloo' with a model on CPU"
            )
        self.main_param_dtype = torch.float32
        self.main_grad_dtype = main_grad_dtype
        #: dtype of the unsharded gradient buffers and the collectives ([Note: reducing in another dtype])
        self.reduce_dtype = reduce_dtype or main_grad_dtype
        #: the gradient collectives average, and the fold skips its scale pass ([Note: averaging in the collective])
        self.reduce_average = hsdp.replicate_size == 1 and reduce_by_average(backend, self.world_size, self.reduce_dtype)
        # Default from a floating-point parameter: a stray integer parameter is then reported by name below,
        # not as a compute_dtype the caller never passed.
        first_float = next((p.dtype for p in params if p.dtype.is_floating_point), params[0].dtype)
        self.compute_dtype = compute_dtype or first_float
        #: An explicit compute_dtype also applies to the root forward's floating-point tensor inputs (args and
        #: kwargs, nested), as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does: fp32 activations
        #: would not meet bf16 weights otherwise. Integer and bool tensors (tokens, masks) are left alone.
        self._cast_inputs = compute_dtype is not None
        for what, dt in (("compute_dtype", self.compute_dtype), ("main_grad_dtype", main_grad_dtype),
                         ("reduce_dtype", self.reduce_dtype)):
            if not dt.is_floating_point:
                raise ValueError(f"{what}={dt} is not a floating-point dtype; pass e.g. torch.bfloat16 or torch.float32")

        self.units: List[FSDPUnit] = []
        self.root_unit: Optional[FSDPUnit] = None
        self.slot_owner: List[Optional[FSDPUnit]] = [None, None]
        self._pending: "collections.deque[_PendingReduce]" = collections.deque()
        #: gradient slot -> the unit whose TE modules write into it during its backward ([Note: fused weight gradients])
        self.grad_slot_holder: Dict[int, FSDPUnit] = {}
        #: Live captured steps that write the units' kept main gradients ([Note: main gradients live like .grad]).
        self.main_grad_keepers = 0
        #: A graph layer's capture (warmup and capture passes) is running: backwards reduce nothing.
        self.graph_maker_running = False
        self._forward_order: List[FSDPUnit] = []
        self._last_forward_order: List[FSDPUnit] = []
        self._in_root_forward = False
        self._callback_queued = False
        #: Between the first gradient reaching the root's output and the end of backward: a unit forward
        #: then is activation checkpointing's recompute ([Note: recompute] in _unit.py).
        self.in_backward = False
        #: Inside summon_full_params(): module parameters are full fp32 copies.
        self._summoned = False
        #: Root forward passes run so far (graph layers read it: steps before a capture matter to streams).
        self.num_forward_calls = 0
        #: Root forward passes with gradients enabled so far: the backward hooks of a forward remember it, and
        #: refuse a backward that reaches them after a later such forward ([Note: one backward per forward]).
        self.num_grad_forwards = 0
        #: When a list, every unit phase appends (phase, unit name, capturing?) to it: a test and debug aid.
        self.trace: Optional[List[Tuple[str, str, bool]]] = None
        self._plan_units(fsdp_unit_modules)
        self._build_storage(fsdp_double_buffer_numel)
        self._register_hooks()
        _guards.mark_compute_params(self)
        _guards.install_optimizer_guard()
        self._guard_handles = [_guards.guard_direct_calls(self)] + _state_dict.guard_module_state_dicts(self)
        log_rank0(
            logging.INFO,
            "megatron_fsdp: %d units + root, strategy %s, world %d (replicate %d x shard %d), compute %s, "
            "double buffer %s", len(self.units), self.strategy.value, self.dp_world_size, hsdp.replicate_size,
            self.world_size, self.compute_dtype, fsdp_double_buffer,
        )

    @property
    def group(self) -> dist.ProcessGroup:
        """The engine's process group, while torch.distributed holds it (until ``destroy_process_group``).

        [Note: the engine does not keep its group alive]
        ``destroy_process_group()`` frees a Gloo group, and the group's destructor joins its worker threads, only
        when nothing else holds the group. A worker thread drops its own reference to a finished ``Work`` after the
        waiting rank has moved on, and for a collective issued in backward that drop takes the GIL (the work saved
        the thread's state, which holds the ``contextvars`` context that ``torch.autograd.backward`` stashes). With
        the group still alive after ``destroy_process_group()`` its threads ran on into interpreter exit, and a
        worker that asked for the GIL while the interpreter finalised was ended by ``pthread_exit`` inside a
        ``noexcept`` destructor: the rank aborted after a correct run ("terminate called without an active
        exception", SIGABRT, core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``take_gil`` ->
        ``pthread_exit``). Two things held the group: this engine (a strong reference, now weak: torch.distributed
        holds every group until it is destroyed, so the group lives exactly as long as it can be used), and
        ``torch.distributed.nn.functional``, whose functions take ``group=group.WORLD`` as a default evaluated at
        import: torch.optim's constructors import it lazily (through torch._dynamo), after ``init_process_group``
        in a usual script, and the defaults then pin the world group for good (so does ``torch.distributed._shard``,
        which imports it). This module imports it first, while no group exists, and so does ``fsdp_cudagraph``'s
        ``__init__``: its checker imports the engine only after ``init_process_group`` and aborted at exit in 2 of
        12 two-node launches, 0 of 12 after. tests/apps/test_exit.py runs such a script 20 times and checks that
        each entry point frees the world group at ``destroy_process_group()``.
        """
        group = self._group_ref()
        if group is None:
            raise RuntimeError(
                f"[rank {self.rank}] megatron_fsdp: the engine's process group was destroyed "
                "(torch.distributed.destroy_process_group()); collectives and state dicts need it: use the model "
                "before destroying its group, or build a new one with fully_shard after init_process_group"
            )
        return group

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        """HSDP's replicate group (the gradient all-reduce across shard groups), or None when not hybrid."""
        if not self.hsdp.hybrid:
            return None
        group = self.hsdp.replicate()
        if group is None:
            raise RuntimeError(f"[rank {self.rank}] megatron_fsdp: the engine's replicate group was destroyed "
                               "(torch.distributed.destroy_process_group()); use the model before destroying it")
        return group

    @property
    def grad_scale(self) -> float:
        """What the gradient fold multiplies by before a summing collective (1.0: no scale pass)."""
        return 1.0 if self.reduce_average else 1.0 / self.dp_world_size

    @property
    def in_root_forward(self) -> bool:
        """True while the wrapper's forward runs the user's module (between root pre-forward and return)."""
        return self._in_root_forward

    # ------------------------------------------------------------------ used by units
    def record(self, phase: str, unit: FSDPUnit) -> None:
        if self.trace is not None:
            self.trace.append((phase, unit.name, is_capturing()))

    def note_forward(self, unit: FSDPUnit) -> None:
        if self._in_root_forward:
            self._forward_order.append(unit)

    def neighbour(self, unit: FSDPUnit, step: int) -> Optional[FSDPUnit]:
        """The unit that runs after (+1) or before (-1) ``unit`` in forward order."""
        order = self._forward_order if step < 0 else (self._last_forward_order or self.units)
        try:
            i = order.index(unit) + step
        except ValueError:
            return None
        return order[i] if 0 <= i < len(order) else None

    def add_pending_reduce(self, pending: _PendingReduce) -> None:
        self._pending.append(pending)
        # Keep one reduction in flight: it overlaps the next unit's backward, and bounds the memory of
        # on-demand gradient buffers to two units. HSDP keeps two: the previous unit's reduced shard starts
        # its all-reduce across replicas now and is retired one unit later, so the all-reduce overlaps a
        # unit's backward too ([Note: hybrid sharding] in _hsdp.py).
        in_flight = 1
        if self.hsdp.hybrid:
            in_flight = 2
            if len(self._pending) > 1:
                self._pending[-2].launch()
        while len(self._pending) > in_flight:
            self._pending.popleft().retire()

    def retire_reduces(self, slot: Optional[int] = None) -> None:
        """Retire the reductions in flight (those reading gradient slot ``slot``, if given).

        Under HSDP a sharded strategy's reduction only needs its reduce-scatter finished to give the slot back:
        it is launched across replicas (``_PendingReduce.launch``) and stays in flight.
        """
        keep: "collections.deque[_PendingReduce]" = collections.deque()
        while self._pending:
            p = self._pending.popleft()
            if slot is None:
                p.retire()
            elif p.unit.grad_buffer.slot != slot or not p.holds_buffer:
                keep.append(p)
            elif self.hsdp.hybrid and self.strategy is not ShardingStrategy.NO_SHARD:
                p.launch()
                assert not p.holds_buffer, "a sharded strategy's all-reduce across replicas reads the reduced shard"
                keep.append(p)
            else:
                p.retire()
        self._pending = keep

    # ------------------------------------------------------------------ root forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cast_inputs:
            args, kwargs = _cast_floating(args, self.compute_dtype), _cast_floating(kwargs, self.compute_dtype)
        self._root_pre_forward()
        grad = torch.is_grad_enabled()
        if grad:
            self.num_grad_forwards += 1  # before the units' forwards: their backward hooks record it
        self._in_root_forward = True
        try:
            out = self.module(*args, **kwargs)
        finally:
            self._in_root_forward = False
        self._last_forward_order = list(self._forward_order)
        self.num_forward_calls += 1
        if grad:
            tensors = _grad_tensors(out)
            hook = functools.partial(self._root_pre_backward, self.num_grad_forwards)
            if len(tensors) == 1:
                tensors[0].register_hook(hook)
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return out

    def _root_pre_forward(self) -> None:
        if self._summoned:
            raise RuntimeError(
                f"[rank {self.rank}] megatron_fsdp: forward inside summon_full_params(); the parameters are full fp32 "
                "copies there, not the compute buffers the engine gathers into: leave the block first"
            )
        busy = [u.name for u in self.units if u.state in COMPUTING]
        # Compute parameters hold gradients between steps only when a backward failed before their unit
        # reduced them (e.g. the root's head, before any unit's backward ran); they must not reach this step.
        if torch.is_grad_enabled():
            _clip.unbind_no_gradient(self)  # before this forward's backward accumulates into .grad
        busy += [u.name for u in self.all_units() if u.name not in busy and any(map(_clip.holds_gradient, u.params))]
        if busy or self._pending:
            logger.warning(
                "[rank %d] megatron_fsdp: the previous step did not finish (units %s mid-step); resetting",
                self.rank, busy,
            )
            self.reset_step_state()
        self._forward_order = []
        self._callback_queued = False
        self.in_backward = False
        for u in self.units:
            u.state = TrainingState.IDLE
        r = self.root_unit
        with phase("FSDP::root_pre_forward"):
            if r is not None:
                r.unshard()
            if self.prefetch and self.units:
                (self._last_forward_order or self.units)[0].unshard()
            if r is not None:
                r.wait_unshard()
                r.state = TrainingState.FORWARD_DONE

    def _root_pre_backward(self, forward_index: int, *_: Any) -> None:
        if forward_index != self.num_grad_forwards:
            raise _guards.stale_backward_error(self, forward_index, "the model's output")
        self.in_backward = True
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._post_backward_final)

    def _post_backward_final(self) -> None:
        with phase("FSDP::post_backward_final"):
            for u in self.units:
                if u.state is not TrainingState.IDLE:
                    u.post_backward()
            r = self.root_unit
            if r is not None:
                r.state = TrainingState.BACKWARD
                r.post_backward()
            self.retire_reduces()
            self._callback_queued = False
            self.in_backward = False
            _guards.check_stray_gradients(self)
            _clip.bind_no_gradient(self)  # [Note: compute parameters hold no gradient] in _clip.py

    def reset_step_state(self) -> None:
        """Bring every unit back to IDLE: after a step raised part-way, or after a graph capture.

        Waits for collectives in flight and drops their results, clears compute-parameter gradients and
        releases on-demand buffers. Reductions that had already finished stay in the main gradients: call
        ``optimizer.zero_grad()`` before the next step.
        """
        for p in self._pending:
            if p.work is not None:
                p.work.wait()
            p.unit.grad_buffer.free()
        self._pending.clear()
        self.grad_slot_holder.clear()
        self.graph_maker_running = False
        for u in self.units + ([self.root_unit] if self.root_unit else []):
            if u.fused is not None:
                u.fused.end_backward()
            u.wait_unshard()
            for p in u.all_params:
                p.grad = None
            u.state = TrainingState.IDLE
            u.reshard()
        self._callback_queued = False
        self.in_backward = False

    # ------------------------------------------------------------------ public helpers
    def all_units(self) -> List[FSDPUnit]:
        return self.units + ([self.root_unit] if self.root_unit is not None else [])

    def optimizer_parameters(self) -> List[nn.Parameter]:
        """The fp32 main shards, one flat parameter per unit with trainable parameters: what to step."""
        return [u.main_shard for u in self.all_units() if u.grad_numel]

    def named_optimizer_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(u.name, u.main_shard) for u in self.all_units() if u.grad_numel]

    def buffer_addresses(self) -> Dict[str, Dict[str, Optional[int]]]:
        """Per unit: data pointers of its unshard and gradient buffers (for graph-replay checks)."""
        return {u.name: u.buffer_addresses() for u in self.all_units()}

    # ------------------------------------------------------------------ state dicts (see _state_dict.py)
    def state_dict(self, *args: Any, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        """Full fp32 parameters and persistent buffers under the unwrapped model's keys, on every rank.

        The nn.Module API ([Note: state dict keys and values] in _state_dict.py): a collective (all-gather
        per unit), so call it on every rank. Values are copies; ``keep_vars`` is accepted and ignored.
        """
        if args:
            raise TypeError("MegatronFSDP.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        out = destination if destination is not None else collections.OrderedDict()
        for k, v in _state_dict.full_state_dict(self).items():
            out[prefix + k] = v
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full values (keys as the unwrapped model's, e.g. from ``state_dict()``) into the main shards.

        No communication: each rank copies its own slices. Returns ``(missing_keys, unexpected_keys)`` as
        nn.Module does; ``strict`` raises on a mismatch before writing anything.
        """
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) would replace the sharded parameters; load by copy "
                                      "(assign=False)")
        missing, unexpected = _state_dict.load_full_state_dict(self, state_dict, strict=strict)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Same as ``state_dict()``: gathered fp32 parameters plus persistent buffers, on every rank."""
        return _state_dict.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Strict ``load_state_dict``."""
        _state_dict.load_full_state_dict(self, state_dict, strict=True)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """Parameters for ``torch.distributed.checkpoint``: fp32 DTensors, ``Shard(0)`` over the process group.

        Keys and shapes are the unwrapped model's ([Note: DCP sharding metadata] in _dcp.py), as FSDP2 saves
        them. Values are copies: after ``dcp.load`` fills the dict, ``load_sharded_state_dict`` writes them
        back. A collective (an all-gather per unit): call it on every rank.
        Save: ``dcp.save({"model": model.sharded_state_dict(), ...})``. Load (any world size or strategy):
        ``sd = model.sharded_state_dict(); dcp.load({"model": sd}); model.load_sharded_state_dict(sd)``.
        """
        return _dcp.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take the values of a dict shaped like ``sharded_state_dict()`` (a collective: call it on every rank)."""
        _dcp.load_sharded_state_dict(self, state_dict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's state, keyed by parameter name and sharded like the parameters, for DCP.

        ``{"state": {name: {"exp_avg": DTensor, "step": tensor, ...}}, "param_groups": [...]}``.
        An optimizer that never stepped gets its state from one step at learning rate 0 first.
        """
        return _dcp.optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        """Take optimizer state from a dict shaped like ``optimizer_state_dict()`` (after ``dcp.load`` filled it)."""
        _dcp.load_optimizer_state_dict(self, optimizer, state_dict)

    def summon_full_params(self, *, writeback: bool = False) -> contextlib.AbstractContextManager:
        """Context manager: module parameters are full fp32 copies inside (a collective; see _state_dict.py)."""
        return _state_dict.summon_full_params(self, writeback=writeback)
