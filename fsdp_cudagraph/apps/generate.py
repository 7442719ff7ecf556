"""Greedy generation for the reference GPT: a static KV cache and decode graphs per batch-size bucket.

An application of :class:`~fsdp_cudagraph.InferenceCudaGraphs` (the library), for the plain-torch reference
GPT (``GPTConfig(use_te=False, unit='block')``, unwrapped)::

    gpt.eval()
    gen = GreedyGenerator(gpt, CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope="block"),
                          max_batch=8, max_len=128)
    with torch.no_grad():
        new_tokens = gen.generate(prompts, max_new_tokens=32)     # prompts [B, P] -> [B, 32]
    gen.delete()

Design choices:
- **Static KV cache.** Keys and values of every layer live in two tensors allocated once,
  ``[num_layers, max_batch, num_heads, max_len, head_dim]`` (zeros), so every graph reads and writes them at
  the addresses of capture. The write position is a device scalar; a decode step writes row ``position``
  with ``index_copy_`` and attends over the whole cache with a mask ``key <= position``, so the step has one
  shape for every position: one graph per batch bucket serves the whole generation.
- **Prefill runs eagerly**: it is one call per request with a prompt-length shape (graphing it would need a
  graph per prompt length). It is the model's own forward over the prompt; a forward hook on each layer's
  ``qkv`` projection copies the keys and values into the cache, so prefill computes exactly ``model(prompt)``.
- **Decode steps** go through ``InferenceCudaGraphs`` over :class:`DecodeStep`: the batch is padded to the
  bucket (padded rows write cache rows nobody reads), ``layer`` scope graphs each :class:`DecodeLayer`, and
  ``block`` scope the whole step. The greedy choice (argmax) runs outside the graph; tokens stay on the
  device until the end (no host sync per token).
- Not supported (clear errors): a ``megatron_fsdp``-wrapped model (generate with the unwrapped model, e.g.
  ``GPT(cfg).load_state_dict(model.state_dict())``), TransformerEngine layers, prompts of different lengths
  in one batch.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fsdp import MegatronFSDP

from fsdp_cudagraph.apps.model import GPT
from fsdp_cudagraph.config import CudaGraphConfig
from fsdp_cudagraph.graphs.inference import InferenceCudaGraphs
from fsdp_cudagraph.capture.buckets import Buckets

__all__ = ["StaticKVCache", "DecodeLayer", "DecodeStep", "GreedyGenerator", "greedy_reference"]


class StaticKVCache:
    """Keys and values of every layer, ``[num_layers, max_batch, num_heads, max_len, head_dim]``, at fixed addresses."""

    def __init__(self, model: GPT, *, max_batch: int, max_len: int, dtype: Optional[torch.dtype] = None) -> None:
        cfg = model.cfg
        p = next(model.parameters())
        shape = (cfg.num_layers, max_batch, cfg.num_heads, max_len, cfg.hidden_size // cfg.num_heads)
        self.k = torch.zeros(shape, dtype=dtype or p.dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        #: the position a decode step writes (a device scalar, so that one graph serves every position)
        self.position = torch.zeros((), dtype=torch.long, device=p.device)
        self.key_positions = torch.arange(max_len, device=p.device)
        self.max_batch, self.max_len = max_batch, max_len


class DecodeLayer(nn.Module):
    """One reference-GPT block for one new token per row, reading and extending the layer's cache."""

    def __init__(self, block: nn.Module, index: int, cache: StaticKVCache) -> None:
        super().__init__()
        self.block = block
        self.index = index
        self.cache = cache
        self.training = False  # its own flag only: the GPT's modes stay the user's

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        attn, cache = self.block.attn, self.cache
        b, _, h = x.shape
        heads = attn.num_heads
        q, k, v = attn.qkv(attn.ln(x)).view(b, 1, 3, heads, h // heads).permute(2, 0, 3, 1, 4)  # [b, heads, 1, d]
        keys, values = cache.k[self.index, :b], cache.v[self.index, :b]  # views at fixed addresses
        where = position.view(1)
        keys.index_copy_(2, where, k.to(keys.dtype))
        values.index_copy_(2, where, v.to(values.dtype))
        visible = (cache.key_positions <= position).view(1, 1, 1, -1)
        y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible)
        y = y.transpose(1, 2).reshape(b, 1, h)
        out = x + attn.proj(y)
        ffn = self.block.moe if hasattr(self.block, "moe") else self.block.mlp
        return ffn(out, skip=y) if attn.rich_calls else ffn(out)


class DecodeStep(nn.Module):
    """``forward(tokens [b, 1], position) -> logits [b, 1, vocab]``: one decode step over the cache."""

    def __init__(self, model: GPT, cache: StaticKVCache) -> None:
        super().__init__()
        self.gpt = model
        self.layers = nn.ModuleList(DecodeLayer(block, i, cache) for i, block in enumerate(model.layers))
        self.training = False

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.tok(tokens) + gpt.pos(position.view(1))[None]
        for layer in self.layers:
            x = layer(x, position)
        return gpt.head(gpt.ln_f(x))


class GreedyGenerator:
    """Greedy decoding of the reference GPT with a static KV cache; decode steps graphed per batch bucket.

    Args:
        model: an unwrapped :class:`~fsdp_cudagraph.apps.model.GPT` with plain-torch blocks, in eval mode when
            generating.
        config: its ``inference_cuda_graph_scope`` picks the decode graphs (``none``: eager decode steps).
        max_batch, max_len: the cache's rows and positions (``max_len`` <= the model's ``seq_len``).
        batch_buckets: padded decode batch sizes (default ``Buckets.powers_of_two(max_batch)``).
        backend, max_graph_sets: as for :class:`InferenceCudaGraphs`.

    Hazards: one generation at a time (the cache is shared); do not change the model's parameters or modules
    while the graphs exist (``delete()`` first).
    """

    def __init__(self, model: GPT, config: CudaGraphConfig, *, max_batch: int, max_len: int,
                 batch_buckets: Optional[Buckets] = None, backend: Optional[str] = None,
                 cache_dtype: Optional[torch.dtype] = None, max_graph_sets: int = 16) -> None:
        if isinstance(model, MegatronFSDP):
            raise NotImplementedError(
                "GreedyGenerator needs the unwrapped GPT: decode steps call its blocks' submodules directly, which "
                "a megatron_fsdp model does not gather. Build a plain GPT and load the full state: "
                "gpt = GPT(cfg).to(device); gpt.load_state_dict(model.state_dict())")
        if not isinstance(model, GPT):
            raise TypeError(f"GreedyGenerator drives the reference GPT (fsdp_cudagraph.apps.model.GPT), got "
                            f"{type(model).__name__}")
        if model.cfg.use_te or model.cfg.unit != "block":
            raise NotImplementedError(f"GreedyGenerator supports the plain-torch GPT (use_te=False, unit='block'), got "
                                      f"use_te={model.cfg.use_te}, unit={model.cfg.unit!r}")
        cfg = model.cfg
        if cfg.num_kv_heads != cfg.num_heads or cfg.num_heads * cfg.head_dim != cfg.hidden_size:
            raise NotImplementedError(f"GreedyGenerator's cache holds num_heads heads of hidden_size / num_heads; got "
                                      f"num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim} with num_heads="
                                      f"{cfg.num_heads}, hidden_size={cfg.hidden_size}: generate with a model whose "
                                      "num_kv_heads and head_dim are left at their defaults")
        if max_len > model.cfg.seq_len or max_len < 1 or max_batch < 1:
            raise ValueError(f"max_len={max_len}, max_batch={max_batch}: need 1 <= max_len <= the GPT's positional "
                             f"embedding ({model.cfg.seq_len} positions, GPTConfig.seq_len) and max_batch >= 1")
        buckets = batch_buckets if batch_buckets is not None else Buckets.powers_of_two(max_batch)
        if buckets.max_size > max_batch:
            raise ValueError(f"batch_buckets={list(buckets.sizes)} pad decode steps beyond max_batch={max_batch} "
                             f"cache rows; drop the larger buckets or raise max_batch")
        self.model = model
        self.cache = StaticKVCache(model, max_batch=max_batch, max_len=max_len, dtype=cache_dtype)
        self.step = DecodeStep(model, self.cache)
        self.graphs = InferenceCudaGraphs(self.step, config, batch_buckets=buckets, layer_modules=[DecodeLayer],
                                          backend=backend, max_graph_sets=max_graph_sets)

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """The ``max_new_tokens`` greedy continuations of ``prompts`` ([B, P] token ids): ``[B, max_new_tokens]``.

        With ``return_logits`` also the logits each token was chosen from, ``[B, max_new_tokens, vocab]``.
        Runs under ``torch.no_grad()``; the model must be in eval mode.
        """
        if self.graphs.deleted:
            raise RuntimeError("GreedyGenerator.generate() after delete(); build a new GreedyGenerator")
        if self.model.training:
            raise RuntimeError("GreedyGenerator.generate() needs the model in eval mode: call model.eval() first")
        if prompts.dim() != 2 or prompts.dtype not in (torch.long, torch.int32):
            raise ValueError(f"prompts must be [batch, prompt_len] token ids, got {tuple(prompts.shape)} {prompts.dtype}")
        b, p = prompts.shape
        if b > self.cache.max_batch or p < 1 or max_new_tokens < 1 or p + max_new_tokens - 1 > self.cache.max_len:
            raise ValueError(
                f"prompts of {b} rows x {p} tokens with max_new_tokens={max_new_tokens}: need rows <= max_batch="
                f"{self.cache.max_batch}, prompt_len >= 1, max_new_tokens >= 1 and prompt_len + max_new_tokens - 1 <= "
                f"max_len={self.cache.max_len}")
        with torch.no_grad():
            logits = self._prefill(prompts)
            tok = logits.argmax(-1, keepdim=True)
            tokens: List[torch.Tensor] = [tok]
            seen: List[torch.Tensor] = [logits]
            for t in range(p, p + max_new_tokens - 1):
                self.cache.position.fill_(t)
                logits = self.graphs(tok, self.cache.position)[:, -1]
                tok = logits.argmax(-1, keepdim=True)
                tokens.append(tok)
                seen.append(logits)
            out = torch.cat(tokens, dim=1)
            return (out, torch.stack(seen, dim=1)) if return_logits else out

    def _prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the prompts, keys and values copied into the cache; last logits [B, vocab]."""
        b, p = prompts.shape
        cfg = self.model.cfg
        heads, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        cache = self.cache
        handles = []
        for i, block in enumerate(self.model.layers):
            def store(module: nn.Module, args: tuple, out: torch.Tensor, i: int = i) -> None:
                _, k, v = out.view(b, p, 3, heads, d).permute(2, 0, 3, 1, 4)
                cache.k[i, :b, :, :p].copy_(k)
                cache.v[i, :b, :, :p].copy_(v)

            handles.append(block.attn.qkv.register_forward_hook(store))
        try:
            logits = self.model(prompts)
        finally:
            for h in handles:
                h.remove()
        return logits[:, -1]

    def delete(self) -> None:
        """Reset the decode graphs and free the cache. Idempotent."""
        self.graphs.delete()
        self.cache.k = self.cache.v = torch.empty(0)


def greedy_reference(model: nn.Module, prompts: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Greedy decoding without a cache: the whole sequence through ``model`` for every new token (eager)."""
    seq = prompts
    tokens, seen = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(seq)[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(tok)
            seen.append(logits)
            seq = torch.cat([seq, tok], dim=1)
    out = torch.cat(tokens, dim=1)
    return (out, torch.stack(seen, dim=1)) if return_logits else out
