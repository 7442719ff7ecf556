"""``fully_shard``, the public API, and ``MegatronFSDP``, the root wrapper: one class, whole.

The class plans the model once, in ``__init__`` (which modules become units and which parameters each owns,
the buffers every unit gets and its initial values, the hooks on the unit modules), answers questions about the
plan (``unit_of``, ``unit_uses_recompute``), runs the root's forward and backward, and offers the gradient and
checkpoint methods. Its pieces that stand on their own live beside it: one unit's state machine in ``_unit.py``,
its hooks in ``_unit_hooks.py`` and its gradient reduction in ``_reduce.py``; the norm and clipping functions
in ``_clip.py``; full state dicts in ``_state_dict.py`` and DCP state dicts in ``_dcp.py``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before any group exists: [Note: the engine does not keep its group alive]
from torch import nn
from torch.autograd import Variable

from torch.distributed.device_mesh import DeviceMesh

from . import _clip, _dcp, _expert, _fp8, _guards, _hsdp, _state_dict, _tensor
from . import _collectives as C
from ._collectives import backend_for
from ._common import COMPUTING, ShardingStrategy, TrainingState, _cast_floating, is_capturing, log_rank0, phase
from ._flat import _Buffer
from ._hsdp import broadcast_order
from ._reduce import _PendingReduce, reduce_by_average
from ._unit import FSDPUnit
from ._unit_hooks import _grad_tensors, make_call_guard, make_unit_hooks

__all__ = ["fully_shard", "MegatronFSDP", "UnitSpec"]

logger = logging.getLogger(__name__)

#: What ``fsdp_unit_modules`` lists: a module class (instances and subclasses match) or a class name.
UnitSpec = Union[Type[nn.Module], str]


def _matches(module: nn.Module, specs: Sequence[UnitSpec]) -> bool:
    for s in specs:
        if isinstance(s, str):
            if type(module).__name__ == s:
                return True
        elif isinstance(module, s):
            return True
    return False


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
    keep_compute_shard: bool = False,
    expert_parallel_size: Optional[int] = None,
    expert_parallel_group: Optional[dist.ProcessGroup] = None,
    expert_data_parallel_group: Optional[dist.ProcessGroup] = None,
    expert_mesh: Optional[DeviceMesh] = None,
    tensor_parallel_size: Optional[int] = None,
    tensor_parallel_group: Optional[dist.ProcessGroup] = None,
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
        keep_compute_shard: ZeRO-3 with a compute dtype other than fp32 (e.g. bf16): keep a compute-dtype copy of
            each unit's shards, cast once after each change of the main shards (an optimizer step, a load), and
            gather from it, instead of casting the fp32 shards at every gather (forward and backward of every
            micro-batch: [Note: cast on gather] in _unit.py). The same bits; it costs 2 bytes a shard element (bf16)
            for the run and saves the casts of every gather but the first of a step. A unit whose shard group has
            one rank keeps the cast in an unshard buffer of its own instead of a double-buffer slot. A gather inside a
            full-iteration capture casts as without it. Refused where there is nothing to keep (other
            strategies keep unsharded compute parameters; fp32 compute gathers the main shards as they are).
        expert_parallel_size: expert parallelism (EP) over the data-parallel ranks ([Note: expert parallelism] in
            _expert.py): groups of ``EP`` contiguous ranks share the experts between them (the model's
            all-to-all), and the ``W/EP`` ranks holding the same local experts (strided by ``EP``) shard them.
            Expert parameters (a module with ``is_expert = True`` on their path, or a name segment ``experts``)
            hold only this rank's ``E/EP`` local experts, as the model built them; they are sharded and reduced over
            the expert-data-parallel group, everything else over the data-parallel group as without EP. A unit
            holding both gets two buckets, each on its own group. Expert gradients are summed over that group and
            divided by the whole data-parallel size, so ``EP = k`` trains as ``EP = 1`` does on the same global
            batch. A parameter that stacks the local experts along a dim (``w1 [E/EP, h, f]``, one name on every
            EP rank) is declared by its module, ``stacked_expert_dims = {"w1": 0}``: the state dicts then hold the
            global ``[E, h, f]`` tensor under the EP=1 key, so checkpoints load at any EP; different experts under
            one undeclared name make the state dicts refuse. Default 1 (no split); not with hybrid sharding.
            Needs ``process_group`` to be the world (the groups are built with ``new_group``); otherwise pass the
            two groups.
        expert_parallel_group, expert_data_parallel_group: the same, given as the two groups this rank belongs to
            (both or neither; e.g. from ``megatron_fsdp.expert_parallel_groups(ep)``, whose EP group the model's
            all-to-all uses too). They must tile the data-parallel group as a grid; ``expert_parallel_size``, if
            given too, must equal the EP group's size.
        expert_mesh: the same as a 2-D ``DeviceMesh`` ``(expert_data_parallel, expert_parallel)`` over the
            data-parallel ranks (torchtitan's ``(efsdp, ep)``; NVIDIA Megatron-FSDP's expert device mesh), e.g.
            ``init_device_mesh(device_type, (W // EP, EP))``; not with the two groups.
        tensor_parallel_size: tensor parallelism (TP, [Note: tensor parallelism] in _tensor.py): the world forms a
            ``(dp, tp)`` grid, TP groups of contiguous ranks (the model splits every layer among them) and
            data-parallel groups strided by ``TP`` (the ranks holding the same TP slice). The model is already
            this rank's TP slice ("TP first, FSDP last"); the engine shards, gathers and reduces over the
            data-parallel group only, sums the gradients of parameters tagged ``sequence_parallel`` over the TP
            group before that, clips by the norm over both, and keys TP shards (``tensor_model_parallel``) per TP
            rank in DCP checkpoints. Builds the groups from the world (``process_group`` must be left out); a model
            that exposes ``tensor_parallel_group`` must hold the same ranks. Not with hybrid sharding or expert
            parallelism.
        tensor_parallel_group: the same, given as this rank's TP group, with ``process_group`` its data-parallel
            group (both, e.g. from ``megatron_fsdp.tensor_parallel_groups(tp)``, whose TP group the model uses too);
            they must tile the world as a grid.

    Lifecycle: build the optimizer over ``model.optimizer_parameters()`` (fp32 main shards; an optimizer
    over ``model.parameters()`` is refused at its first step); call ``model(...)``, ``loss.backward()``
    (repeat for gradient accumulation), optionally ``model.clip_grad_norm_(max_norm)``,
    ``optimizer.step()``, ``optimizer.zero_grad()``. Compute parameters are refreshed from the main shards
    lazily, before each unit's next unshard (an optimizer step bumps the shards' version counters).
    Parameters with ``requires_grad=False`` at this call are frozen: sharded and gathered for compute,
    never given a gradient buffer or an optimizer shard. Checkpoints: ``state_dict()`` /
    ``load_state_dict()`` (full fp32, the unwrapped model's keys; a collective), ``sharded_state_dict()``
    and ``optimizer_state_dict(optimizer)`` for ``torch.distributed.checkpoint`` (any world size). A plain
    ``optimizer.state_dict()`` holds one rank's shards: it loads back only at the same world size and strategy,
    each rank its own (other shard sizes are refused). A tied parameter keeps each of its names in the state
    dicts ([Note: tied parameters]).

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
        keep_compute_shard=keep_compute_shard,
        expert_parallel_size=expert_parallel_size,
        expert_parallel_group=expert_parallel_group,
        expert_data_parallel_group=expert_data_parallel_group,
        expert_mesh=expert_mesh,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_group=tensor_parallel_group,
    )


class MegatronFSDP(nn.Module):
    """A fully-sharded data-parallel wrapper (see :func:`fully_shard`).

    Sections, in order: construction; the groups and read-only views; planning (called from ``__init__``
    only: it fills ``units``, ``root_unit``, the buffers and the hooks); queries on the plan; what units call
    back; the root's forward and backward; public helpers; gradients (clipping, norms, ``zero_grad``); state
    dicts and checkpoints.
    """

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
        keep_compute_shard: bool = False,
        mesh: Optional[DeviceMesh] = None,
        replicate_group: Optional[dist.ProcessGroup] = None,
        shard_group: Optional[dist.ProcessGroup] = None,
        expert_parallel_size: Optional[int] = None,
        expert_parallel_group: Optional[dist.ProcessGroup] = None,
        expert_data_parallel_group: Optional[dist.ProcessGroup] = None,
        expert_mesh: Optional[DeviceMesh] = None,
        tensor_parallel_size: Optional[int] = None,
        tensor_parallel_group: Optional[dist.ProcessGroup] = None,
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
        #: The TP group ([Note: tensor parallelism] in _tensor.py), or None without tensor parallelism; with TP
        #: the process group is the data-parallel group (one TP column of the (dp, tp) grid).
        process_group, self.tp_topology = _tensor.resolve(
            process_group=process_group, tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_group=tensor_parallel_group,
            hybrid=mesh is not None or replicate_group is not None or shard_group is not None,
            expert=bool(expert_parallel_size and expert_parallel_size > 1) or expert_parallel_group is not None
            or expert_data_parallel_group is not None or expert_mesh is not None)
        _tensor.check_model_group(self.tp_topology, module)
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
        #: The expert groups ([Note: expert parallelism] in _expert.py), or None without expert parallelism.
        self.expert_topology = _expert.resolve(
            dp_group=group, hybrid=hsdp.hybrid, expert_parallel_size=expert_parallel_size,
            expert_parallel_group=expert_parallel_group, expert_data_parallel_group=expert_data_parallel_group,
            expert_mesh=expert_mesh)
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
        #: a compute-dtype copy of every unit's shards, cast once a change of the main shards ([Note: cast on gather])
        self.keep_compute_shard = keep_compute_shard
        if keep_compute_shard and not (self.strategy.shards_params and self.compute_dtype != self.main_param_dtype):
            why = (f"sharding_strategy={self.strategy.value!r} keeps the compute parameters unsharded and casts them "
                   "once a step already" if not self.strategy.shards_params else
                   f"compute_dtype={self.compute_dtype} is the main shards' dtype, so every gather reads them as they are")
            raise ValueError(f"keep_compute_shard=True keeps a compute-dtype copy of ZeRO-3's shards, but {why}: "
                             "there is nothing to keep; drop keep_compute_shard (or use optim_grads_params with a "
                             "compute_dtype such as torch.bfloat16)")

        self.units: List[FSDPUnit] = []
        self.root_unit: Optional[FSDPUnit] = None
        #: further name of a tied parameter -> the name its unit holds it under ([Note: tied parameters])
        self.tied_names: Dict[str, str] = {}
        #: unshard slot -> the unit whose values it holds: 0 and 1 dense, 2 and 3 expert buckets
        self.slot_owner: List[Optional[FSDPUnit]] = [None, None, None, None]
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
        self._check_fp8()
        self._build_storage(fsdp_double_buffer_numel)
        self._register_hooks()
        _guards.mark_compute_params(self)
        _guards.install_optimizer_guard()
        self._guard_handles = [_guards.guard_direct_calls(self)] + _state_dict.guard_module_state_dicts(self)
        log_rank0(
            logging.INFO,
            "megatron_fsdp: %d units + root, strategy %s, data parallel %d (replicate %d x shard %d), expert parallel %d, "
            "tensor parallel %d, compute %s, double buffer %s", len(self.units), self.strategy.value, self.dp_world_size,
            hsdp.replicate_size, self.world_size, self.expert_parallel_size, self.tensor_parallel_size,
            self.compute_dtype, fsdp_double_buffer,
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
    def expert_parallel_size(self) -> int:
        """EP: the ranks that share the experts between them (1 without expert parallelism)."""
        return self.expert_topology.ep_size if self.expert_topology is not None else 1

    @property
    def expert_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's expert-parallel group (the model's all-to-all), or None without expert parallelism."""
        return self.expert_topology.ep_group if self.expert_topology is not None else None

    @property
    def expert_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The group that shards this rank's local experts (None without expert parallelism)."""
        return self.expert_topology.edp_group if self.expert_topology is not None else None

    @property
    def tensor_parallel_size(self) -> int:
        """TP: the ranks that split every layer of the model (1 without tensor parallelism)."""
        return self.tp_topology.tp_size if self.tp_topology is not None else 1

    @property
    def tensor_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's tensor-parallel group, or None without tensor parallelism."""
        return self.tp_topology.tp_group if self.tp_topology is not None else None

    def expert_unit_of(self, unit: FSDPUnit) -> Optional[FSDPUnit]:
        """The expert bucket over ``unit``'s module (None when it has none), for a dense unit or an expert one."""
        return unit if unit.is_expert else unit.partner

    @property
    def grad_scale(self) -> float:
        """What the gradient fold multiplies by before a summing collective (1.0: no scale pass)."""
        return 1.0 if self.reduce_average else 1.0 / self.dp_world_size

    @property
    def in_root_forward(self) -> bool:
        """True while the wrapper's forward runs the user's module (between root pre-forward and return)."""
        return self._in_root_forward

    # ------------------------------------------------------------------ planning (from __init__ only)
    # Which modules become units and which parameters each owns, the buffers every unit gets (on-demand,
    # persistent or a double-buffer slot) and its initial values, and the hooks registered on the unit modules.
    def _plan_units(self, specs: Sequence[UnitSpec]) -> None:
        if not specs:
            raise ValueError("fsdp_unit_modules is empty; name at least one module class, e.g. your transformer layer")
        owner_of: Dict[int, str] = {}
        unit_modules: List[Tuple[str, nn.Module]] = [
            (n, m) for n, m in self.module.named_modules() if m is not self.module and _matches(m, specs)
        ]
        if not unit_modules:
            found = sorted({type(m).__name__ for m in self.module.modules()})
            raise ValueError(
                f"fsdp_unit_modules={[getattr(s, '__name__', s) for s in specs]} matches no submodule of "
                f"{type(self.module).__name__}; its module classes are {found[:20]}; name one of those"
            )
        unit_set = {id(m) for _, m in unit_modules}
        topo = self.expert_topology
        tagged = _expert.expert_param_ids(self.module)
        #: names of the parameters tagged as experts, at any EP (what optimizer-state loads compare loosely)
        self.expert_param_names = {_state_dict.clean_fqn(n) for n, p in self.module.named_parameters()
                                   if id(p) in tagged}
        experts = tagged if topo is not None else set()
        # [Note: expert parallelism] in _expert.py, Checkpoints: parameters that stack their local experts
        stacked_dims = _expert.stacked_expert_dims(self.module)
        untagged = [n for n, p in self.module.named_parameters() if id(p) in stacked_dims and id(p) not in tagged]
        if untagged:
            raise ValueError(
                f"parameters {untagged[:5]} are declared stacked experts ({_expert.STACKED_ATTR}) but are not expert "
                "parameters; tag their module with is_expert = True (or give it a name segment 'experts')")
        stacked: Dict[str, Tuple[int, Tuple[int, ...]]] = {}
        plan: List[Tuple[str, List[Tuple[str, Tuple[int, ...]]], List[Tuple[str, Tuple[int, ...]]]]] = []
        tp_plan: List[Tuple[str, List[Tuple[str, Tuple[int, ...], str]]]] = []
        for index, (name, m) in enumerate(unit_modules):
            names, ps = [], []
            for pn, p in self._own_params(m, unit_set):
                if id(p) in owner_of:
                    raise ValueError(
                        f"parameter {name}.{pn} is shared with unit {owner_of[id(p)]}; a parameter can live in one "
                        "FSDP unit only: untie it, or make the module that owns both a single unit"
                    )
                owner_of[id(p)] = name
                names.append(f"{name}.{pn}")
                ps.append(p)
            self._check_params(name, names, ps)
            if self.tp_topology is not None:  # [Note: tensor parallelism] in _tensor.py: the TP all-reduce's range
                names, ps = _tensor.tp_order(names, ps)
                tp_plan.append((name, [(n, tuple(p.shape), _tensor.kind_of(p)) for n, p in zip(names, ps)]))
            # [Note: expert parallelism] in _expert.py: a unit's expert parameters form a second unit (bucket) over
            # the same module, sharded over the expert-data-parallel group.
            dense = [(n, p) for n, p in zip(names, ps) if id(p) not in experts]
            expert = [(n, p) for n, p in zip(names, ps) if id(p) in experts]
            if topo is not None:
                plan.append((name, [(n, tuple(p.shape)) for n, p in dense], [(n, tuple(p.shape)) for n, p in expert]))
                stacked.update((n, (stacked_dims[id(p)], tuple(p.shape))) for n, p in expert if id(p) in stacked_dims)
            if dense:
                self.units.append(FSDPUnit(engine=self, name=name, module=m, names=[n for n, _ in dense],
                                           params=[p for _, p in dense], index=len(self.units), is_root=False))
            if expert:
                self.units.append(FSDPUnit(engine=self, name=name, module=m, names=[n for n, _ in expert],
                                           params=[p for _, p in expert], index=len(self.units), is_root=False,
                                           expert=True))
                if dense:
                    self.units[-2].partner, self.units[-1].partner = self.units[-1], self.units[-2]
        for pn, p in self.module.named_parameters(remove_duplicate=False):
            # A unit parameter also reachable outside that unit (tied to the root, e.g. a norm or a head) would
            # be read through the unit's buffer while the unit is resharded.
            owner = owner_of.get(id(p))
            if owner is not None and not pn.startswith(f"{owner}."):
                raise ValueError(
                    f"parameter {pn} is shared with unit {owner}, outside that unit; a parameter can live in one "
                    "FSDP unit only: untie it, or keep both users outside the units (in the root)"
                )
        root_names, root_params = [], []
        for pn, p in self.module.named_parameters():
            if id(p) not in owner_of:
                root_names.append(pn)
                root_params.append(p)
        if topo is not None:
            outside = [n for n, p in zip(root_names, root_params) if id(p) in experts]
            if outside:
                raise ValueError(
                    f"expert parameters {outside[:5]} are in no FSDP unit (they would be in the root, whose reduction "
                    "has no expert group); with expert_parallel_size > 1 every expert parameter must live in a unit: "
                    "add the class of the layer holding the experts to fsdp_unit_modules")
            if not experts:
                raise ValueError(
                    f"expert_parallel_size={topo.ep_size} but the model has no expert parameters (a module with "
                    "is_expert = True, or a parameter name with a segment 'experts'); tag the experts module with "
                    "is_expert = True, or pass expert_parallel_size=1")
            _expert.check_expert_plan(topo, self.group, plan, stacked)
        if self.tp_topology is not None:
            root_names, root_params = _tensor.tp_order(root_names, root_params)
            tp_plan.append(("<root>", [(n, tuple(p.shape), _tensor.kind_of(p)) for n, p in zip(root_names, root_params)]))
            _tensor.check_tp_plan(self.tp_topology, tp_plan)
            self.tp_topology.shard_names = {_state_dict.clean_fqn(n) for _, ps in tp_plan for n, _, k in ps
                                            if k == "shard"}
        if root_params:
            self._check_params("<root>", root_names, root_params)
            self.root_unit = FSDPUnit(engine=self, name="", module=self.module, names=root_names, params=root_params, index=-1, is_root=True)
        for u in self.units:
            if not u.is_expert or getattr(u.module, "_megatron_fsdp_unit", None) is None:
                u.module._megatron_fsdp_unit = u  # type: ignore[attr-defined]  # the dense bucket, if any
        self.tied_names = self._tied_names()

    def _tied_names(self) -> Dict[str, str]:
        """Every further name of a tied parameter -> the name its unit holds it under (state-dict keys).

        [Note: tied parameters]
        A parameter reachable under several names (``head.weight = tok.weight``, or two modules of one unit
        sharing a norm) lives once in its unit's flat buffer, under the first of its names the unit plan meets
        (``named_parameters()``'s first, for the root). The unwrapped model's ``state_dict()`` holds every name, each the same
        tensor, and so do FSDP2's and ``torch.distributed.checkpoint``'s state dicts: a checkpoint of ours must
        load into them and theirs into ours. So ``state_dict()`` and ``sharded_state_dict()`` give every further
        name the very tensor (DTensor) of the first, and DCP stores it under each name, the same values.
        ``load_state_dict`` expects every name, as the unwrapped model's does, takes the value from whichever
        names are present and refuses names of one parameter that disagree; ``load_sharded_state_dict`` reads the
        first name, or another when the first is absent. The optimizer's state stays under the first name only
        (the parameter is stepped once).
        """
        first = {id(p): n for u in self.all_units() for n, p in zip(u.names, u.all_params)}
        tied: Dict[str, str] = {}
        for pn, p in self.module.named_parameters(remove_duplicate=False):
            if pn != first[id(p)]:
                tied[_state_dict.clean_fqn(pn)] = _state_dict.clean_fqn(first[id(p)])
        return tied

    @staticmethod
    def _own_params(m: nn.Module, unit_set: set) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters of ``m`` that no nested unit claims."""
        stack: List[Tuple[str, nn.Module]] = [("", m)]
        seen: set = set()
        while stack:
            prefix, mod = stack.pop(0)
            for pn, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}{pn}", p)
            for cn, child in mod.named_children():
                if id(child) not in unit_set:
                    stack.append((f"{prefix}{cn}.", child))

    def _check_params(self, unit: str, names: List[str], params: List[nn.Parameter]) -> None:
        for n, p in zip(names, params):
            if not p.dtype.is_floating_point:
                raise ValueError(
                    f"parameter {n} of unit {unit} has dtype {p.dtype}; a unit's flat buffer holds floating-point "
                    "parameters cast to one compute dtype; register it as a buffer instead"
                )

    def _check_fp8(self) -> None:
        """Refuse FP8 weights where the FP8 all-gather does not run ([Note: FP8 parameter all-gather] in _fp8.py),
        naming each parameter and the fix; a parameter of a kind the plan did not take is refused too."""
        found: List[str] = []
        for u in self.all_units():
            quantized = [(n, p) for n, p in zip(u.names, u.all_params) if _fp8.is_quantized(p)]
            if not quantized:
                continue
            found += _fp8.problems(
                unit=u.name, names=u.layout.names, params=u.params,
                frozen=list(zip(u.frozen_layout.names, u.frozen_params)), expert=u.is_expert,
                tensor_parallel=self.tp_topology is not None, strategy=self.strategy.value,
                shards_params=self.strategy.shards_params,
                double_buffer=self.fsdp_double_buffer, hybrid=self.hsdp.hybrid, compute_dtype=self.compute_dtype)
            kinds = {type(_fp8.ops_for(p)).__name__ for _, p in quantized}
            if len(kinds) > 1:
                found.append(f"unit {u.name} mixes quantized parameters of kinds {sorted(kinds)}; one kind a unit")
        if found:
            raise ValueError(f"megatron_fsdp: FP8 weights it cannot gather as FP8: {'; '.join(dict.fromkeys(found))}")

    def _build_storage(self, slot_numel: Optional[int]) -> None:
        dev, cdt, gdt = self.device, self.compute_dtype, self.reduce_dtype
        all_units = self.units + ([self.root_unit] if self.root_unit is not None else [])
        db_units: List[FSDPUnit] = []
        if self.fsdp_double_buffer:
            if slot_numel is None:
                slot_numel = max(u.param_numel for u in self.units) if self.units else 0
            for u in self.units:
                if u.param_numel <= slot_numel:
                    db_units.append(u)
                elif not self.fsdp_db_use_persist_buf_on_alloc_fail:
                    raise ValueError(
                        f"unit {u.name} needs {u.param_numel} elements but fsdp_double_buffer_numel={slot_numel}; raise "
                        "fsdp_double_buffer_numel, or set fsdp_db_use_persist_buf_on_alloc_fail=True to give such "
                        "units a persistent buffer of their own"
                    )
        self.slot_numel = slot_numel or 0

        def resident(u: FSDPUnit) -> bool:
            """[Note: cast on gather]: with keep_compute_shard, a unit whose shard group has one rank keeps its
            cast in an unshard buffer of its own (its shard is the whole unit): one cast a step, no gather."""
            return self.keep_compute_shard and u.shard_size == 1 and u.fp8 is None

        p_slot_units = [u for u in db_units if not resident(u)]
        use_p_slots = bool(p_slot_units) and self.strategy.shards_params
        # Expert buckets alternate between slots 2 and 3 of their own ([Note: expert parallelism] in _expert.py).
        n_pslots = 4 if any(u.is_expert for u in p_slot_units) else 2
        slots_p = [torch.zeros(self.slot_numel, dtype=cdt, device=dev) for _ in range(n_pslots)] if use_p_slots else []
        # [Note: one gradient slot] Unshard buffers need two slots (the running unit's and the prefetched
        # one's); gradient buffers one: a unit's buffer is read only by its own reduce-scatter, and the engine
        # keeps one reduction in flight, which the next unit's fold retires before it overwrites the slot,
        # a whole unit's backward after it started. Two fp32 slots cost the largest unit's size in fp32 more
        # (0.78 GiB of an 822 M-parameter model) for one more unit of slack when communication is slower than
        # a unit's backward.
        # With fused weight-gradient accumulation a unit's slot is busy through its whole backward, so on
        # several ranks a second slot lets the previous unit's reduce-scatter overlap this unit's backward.
        fused = any(u.fused is not None and u.fused.any_fused() for u in db_units)
        n_gslots = 2 if fused and self.world_size > 1 else 1
        # An FP8 unit's unshard buffer holds bytes, so its gradients may need more elements than its parameters
        self.grad_slot_numel = max([self.slot_numel] + [u.grad_numel for u in db_units])
        slots_g = [torch.zeros(self.grad_slot_numel, dtype=gdt, device=dev) for _ in range(n_gslots)] if db_units else []
        # [Note: fixed slots] A double-buffered unit's slot is fixed here, once: the parity of its index among
        # the double-buffered units in plan order (module order, which is forward order for a model that calls
        # its layers in the order it registers them). Fixed, because a CUDA graph replays the addresses it
        # captured: a unit's parameter views and gradient views must sit at the same bytes every step, not
        # in whichever slot happens to be free. Parity, because the unit that computes and the neighbour it
        # prefetches (the next in forward, the previous in backward) then never share a slot; units that nest
        # or run out of plan order can, and unshard refuses to take a slot its owner still computes in. The
        # gradient slot is the same parity folded onto the number of gradient slots ([Note: one gradient slot]).
        slot_of = {id(u): i % 2 for i, u in enumerate(x for x in db_units if not x.is_expert)}
        slot_of.update({id(u): 2 + i % 2 for i, u in enumerate(x for x in db_units if x.is_expert)})
        root_gslot = self._root_grad_slot(db_units, n_gslots)
        differ: List[str] = []  # parameters replicated over TP whose values differ from TP rank 0's
        with torch.no_grad():
            for u in all_units:
                flat = torch.zeros(u.numel, dtype=torch.float32, device=dev)
                for p, v in zip(u.all_params, u.views(flat)):
                    v.copy_(_fp8.initial_values(p))
                # [Note: hybrid sharding]: from mesh (0, 0); an expert bucket from its EDP group's first rank
                order = [("expert-data-parallel", u.group)] if u.is_expert else broadcast_order(self.hsdp)
                for dim, group in order:
                    what = f"initial values of unit {u.name}" + (f" over the {dim} group" if self.hsdp.hybrid else "")
                    C.broadcast(flat, 0, group, what)
                if self.tp_topology is not None:
                    differ += _tensor.differing_replicated(self.tp_topology, dev, [
                        (n, v) for n, p, v in zip(u.names, u.all_params, u.views(flat)) if not _tensor.is_tp_shard(p)])
                s = slot_of.get(id(u))
                # Unsharded strategies keep compute parameters resident, so only ZeRO-3 puts them in slots;
                # `optim` (ZeRO-1) keeps its full gradient buffer by definition.
                if s is not None and self.strategy.shards_params and not resident(u):
                    pbuf = _Buffer("slot", slots_p[s], s)
                else:
                    kept = self.fsdp_double_buffer or not self.strategy.shards_params or resident(u)
                    pbuf = _Buffer("persistent" if kept else "dynamic", torch.zeros(u.param_numel, dtype=cdt, device=dev))
                if s is not None and self.strategy is not ShardingStrategy.OPTIM:
                    gbuf = _Buffer("slot", slots_g[s % n_gslots], s % n_gslots)
                elif u is self.root_unit and root_gslot is not None:
                    gbuf = _Buffer("slot", slots_g[root_gslot], root_gslot)
                else:
                    gkeep = self.fsdp_double_buffer or self.strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)
                    gbuf = _Buffer("persistent" if gkeep else "dynamic", torch.zeros(u.grad_numel, dtype=gdt, device=dev))
                u.init_storage(flat, pbuf, gbuf)
            if self.tp_topology is not None:
                _tensor.refuse_differing_replicated(self.tp_topology, differ)

    def _root_grad_slot(self, db_units: List[FSDPUnit], n_gslots: int) -> Optional[int]:
        """The gradient slot the root unit borrows, or None for a buffer of its own.

        [Note: the root's gradients in a slot] The root's parameters (embeddings, output layer, final norm)
        fold and reduce once per backward, in its post-backward at the very end, when every unit's backward is
        over. A buffer of its own would hold ``grad_numel`` elements for the whole run (64 MiB of fp32 in the
        compute config; the 2-GPU eager peak exceeded FSDP2's by about that much, S10); a slot is
        free then: it takes the slot the first unit of plan order (whose backward ran just before) does not
        use, retiring that slot's earlier reduction like any unit. Not when a TE module of the root writes its
        weight gradient during the backward (fused weight-gradient accumulation): it would hold the slot from
        its first GEMM, while the units still need it.
        """
        root = self.root_unit
        if root is None or not db_units or self.strategy is ShardingStrategy.OPTIM or not root.grad_numel:
            return None
        if root.grad_numel > self.grad_slot_numel or (root.fused is not None and root.fused.any_fused()):
            return None
        return 1 % n_gslots

    def _register_hooks(self) -> None:
        for u in self.units:
            pre, reg_post_bwd, post, reg_pre_bwd = make_unit_hooks(u)
            m = u.module
            u.hook_handles = [
                m.register_forward_pre_hook(pre),
                m.register_forward_pre_hook(reg_post_bwd, with_kwargs=True),
                m.register_forward_hook(post),
                m.register_forward_hook(reg_pre_bwd),
            ]
            # [Note: calls outside the unit] every submodule that owns parameters of this unit refuses calls
            # made while the unit is not computing.
            for name, sub in self._param_owners(u):
                u.hook_handles.append(sub.register_forward_pre_hook(make_call_guard(u, name)))

    def _param_owners(self, unit: FSDPUnit) -> List[Tuple[str, nn.Module]]:
        """Submodules of ``unit`` (not the unit itself, not inside a nested unit) that own its parameters."""
        mine = {id(p) for p in unit.all_params}
        nested = {id(u.module) for u in self.units if u is not unit}
        out: List[Tuple[str, nn.Module]] = []
        stack = [(unit.name, unit.module)]
        while stack:
            prefix, mod = stack.pop()
            for cn, child in mod.named_children():
                if id(child) in nested:
                    continue
                qual = f"{prefix}.{cn}" if prefix else cn
                if any(id(p) in mine for p in child.parameters(recurse=False)):
                    out.append((qual, child))
                stack.append((qual, child))
        return out

    # ------------------------------------------------------------------ queries on the plan
    def unit_of(self, module: nn.Module) -> Optional[FSDPUnit]:
        """The unit that owns ``module`` (the nearest enclosing unit module), or None for the root."""
        for m in self._ancestors(module):
            u = getattr(m, "_megatron_fsdp_unit", None)
            if u is not None and u.engine is self:
                return u
        return None

    def _ancestors(self, module: nn.Module) -> List[nn.Module]:
        path = {id(m): n for n, m in self.module.named_modules()}
        if id(module) not in path:
            raise ValueError(f"{type(module).__name__} is not a submodule of the sharded model")
        name = path[id(module)]
        out = [module]
        while name:
            name = name.rsplit(".", 1)[0] if "." in name else ""
            out.append(self.module.get_submodule(name) if name else self.module)
        return out

    def unit_uses_recompute(self, unit: FSDPUnit) -> bool:
        """Whether ``unit`` runs under activation checkpointing: seen recomputing, or inside a checkpoint wrapper.

        A graph layer calls it to refuse graphing such units: a recomputed forward would replay the graph
        inside backward. The dynamic half only knows after an eager step that ran backward.
        """
        if unit.recomputed:
            return True
        return any(type(m).__name__ == "CheckpointWrapper" or hasattr(m, "_checkpoint_wrapped_module")
                   for m in self._ancestors(unit.module))

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
        ``optimizer.zero_grad()`` before the next step. Every unit re-installs its parameters from the shards at
        its next use (FP8 weights are quantized again), so a write to the main shards the engine could not see (an
        optimizer step that raised part-way, a write through ``.data``, an optimizer graph of your own) is taken.
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
            u.mark_stale()
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

    # ------------------------------------------------------------------ gradients (see _clip.py)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the main gradients by their global norm (all ranks); return that norm (before clipping).

        The FSDP2 / Megatron-FSDP spelling of ``torch.nn.utils.clip_grad_norm_``, which is refused over
        ``optimizer_parameters()`` (one rank's shard: [Note: local norms] in _clip.py) and over ``parameters()`` (no
        gradient there: [Note: compute parameters hold no gradient] in _clip.py).
        A collective: call it on every rank after backward, before ``optimizer.step()``. ``foreach`` is
        accepted for signature compatibility.
        """
        return _clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def total_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of the main gradients without clipping (a collective)."""
        return _clip.total_grad_norm(self, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that also clears the fp32 main gradients (what ``optimizer.zero_grad()`` over
        ``optimizer_parameters()`` clears): ``set_to_none`` drops them, ``False`` zeroes them in place."""
        super().zero_grad(set_to_none)  # the compute parameters (and their sentinels)
        for p in self.optimizer_parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch.optim.Optimizer.zero_grad: the main gradient may be a view of a flat buffer
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # ------------------------------------------------------------------ state dicts (see _state_dict.py)
    def state_dict(self, *args: Any, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        """Full fp32 parameters and persistent buffers under the unwrapped model's keys, on every rank.

        The nn.Module API ([Note: state dict keys and values] in _state_dict.py): a collective (all-gather
        per unit), so call it on every rank. Values are copies; ``keep_vars`` is accepted and ignored. A tied
        parameter appears under each of its names, one tensor ([Note: tied parameters]).
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
        """Parameters for ``torch.distributed.checkpoint``: fp32 DTensors, ``Shard(0)`` over the process group
        (expert parameters over their groups: [Note: expert parallelism] in _expert.py, Checkpoints).

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
