"""Configuration of per-layer ("partial") CUDA graphs: typed options, deprecated spellings, validation.

Lifecycle: a :class:`CudaGraphConfig` is built from keyword arguments (or from argparse through
:func:`config_from_args`), and its ``__post_init__`` does three things in order:

1. parse: strings become enum members (see :func:`parse_cuda_graph_impl`; case-insensitive, ``-`` may stand
   for ``_``, no other aliases);
2. migrate: the deprecated inputs (``enable_cuda_graph``, ``external_cuda_graph``, ``cuda_graph_scope``) are
   turned into the typed fields by :func:`migrate_deprecated_options`, with a ``DeprecationWarning`` each,
   and then reset to ``None`` so that the object holds one truth;
3. validate: every cross-field rule is checked in one pass and all violations are reported in one
   ``ValueError``.

Nothing here touches CUDA or TransformerEngine, so configs can be built and checked on CPU machines. What the
machine must provide is checked by :meth:`CudaGraphConfig.check_runtime`, which the capture entry point calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import warnings
from collections.abc import Iterable
from typing import Any, List, NamedTuple, Optional, Tuple, Type, Union

import torch

from fsdp_cudagraph.capture import fp8 as _fp8
from fsdp_cudagraph.capture import te as _te

logger = logging.getLogger(__name__)

__all__ = [
    "CudaGraphImpl", "CudaGraphModule", "InferenceCudaGraphScope", "CudaGraphConfig", "MigratedOptions",
    "BACKENDS", "WHOLE_STEP_BACKENDS",
    "parse_cuda_graph_impl", "parse_cuda_graph_module", "parse_cuda_graph_modules", "module_tag", "graph_unsafe_modules",
    "parse_inference_cuda_graph_scope", "migrate_deprecated_options", "add_cuda_graph_args", "config_from_args",
]


class _StrEnum(str, enum.Enum):
    """A str-valued enum whose members compare equal to, and print as, their value."""

    def __str__(self) -> str:
        return self.value


class CudaGraphImpl(_StrEnum):
    """Who captures the graphs."""

    NONE = "none"  # eager: no graphs
    LOCAL = "local"  # our capture through torch.cuda.make_graphed_callables
    TRANSFORMER_ENGINE = "transformer_engine"  # TE's make_graphed_callables (capture_time_hooks, TE >= 2.19)
    FULL_ITERATION = "full_iteration"  # forward+backward of a whole step in one graph (FullIterationCudaGraph)


class CudaGraphModule(_StrEnum):
    """Submodule kinds graphed separately; the model tags them with a ``cuda_graph_module`` attribute. A module
    that must never be inside a graph says why with ``cuda_graph_unsafe`` ([Note: graph-unsafe modules])."""

    ATTN = "attn"
    MLP = "mlp"
    MOE = "moe"  # the whole MoE block, router and preprocess included
    MOE_ROUTER = "moe_router"
    MOE_PREPROCESS = "moe_preprocess"  # token preprocessing after the router; graphed with the router
    MAMBA = "mamba"


class InferenceCudaGraphScope(_StrEnum):
    """What is graphed for inference: nothing, each layer, or the whole block of layers as one graph."""

    NONE = "none"
    LAYER = "layer"
    BLOCK = "block"


class _LegacyScope(_StrEnum):
    """The non-module values of the deprecated ``cuda_graph_scope``."""

    FULL_ITERATION = "full_iteration"
    FULL_ITERATION_INFERENCE = "full_iteration_inference"


_PER_LAYER_IMPLS = (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE)

#: [Note: backends] The one vocabulary of who captures, for every graph kind's ``backend=`` argument:
#: ``te``: TransformerEngine's ``make_graphed_callables`` (per-layer kinds only); ``torch``: PyTorch's graphs
#: (``torch.cuda.make_graphed_callables`` per layer, ``torch.cuda.graph`` for a whole step); ``protocol``: the
#: same schedule without graphs, on CPU. Per-layer kinds (PartialCudaGraphs, LengthBucketGraphs) take all three,
#: whole-step kinds (FullIterationCudaGraph, InferenceCudaGraphs) the last two. ``cuda_graph_impl`` maps to it
#: through :attr:`CudaGraphConfig.backend`. (Whole-step kinds spelled ``torch`` as ``cuda`` before.)
BACKENDS = ("te", "torch", "protocol")
WHOLE_STEP_BACKENDS = ("torch", "protocol")


def _valid(*enum_classes: Type[_StrEnum]) -> str:
    return ", ".join(m.value for cls in enum_classes for m in cls)


def _parse_enum(cls: Type[_StrEnum], value: Any, what: str, *extra: Type[_StrEnum]) -> Any:
    """Parse ``value`` into a member of ``cls`` (or of an ``extra`` class), case-insensitively."""
    if isinstance(value, (cls, *extra)):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str or {cls.__name__}, got {type(value).__name__} {value!r}; "
                        f"pass one of: {_valid(cls, *extra)}")
    key = value.strip().lower().replace("-", "_")
    for enum_cls in (cls, *extra):
        try:
            return enum_cls(key)
        except ValueError:
            pass
    raise ValueError(f"unknown {what} {value!r}; valid values are: {_valid(cls, *extra)} "
                     "(case-insensitive, '-' may replace '_')")


def parse_cuda_graph_impl(value: Union[CudaGraphImpl, str]) -> CudaGraphImpl:
    """Parse an impl name such as ``"local"`` or ``"Transformer-Engine"``; unknown names raise ValueError."""
    return _parse_enum(CudaGraphImpl, value, "cuda_graph_impl")


def parse_inference_cuda_graph_scope(value: Union[InferenceCudaGraphScope, str]) -> InferenceCudaGraphScope:
    """Parse an inference scope name (``none``, ``layer``, ``block``), case-insensitively."""
    return _parse_enum(InferenceCudaGraphScope, value, "inference_cuda_graph_scope")


def module_tag(module: Any) -> Optional[str]:
    """A module's ``cuda_graph_module`` tag as a plain string: the instance's attribute, else its class's."""
    tag = getattr(module, "cuda_graph_module", None)
    return getattr(tag, "value", tag)


#: [Note: graph-unsafe modules] A module whose forward cannot be captured (a device-to-host sync such as
#: ``tensor.tolist()``, shapes that depend on data) declares it with an attribute ``cuda_graph_unsafe`` holding
#: the reason as a string (``None`` or absent: capturable); the attribute may be a property when the answer
#: depends on the device or dtype. Graph kinds refuse, when they select their callables, any graphed callable
#: that contains such a module, naming the callable, the module and the reason. The tag ``cuda_graph_module``
#: says what a module is (which scope selects it); ``cuda_graph_unsafe`` says whether it may be inside a graph.
#: Example: the reference model's dropless experts (``apps/moe.py``) with ``moe_experts='split'``.
def graph_unsafe_modules(module: Any) -> List[Tuple[str, str]]:
    """(qualified name inside ``module``, reason) of every submodule, ``module`` itself included (name ``""``),
    whose ``cuda_graph_unsafe`` reason is set ([Note: graph-unsafe modules])."""
    found = []
    for name, sub in module.named_modules():
        reason = getattr(sub, "cuda_graph_unsafe", None)
        if reason:
            found.append((name, str(reason)))
    return found


def parse_cuda_graph_module(value: Union[CudaGraphModule, str]) -> CudaGraphModule:
    """Parse one module name such as ``"attn"`` or ``"MoE-Router"``."""
    return _parse_enum(CudaGraphModule, value, "cuda_graph_modules entry")


def _as_list(values: Any, what: str) -> list:
    if values is None:
        return []
    if isinstance(values, str):  # one name, not its characters
        return [values]
    if not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of names, got {type(values).__name__} {values!r}")
    return list(values)


def _dedupe(items: Iterable[Any]) -> list:
    return list(dict.fromkeys(items))


def parse_cuda_graph_modules(
    values: Union[None, str, CudaGraphModule, Iterable[Union[CudaGraphModule, str]]],
) -> List[CudaGraphModule]:
    """Parse a list of module names; a single name counts as a one-element list and ``None`` as empty.

    Duplicates are dropped, keeping the first occurrence's position: the list means a set of submodule kinds,
    so ``[attn, attn]`` has one unambiguous meaning and rejecting it would only punish a harmless repeat.
    """
    return _dedupe(parse_cuda_graph_module(v) for v in _as_list(values, "cuda_graph_modules"))


def _parse_scope_item(value: Any) -> Union[CudaGraphModule, _LegacyScope]:
    return _parse_enum(CudaGraphModule, value, "cuda_graph_scope entry", _LegacyScope)


def _parse_patterns(values: Any, field: str, example_glob: str) -> List[str]:
    """A list field of module patterns (qualified-name globs or class names): stripped, deduplicated."""
    patterns = _as_list(values, field)
    for p in patterns:
        if not isinstance(p, str) or not p.strip():
            raise TypeError(f"{field} entries must be non-empty strings, got {p!r}; give qualified-name globs such "
                            f"as '{example_glob}' or class names such as 'MLP'")
    return _dedupe(p.strip() for p in patterns)


def _offload_problems(cfg: "CudaGraphConfig") -> List[str]:
    """The activation-offloading rules (impl, warmup, graph boundary by tag, fraction), as problem lines."""
    fraction, min_bytes = cfg.activation_offload_fraction, cfg.activation_offload_min_bytes
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"activation_offload_fraction must be a number, got {type(fraction).__name__} {fraction!r}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(f"activation_offload_min_bytes must be an int, got {type(min_bytes).__name__} {min_bytes!r}")
    tags, pats, impl = cfg.activation_offload_modules, cfg.activation_offload_module_patterns, cfg.cuda_graph_impl
    shown = [str(t) for t in tags]
    given = (f"activation_offload_modules={shown}" if tags else f"activation_offload_module_patterns={pats}")
    problems: List[str] = []
    if tags and pats:
        problems.append(f"activation_offload_modules={shown} and activation_offload_module_patterns={pats} are "
                        "exclusive; use the tags for tagged models and patterns only for untagged ones")
    if not 0.0 < fraction <= 1.0:
        problems.append(f"activation_offload_fraction={fraction} must be in (0, 1]; 1.0 offloads every group, "
                        "smaller values keep the last groups of forward on the device")
    if min_bytes < 0:
        problems.append(f"activation_offload_min_bytes={min_bytes} must be >= 0")
    if not (tags or pats):
        if fraction != 1.0:
            problems.append(f"activation_offload_fraction={fraction} without activation_offload_modules (or "
                            "activation_offload_module_patterns) would be ignored; name the modules to offload")
        return problems
    if impl == CudaGraphImpl.FULL_ITERATION:
        problems.append(f"{given} with cuda_graph_impl='full_iteration' is not supported: activation offloading "
                        "works eagerly (impl 'none') and with per-layer graphs (impl 'local' or 'transformer_engine')")
    if impl in _PER_LAYER_IMPLS and cfg.cuda_graph_warmup_steps < 1:
        problems.append(f"{given} with cuda_graph_impl='{impl}' needs cuda_graph_warmup_steps >= 1 (got "
                        f"{cfg.cuda_graph_warmup_steps}): an eager step records the offload groups' sizes so that "
                        "capture pins no memory")
    M = CudaGraphModule
    graphed = set(cfg.cuda_graph_modules) if impl in _PER_LAYER_IMPLS else set()
    for part in (M.MOE_ROUTER, M.MOE_PREPROCESS):
        if M.MOE in tags and part in graphed:
            problems.append(f"activation_offload_modules={shown} with cuda_graph_modules="
                            f"{[str(m) for m in cfg.cuda_graph_modules]}: the offloaded 'moe' block contains the "
                            f"graphed '{part}', so its group would cross a graph boundary; offload '{part}' or other "
                            "parts instead, or graph 'moe' whole")
    return problems


class MigratedOptions(NamedTuple):
    """The typed options after the deprecated inputs have been folded in. ``None`` means "not given"."""

    cuda_graph_impl: Optional[CudaGraphImpl]
    cuda_graph_modules: List[CudaGraphModule]
    inference_cuda_graph_scope: Optional[InferenceCudaGraphScope]


def _merge_impls(claims: List[tuple]) -> Optional[CudaGraphImpl]:
    """Reduce ``(source, impl)`` claims to one impl, or raise naming two sources that disagree.

    ``local`` and ``full_iteration`` agree and give ``full_iteration``: upstream spelled full-iteration graphs as
    the local impl plus ``--cuda-graph-scope full_iteration``, and those command lines keep working.
    """
    wanted = {impl for _, impl in claims}
    if wanted == {CudaGraphImpl.LOCAL, CudaGraphImpl.FULL_ITERATION}:
        return CudaGraphImpl.FULL_ITERATION
    if len(wanted) > 1:
        (src_a, a), (src_b, b) = claims[0], next(c for c in claims if c[1] != claims[0][1])
        raise ValueError(f"conflicting CUDA graph options: {src_a} means cuda_graph_impl='{a}', but {src_b} "
                         f"means cuda_graph_impl='{b}'; keep only cuda_graph_impl (--cuda-graph-impl) and drop "
                         "the deprecated option")
    return next(iter(wanted), None)


def migrate_deprecated_options(
    *,
    cuda_graph_impl: Union[None, CudaGraphImpl, str] = None,
    cuda_graph_modules: Any = None,
    inference_cuda_graph_scope: Union[None, InferenceCudaGraphScope, str] = None,
    enable_cuda_graph: Optional[bool] = None,
    external_cuda_graph: Optional[bool] = None,
    cuda_graph_scope: Any = None,
    stacklevel: int = 1,
) -> MigratedOptions:
    """Parse the typed options and fold the deprecated ones into them: the one place where migration happens.

    Both :class:`CudaGraphConfig` and :func:`config_from_args` call this. Each deprecated input that is not
    ``None`` emits a ``DeprecationWarning`` naming its replacement; ``stacklevel`` says which frame the warning
    points at, counted from the caller of this function (1, the default: the line that calls it).

    The migration table:

    ============================================================  ===============================================
    ``enable_cuda_graph=True`` / ``--enable-cuda-graph``          ``cuda_graph_impl=local``
    ``external_cuda_graph=True`` / ``--external-cuda-graph``      ``cuda_graph_impl=transformer_engine``
    ``cuda_graph_scope="full_iteration"``                         ``cuda_graph_impl=full_iteration``
    ``cuda_graph_scope="full_iteration_inference"``               ``cuda_graph_impl=local`` and
                                                                  ``inference_cuda_graph_scope=block``
    ``cuda_graph_scope=["attn", "mlp"]``                          ``cuda_graph_modules=[attn, mlp]``
    ============================================================  ===============================================

    ``enable_cuda_graph=False`` / ``external_cuda_graph=False`` still warn and change nothing. An empty
    ``cuda_graph_modules`` counts as "not given" (it is also the default meaning, whole layers). Inputs that
    disagree (e.g. ``enable_cuda_graph=True`` with ``cuda_graph_impl='transformer_engine'``, or
    ``cuda_graph_scope=['attn']`` with ``cuda_graph_modules=['mlp']``) raise ValueError naming both; inputs that
    agree are accepted.
    """

    def deprecated(old: str, new: str) -> None:
        warnings.warn(f"{old} is deprecated; use {new} instead", DeprecationWarning, stacklevel=stacklevel + 2)

    impl = None if cuda_graph_impl is None else parse_cuda_graph_impl(cuda_graph_impl)
    modules = parse_cuda_graph_modules(cuda_graph_modules)
    inference = (None if inference_cuda_graph_scope is None
                 else parse_inference_cuda_graph_scope(inference_cuda_graph_scope))

    claims: List[tuple] = [] if impl is None else [(f"cuda_graph_impl='{impl}'", impl)]
    if enable_cuda_graph is not None:
        deprecated("enable_cuda_graph (--enable-cuda-graph)", "cuda_graph_impl='local' (--cuda-graph-impl local)")
        if enable_cuda_graph:
            claims.append(("enable_cuda_graph=True (--enable-cuda-graph)", CudaGraphImpl.LOCAL))
    if external_cuda_graph is not None:
        deprecated("external_cuda_graph (--external-cuda-graph)",
                   "cuda_graph_impl='transformer_engine' (--cuda-graph-impl transformer_engine)")
        if external_cuda_graph:
            claims.append(("external_cuda_graph=True (--external-cuda-graph)", CudaGraphImpl.TRANSFORMER_ENGINE))

    if cuda_graph_scope is not None:
        items = _dedupe(_parse_scope_item(v) for v in _as_list(cuda_graph_scope, "cuda_graph_scope"))
        legacy = [i for i in items if isinstance(i, _LegacyScope)]
        scope_modules = [i for i in items if isinstance(i, CudaGraphModule)]
        src = f"cuda_graph_scope={[str(i) for i in items]} (--cuda-graph-scope)"
        if legacy and (scope_modules or len(legacy) > 1):
            deprecated(src, "cuda_graph_impl and cuda_graph_modules")
            raise ValueError(f"{src} mixes '{legacy[0]}' with other entries; '{legacy[0]}' must stand alone "
                             "(better: use cuda_graph_impl / --cuda-graph-impl instead)")
        if legacy == [_LegacyScope.FULL_ITERATION]:
            deprecated(src, "cuda_graph_impl='full_iteration' (--cuda-graph-impl full_iteration)")
            claims.append((src, CudaGraphImpl.FULL_ITERATION))
        elif legacy == [_LegacyScope.FULL_ITERATION_INFERENCE]:
            deprecated(src, "cuda_graph_impl='local' with inference_cuda_graph_scope='block'")
            if impl == CudaGraphImpl.FULL_ITERATION:  # would otherwise merge with local (see _merge_impls)
                raise ValueError(f"conflicting CUDA graph options: {src} means cuda_graph_impl='local', but "
                                 "cuda_graph_impl='full_iteration' was given; drop cuda_graph_scope")
            claims.append((src, CudaGraphImpl.LOCAL))
            if inference not in (None, InferenceCudaGraphScope.BLOCK):
                raise ValueError(f"conflicting CUDA graph options: {src} means inference_cuda_graph_scope='block', "
                                 f"but inference_cuda_graph_scope='{inference}' was given; drop cuda_graph_scope")
            inference = InferenceCudaGraphScope.BLOCK
        else:
            deprecated(src, "cuda_graph_modules (--cuda-graph-modules)")
            if modules and set(modules) != set(scope_modules):
                raise ValueError(f"conflicting CUDA graph options: {src} and cuda_graph_modules="
                                 f"{[str(m) for m in modules]} name different modules; keep only cuda_graph_modules")
            modules = modules or scope_modules

    return MigratedOptions(_merge_impls(claims), modules, inference)


@dataclasses.dataclass
class CudaGraphConfig:
    """Per-layer CUDA graph options, validated on construction (see the module docstring for the lifecycle).

    Graph selection:
        cuda_graph_impl: who captures; ``None`` means "not given" and becomes ``CudaGraphImpl.NONE``. Keeping
            "not given" apart from an explicit ``"none"`` lets ``cuda_graph_impl='none'`` together with
            ``enable_cuda_graph=True`` be reported as the conflict it is.
        cuda_graph_modules: submodule kinds graphed separately; empty means whole layers. Rules: ``moe_preprocess``
            needs ``moe_router``; ``moe`` excludes ``moe_router`` and ``moe_preprocess`` (it already contains
            them); ``full_iteration`` takes no modules; modules with impl ``none`` are rejected, not ignored.
        cuda_graph_module_patterns: for models that do not tag their submodules: each pattern is an
            :func:`fnmatch.fnmatchcase` glob over qualified module names (``"layers.*.attn"``) or an exact class
            name (``"MLP"``). Exclusive with ``cuda_graph_modules``; same impl rules.
        inference_cuda_graph_scope: ``None`` resolves to ``layer`` for impl ``local`` and ``none`` otherwise; an
            explicit ``layer``/``block`` with impl ``none`` is rejected.

    Capture timing:
        cuda_graph_warmup_steps (>= 1): eager training steps before capture. At least one, because the sample
            args take their shapes from a real eager step, and that step also lets FSDP allocate its buffers at
            the addresses the graphs will be tied to.
        cuda_graph_num_warmup_iters (>= 1): warmup iterations inside ``make_graphed_callables`` before capture.
            TE filters out parameters that receive no gradient using the warmup pass, so zero is refused.

    Replay:
        cuda_graph_strict_signature: a graphed callable called with other constants, shapes or dtypes than at
            capture runs eagerly with one warning per callable (False, the default) or raises ValueError (True).

    FSDP (read from the training script's own flags by :func:`config_from_args`):
        use_megatron_fsdp, fsdp_double_buffer, fsdp_db_use_persist_buf_on_alloc_fail: a per-layer impl under
        Megatron-FSDP needs both buffer options, because replay needs every unshard buffer at the address it
        had at capture; ``fsdp_db_use_persist_buf_on_alloc_fail`` changes the double buffer and needs it.
        This is Megatron-LM's command-line rule, checked here as its argument checks do. The graph kinds
        check the model's engine itself, by the precise rule in the engine's contract
        (``megatron_fsdp/graph_contract.py`` ``StaticStep.require_fixed_buffers``).

    Activation offloading (``fsdp_cudagraph.offload.offloader``; eager, or with impl ``local`` / ``transformer_engine``):
        activation_offload_modules: submodule kinds (``cuda_graph_module`` tags) whose saved activations go to
            host memory during forward and come back for backward; empty: offloading off.
        activation_offload_module_patterns: the same by qualified-name glob or class name; exclusive with the tags.
        activation_offload_fraction (0, 1]: the last ``floor(n * (1 - fraction))`` groups of forward stay on
            the device. activation_offload_min_bytes (>= 0): smaller copies stay on the device.
        Rules: not with impl ``full_iteration``; with a per-layer impl it needs ``cuda_graph_warmup_steps >= 1``
        (the eager step records the groups' sizes), and no offloaded module may contain a graphed callable
        (``moe`` offloaded while ``moe_router``/``moe_preprocess`` are graphed); patterns are checked when the
        modules are selected.

    FP8 (TransformerEngine; ``capture/fp8.py``, docs/fp8.md):
        fp8_recipe: ``None`` (no FP8), ``delayed``, ``current`` or ``block``: the recipe TE's graph maker captures
            the graphed callables with; a :class:`~fsdp_cudagraph.capture.fp8.FP8Recipe` of this name runs the
            eager autocast (``PartialCudaGraphs(..., fp8=...)`` takes yours, or builds one and exposes it as
            ``graphs.fp8``). Rules: not with impl ``local`` (torch's graph maker knows no FP8 state: TE's saves
            and restores the scaling state around its warmup and wraps each callable in TE's autocast);
            ``delayed`` not with ``full_iteration`` (TE skips the backward amax reduction while its capture flag
            is up, so a captured step would never update the gradients' scales); not with inference graphs.
        fp8_cache_quantized_params: TE's ``cache_quantized_params``: the FP8 weights are quantized on the first
            micro-batch of a step and reused on the others; needs ``fp8_recipe`` and a per-layer or no impl.
        fp8_dot_product_attention: attention in FP8 too (TE's ``fp8_dpa``, Megatron-LM's
            ``--fp8-dot-product-attention``); needs ``fp8_recipe`` other than ``block``, not with
            ``full_iteration``, not ``current`` with ``transformer_engine``; the GPU, the recipe and the cuDNN TE
            loaded are checked at runtime ([Note: FP8 attention] in capture/fp8.py).

    Deprecated (migrated by :func:`migrate_deprecated_options`, then reset to ``None``):
        enable_cuda_graph, external_cuda_graph, cuda_graph_scope.
    """

    cuda_graph_impl: Union[CudaGraphImpl, str, None] = None
    cuda_graph_modules: List[Union[CudaGraphModule, str]] = dataclasses.field(default_factory=list)
    cuda_graph_module_patterns: List[str] = dataclasses.field(default_factory=list)
    inference_cuda_graph_scope: Union[InferenceCudaGraphScope, str, None] = None
    cuda_graph_warmup_steps: int = 3
    cuda_graph_num_warmup_iters: int = 3
    cuda_graph_strict_signature: bool = False
    activation_offload_modules: List[Union[CudaGraphModule, str]] = dataclasses.field(default_factory=list)
    activation_offload_module_patterns: List[str] = dataclasses.field(default_factory=list)
    activation_offload_fraction: float = 1.0
    activation_offload_min_bytes: int = 1 << 20
    use_megatron_fsdp: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    fp8_recipe: Optional[str] = None
    fp8_cache_quantized_params: bool = False
    fp8_dot_product_attention: bool = False
    enable_cuda_graph: Optional[bool] = None
    external_cuda_graph: Optional[bool] = None
    cuda_graph_scope: Union[List[str], str, None] = None

    def __post_init__(self) -> None:
        migrated = migrate_deprecated_options(
            cuda_graph_impl=self.cuda_graph_impl,
            cuda_graph_modules=self.cuda_graph_modules,
            inference_cuda_graph_scope=self.inference_cuda_graph_scope,
            enable_cuda_graph=self.enable_cuda_graph,
            external_cuda_graph=self.external_cuda_graph,
            cuda_graph_scope=self.cuda_graph_scope,
            stacklevel=3,  # __post_init__ <- __init__ <- the caller
        )
        self.enable_cuda_graph = self.external_cuda_graph = self.cuda_graph_scope = None
        self.cuda_graph_impl = migrated.cuda_graph_impl or CudaGraphImpl.NONE
        self.cuda_graph_modules = migrated.cuda_graph_modules
        self.cuda_graph_module_patterns = _parse_patterns(
            self.cuda_graph_module_patterns, "cuda_graph_module_patterns", "layers.*.attn")
        inference = migrated.inference_cuda_graph_scope
        if inference is None:
            inference = (InferenceCudaGraphScope.LAYER if self.cuda_graph_impl == CudaGraphImpl.LOCAL
                         else InferenceCudaGraphScope.NONE)
        self.inference_cuda_graph_scope = inference
        self.activation_offload_modules = _dedupe(_parse_enum(CudaGraphModule, v, "activation_offload_modules entry")
                                                  for v in _as_list(self.activation_offload_modules,
                                                                    "activation_offload_modules"))
        self.activation_offload_module_patterns = _parse_patterns(
            self.activation_offload_module_patterns, "activation_offload_module_patterns", "layers.*.mlp")
        self.fp8_recipe = _fp8.parse_fp8_recipe(self.fp8_recipe)
        self._validate()
        logger.debug("CUDA graph config: %s", self)

    def _validate(self) -> None:
        """Check every cross-field rule; raise one ValueError listing all violations."""
        for name in ("use_megatron_fsdp", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail",
                     "cuda_graph_strict_signature", "fp8_cache_quantized_params", "fp8_dot_product_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        problems: List[str] = []
        for name in ("cuda_graph_warmup_steps", "cuda_graph_num_warmup_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                problems.append(f"{name}={value} must be >= 1; set it to 1 or more (default 3)")

        impl, mods, pats = self.cuda_graph_impl, self.cuda_graph_modules, self.cuda_graph_module_patterns
        shown = [str(m) for m in mods]
        if mods and pats:
            problems.append(f"cuda_graph_modules={shown} and cuda_graph_module_patterns={pats} are exclusive; "
                            "use cuda_graph_modules for tagged models and patterns only for untagged ones")
        for name, given in (("cuda_graph_modules", shown), ("cuda_graph_module_patterns", pats)):
            if given and impl == CudaGraphImpl.NONE:
                problems.append(f"{name}={given} with cuda_graph_impl='none' would be ignored; set "
                                f"cuda_graph_impl to 'local' or 'transformer_engine', or drop {name}")
            if given and impl == CudaGraphImpl.FULL_ITERATION:
                problems.append(f"{name}={given} with cuda_graph_impl='full_iteration': a full-iteration graph "
                                f"takes no module selection; drop {name} or pick a per-layer impl")
        if self.inference_cuda_graph_scope != InferenceCudaGraphScope.NONE and impl == CudaGraphImpl.NONE:
            problems.append(f"inference_cuda_graph_scope='{self.inference_cuda_graph_scope}' with cuda_graph_impl="
                            "'none' would be ignored; set cuda_graph_impl='local' or drop the inference scope")

        M = CudaGraphModule
        for part in (M.MOE_ROUTER, M.MOE_PREPROCESS):
            if M.MOE in mods and part in mods:
                problems.append(f"cuda_graph_modules={shown}: 'moe' already graphs the whole MoE block including "
                                f"'{part}'; drop '{part}' (or replace 'moe' by 'moe_router')")
        if M.MOE_PREPROCESS in mods and M.MOE not in mods and M.MOE_ROUTER not in mods:
            problems.append(f"cuda_graph_modules={shown}: 'moe_preprocess' requires 'moe_router' (the preprocess "
                            "consumes the router's output inside the same graph); add 'moe_router'")

        if self.fsdp_db_use_persist_buf_on_alloc_fail and not self.fsdp_double_buffer:
            problems.append("fsdp_db_use_persist_buf_on_alloc_fail=True requires fsdp_double_buffer=True (it "
                            "modifies the double buffer); set fsdp_double_buffer=True or drop it")
        if self.use_megatron_fsdp and impl in _PER_LAYER_IMPLS:
            missing = [n for n in ("fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail")
                       if not getattr(self, n)]
            if missing:
                flags = " ".join("--" + n.replace("_", "-") for n in missing)
                problems.append(f"use_megatron_fsdp=True with cuda_graph_impl='{impl}' requires address-stable "
                                f"unshard buffers, but {' and '.join(n + '=False' for n in missing)}; set "
                                f"{' and '.join(n + '=True' for n in missing)} ({flags}) or use "
                                "cuda_graph_impl='none'. This is Megatron-LM's command-line rule. The graph kinds "
                                "check the model's engine itself (the precise rule, in the engine's contract)")
        problems += _offload_problems(self)
        problems += _fp8.config_problems(self.fp8_recipe, impl=str(impl), cache=self.fp8_cache_quantized_params,
                                         inference_scope=str(self.inference_cuda_graph_scope),
                                         attention=self.fp8_dot_product_attention)
        if problems:
            raise ValueError("invalid CUDA graph config:\n  - " + "\n  - ".join(problems))

    @property
    def enabled(self) -> bool:
        """Whether per-layer graphs are captured (impl ``local`` or ``transformer_engine``)."""
        return self.cuda_graph_impl in _PER_LAYER_IMPLS

    @property
    def backend(self) -> Optional[str]:
        """``"te"`` for TE's capture, ``"torch"`` for the local one, ``None`` when nothing is graphed per layer
        (the vocabulary of [Note: backends])."""
        return {CudaGraphImpl.TRANSFORMER_ENGINE: "te", CudaGraphImpl.LOCAL: "torch"}.get(self.cuda_graph_impl)

    def check_runtime(self) -> None:
        """Check that this machine can run the configured impl; graph objects call it when they are built.

        Raises RuntimeError without a CUDA GPU (every graph impl; ``full_iteration`` is captured by
        :class:`~fsdp_cudagraph.FullIterationCudaGraph`, which runs its CPU protocol backend without one), and
        ImportError for ``transformer_engine`` without TE >= 2.19. Does nothing for impl ``none``.
        """
        impl = self.cuda_graph_impl
        if impl == CudaGraphImpl.NONE:
            return
        if not torch.cuda.is_available():
            raise RuntimeError(f"cuda_graph_impl='{impl}' needs a CUDA GPU, but torch.cuda.is_available() is "
                               "False; run on a GPU machine. On CPU, PartialCudaGraphs and LengthBucketGraphs take "
                               "backend='protocol' (the same warmup/capture hook schedule, without graphs), or train "
                               "eagerly with cuda_graph_impl='none' and no cuda_graph_modules, "
                               "cuda_graph_module_patterns or inference_cuda_graph_scope")
        if impl == CudaGraphImpl.TRANSFORMER_ENGINE and not _te.HAS_TE:
            raise ImportError(f"cuda_graph_impl='transformer_engine' needs TransformerEngine >= "
                              f"{_te.MIN_TE_VERSION}: {_te.TE_REASON}; install it with pip install "
                              "'fsdp-cudagraph[te]' or use cuda_graph_impl='local'")
        if self.fp8_recipe is not None:
            _fp8.check_fp8_runtime(self.fp8_recipe, dot_product_attention=self.fp8_dot_product_attention)


def _argtype(parse: Any) -> Any:
    """Wrap a parse helper so that argparse shows its message instead of a generic 'invalid value'."""

    def convert(value: str) -> Any:
        try:
            return parse(value)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def add_cuda_graph_args(parser_or_group: Union[argparse.ArgumentParser, Any]) -> Any:
    """Add the CUDA graph flags to a parser (in a new group, returned) or to an existing group (returned).

    Every flag defaults to ``None`` ("not given") so that :class:`CudaGraphConfig` keeps the defaults. The FSDP
    flags are not added: the training script owns them, and :func:`config_from_args` reads them from ``args``.
    """
    if isinstance(parser_or_group, argparse.ArgumentParser):
        group = parser_or_group.add_argument_group("CUDA graphs", "per-layer CUDA graph capture (fsdp_cudagraph)")
    else:
        group = parser_or_group
    group.add_argument("--cuda-graph-impl", type=_argtype(parse_cuda_graph_impl), default=None,
                       help=f"who captures: {_valid(CudaGraphImpl)} (default none)")
    group.add_argument("--cuda-graph-modules", nargs="*", type=_argtype(parse_cuda_graph_module), default=None,
                       help=f"submodules graphed separately, from {_valid(CudaGraphModule)}; none = whole layers")
    group.add_argument("--cuda-graph-module-patterns", nargs="*", default=None,
                       help="qualified-name globs or class names selecting callables in untagged models")
    group.add_argument("--inference-cuda-graph-scope", type=_argtype(parse_inference_cuda_graph_scope),
                       default=None, help=f"{_valid(InferenceCudaGraphScope)} (default: layer for impl local)")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=None,
                       help="eager training steps before capture, >= 1 (default 3)")
    group.add_argument("--cuda-graph-num-warmup-iters", type=int, default=None,
                       help="warmup iterations inside make_graphed_callables, >= 1 (default 3)")
    group.add_argument("--cuda-graph-strict-signature", action="store_true", default=None,
                       help="raise when a graphed callable is called differently than at capture (default: run "
                            "that call eagerly, warn once)")
    group.add_argument("--activation-offload-modules", nargs="*", type=_argtype(parse_cuda_graph_module), default=None,
                       help="submodule kinds whose saved activations are offloaded to host memory (default none)")
    group.add_argument("--activation-offload-module-patterns", nargs="*", default=None,
                       help="the same by qualified-name glob or class name")
    group.add_argument("--activation-offload-fraction", type=float, default=None,
                       help="fraction of offload groups (the first ones of forward) that offload, in (0, 1] (default 1)")
    group.add_argument("--activation-offload-min-bytes", type=int, default=None,
                       help="smaller copies stay on the device (default 1 MiB)")
    group.add_argument("--fp8-recipe", type=_argtype(_fp8.parse_fp8_recipe), default=None,
                       help=f"FP8 training with TransformerEngine: {', '.join(_fp8.FP8_RECIPES)} (default: none, bf16)")
    group.add_argument("--fp8-cache-quantized-params", action="store_true", default=None,
                       help="quantize FP8 weights on a step's first micro-batch only and reuse them (TE's "
                            "cache_quantized_params)")
    group.add_argument("--fp8-dot-product-attention", action="store_true", default=None,
                       help="attention in FP8 too (TE's fp8_dpa; delayed scaling, or current where TE runs it)")
    group.add_argument("--enable-cuda-graph", action="store_true", default=None,
                       help="DEPRECATED: use --cuda-graph-impl local")
    group.add_argument("--external-cuda-graph", action="store_true", default=None,
                       help="DEPRECATED: use --cuda-graph-impl transformer_engine")
    group.add_argument("--cuda-graph-scope", nargs="+", type=_argtype(_parse_scope_item), default=None,
                       help="DEPRECATED: use --cuda-graph-modules, or --cuda-graph-impl full_iteration")
    return group


_NEW_FIELDS = ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_module_patterns", "inference_cuda_graph_scope",
               "cuda_graph_warmup_steps", "cuda_graph_num_warmup_iters", "cuda_graph_strict_signature",
               "activation_offload_modules", "activation_offload_module_patterns", "activation_offload_fraction",
               "activation_offload_min_bytes", "fp8_recipe", "fp8_cache_quantized_params",
               "fp8_dot_product_attention")
_DEPRECATED_FIELDS = ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope")
_FSDP_FIELDS = ("use_megatron_fsdp", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail")


def config_from_args(args: argparse.Namespace, **overrides: Any) -> CudaGraphConfig:
    """Build a :class:`CudaGraphConfig` from parsed args; keyword ``overrides`` win over ``args``.

    Flags left at ``None`` keep the dataclass defaults; the FSDP fields are read with ``getattr(args, name,
    False)``. Deprecated flags are migrated here, through :func:`migrate_deprecated_options`, so their
    ``DeprecationWarning`` points at the caller.
    """
    fields = {f.name for f in dataclasses.fields(CudaGraphConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"config_from_args got unknown overrides {unknown}; valid names: {sorted(fields)}")
    values = {name: getattr(args, name, None) for name in _NEW_FIELDS + _DEPRECATED_FIELDS}
    values.update({name: bool(getattr(args, name, False)) for name in _FSDP_FIELDS})
    values.update(overrides)
    migrated = migrate_deprecated_options(**{n: values.pop(n) for n in _DEPRECATED_FIELDS + (
        "cuda_graph_impl", "cuda_graph_modules", "inference_cuda_graph_scope")}, stacklevel=2)
    values.update(migrated._asdict())
    return CudaGraphConfig(**{k: v for k, v in values.items() if v is not None})


def __getattr__(name: str) -> Any:
    if name == "CudaGraphScope":
        warnings.warn("fsdp_cudagraph.config.CudaGraphScope is deprecated; use CudaGraphModule (and "
                      "cuda_graph_modules=) instead", DeprecationWarning, stacklevel=2)
        return CudaGraphModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
