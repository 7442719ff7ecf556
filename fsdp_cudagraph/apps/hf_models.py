"""Small HuggingFace ``transformers`` causal LMs for tests, the alignment checker and benchmarks.

The model classes are used unmodified (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``),
built from a tiny config with random weights (no download). Attention is ``attn_implementation="sdpa"``
(PyTorch's ``scaled_dot_product_attention``; HF's default and what users train with); ``"eager"`` works too
and makes the attention modules return their weights as a second tensor. Training runs with
``use_cache=False`` (a KV cache object cannot enter a graph; see docs/models.md).

``transformers`` is an optional dependency (``pip install 'fsdp-cudagraph[hf]'``): it is imported when a
model is built, never at package import. The factories :func:`llama`, :func:`qwen2` and :func:`mistral`
follow the checker's factory protocol, so::

    python -m fsdp_cudagraph.check --model fsdp_cudagraph.apps.hf_models:llama --patterns 'model.layers.*.mlp'
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["HAS_TRANSFORMERS", "TRANSFORMERS_REASON", "HFShape", "FAMILIES", "build", "batch", "loss", "spec",
           "llama", "qwen2", "mistral"]

try:  # pragma: no cover - depends on the machine
    import transformers as _transformers

    HAS_TRANSFORMERS = True
    TRANSFORMERS_REASON = ""
    TRANSFORMERS_VERSION: Optional[str] = _transformers.__version__
except Exception as exc:  # ImportError, or a broken install
    HAS_TRANSFORMERS = False
    TRANSFORMERS_REASON = (f"transformers is not importable ({type(exc).__name__}: {exc}); install it with: "
                           "pip install 'fsdp-cudagraph[hf]'")
    TRANSFORMERS_VERSION = None

#: family -> (config class, model class, decoder-layer class = the FSDP unit), names in ``transformers``.
FAMILIES: Dict[str, Tuple[str, str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralDecoderLayer"),
}


@dataclasses.dataclass
class HFShape:
    """Model and batch size. ``micro_batch_size`` is per rank; ``num_kv_heads < num_heads`` exercises GQA."""

    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 16
    micro_batch_size: int = 2
    attn_implementation: str = "sdpa"


def _require() -> Any:
    if not HAS_TRANSFORMERS:
        raise ImportError(f"fsdp_cudagraph.apps.hf_models needs transformers: {TRANSFORMERS_REASON}")
    return _transformers


def build(family: str, shape: HFShape, device: torch.device) -> Tuple[nn.Module, Type[nn.Module]]:
    """(model, decoder-layer class) of ``family`` with ``shape``, random weights from torch's current RNG state."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {sorted(FAMILIES)}")
    tf = _require()
    cfg_name, model_name, layer_name = FAMILIES[family]
    config = getattr(tf, cfg_name)(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=max(64, shape.seq_len),
        use_cache=False, tie_word_embeddings=False, attn_implementation=shape.attn_implementation,
    )
    model = getattr(tf, model_name)(config).to(device)
    layer_cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), layer_name)
    return model, layer_cls


def batch(step: int, shape: HFShape, device: torch.device, *, seed: int = 1234) -> Dict[str, torch.Tensor]:
    """This rank's batch of ``step``: ``{"input_ids", "labels"}`` (HF shifts the labels), deterministic."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch_size * world, shape.seq_len), generator=g)
    mine = tokens[rank * shape.micro_batch_size:(rank + 1) * shape.micro_batch_size].to(device)
    return {"input_ids": mine, "labels": mine}


def loss(model: nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    """HF's own causal-LM loss of one forward."""
    return model(**inputs).loss


def spec(family: str, device: torch.device, shape: Optional[HFShape] = None) -> Any:
    """A :class:`fsdp_cudagraph.check.ModelSpec` for ``family`` (the checker's factory protocol)."""
    from fsdp_cudagraph.check import ModelSpec

    shape = shape or HFShape()
    model, layer_cls = build(family, shape, device)
    return ModelSpec(model=model, unit_modules=[layer_cls], batch=lambda step: batch(step, shape, device), loss=loss)


def llama(device: torch.device) -> Any:
    """Checker factory: a tiny ``LlamaForCausalLM`` (units: ``LlamaDecoderLayer``)."""
    return spec("llama", device)


def qwen2(device: torch.device) -> Any:
    """Checker factory: a tiny ``Qwen2ForCausalLM`` (units: ``Qwen2DecoderLayer``; q/k/v carry biases)."""
    return spec("qwen2", device)


def mistral(device: torch.device) -> Any:
    """Checker factory: a tiny ``MistralForCausalLM`` (units: ``MistralDecoderLayer``)."""
    return spec("mistral", device)
