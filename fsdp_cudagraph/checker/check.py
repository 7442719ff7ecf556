"""Alignment checker: does *your* model train bit-identically with partial CUDA graphs? If not, where not?

:func:`check_alignment` trains the model a factory builds twice under one FSDP engine on the factory's
batches, eagerly and with partial graphs captured before ``capture_step``, and reports per step whether
the losses are equal (``torch.equal``, on every rank), whether the final parameters are equal, and, on a
mismatch, the first graphed callable whose output (or backward) differs in the first step that differs
(see [Note: localising a mismatch] in ``checker/divergence.py``). It also reports each callable's TE attention
backend eagerly and under capture, the hooks kept but not run at capture, and calls that ran eagerly
because they differed from capture.

The factory protocol (a few lines for any model)::

    from fsdp_cudagraph.check import ModelSpec

    def my_factory(device):                        # called with torch seeded identically on every rank
        model = MyModel(...).to(device)
        return ModelSpec(
            model=model,
            unit_modules=[MyDecoderLayer],         # the FSDP units (classes or class names)
            batch=lambda step: my_batch(step, device),   # this rank's batch for a step, deterministic
            loss=lambda model, batch: model(**batch).loss,
        )

Engines (``engine=`` / ``--engine``; how each shards the model: ``engines/<engine>/build.py``):

- ``megatron_fsdp`` (default): this project's ``fully_shard``, ZeRO-3 with its double buffer; compute in
  ``--dtype``, fp32 main parameters (``--keep-compute-shard``: the shards cast once a step and kept). CPU (Gloo)
  or GPU.
- ``fsdp2``: PyTorch's ``torch.distributed.fsdp.fully_shard`` on each unit, then the root, with
  ``keep_unsharded_storage`` (``--fsdp2-storage slots``: ``use_unsharded_slots``, two slots, ZeRO-3 memory,
  2+ ranks). ``--dtype`` is the dtype the model is cast to (parameters, gradients and optimizer state);
  ``--fsdp2-mp bf16`` instead keeps fp32 sharded parameters under ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, as FSDP2 users train (its casts run in FSDP2's hooks, around each replay as around
  the eager call). ``--strategy`` ``optim_grads_params`` or ``optim_grads``. CPU (Gloo) or GPU.
- ``nvidia``: NVIDIA Megatron-FSDP through megatron-core (``pip install 'megatron-core==0.19.2'``), ZeRO-3
  with its double buffer, module in ``--dtype``, fp32 main parameters; the final parameters are compared
  shard by shard. GPU only: refused before any work elsewhere.

Run (1 GPU, 2 GPUs, CPU)::

    python -m fsdp_cudagraph.check --model my_pkg.my_module:my_factory --patterns 'model.layers.*.mlp'
    torchrun --nproc-per-node 2 -m fsdp_cudagraph.check --model fsdp_cudagraph.apps.hf_models:llama
    python -m fsdp_cudagraph.check --model fsdp_cudagraph.apps.hf_models:llama --device cpu   # protocol backend
    python -m fsdp_cudagraph.check --engine fsdp2 --model my_pkg.my_module:my_factory     # under PyTorch FSDP2
    python -m fsdp_cudagraph.check --engine nvidia --model my_pkg.my_module:my_factory    # NVIDIA's, 1 GPU

``--perturb NAME`` is a negative control: it scales the graphed output of callable NAME by 1.01 from the
capture on (graphed run only); the checker must then report a mismatch naming NAME (exit status 0 if it
does). Without ``--perturb`` the exit status is 0 if everything is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import socket
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.config import CudaGraphConfig
from fsdp_cudagraph.graphs import partial as _capture
from fsdp_cudagraph.capture.te import HAS_TE
from fsdp_cudagraph.checker.divergence import StepRecorder, describe_divergence, first_divergence
from fsdp_cudagraph.engines.build import EngineBuilder, check_options
from fsdp_cudagraph.engines.registry import adapter_for, engine_builder, registered_builders, unavailable_engines
from fsdp_cudagraph.checker.records import write_record

__all__ = ["ModelSpec", "AlignmentReport", "check_alignment", "main"]

logger = logging.getLogger(__name__)


def _adam(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


@dataclasses.dataclass
class ModelSpec:
    """What a checker factory returns (see the module docstring).

    Attributes:
        model: the model, on the device the factory was given, built the same way on every rank.
        unit_modules: FSDP unit classes or class names (``fully_shard``'s ``fsdp_unit_modules``).
        batch: ``step -> batch``, this rank's batch; must return the same batch when called twice.
        loss: ``(sharded model, batch) -> scalar loss`` (one forward).
        make_optimizer: ``optimizer parameters -> optimizer``; default Adam, lr 1e-3.
        expert_groups: ``(expert-parallel group, expert-data-parallel group)`` of this rank, for a model built
            with expert parallelism (EP > 1: each rank holds only its ``E/EP`` local experts and the model's
            token exchange runs over the first group); None (default): no expert parallelism. The engine shards
            the expert parameters over the second group (``megatron_fsdp``: ``fully_shard(expert_parallel_group=,
            expert_data_parallel_group=)``; ``nvidia``: its expert device mesh); an engine that cannot is refused.
        tensor_groups: ``(tensor-parallel group, data-parallel group)`` of this rank, for a model built with
            tensor parallelism (TP > 1: each rank holds its TP slice; megatron-core's ``tensor_model_parallel`` and
            ``sequence_parallel`` parameter tags say which parameters are shards and which need their gradients
            summed over TP). ``megatron_fsdp`` takes them as ``fully_shard(process_group=dp,
            tensor_parallel_group=tp)``, ``nvidia`` with ``engine_options wrapper='mcore'`` checks that they are
            megatron-core's parallel-state groups (``FullyShardedDataParallel`` reads them there); ``fsdp2`` and
            ``nvidia`` with wrapper ``fully_shard`` refuse them. None (default): no tensor parallelism.
    """

    model: nn.Module
    unit_modules: Sequence[Union[type, str]]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer] = _adam
    expert_groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
    tensor_groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None


@dataclasses.dataclass
class AlignmentReport:
    """What :func:`check_alignment` found. ``equal`` is the verdict, the same on every rank."""

    equal: bool
    #: the FSDP engine both runs trained under (``megatron_fsdp``, ``fsdp2`` or ``nvidia``)
    engine: str
    #: what ran in which dtype under that engine (one line)
    precision: str
    backend: str
    world_size: int
    scope: str
    callables: List[str]
    #: per step: {"step", "eager_loss", "graphed_loss" (this rank's), "equal" (on every rank)}
    steps: List[Dict[str, Any]]
    first_mismatch_step: Optional[int]
    params_equal: bool
    #: the first graphed callable to blame (None when equal, or when the difference starts outside callables)
    culprit: Optional[str] = None
    #: {"step", "rank", "record", "what", "explanation"} of the earliest divergence over ranks
    divergence: Optional[Dict[str, Any]] = None
    attention_backends: Dict[str, Dict[str, str]] = dataclasses.field(default_factory=dict)
    unknown_hooks: List[str] = dataclasses.field(default_factory=list)
    #: callable -> {"replays", "eager_calls", "last_change"}
    calls: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    perturbed: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A human-readable report."""
        lines = [f"fsdp_cudagraph alignment check: engine {self.engine}, backend {self.backend}, "
                 f"{self.world_size} rank(s), scope {self.scope}, {len(self.callables)} graphed callables"
                 + (f" (negative control: {self.perturbed} perturbed)" if self.perturbed else ""),
                 f"engine {self.engine}: {self.precision}"]
        lines.append(f"{'step':>4}  {'eager loss':>14}  {'graphed loss':>14}  result")
        for s in self.steps:
            lines.append(f"{s['step']:4d}  {s['eager_loss']:14.8f}  {s['graphed_loss']:14.8f}  "
                         f"{'equal' if s['equal'] else 'MISMATCH'}")
        lines.append(f"final parameters: {'equal' if self.params_equal else 'DIFFER'}")
        if self.equal:
            lines.append("verdict: EQUAL (losses and parameters bit-identical on every rank)")
        else:
            lines.append(f"verdict: MISMATCH (first differing loss: step {self.first_mismatch_step})")
            if self.divergence:
                d = self.divergence
                lines.append(f"first divergence: step {d['step']}, rank {d['rank']}: {d['explanation']}")
            lines.append(f"first graphed callable to differ: {self.culprit or 'none (outside graphed callables)'}")
        for name, sel in self.attention_backends.items():
            mark = "" if sel.get("eager") == sel.get("graph") else "   <- differ"
            lines.append(f"TE attention {name}: eager {sel.get('eager')}, graph {sel.get('graph')}{mark}")
        if not self.attention_backends:
            lines.append("TE attention: none inside the graphed callables")
        lines.append(f"hooks kept but not run at capture: {self.unknown_hooks or 'none'}")
        fell_back = {n: c for n, c in self.calls.items() if c["eager_calls"]}
        for n, c in fell_back.items():
            lines.append(f"ran eagerly {c['eager_calls']}x (call differed from capture): {n}: {c['last_change']}")
        if not fell_back:
            lines.append("every call after capture replayed its graph")
        return "\n".join(lines)


@contextlib.contextmanager
def _deterministic_kernels() -> Iterator[None]:
    """Both runs must use deterministic kernels, or they differ for reasons of their own: PyTorch's
    deterministic mode (e.g. flash SDPA's backward accumulates with atomics otherwise) and, for TE's attention,
    which reads it at each backend selection, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (a value the user set is
    kept). Both are restored afterwards. cuBLAS also wants CUBLAS_WORKSPACE_CONFIG, which only works when set
    before CUDA starts: the command line sets it."""
    key = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
    set_env = key not in os.environ
    if set_env:
        os.environ[key] = "0"
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # a cost, not a need here
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        if set_env:
            os.environ.pop(key, None)


def _default_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "protocol"
    return "te" if HAS_TE else "torch"


def _perturb(graphed: Callable[..., Any]) -> Callable[..., Any]:
    def perturbed(*tensors: torch.Tensor) -> Any:
        out = graphed(*tensors)
        seq = list(out) if isinstance(out, (tuple, list)) else [out]
        for i, t in enumerate(seq):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seq[i] = t * 1.01
                break
        return tuple(seq)

    return perturbed


def _train(factory: Callable[[torch.device], ModelSpec], *, engine: EngineBuilder, graphed: bool,
           device: torch.device, backend: str, config: CudaGraphConfig, steps: int, seed: int,
           sharding_strategy: str, compute_dtype: Optional[torch.dtype], perturb: Optional[str],
           engine_options: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    spec = factory(device)
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"the model factory returned {type(spec).__name__}; it must return a "
                        "fsdp_cudagraph.check.ModelSpec(model=..., unit_modules=..., batch=..., loss=...)")
    extra: Dict[str, Any] = {"options": engine_options} if engine_options else {}
    if spec.expert_groups is not None:
        extra["expert_groups"] = spec.expert_groups
    if spec.tensor_groups is not None:
        if not engine.tensor_parallel:
            raise NotImplementedError(
                f"engine={engine.name!r} with a model's tensor-parallel groups (TP="
                f"{dist.get_world_size(spec.tensor_groups[0])}): its builder shards every parameter over one group "
                "of all ranks and would treat the TP ranks' different slices as one data-parallel model; use "
                "engine='megatron_fsdp' (fully_shard(process_group=dp, tensor_parallel_group=tp)) or engine='nvidia' "
                "with engine_options wrapper='mcore'")
        extra["tensor_groups"] = spec.tensor_groups
    run = engine.build(spec.model, unit_modules=spec.unit_modules, make_optimizer=spec.make_optimizer, device=device,
                       sharding_strategy=sharding_strategy, compute_dtype=compute_dtype, **extra)
    model, opt, root, precision = run.model, run.optimizer, run.root, run.precision
    watched = _capture.select_modules(adapter_for(model), config)
    graphs = _capture.PartialCudaGraphs(model, config, backend=backend) if graphed else None
    matcher = None if graphed else _capture.match_graph_attention(model, config)
    recorder = StepRecorder(watched)
    losses: List[torch.Tensor] = []
    records: List[Any] = []
    report = None
    try:
        for step in range(steps):
            if graphs is not None and step == config.cuda_graph_warmup_steps:
                report = graphs.capture()
                if perturb is not None:
                    names = [n for n, _ in watched]
                    if perturb not in names:
                        raise ValueError(f"perturb={perturb!r} is not a graphed callable; choose one of {names}")
                    dispatcher = root.get_submodule(perturb).__dict__["forward"]
                    dispatcher.graphed = _perturb(dispatcher.graphed)
            recorder.start()
            loss = spec.loss(model, spec.batch(step))
            recorder.loss(loss)
            loss.backward()
            recorder.grads(run.named_parameters())
            records.append(recorder.stop())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float().cpu())
        state = run.final_parameters()
        calls = {}
        if graphs is not None and graphs.captured:
            for n, _ in watched:
                d = root.get_submodule(n).__dict__.get("forward")
                calls[n] = {"replays": getattr(d, "replays", 0), "eager_calls": getattr(d, "eager_calls", 0),
                            "last_change": getattr(d, "last_change", None)}
    finally:
        recorder.stop()
        if graphs is not None:
            graphs.delete()
        if matcher is not None:
            matcher.uninstall()
    del model, opt, root, run, spec, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "records": records, "state": state, "report": report, "calls": calls,
            "callables": [n for n, _ in watched], "precision": precision}


def check_alignment(
    factory: Callable[[torch.device], ModelSpec],
    *,
    steps: int = 8,
    capture_step: int = 3,
    backend: Optional[str] = None,
    cuda_graph_modules: Sequence[str] = (),
    cuda_graph_module_patterns: Sequence[str] = (),
    sharding_strategy: str = "optim_grads_params",
    compute_dtype: Optional[torch.dtype] = None,
    num_warmup_iters: int = 3,
    seed: int = 1234,
    device: Optional[torch.device] = None,
    perturb: Optional[str] = None,
    engine: str = "megatron_fsdp",
    engine_options: Optional[Dict[str, Any]] = None,
) -> AlignmentReport:
    """Train ``factory``'s model eagerly and with partial graphs; compare per step; localise a mismatch.

    ``engine``: ``megatron_fsdp`` (default), ``fsdp2`` or ``nvidia`` (see the module docstring); an unknown
    name (``ValueError``) or an engine this machine cannot run (``ImportError``/``RuntimeError``, e.g.
    ``nvidia`` without a GPU) is refused before the factory is called. ``engine_options``: the engine's own
    settings (``fsdp2``: ``storage`` keep|slots, ``mixed_precision`` None|bf16; see ``engines/fsdp2/build.py``);
    a key the engine does not take is refused (``ValueError``) before any work. ``sharding_strategy`` and
    ``compute_dtype`` are read per engine (``fsdp2``: the model is cast to ``compute_dtype`` unless
    ``mixed_precision`` is set).

    Needs an initialised process group (every rank calls it; the verdict is agreed over ranks). Scope:
    ``cuda_graph_modules`` (tags) or ``cuda_graph_module_patterns`` (globs or class names); neither means
    whole FSDP units. ``backend`` defaults to ``te`` (TE installed) or ``torch`` on CUDA and ``protocol`` on
    CPU. ``perturb`` names a callable whose graphed output is scaled by 1.01 after capture (negative control).

    Determinism: both runs use PyTorch's deterministic algorithms (warn-only) and, for TE attention,
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` unless the environment sets it; both are restored afterwards.
    Set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before CUDA starts (the command line does).

    Hazards: both runs build the model from the same seed, one after the other (memory for one model at a
    time); the factory and ``batch`` must be deterministic, and the model free of dropout and other
    randomness, or the runs differ for reasons of their own. Recording adds hooks around each callable and
    small kernels per tensor; it does not change what the model computes.
    """
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    builder = engine_builder(engine, device)  # an unknown or unavailable engine is refused before any work
    engine_options = check_options(builder, engine_options)
    if not dist.is_initialized():
        raise RuntimeError(f"check_alignment needs an initialised process group (engine {engine} shards over it); "
                           "call torch.distributed.init_process_group first, or run python -m fsdp_cudagraph.check")
    if not 1 <= capture_step < steps:
        raise ValueError(f"capture_step={capture_step} and steps={steps}: need 1 <= capture_step < steps (at least "
                         "one eager step before capture and one replayed step after)")
    backend = backend or _default_backend(device)
    impl = "transformer_engine" if backend == "te" else "local"
    config = CudaGraphConfig(
        cuda_graph_impl=impl, cuda_graph_modules=list(cuda_graph_modules),
        cuda_graph_module_patterns=list(cuda_graph_module_patterns), cuda_graph_warmup_steps=capture_step,
        cuda_graph_num_warmup_iters=num_warmup_iters, use_megatron_fsdp=builder.use_megatron_fsdp,
        fsdp_double_buffer=builder.use_megatron_fsdp, fsdp_db_use_persist_buf_on_alloc_fail=builder.use_megatron_fsdp,
    )
    common = dict(engine=builder, device=device, backend=backend, config=config, steps=steps, seed=seed,
                  sharding_strategy=sharding_strategy, compute_dtype=compute_dtype, engine_options=engine_options)
    with _deterministic_kernels():
        logger.info("check_alignment: engine %s, eager run, %d steps", engine, steps)
        eager = _train(factory, graphed=False, perturb=None, **common)
        logger.info("check_alignment: graphed run (%s backend), capture before step %d", backend, capture_step)
        graphed = _train(factory, graphed=True, perturb=perturb, **common)

    rank, world = dist.get_rank(), dist.get_world_size()
    local_eq = [torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])]
    params_eq = eager["state"].keys() == graphed["state"].keys() and all(
        torch.equal(eager["state"][k], graphed["state"][k]) for k in eager["state"])
    flags = torch.tensor(local_eq + [params_eq], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    agreed = [bool(x) for x in flags.tolist()]
    step_eq, params_all = agreed[:-1], agreed[-1]
    found = first_divergence(eager["records"], graphed["records"])
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, None if found is None else (found[0], rank, found[1], found[2]))
    divergences = sorted((d for d in everyone if d is not None), key=lambda d: (d[0], d[1]))
    culprit, divergence = None, None
    if divergences:
        step, at_rank, key, what = divergences[0]
        culprit, explanation = describe_divergence(key, what)
        divergence = {"step": step, "rank": at_rank, "record": list(key), "what": what, "explanation": explanation}
    report = graphed["report"]
    equal = all(step_eq) and params_all
    return AlignmentReport(
        equal=equal,
        engine=engine,
        precision=graphed["precision"],
        backend=backend,
        world_size=world,
        scope=(f"patterns {list(cuda_graph_module_patterns)}" if cuda_graph_module_patterns
               else f"modules {list(cuda_graph_modules)}" if cuda_graph_modules else "whole FSDP units"),
        callables=graphed["callables"],
        steps=[{"step": i, "eager_loss": float(a), "graphed_loss": float(b), "equal": e}
               for i, (a, b, e) in enumerate(zip(eager["losses"], graphed["losses"], step_eq))],
        first_mismatch_step=next((i for i, e in enumerate(step_eq) if not e), None),
        params_equal=params_all,
        culprit=culprit,
        divergence=divergence if not equal or divergences else None,
        attention_backends=dict(getattr(report, "attention_backends", {}) or {}),
        unknown_hooks=list(getattr(report, "unknown_hooks", []) or []),
        calls=graphed["calls"],
        perturbed=perturb,
    )


# ---------------------------------------------------------------------------------------------- command line


def load_factory(path: str) -> Callable[[torch.device], ModelSpec]:
    """``"pkg.module:attr"`` -> the factory object."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {path!r}: expected 'package.module:factory', e.g. fsdp_cudagraph.apps.hf_models:llama")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--model {path!r}: module {module_name} has no attribute {attr!r}") from None


def _init_process_group(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # one process without torchrun
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def plain_text(doc: str) -> str:
    """``doc`` without its Sphinx markup, for ``--help``: ``x`` and :func:`~pkg.x` read x, a literal block's ``::``
    reads ``:``."""
    doc = re.sub(r":[a-z]+:`([^`]+)`", lambda m: _role_name(m.group(1)), doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    return re.sub(r"(\S)::$", r"\1:", doc, flags=re.MULTILINE)


def _role_name(target: str) -> str:
    # :func:`~a.b.name` shows "name"; :func:`a.b.name` shows the whole path, as Sphinx renders them.
    return target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_cudagraph.check", description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="factory as package.module:name (see the factory protocol)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--capture-step", type=int, default=3)
    p.add_argument("--backend", choices=["te", "torch", "protocol"], default=None,
                   help="default: te (TE installed) or torch on CUDA, protocol on CPU")
    p.add_argument("--modules", nargs="*", default=[], help="cuda_graph_modules tags (attn, mlp, ...)")
    p.add_argument("--patterns", nargs="*", default=[], help="cuda_graph_module_patterns (globs or class names)")
    # an engine that failed to load stays a choice: engine_builder then names why and the fix
    p.add_argument("--engine", choices=sorted(set(registered_builders()) | set(unavailable_engines())),
                   default="megatron_fsdp",
                   help="the FSDP engine both runs train under (default megatron_fsdp; nvidia needs a GPU and "
                        "megatron-core)")
    p.add_argument("--strategy", default="optim_grads_params",
                   help="sharding strategy (fsdp2: optim_grads_params or optim_grads)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="compute dtype (default bf16 on CUDA, fp32 on CPU; fsdp2: the dtype the model is cast to)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--fsdp2-storage", choices=["keep", "slots"], default=None,
                   help="engine fsdp2: keep (keep_unsharded_storage, default) or slots (use_unsharded_slots, 2+ ranks)")
    p.add_argument("--fsdp2-mp", choices=["bf16"], default=None,
                   help="engine fsdp2: fp32 sharded parameters with MixedPrecisionPolicy(param_dtype=bf16, "
                        "reduce_dtype=fp32) instead of casting the model to --dtype")
    p.add_argument("--keep-compute-shard", action="store_true",
                   help="engine megatron_fsdp: fully_shard(keep_compute_shard=True), the shards cast to --dtype once "
                        "a step and kept (needs --dtype bf16 or fp16)")
    p.add_argument("--nvidia-wrapper", choices=["fully_shard", "mcore"], default=None,
                   help="engine nvidia: NVIDIA's fully_shard (default) or megatron-core's FullyShardedDataParallel "
                        "(a megatron-core model only)")
    p.add_argument("--perturb", default=None, help="negative control: perturb this callable's graphed output")
    p.add_argument("--json", default=None, help="write the report as JSON (rank 0)")
    args = p.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts
    logging.basicConfig(level=logging.WARNING)
    engine_options = {k: v for k, v in (("storage", args.fsdp2_storage), ("mixed_precision", args.fsdp2_mp))
                      if v is not None}
    if engine_options and args.engine != "fsdp2":
        p.error(f"--fsdp2-storage/--fsdp2-mp are options of --engine fsdp2, not --engine {args.engine}")
    if args.keep_compute_shard:
        if args.engine != "megatron_fsdp":
            p.error(f"--keep-compute-shard is an option of --engine megatron_fsdp, not --engine {args.engine}")
        engine_options["keep_compute_shard"] = True
    if args.nvidia_wrapper is not None:
        if args.engine != "nvidia":
            p.error(f"--nvidia-wrapper is an option of --engine nvidia, not --engine {args.engine}")
        engine_options["wrapper"] = args.nvidia_wrapper
    if args.fsdp2_mp and args.dtype not in (None, "fp32"):
        p.error(f"--fsdp2-mp {args.fsdp2_mp} keeps fp32 parameters and computes in the policy's dtype; drop "
                f"--dtype {args.dtype}")
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = _init_process_group(kind)
    dtype: Optional[torch.dtype] = None  # --fsdp2-mp: fp32 sharded parameters, the policy computes in bf16
    if not args.fsdp2_mp:
        dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        report = check_alignment(
            load_factory(args.model), steps=args.steps, capture_step=args.capture_step, backend=args.backend,
            cuda_graph_modules=args.modules, cuda_graph_module_patterns=args.patterns,
            sharding_strategy=args.strategy, compute_dtype=dtype, device=device, perturb=args.perturb,
            engine=args.engine, engine_options=engine_options,
        )
        if args.perturb:
            ok = not report.equal and report.culprit == args.perturb
        else:
            ok = report.equal
        if dist.get_rank() == 0:
            print(report.format())
            if args.perturb:
                print(f"negative control: {'CAUGHT' if ok else 'NOT CAUGHT'} (perturbed {args.perturb}, "
                      f"reported {report.culprit})")
            if args.json:
                write_record(args.json, {"command": " ".join(sys.argv), "model": args.model, "dtype": str(dtype),
                                         "ok": ok, **report.to_dict()})
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1

