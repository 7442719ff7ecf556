"""Engine builders: how the checker, the apps and the benchmarks shard a model under each FSDP engine.

One :class:`EngineBuilder` per engine, in the engine's folder (``<engine>/build.py``), registered in the one
registry (``registry.register_builder``; ``registry.engine_builder(name, device)`` hands it out), each answering
the same questions, so the checker's training loop names no engine:

- ``unavailable(device)``: why the engine cannot run here (None: it can), asked before any work, as the
  exception to raise (ImportError: a package is missing; RuntimeError: the machine lacks something);
- ``build(model, unit_modules, make_optimizer, ...)``: the sharded model as a :class:`ShardedRun`, i.e. what
  the loss calls and ``PartialCudaGraphs`` wraps, the user's module (``select_modules`` and
  ``get_submodule`` names are relative to it), the optimizer, the optimizer's parameters by name (the
  gradient recorder reads their ``.grad``) and the final parameters to compare.

Engines:

- ``megatron_fsdp``: this project's engine, ``fully_shard`` with the double buffer and persistent buffers
  (address-stable ZeRO-3); ``compute_dtype`` is its compute dtype, main parameters stay fp32.
- ``fsdp2``: PyTorch's ``torch.distributed.fsdp.fully_shard`` on every unit module, then the root. Options
  (``engine_options``): ``storage`` ``keep`` (default: ``keep_unsharded_storage``, every unit's unsharded
  parameters held) or ``slots`` (``use_unsharded_slots``: two preallocated slots, units alternating, ZeRO-3
  memory; 2+ ranks); ``mixed_precision`` ``None`` (default: the model is cast to ``compute_dtype`` before
  sharding, parameters, gradients and optimizer state in that dtype) or ``bf16`` (fp32 sharded parameters
  and optimizer state, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every unit and
  the root, as FSDP2 and torchtitan train; ``compute_dtype`` must then be None or float32);
  ``expert_parallel_size`` (default 1: for a model built with expert parallelism, each experts module its own
  ``fully_shard`` over the expert-data-parallel mesh, [Note: FSDP2 expert parallelism]). See docs/engines.md,
  "PyTorch FSDP2".
- ``nvidia``: NVIDIA Megatron-FSDP through megatron-core's bundled copy
  (``megatron.core.distributed.fsdp.src.megatron_fsdp``), ZeRO-3 with ``fsdp_double_buffer`` and, where the
  version has it (0.6.1), ``fsdp_db_use_persist_buf_on_alloc_fail``; the module is cast to ``compute_dtype``
  (NVIDIA computes in the module's dtype) with fp32 main parameters and gradients. NVIDIA's ``fully_shard``
  replaces the optimizer's parameter groups by one group of its main parameters, so the optimizer's
  defaults apply (per-group settings of ``make_optimizer`` are dropped). Needs CUDA and megatron-core.
  Option ``wrapper``: ``fully_shard`` (default, the bundled ``megatron_fsdp.fully_shard``) or ``mcore``
  (megatron-core's ``FullyShardedDataParallel`` with a ``DistributedDataParallelConfig(use_megatron_fsdp=True,
  ...)`` over the same units, for megatron-core models; it builds the same ``MegatronFSDP`` engine, with
  megatron-core's parallel-state groups; the optimizer is wired by NVIDIA's ``fully_shard_optimizer``).

Final parameters: ``megatron_fsdp`` and ``fsdp2`` gather full parameters on every rank; ``nvidia`` gives this
rank's shard of each main parameter (the checker agrees its verdict over ranks, so equal shards on every
rank are equal parameters).

Expert parallelism (``expert_groups``): ``megatron_fsdp`` and ``nvidia`` shard the expert parameters over the
expert-data-parallel group (see their build.py); ``fsdp2`` refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["EngineBuilder", "ShardedRun", "check_options", "unit_classes", "is_unit", "cpu_copy", "UnitSpec", "MakeOptimizer"]

UnitSpec = Union[type, str]
MakeOptimizer = Callable[[List[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass
class ShardedRun:
    """One model sharded by one engine, as the checker's training loop uses it."""

    #: what the loss calls and ``PartialCudaGraphs`` wraps
    model: nn.Module
    #: the user's module: callable names (``select_modules``, ``get_submodule``) are relative to it
    root: nn.Module
    optimizer: torch.optim.Optimizer
    #: ``() -> [(name, parameter)]``: the optimizer's parameters, whose ``.grad`` the recorder reads after backward
    named_parameters: Callable[[], Sequence[Tuple[str, torch.Tensor]]]
    #: ``() -> {name: tensor on the CPU}``: the final parameters, compared rank by rank (a collective: every rank)
    final_parameters: Callable[[], Dict[str, torch.Tensor]]
    #: one line for the report: what runs in which dtype
    precision: str


@dataclasses.dataclass(frozen=True)
class EngineBuilder:
    """How the checker runs under one engine (registered with ``registry.register_builder``)."""

    name: str
    #: ``(model, *, unit_modules, make_optimizer, device, sharding_strategy, compute_dtype) -> ShardedRun``, and
    #: ``options=`` (the engine's own, see ``options``) and ``expert_groups=`` (``(EP group, EDP group)`` of a
    #: model built with expert parallelism, ``ModelSpec.expert_groups``) when the checker has any: an engine that
    #: cannot shard experts over the expert-data-parallel group refuses them (``NotImplementedError``)
    build: Callable[..., ShardedRun]
    #: ``device -> why it cannot run here (ImportError or RuntimeError carrying the reason), or None``
    unavailable: Callable[[torch.device], Optional[Exception]]
    #: ``CudaGraphConfig.use_megatron_fsdp`` (the Megatron-FSDP address-stability flags are checked)
    use_megatron_fsdp: bool
    #: what makes it available, for the refusal
    fix: str = ""
    #: the ``engine_options`` keys ``build`` takes (passed as ``options=``); others are refused
    options: Tuple[str, ...] = ()
    #: whether ``build`` takes ``tensor_groups=`` (``(TP group, DP group)``, ``ModelSpec.tensor_groups``); the
    #: checker refuses a TP model on an engine that does not
    tensor_parallel: bool = False


def check_options(builder: EngineBuilder, options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``options`` for ``builder``, refusing a key the engine does not take (ValueError naming the keys it does)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(builder.options))
    if unknown:
        takes = f"it takes {list(builder.options)}" if builder.options else "it takes none"
        raise ValueError(f"engine_options {unknown} are not options of engine={builder.name!r} ({takes}); drop them "
                         "or pick the engine they belong to")
    return options


def is_unit(module: nn.Module, unit_modules: Sequence[UnitSpec]) -> bool:
    """As ``megatron_fsdp.fully_shard`` reads ``fsdp_unit_modules``: an instance of a class, or a class name."""
    return any(type(module).__name__ == s if isinstance(s, str) else isinstance(module, s) for s in unit_modules)


def unit_classes(model: nn.Module, unit_modules: Sequence[UnitSpec], *, engine: str) -> List[type]:
    """The classes of ``model``'s submodules that ``unit_modules`` selects (see :func:`is_unit`), in module
    order; ValueError naming the classes present when none is selected."""
    if not unit_modules:
        raise ValueError(f"engine={engine!r}: unit_modules is empty; name the FSDP unit class (e.g. your decoder "
                         "layer's class or its class name) in the factory's ModelSpec")
    found: List[type] = []
    for m in model.modules():
        if m is not model and is_unit(m, unit_modules) and type(m) not in found:
            found.append(type(m))
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"engine={engine!r}: unit_modules={[getattr(s, '__name__', s) for s in unit_modules]} "
                         f"matches no submodule of {type(model).__name__}; its module classes are {present[:20]}; "
                         "name one of those in the factory's ModelSpec")
    return found


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()
