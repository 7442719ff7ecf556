"""FP8 training with TransformerEngine, eagerly and under per-layer graphs: one recipe object for both.

Lifecycle::

    fp8 = FP8Recipe("delayed")                        # one per run: the eager autocast and the graph maker share it
    graphs = PartialCudaGraphs(model, config, fp8=fp8)   # config.cuda_graph_impl='transformer_engine'
    for step, micro_batches in enumerate(loader):
        if step == config.cuda_graph_warmup_steps:
            graphs.capture()                          # outside any autocast
        for i, (x, y) in enumerate(micro_batches):
            with fp8.autocast(first_microbatch=i == 0):   # first_microbatch: only with cache_quantized_params
                loss = loss_fn(model(x), y)
            loss.backward()
        optimizer.step(); optimizer.zero_grad()

Recipes (``FP8_RECIPES``), built as Megatron-LM builds them: ``delayed`` is TE's ``DelayedScaling`` with
format HYBRID (E4M3 forward, E5M2 gradients; TE's default history of 1024 amaxes, ``max``); ``current`` is
``Float8CurrentScaling`` with format HYBRID; ``block`` is ``Float8BlockScaling`` as TE builds it by default
(E4M3, 1x128 blocks for activations and gradients, 128x128 for weights). ``block`` needs compute capability
9.0 (Hopper) and CUDA 12.9; the others 8.9 (TE's own rules, checked before any work: :func:`check_fp8_device`).

[Note: the FP8 region under graphs]
TE's ``make_graphed_callables(enabled=True, recipe=..., amax_reduction_group=...)`` wraps each callable in
``te.autocast(..., _graph=True)`` while it warms up and captures (saving every module's delayed-scaling
``scale`` and ``amax_history`` first and restoring them after, so warmup leaves no trace), then removes the
wrapper. At replay no autocast of TE's is entered: the graphed forward reads the FP8 state of the autocast
*around the call*, the user's, to register each module's amax buffers and to tell the first graphed callable
of the region, whose backward replay then reduces and updates the backward scales. So the eager run and
the graphed run must use the same region around the same calls, and the region must not be per layer for
delayed scaling: every autocast exit reduces and rolls *every* registered forward amax history, so per-layer
regions would roll them once per layer. The region here is Megatron's for delayed scaling: one
``fp8.autocast()`` around each micro-batch's forward, in both runs; the eager modules, the graphed callables
and TE's graph maker get the same recipe object and reduction group. For ``current`` and ``block`` the
scaling is computed per tensor inside the kernels and nothing is kept between steps, so where the region
starts does not change the numbers.

[Note: quantized weights across micro-batches]
With ``cache_quantized_params=True`` TE quantizes each weight on the first micro-batch of a step and reuses
that FP8 copy (the module's ``_fp8_workspaces``) on the others. TE's graph maker then requires
``is_first_microbatch=<bool>`` at every replay and turns it into a device flag the captured quantization
reads; the eager TE modules take the same flag as their ``is_first_microbatch`` argument. Both come from
:func:`is_first_microbatch`, the flag of the innermost ``fp8.autocast(first_microbatch=...)``. The cached
copy lives outside the graphs' memory at a fixed address that the captured kernels write and read: a
module that drops or replaces it after capture (TE clears it on a recipe change) would leave the graph
writing freed memory, so the replay check compares those addresses too (:func:`quantized_weight_probe`).

[Note: FP8 attention]
``dot_product_attention=True`` (Megatron-LM's ``--fp8-dot-product-attention``) sets TE's ``fp8_dpa``: TE's
``DotProductAttention`` then quantizes Q, K and V, runs cuDNN's FP8 fused attention and returns bf16. TE 2.20
chooses that kernel by rules this module checks first, so a run that cannot have it is refused by name instead of
failing inside the first forward ("no dot product attention backend"): block scaling has no FP8 attention (TE's
recipe asserts); the fused FP8 kernel needs Hopper (9.0); current scaling runs it from Blackwell (10.0), and on
Hopper only with ``NVTE_DPA_FP8_RECIPE=DelayedScaling`` (attention scaled by delayed scaling, the linears by current);
and deterministic training (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or torch's deterministic mode, which bit-exact
runs need) takes cuDNN 9.19 or newer. Which cuDNN TE runs is decided by ``CUDNN_PATH`` and the library path
([Note: two cuDNNs in one process] in ``capture/te.py``): on a machine with a system cuDNN 9.14 beside torch's 9.19,
only both pointed at torch's made every part 9.19.

Attention in FP8 keeps delayed-scaling state under every recipe (the softmax's S and dP scales under current
scaling; all of attention's with ``NVTE_DPA_FP8_RECIPE=DelayedScaling``), so it is refused with whole-step graphs
as delayed scaling is ([Note: the FP8 region under graphs]): TE updates those scales on the host. And with
``current`` it is refused under per-layer graphs: TE's graph maker saves and restores the delayed-scaling state
around its warmup only when the recipe it is given is ``DelayedScaling``, so under ``current`` the warmup's
attention amaxes stay in that state and the replays differ from the eager steps (measured on an H200: the first
replayed step differs). ``delayed`` with FP8 attention is restored whole and graphs equal eager bit for bit.

Nothing here imports TE at import time (``capture/te.py`` probes it once); the recipe object is built on
first use, so configs and refusals are checkable on CPU.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fsdp_cudagraph.capture import te as _te

__all__ = ["FP8_RECIPES", "FP8Recipe", "parse_fp8_recipe", "config_problems", "check_fp8_device", "fp8_shape_problem",
           "fp8_attention_problems", "check_fp8_runtime",
           "is_first_microbatch", "te_call_kwargs", "te_autocast_active", "delayed_scaling_modules",
           "quantized_weight_probe", "reset_scaling_state"]

#: Recipe names, in the vocabulary of ``GPTConfig(fp8=...)`` and ``CudaGraphConfig(fp8_recipe=...)``.
FP8_RECIPES = ("delayed", "current", "block")
#: The oldest compute capability each recipe runs on (TE's ``check_fp8_support`` and block-scaling rule).
MIN_CAPABILITY = {"delayed": (8, 9), "current": (8, 9), "block": (9, 0)}
#: Block scaling's FP8 GEMMs also need this CUDA version (TE's ``check_fp8_block_scaling_support``).
BLOCK_MIN_CUDA = (12, 9)
#: FP8 attention ([Note: FP8 attention]), TE 2.20's rules: cuDNN's fused FP8 kernel needs this compute capability;
#: current scaling runs it from the second; deterministic training needs this cuDNN.
FP8_ATTENTION_MIN_CAPABILITY = (9, 0)
FP8_ATTENTION_CURRENT_CAPABILITY = (10, 0)
FP8_ATTENTION_DETERMINISTIC_CUDNN = (9, 19, 0)


def parse_fp8_recipe(value: Any, what: str = "fp8_recipe") -> Optional[str]:
    """``None`` (no FP8) or one of :data:`FP8_RECIPES`, case-insensitively; anything else raises naming it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be None or a str, got {type(value).__name__} {value!r}; pass one of {FP8_RECIPES}")
    key = value.strip().lower()
    if key not in FP8_RECIPES:
        raise ValueError(f"unknown {what} {value!r}; valid values are: {', '.join(FP8_RECIPES)} (or None for no FP8)")
    return key


def _version(text: Optional[str]) -> Tuple[int, ...]:
    return tuple(int(p) for p in (text or "0").split(".")[:2] if p.isdigit())


def check_fp8_device(name: str, capability: Tuple[int, int], cuda_version: Optional[str]) -> None:
    """Refuse ``name`` on a GPU or CUDA that TE's FP8 kernels do not run on (RuntimeError with the fix).

    ``capability``: ``torch.cuda.get_device_capability()``; ``cuda_version``: ``torch.version.cuda``.
    """
    need = MIN_CAPABILITY[name]
    if tuple(capability) < need:
        older = "Hopper (9.0)" if name == "block" else "Ada (8.9)"
        raise RuntimeError(
            f"fp8_recipe={name!r} needs a GPU of compute capability {need[0]}.{need[1]} or newer ({older}), this one "
            f"is {capability[0]}.{capability[1]}; " + (
                "use fp8_recipe='current' or 'delayed' (per-tensor scaling, from 8.9), or train in bf16 (no fp8_recipe)"
                if name == "block" else "train in bf16 (no fp8_recipe) on this GPU"))
    if name == "block" and _version(cuda_version) < BLOCK_MIN_CUDA:
        raise RuntimeError(
            f"fp8_recipe='block' needs CUDA {BLOCK_MIN_CUDA[0]}.{BLOCK_MIN_CUDA[1]} or newer for its block-scaled "
            f"GEMMs, torch runs CUDA {cuda_version}; use a newer CUDA build of torch, or fp8_recipe='current'")


def check_fp8_runtime(name: str, *, dot_product_attention: bool = False, dpa_recipe: Optional[str] = None) -> None:
    """:func:`check_fp8_device` on this machine's current GPU; RuntimeError without one. With
    ``dot_product_attention`` also :func:`fp8_attention_problems` with the cuDNN TE loaded, each problem named;
    ``dpa_recipe``: TE's ``NVTE_DPA_FP8_RECIPE`` to check with (None: this process's environment)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"fp8_recipe={name!r} needs a CUDA GPU (TransformerEngine's FP8 kernels), but "
                           "torch.cuda.is_available() is False; run on a GPU machine or drop fp8_recipe")
    check_fp8_device(name, torch.cuda.get_device_capability(), torch.version.cuda)
    if not dot_product_attention:
        return
    _te.require_te("FP8 attention (dot_product_attention=True)")
    problems = fp8_attention_problems(  # pragma: no cover - needs TE
        name, torch.cuda.get_device_capability(), _te.te_cudnn_version(),
        deterministic=attention_deterministic(),
        dpa_recipe=os.getenv("NVTE_DPA_FP8_RECIPE", "") if dpa_recipe is None else dpa_recipe)
    if problems:  # pragma: no cover - needs TE
        raise RuntimeError("; ".join(problems))


def _no_block_attention(given: str) -> str:
    return (f"{given}: TE has no FP8 attention for block scaling (Float8BlockScaling asserts fp8_dpa=False); use "
            "fp8_recipe='delayed' for FP8 attention, or keep attention in bf16")


def fp8_attention_problems(name: str, capability: Tuple[int, int], cudnn: Tuple[int, ...], *, deterministic: bool,
                           dpa_recipe: str = "") -> List[str]:
    """Why FP8 attention ([Note: FP8 attention]) cannot run with recipe ``name`` on a GPU of ``capability`` with
    cuDNN ``cudnn`` (the one TE loaded), as problem lines (empty: it can). ``deterministic``: whether TE must pick
    deterministic kernels; ``dpa_recipe``: TE's ``NVTE_DPA_FP8_RECIPE``."""
    given = f"fp8_recipe={name!r} with dot_product_attention=True"
    cap = ".".join(str(c) for c in capability)
    if name == "block":
        return [_no_block_attention(given)]
    if tuple(capability) < FP8_ATTENTION_MIN_CAPABILITY:
        return [f"{given} needs a GPU of compute capability 9.0 or newer (cuDNN's fused FP8 attention), this one is "
                f"{cap}; keep attention in bf16 (dot_product_attention=False)"]
    problems = []
    if name == "current" and tuple(capability) < FP8_ATTENTION_CURRENT_CAPABILITY and dpa_recipe != "DelayedScaling":
        problems.append(f"{given}: TE runs current-scaling FP8 attention on compute capability 10.0 or newer, this GPU "
                        f"is {cap}; use fp8_recipe='delayed', or, eagerly only (not with graphs), set "
                        "NVTE_DPA_FP8_RECIPE=DelayedScaling before transformer_engine is imported (attention then "
                        "scales by delayed scaling, the linears by current)")
    if deterministic and tuple(cudnn) < FP8_ATTENTION_DETERMINISTIC_CUDNN:
        problems.append(
            f"{given} and deterministic kernels (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or "
            f"torch.use_deterministic_algorithms) need cuDNN 9.19 or newer for FP8 attention's backward, and TE runs "
            f"cuDNN {'.'.join(str(v) for v in cudnn)}; {_te.CUDNN_FIX} (torch's is 9.19 or newer), or allow "
            "non-deterministic kernels (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1; graphed and eager runs are then not "
            "bit-exact)")
    return problems


def attention_graph_problem(name: str) -> str:
    """Why per-layer graphs refuse FP8 attention under ``name`` (``current``; [Note: FP8 attention])."""
    return (f"fp8_recipe={name!r} with FP8 attention under per-layer graphs is not supported: the attention keeps "
            "delayed-scaling state that TE's graph maker saves and restores around its warmup only for a "
            "DelayedScaling recipe, so the replays would differ from the eager steps (measured); use "
            "fp8_recipe='delayed' for FP8 attention with graphs, or keep attention in bf16")


def attention_deterministic() -> bool:
    """Whether TE's attention must pick deterministic kernels (TE's own test: the environment, or torch's mode)."""
    return os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0" or torch.are_deterministic_algorithms_enabled()


def fp8_shape_problem(what: str, shape: Sequence[int]) -> Optional[str]:
    """TE's FP8 GEMM rule for one operand (``assert_dim_for_fp8_exec``): the product of all dimensions but the last
    a multiple of 8, the last a multiple of 16. Returns the violation in words, or None."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return None
    lead = 1
    for s in shape[:-1]:
        lead *= s
    if lead % 8 or shape[-1] % 16:
        return (f"{what} has shape {list(shape)}: FP8 GEMMs need the product of all dimensions but the last "
                f"({lead}) to be a multiple of 8 and the last ({shape[-1]}) a multiple of 16")
    return None


def _is_te_module(module: nn.Module) -> bool:
    """A TransformerEngine module that keeps FP8 state (TE's ``TransformerEngineBaseModule`` has ``fp8_meta``)."""
    return isinstance(getattr(module, "fp8_meta", None), dict)


def fp8_gemm_problems(name: str, module: nn.Module, sample_args: Sequence[Any]) -> List[str]:
    """What TE's FP8 GEMMs would refuse in graphed callable ``name``: each 2-D weight of its TE modules
    (``[out, in]``), and each floating-point input whose last dimension is one of those weights' input sizes
    (``[..., hidden]``: the tokens it carries must be a multiple of 8; masks and other inputs are not checked)."""
    out, in_sizes = [], set()
    for mname, m in module.named_modules():
        if _is_te_module(m):
            for pname, p in m.named_parameters(recurse=False):
                if p.dim() == 2:
                    in_sizes.add(p.shape[-1])
                    problem = fp8_shape_problem(f"{name}.{mname + '.' if mname else ''}{pname}", p.shape)
                    if problem:
                        out.append(problem)
    for i, a in enumerate(sample_args or ()):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2 and a.shape[-1] in in_sizes:
            problem = fp8_shape_problem(f"input {i} of {name}", a.shape)
            if problem:
                out.append(problem)
    return out


def config_problems(recipe: Optional[str], *, impl: str, cache: bool, inference_scope: str,
                    attention: bool = False) -> List[str]:
    """``CudaGraphConfig``'s FP8 rules, as problem lines: which graph makers know TE's FP8 state ([Note: the FP8
    region under graphs]). ``impl``, ``inference_scope``: the config's values as strings; ``attention``:
    ``fp8_dot_product_attention``."""
    if recipe is None:
        return [f"{flag}=True without fp8_recipe would be ignored; set fp8_recipe (one of {', '.join(FP8_RECIPES)}) "
                f"or drop {flag}" for flag, on in (("fp8_cache_quantized_params", cache),
                                                   ("fp8_dot_product_attention", attention)) if on]
    given, problems = f"fp8_recipe='{recipe}'", []
    if attention and recipe == "block":
        problems.append(_no_block_attention(f"{given} with fp8_dot_product_attention=True"))
    if attention and recipe == "current" and impl == "transformer_engine":
        problems.append(attention_graph_problem(recipe))
    if attention and impl == "full_iteration" and recipe != "delayed":  # delayed: refused below for the same reason
        problems.append("fp8_dot_product_attention=True with cuda_graph_impl='full_iteration' is not supported: FP8 "
                        "attention keeps delayed-scaling state (the softmax's scales) that TE updates on the host, "
                        "which a replayed step would never do ([Note: FP8 attention]); use per-layer graphs "
                        "(cuda_graph_impl='transformer_engine') or drop fp8_dot_product_attention")
    if impl == "local":
        problems.append(f"{given} with cuda_graph_impl='local' is not supported: torch's make_graphed_callables knows "
                        "no FP8 state (TE's graph maker wraps each callable in TE's autocast while it captures and "
                        "restores the scaling state its warmup changed); use cuda_graph_impl='transformer_engine'")
    if impl == "full_iteration" and recipe == "delayed":
        problems.append(f"{given} with cuda_graph_impl='full_iteration' is not supported: TE reduces the gradients' "
                        "amaxes and updates their scales on the host after the first FP8 module's backward and skips "
                        "that while a capture is under way, so a replayed step would never update them; use "
                        "fp8_recipe='current' or 'block' (no state between steps) for whole-step graphs, or per-layer "
                        "graphs (cuda_graph_impl='transformer_engine') for delayed scaling")
    if impl == "full_iteration" and cache:
        problems.append("fp8_cache_quantized_params=True with cuda_graph_impl='full_iteration' is not supported: it is "
                        "TE's make_graphed_callables argument (per-layer graphs, cuda_graph_impl='transformer_engine'); "
                        "drop it for whole-step graphs")
    if impl != "local" and inference_scope not in ("none", "None"):  # local: refused above, its scope by default
        problems.append(f"{given} with inference_cuda_graph_scope='{inference_scope}' is not supported: inference "
                        "graphs are captured by torch's graph maker, which knows no FP8 state; drop "
                        "inference_cuda_graph_scope (evaluate eagerly under fp8.autocast()) or fp8_recipe")
    return problems


# ------------------------------------------------------------------------------------------------ the region
#: The FP8 regions entered through :meth:`FP8Recipe.autocast`, innermost last: (recipe, first_microbatch).
_REGIONS: List[Tuple["FP8Recipe", Optional[bool]]] = []


def is_first_microbatch() -> Optional[bool]:
    """The ``first_microbatch`` flag of the innermost :meth:`FP8Recipe.autocast` region (None outside one, or
    when it was entered without the flag): what a TE module's ``is_first_microbatch`` argument should be."""
    return _REGIONS[-1][1] if _REGIONS else None


def te_call_kwargs() -> Dict[str, Any]:
    """What a TE module's call takes from the open FP8 region: ``is_first_microbatch`` when the region's recipe
    caches quantized weights ([Note: quantized weights across micro-batches]), else nothing (TE's default)."""
    first = is_first_microbatch()
    return {} if first is None else {"is_first_microbatch": first}


def te_autocast_active() -> bool:
    """Whether a TE autocast region (ours or the user's own ``te.autocast``) is open on this thread."""
    if _REGIONS:
        return True
    if not _te.HAS_TE:
        return False
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # pragma: no cover - needs TE

    return bool(FP8GlobalStateManager.quantization_state.autocast_depth)  # pragma: no cover


def te_modules_by_last_forward(named: Iterable[Tuple[str, nn.Module]]) -> Tuple[List[str], List[str]]:
    """(qualified names of the TE modules under ``named`` ((prefix, module) pairs, e.g. graphed callables) whose last
    forward ran in FP8, names of those whose last forward ran without): TE sets a module's ``fp8`` flag from its
    autocast at every forward."""
    ran_fp8: List[str] = []
    ran_plain: List[str] = []
    for prefix, top in named:
        for name, m in top.named_modules(prefix=prefix):
            if _is_te_module(m) and isinstance(getattr(m, "fp8", None), bool):
                (ran_fp8 if m.fp8 else ran_plain).append(name)
    return ran_fp8, ran_plain


def delayed_scaling_modules(module: nn.Module) -> List[str]:
    """The TE modules in ``module`` whose last forward ran FP8 with delayed scaling (their ``fp8_meta`` holds a
    ``DelayedScaling`` recipe and amax history): their scales change between steps through host-side
    reductions. Reads only the modules' own state, not TE's process-wide buffers (which outlive models)."""
    out = []
    for name, m in module.named_modules():
        meta = getattr(m, "fp8_meta", None)
        if not isinstance(meta, dict) or not getattr(m, "fp8", False):
            continue
        recipe = meta.get("recipe")
        delayed = getattr(recipe, "delayed", None)
        if callable(delayed) and delayed() and hasattr(meta.get("scaling_fwd"), "amax_history"):
            out.append(name or type(module).__name__)
    return out


def _recipe_classes() -> Any:
    """TE's ``transformer_engine.common.recipe`` (tests replace this function to build recipes without TE)."""
    _te.require_te("FP8 training (fp8_recipe)")
    import transformer_engine.common.recipe as recipes  # pragma: no cover - needs TE

    return recipes  # pragma: no cover


def build_te_recipe(name: str, *, dot_product_attention: bool = False) -> Any:
    """TE's recipe object for ``name``: HYBRID for ``delayed`` and ``current`` (Megatron-LM's ``--fp8-format
    hybrid``), TE's defaults for ``block``; ``dot_product_attention``: TE's ``fp8_dpa`` ([Note: FP8 attention])."""
    r = _recipe_classes()
    attention = {"fp8_dpa": True} if dot_product_attention else {}
    if name == "delayed":
        return r.DelayedScaling(fp8_format=r.Format.HYBRID, **attention)
    if name == "current":
        return r.Float8CurrentScaling(fp8_format=r.Format.HYBRID, **attention)
    if name == "block":
        if dot_product_attention:
            raise ValueError(_no_block_attention("fp8_recipe='block' with dot_product_attention=True"))
        return r.Float8BlockScaling()
    raise ValueError(f"unknown FP8 recipe {name!r}; valid values are: {', '.join(FP8_RECIPES)}")


class FP8Recipe:
    """One run's FP8 setting: the recipe, its amax reduction group and whether quantized weights are cached.

    Args:
        name: ``delayed``, ``current`` or ``block`` (:data:`FP8_RECIPES`).
        amax_reduction_group: the data-parallel group over which delayed scaling reduces its amaxes (TE's
            ``amax_reduction_group``). ``None``: TE's default, every rank of the default group: the
            data-parallel group of a model that is only data parallel (``fully_shard`` over the world,
            hybrid sharding included). Pass your data-parallel group when other parallel dimensions exist.
        cache_quantized_params: quantize each weight once per step, on the first micro-batch, and reuse
            the FP8 copy on the others (TE's ``cache_quantized_params``; [Note: quantized weights across
            micro-batches]); every region then needs ``autocast(first_microbatch=...)``.
        dot_product_attention: attention in FP8 too (TE's ``fp8_dpa``, Megatron-LM's
            ``--fp8-dot-product-attention``; [Note: FP8 attention]): ``delayed``, eager and graphed; ``current``
            eagerly where TE runs it (refused under per-layer graphs); refused for ``block``. Checked at the first
            ``autocast()`` and when graphs are built.

    Use the same object for the eager autocast and the graph maker ([Note: the FP8 region under graphs]).
    """

    def __init__(self, name: str, *, amax_reduction_group: Any = None, cache_quantized_params: bool = False,
                 dot_product_attention: bool = False) -> None:
        parsed = parse_fp8_recipe(name, "FP8Recipe name")
        if parsed is None:
            raise ValueError("FP8Recipe(None): pass one of " + ", ".join(FP8_RECIPES) + " (no FP8: pass no FP8Recipe)")
        for flag, value in (("cache_quantized_params", cache_quantized_params),
                            ("dot_product_attention", dot_product_attention)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if dot_product_attention and parsed == "block":
            raise ValueError(_no_block_attention("FP8Recipe('block', dot_product_attention=True)"))
        self.name = parsed
        self.amax_reduction_group = amax_reduction_group
        self.cache_quantized_params = cache_quantized_params
        self.dot_product_attention = dot_product_attention
        self._recipe: Any = None
        self._attention_checked = False

    def __repr__(self) -> str:
        attention = ", dot_product_attention=True" if self.dot_product_attention else ""
        return (f"FP8Recipe({self.name!r}, cache_quantized_params={self.cache_quantized_params}{attention}, "
                f"amax_reduction_group={'default' if self.amax_reduction_group is None else 'given'})")

    @property
    def recipe(self) -> Any:
        """TE's recipe object, built once (needs TE): one object for every region and the graph maker."""
        if self._recipe is None:
            self._recipe = build_te_recipe(self.name, dot_product_attention=self.dot_product_attention)
        return self._recipe

    def check_runtime(self) -> None:
        """Refuse this recipe on a machine whose GPU, CUDA or cuDNN cannot run it (:func:`check_fp8_device`;
        with FP8 attention the cuDNN TE loaded too: :func:`check_fp8_runtime`)."""
        check_fp8_runtime(self.name, dot_product_attention=self.dot_product_attention)

    @contextlib.contextmanager
    def autocast(self, *, first_microbatch: Optional[bool] = None) -> Iterator[None]:
        """TE's ``autocast`` with this recipe and group, around one micro-batch's forward (eager or replayed).

        ``first_microbatch``: whether this is the step's first micro-batch; required (a bool) with
        ``cache_quantized_params``, else ignored by TE. Read inside through :func:`is_first_microbatch`.
        """
        if self.cache_quantized_params and not isinstance(first_microbatch, bool):
            raise ValueError(
                f"{self!r}.autocast(first_microbatch={first_microbatch!r}): with cache_quantized_params=True each "
                "region must say whether it is the step's first micro-batch (TE quantizes the weights on it and "
                "reuses them on the others): pass first_microbatch=(i == 0)")
        te = _te.require_te("FP8Recipe.autocast")
        if self.dot_product_attention and not self._attention_checked:  # eager runs too, before TE's first forward
            self.check_runtime()
            self._attention_checked = True
        _REGIONS.append((self, first_microbatch if self.cache_quantized_params else None))
        try:
            with te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=self.amax_reduction_group):
                yield
        finally:
            _REGIONS.pop()

    def graph_maker_kwargs(self) -> Dict[str, Any]:
        """The FP8 arguments of TE's ``make_graphed_callables`` (TE 2.20's names; the ``fp8_*`` ones are deprecated)."""
        return {"enabled": True, "recipe": self.recipe, "amax_reduction_group": self.amax_reduction_group,
                "cache_quantized_params": self.cache_quantized_params}

    def replay_kwargs(self) -> Dict[str, Any]:
        """What each replay of a TE graph captured with this recipe takes besides its tensors: with
        ``cache_quantized_params``, ``is_first_microbatch`` (TE raises without it)."""
        if not self.cache_quantized_params:
            return {}
        first = is_first_microbatch()
        if first is None:
            raise RuntimeError(
                f"a graph captured with {self!r} replayed outside fp8.autocast(first_microbatch=...): TE needs "
                "is_first_microbatch at every replay to decide whether to quantize the weights again; run each "
                "micro-batch's forward inside `with fp8.autocast(first_microbatch=(i == 0)):`")
        return {"is_first_microbatch": first}


# ------------------------------------------------------------------------------------------------ TE's weight flag
#: Graph sets captured with ``cache_quantized_params=True`` and not yet deleted ([Note: TE's one weight flag]).
_CACHING_GRAPHS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def before_te_capture(recipe: FP8Recipe, owner: Any) -> None:
    """[Note: TE's one weight flag] TE keeps one process-wide device flag, "skip the weight update", that it
    creates for a capture with ``cache_quantized_params=True`` and sets at each replay of such graphs. Every TE
    module captured afterwards reads that flag while a capture is under way, whether its own capture caches or
    not: a later capture without caching would take the caching path and skip its weights' quantization
    whenever the flag was left at "skip". So before a capture without caching the flag, when it exists, is set
    back to "update" (what TE itself does before a caching capture); and a capture without caching is refused
    while graphs that cache are alive (their replays would toggle the flag under it). ``owner``: the graph set."""
    if recipe.cache_quantized_params:
        return
    live = [g for g in list(_CACHING_GRAPHS) if not getattr(g, "deleted", False)]
    if live:
        raise NotImplementedError(
            f"cannot capture with {recipe!r} while {len(live)} graph set(s) captured with cache_quantized_params=True "
            "are alive: TE keeps one process-wide weight-update flag that their replays set and these graphs would "
            "read; delete() those graphs first, or cache quantized weights in both")
    if _te.HAS_TE:  # pragma: no cover - needs TE
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        if FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is not None:
            FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)


def captured_with(recipe: FP8Recipe, owner: Any) -> None:
    """Record that ``owner`` (a graph set) holds graphs captured with ``recipe`` (see :func:`before_te_capture`)."""
    if recipe.cache_quantized_params:
        _CACHING_GRAPHS.add(owner)


# ------------------------------------------------------------------------------------------------ state
def _workspace_tensors(workspace: Any) -> List[Optional[torch.Tensor]]:
    """The data tensors of one TE quantized-weight workspace (``get_data_tensors()``: rowwise, columnwise)."""
    get = getattr(workspace, "get_data_tensors", None)
    data = get() if callable(get) else workspace
    data = data if isinstance(data, (tuple, list)) else (data,)
    return [t if isinstance(t, torch.Tensor) else None for t in data]


def quantized_weight_probe(module: nn.Module) -> Optional[Tuple[Callable[[], Tuple[int, ...]], Tuple[str, ...]]]:
    """A probe of the cached quantized weights (TE's ``_fp8_workspaces``) of every TE module in ``module``.

    Returns ``(probe, names)``: ``probe()`` gives the data address of each workspace tensor as it is now (0 where
    a workspace or tensor is gone), in the order of ``names``; or None when no module holds one. Resolved
    once, right after capture ([Note: quantized weights across micro-batches]).
    """
    slots: List[Tuple[Dict[str, Any], str, int]] = []
    names: List[str] = []
    for mname, m in module.named_modules():
        spaces = getattr(m, "_fp8_workspaces", None)
        if not isinstance(spaces, dict):
            continue
        for key in sorted(spaces):
            for i, t in enumerate(_workspace_tensors(spaces[key])):
                if t is not None:
                    slots.append((spaces, key, i))
                    names.append(f"{mname or type(module).__name__}._fp8_workspaces[{key!r}][{i}]")
    if not slots:
        return None

    def probe() -> Tuple[int, ...]:
        out = []
        for spaces, key, i in slots:
            ws = spaces.get(key)
            tensors = _workspace_tensors(ws) if ws is not None else []
            t = tensors[i] if i < len(tensors) else None
            out.append(t.data_ptr() if t is not None else 0)
        return tuple(out)

    return probe, tuple(names)


def reset_scaling_state(module: nn.Module) -> List[str]:
    """Put the delayed-scaling state of every TE module in ``module`` back to its initial value in place (scale 1,
    amax history 0; TE's ``reset_fp8_meta_tensors``): what a graph maker that did not restore the state after its
    warmup would leave. Returns the modules reset. The negative control "scaling state not restored" uses it."""
    done = []
    for mname, m in module.named_modules():
        reset = getattr(m, "reset_fp8_meta_tensors", None)
        meta = getattr(m, "fp8_meta", None)
        if callable(reset) and isinstance(meta, dict) and hasattr(meta.get("scaling_fwd"), "amax_history"):
            reset()
            done.append(mname)
    return done
