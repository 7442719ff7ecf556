"""``bench_engines.py --config llama8b_fp8``: the Llama-3-8B shape in FP8 beside bf16, the published records' setting.

The model is ``apps/llama.py`` at Llama-3-8B's shape (hidden 4096, 32 query / 8 KV heads, FFN 14336, vocabulary
128256), sequence 8192 by default (the Megatron-Bridge record's), micro-batch 1, ``--micro-batches N`` micro-batches
a step (gradient accumulation, as Megatron reaches its global batch; default 1). The columns:

- ``ours_eager``: bf16 compute, TE ``TransformerLayer`` units (the llama8b column); ``ours_kept_eager``: the same with
  ``fully_shard(keep_compute_shard=True)``, the bf16 shards cast once a step and kept instead of at every gather
  ([Note: cast on gather] in megatron_fsdp/_unit.py).
- ``ours_fp8_<recipe>_eager``: the same under TE's FP8 autocast with the recipe ``delayed``, ``current`` or ``block``
  (``fsdp_cudagraph.FP8Recipe``): one autocast region around each micro-batch's forward, the amaxes of delayed
  scaling reduced over the data-parallel group (the world); weights gathered in bf16 and quantized by TE in each
  layer.
- ``ours_fp8_partial``: + ``PartialCudaGraphs`` (TE's graph maker with the recipe; whole layers graphed), recipe
  ``--fp8-recipe`` (default ``current``, the record's).
- ``ours_fp8_full``: + ``FullIterationCudaGraph`` (the autocast inside the captured step), recipe ``--fp8-recipe``;
  ``delayed`` is refused there by the library (TE skips its backward amax update during a capture).
- ``ours_fp8_gather_eager``: the layers built under TE's ``quantized_model_init`` with current scaling (each TE
  ``Linear`` weight a ``Float8Tensor``): our engine gathers those weights as FP8 bytes, one byte an element, quantized
  from the fp32 main shards with the scale of the whole weight ([Note: FP8 parameter all-gather] in
  megatron_fsdp/_fp8.py); ``ours_fp8_gather_partial``: + ``PartialCudaGraphs`` (whole layers).
- ``ours_fp8_attention_eager``: delayed scaling with attention in FP8 too (``FP8Recipe(..., dot_product_attention=True)``,
  TE's ``fp8_dpa``: cuDNN's FP8 fused attention); ``ours_fp8_attention_partial``: + ``PartialCudaGraphs`` (whole
  layers); ``ours_fp8_attention_kept_eager``: with the bf16 shards kept, as ``ours_kept_eager``;
  ``nvidia_fp8_attention_eager``: NVIDIA's engine under the same recipe.
- ``ours_fp8_gather_attention_eager``: the two together, ours' fastest FP8 step: ``ours_fp8_gather_eager``'s FP8
  weights gathered as bytes (current scaling) with attention in FP8, which TE runs on Hopper beside current-scaled
  linears only with ``NVTE_DPA_FP8_RECIPE=DelayedScaling`` (attention scaled by delayed scaling; read when TE is
  imported, so the column's own process gets it: :func:`column_env`). Eager only: per-layer graphs refuse current
  scaling with FP8 attention ([Note: FP8 attention] in capture/fp8.py).
- ``nvidia_fp8_eager``: NVIDIA Megatron-FSDP (the checker's ``nvidia`` builder) on the same TE layers under the same
  autocast; its parameters are gathered in bf16. ``nvidia_fp8_gather_eager``: its layers built as
  ``ours_fp8_gather_eager``'s, so that NVIDIA's engine gathers the FP8 weights as bytes (its parameter groups of
  dtype "float8", what Megatron-Bridge's ``--fp8-param-gather`` runs; eager only: per-layer graphs over them need
  ``keep_fp8_transpose_cache=True``, which the checker's builder does not pass; docs/fp8.md).
- ``fsdp2_torch_eager``: FSDP2 with ``MixedPrecisionPolicy(bf16, fp32)`` on the model's torch layers (nn.Linear:
  what torchao converts), each layer compiled (``torch.compile`` per block, as torchtitan compiles; ``--fsdp2-compile
  off``: not compiled).
- ``fsdp2_float8_eager``: the same after torchao's ``convert_to_float8_training`` with the ``tensorwise`` recipe and
  ``enable_fsdp_float8_all_gather=True``, the LM head left in bf16, and
  ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step: torchtitan's float8 composition. Needs
  ``torchao`` (``pip install torchao``; its Float8Linear runs on CUDA only).

No CUDA needed to import; the recipes are built lazily (``FP8Recipe``), so ``--cpu-smoke`` checks the plumbing of
the bf16 columns on Gloo and reports the FP8 ones as not applicable there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

__all__ = ["FP8_COLUMNS", "FP8_WEIGHTS", "GATHER_ATTENTION", "COLUMN_RECIPE", "recipe_of", "make_recipe",
           "column_env", "weights_init", "layer_overrides",
           "autocast", "not_applicable", "layers_impl", "float8_fsdp2", "after_optimizer_step", "add_arguments",
           "check_arguments"]

#: The columns of ``--config llama8b_fp8``, in the table's order (their specs are in bench_engines.COLUMN_SPECS).
FP8_COLUMNS = ["ours_eager", "ours_kept_eager", "ours_fp8_delayed_eager", "ours_fp8_current_eager",
               "ours_fp8_block_eager", "ours_fp8_partial", "ours_fp8_full", "ours_fp8_gather_eager",
               "ours_fp8_gather_partial", "ours_fp8_gather_attention_eager", "nvidia_fp8_eager", "nvidia_fp8_gather_eager",
               "ours_fp8_attention_eager", "ours_fp8_attention_kept_eager", "ours_fp8_attention_partial",
               "nvidia_fp8_attention_eager", "fsdp2_torch_eager", "fsdp2_float8_eager"]
#: Columns whose layers are built under TE's quantized_model_init (primary FP8 weights), so that the engine gathers
#: them as FP8 bytes (ours: [Note: FP8 parameter all-gather] in megatron_fsdp/_fp8.py; NVIDIA's: its "float8"
#: parameter groups, what Megatron's fp8_param_gather builds); current scaling.
FP8_WEIGHTS = ["ours_fp8_gather_eager", "ours_fp8_gather_partial", "ours_fp8_gather_attention_eager",
               "nvidia_fp8_gather_eager"]
#: Columns that run attention in FP8 too (TE's ``fp8_dpa``; [Note: FP8 attention] in capture/fp8.py), with delayed
#: scaling: the recipe TE runs it with on Hopper.
FP8_ATTENTION = ["ours_fp8_attention_eager", "ours_fp8_attention_kept_eager", "ours_fp8_attention_partial",
                 "nvidia_fp8_attention_eager"]
#: FP8-weight columns (current scaling) with attention in FP8, delayed-scaled through TE's NVTE_DPA_FP8_RECIPE.
GATHER_ATTENTION = ["ours_fp8_gather_attention_eager"]
#: What a GATHER_ATTENTION column's process needs in its environment before TE is imported.
DPA_DELAYED = {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}
#: Columns whose recipe is fixed by their name; the others with ``fp8`` in their spec take ``--fp8-recipe``.
COLUMN_RECIPE = {"ours_fp8_delayed_eager": "delayed", "ours_fp8_current_eager": "current",
                 "ours_fp8_block_eager": "block", **{c: "current" for c in FP8_WEIGHTS},
                 **{c: "delayed" for c in FP8_ATTENTION}}
#: The columns that run TE's FP8 (the torchao column's float8 is torchao's own, not TE's)
TE_FP8 = ["ours_fp8_delayed_eager", "ours_fp8_current_eager", "ours_fp8_block_eager", "ours_fp8_partial",
          "ours_fp8_full", "nvidia_fp8_eager"] + FP8_WEIGHTS + FP8_ATTENTION


def recipe_of(column: str, args: argparse.Namespace) -> Optional[str]:
    """The TE recipe name ``column`` trains with (None: bf16, or torchao's float8)."""
    if column not in TE_FP8:
        return None
    return COLUMN_RECIPE.get(column, args.fp8_recipe)


def make_recipe(column: str, args: argparse.Namespace) -> Any:
    """``column``'s ``FP8Recipe`` (None for the bf16 and torchao columns), its amaxes reduced over the default group:
    the data-parallel group of these data-parallel-only columns."""
    name = recipe_of(column, args)
    if name is None:
        return None
    from fsdp_cudagraph.capture.fp8 import FP8Recipe

    return FP8Recipe(name, cache_quantized_params=caches_weights(column, args),
                     dot_product_attention=column in FP8_ATTENTION or column in GATHER_ATTENTION)


def column_env(column: str) -> Dict[str, str]:
    """The environment ``column``'s own process needs (set before TE is imported): TE's recipe for FP8 attention
    beside current-scaled linears on Hopper for the GATHER_ATTENTION columns, nothing for the others."""
    return dict(DPA_DELAYED) if column in GATHER_ATTENTION else {}


def caches_weights(column: str, args: argparse.Namespace) -> bool:
    """Whether ``column`` quantizes its bf16 weights once a step (``--fp8-cache-quantized-params``: TE's weight cache,
    what Megatron's ``is_first_microbatch`` does), the eager columns whose TE layers hold bf16 weights. The FP8-weight
    columns have nothing for TE to cache (their engine quantizes the main shards once a step)."""
    return (args.fp8_cache_quantized_params and column in TE_FP8 and column not in FP8_WEIGHTS
            and column.endswith("_eager"))


def weights_init(column: str) -> Any:
    """Where ``column``'s layers are built: under TE's ``quantized_model_init`` with current scaling for the
    FP8-weight columns (every TE ``Linear`` weight a ``Float8Tensor``), plainly for the others. The weights keep
    their bf16 values beside the FP8 bytes (``preserve_high_precision_init_val``): NVIDIA's engine starts its fp32
    mains from them and refuses FP8 weights without them, and ours starts from them too (and drops them at the
    first quantization), so both engines' mains start from the same values."""
    if column not in FP8_WEIGHTS:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    return te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True)


def layer_overrides(column: str) -> Dict[str, Any]:
    """``LlamaConfig`` fields ``column``'s TE layers need beyond the config's: the FP8-weight columns build them in the
    engines' compute dtype, bf16 (an FP8 weight keeps the dtype it was built with and TE checks it against the
    input's; the fp32 main weights then start from the bf16 values, as NVIDIA's always do), with one fused QKV
    weight (TE refuses to split a quantized weight into q, k and v), whatever ``--fuse-wgrad`` says."""
    return {"te_params_dtype": torch.bfloat16, "fuse_qkv": True} if column in FP8_WEIGHTS else {}


def autocast(fp8: Any, first: bool) -> Any:
    """One micro-batch's forward region: TE's autocast with the recipe, saying whether this is the step's first
    micro-batch (which only a recipe that caches quantized weights reads); nothing without a recipe."""
    return contextlib.nullcontext() if fp8 is None else fp8.autocast(first_microbatch=first)


def not_applicable(column: str, device: torch.device, args: argparse.Namespace) -> Optional[str]:
    """Why ``column`` of ``--config llama8b_fp8`` cannot run here by design (None: it can)."""
    from fsdp_cudagraph.capture import te as _te

    name = recipe_of(column, args)
    if name is not None:
        if device.type != "cuda":
            return "TE's FP8 GEMMs need a CUDA GPU of compute capability 8.9+ (9.0+ for block scaling)"
        if not _te.HAS_TE:
            return "FP8 runs in TransformerEngine's layers and TransformerEngine is not importable here"
        if args.layers_impl != "te":
            return f"FP8 runs in TE's layers; this run has --layers-impl {args.layers_impl}"
        from fsdp_cudagraph.capture.fp8 import check_fp8_device, check_fp8_runtime

        try:
            check_fp8_device(name, torch.cuda.get_device_capability(device), torch.version.cuda)
            if column in FP8_ATTENTION:  # the GPU and the cuDNN TE loaded ([Note: FP8 attention])
                check_fp8_runtime(name, dot_product_attention=True)
            elif column in GATHER_ATTENTION:  # with the environment the column's own process will have
                check_fp8_runtime(name, dot_product_attention=True, dpa_recipe=DPA_DELAYED["NVTE_DPA_FP8_RECIPE"])
        except Exception as exc:  # noqa: BLE001 - the library's refusal names the device and the rule
            return str(exc)
        if (column in GATHER_ATTENTION and args.isolate == "none"
                and any(os.environ.get(k) != v for k, v in DPA_DELAYED.items())):
            return ("needs NVTE_DPA_FP8_RECIPE=DelayedScaling before TE is imported, which the run gives each "
                    "column's own process: run with --isolate process (the default), or set it before the run")
    if column == "fsdp2_float8_eager":
        if device.type != "cuda":
            return "torchao's Float8Linear runs its scaled matmuls on CUDA only"
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not importable here; install it with: pip install torchao"
    return None


def layers_impl(column: str, args: argparse.Namespace) -> str:
    """The FSDP2 columns run the torch layers (nn.Linear, what torchao converts); the others ``--layers-impl``."""
    return "torch" if column in ("fsdp2_torch_eager", "fsdp2_float8_eager") else args.layers_impl


def _float8_config() -> Any:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    # torchtitan's float8 all-gather: FSDP2 gathers the float8 weights (tensorwise scaling only)
    config = type(config)(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                             "enable_fsdp_float8_all_gather": True})
    return config


def float8_fsdp2(module: nn.Module, unit_class: type, device: torch.device, *, compile_layers: bool,
                 float8: bool, make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer]) -> Any:
    """FSDP2 as torchtitan composes it on ``module``'s torch layers: torchao float8 (``float8``), each block
    compiled (``compile_layers``), then ``fully_shard`` per block and the root with the bf16 policy. Returns
    ``(model, optimizer, precision)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2
    from fsdp_cudagraph.engines.fsdp2.build import FSDP2_MIXED_PRECISION

    units = [m for m in module.modules() if isinstance(m, unit_class)]
    what = []
    if float8:
        from torchao.float8 import convert_to_float8_training

        # the LM head stays bf16 (torchtitan filters out its output layer)
        convert_to_float8_training(module, config=_float8_config(),
                                   module_filter_fn=lambda m, fqn: fqn != "head")
        what.append("torchao float8 tensorwise, float8 all-gather, LM head bf16")
    if compile_layers:
        for u in units:
            u.compile()
        what.append("each layer torch.compile'd")
    policy = MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION["bf16"])
    shard_fsdp2(module, list(reversed(units)), device=device, mp_policy=policy)
    precision = ("fp32 sharded parameters, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), "
                 "torch layers" + ("; " + "; ".join(what) if what else ""))
    return module, make_optimizer(list(module.parameters())), precision


def after_optimizer_step(column: str, model: nn.Module) -> None:
    """torchao's per-step work of the float8 column: the float8 scales of the next all-gather, in one reduction."""
    if column == "fsdp2_float8_eager":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fp8-recipe", choices=["delayed", "current", "block"], default="current",
                   help="llama8b_fp8: the recipe of the graphed FP8 columns and NVIDIA's (default: current, the "
                        "record's)")
    p.add_argument("--fsdp2-compile", choices=["on", "off"], default="on",
                   help="llama8b_fp8: torch.compile each layer of the FSDP2 columns, as torchtitan does")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per step (gradient accumulation; tokens per step scale with it)")
    p.add_argument("--fp8-cache-quantized-params", action="store_true",
                   help="llama8b_fp8: the eager FP8 columns with bf16 weights quantize them on a step's first "
                        "micro-batch only (TE's weight cache, Megatron's is_first_microbatch)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.micro_batches < 1:
        p.error(f"--micro-batches {args.micro_batches}: need at least one micro-batch a step")
    if args.fp8_cache_quantized_params:
        if args.config != "llama8b_fp8":
            p.error(f"--fp8-cache-quantized-params with --config {args.config}: the flag is for --config llama8b_fp8")
        graphed = [c for c in (args.columns or FP8_COLUMNS)
                   if c in ("ours_fp8_partial", "ours_fp8_full", "ours_fp8_attention_partial")]
        if graphed:
            p.error(f"--fp8-cache-quantized-params with {graphed}: the bench wires TE's weight cache into the eager "
                    "columns only (the graphed columns would run without it under a record that says it is on); "
                    "leave them out with --columns")
    if args.config == "llama8b_fp8" and args.fp8_recipe == "delayed" and "ours_fp8_full" in (args.columns or FP8_COLUMNS):
        p.error("--fp8-recipe delayed with the ours_fp8_full column: delayed scaling is refused in a whole-step graph "
                "(TE skips its backward amax update during a capture; docs/fp8.md); pick current or block, or leave "
                "ours_fp8_full out with --columns")
