"""Models shared by the app tests (not a test module): checker factories that the tests import and that the
checker's command line loads by name (``--model tests.apps._models:gpt_factory``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_cudagraph.check import ModelSpec
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch

GPT_CFG = GPTConfig(num_layers=4, moe_every=2)


def gpt_factory(device: torch.device) -> ModelSpec:
    """A checker factory for the reference GPT (the checker tests import it; their command lines name it
    ``tests.apps._models:gpt_factory``)."""

    def batch(step: int):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        x, y = synthetic_batch(step, 2 * world, GPT_CFG, device)
        return x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]

    return ModelSpec(model=GPT(GPT_CFG).to(device), unit_modules=[TransformerBlock], batch=batch,
                     loss=lambda model, b: loss_fn(model(b[0]), b[1]))
