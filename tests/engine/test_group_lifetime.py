"""The engine does not keep its process group alive ([Note: the engine does not keep its group alive] in
``megatron_fsdp/_fully_shard.py``): after ``destroy_process_group()`` the group is freed (its Gloo threads joined
there, not at interpreter exit) and the engine says why it can no longer communicate. One process, one rank;
the exit itself is tested by tests/apps/test_exit.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp import fully_shard
from tests.engine._misuse_net import Layer, Net, data


def test_the_group_dies_at_destroy_and_the_engine_says_so(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = fully_shard(Net(), fsdp_unit_modules=[Layer], sharding_strategy="optim_grads_params")
        optimizer = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)  # imports torch._dynamo lazily
        x, y = data(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        assert model.group is dist.group.WORLD
        group = weakref.ref(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert group() is None, "the world group outlived destroy_process_group()"
    with pytest.raises(RuntimeError, match=r"\[rank 0\] megatron_fsdp: the engine's process group was destroyed"):
        model.group
