"""The root unit's gradients borrow a gradient slot ([Note: the root's gradients in a slot],
``megatron_fsdp/_fully_shard.py``), on Gloo.

- Under the double buffer, the root (embeddings, head, final norm) has no gradient buffer of its own: its
  buffer is a slot's storage, and the engine's gradient storage is the slots alone; ``optim`` (ZeRO-1, a full
  gradient buffer by definition) keeps the root's own buffer.
- Training with the root in a slot is ``torch.equal`` to training with a buffer of its own (the engine before
  this change, forced), on 1 and 2 ranks, every strategy that uses slots, with two micro-batches per step
  (the second backward's fold must not see the first one's bytes), and a step whose root skips a parameter.
- A root TE module switched to fused weight-gradient accumulation after ``fully_shard`` raises, naming the
  fix, instead of writing into a slot the units use.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard
from megatron_fsdp._fully_shard import MegatronFSDP
from tests.dist_utils import run_gloo
from tests.engine._fused_net import Net as FusedNet
from tests.engine._slot_net import Block, Net

pytestmark = pytest.mark.gloo

DB = dict(fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
STRATEGIES = ["no_shard", "optim_grads", "optim_grads_params"]


def _build(strategy: str, own_buffer: bool):
    torch.manual_seed(0)
    original = MegatronFSDP._root_grad_slot
    if own_buffer:
        MegatronFSDP._root_grad_slot = lambda self, db_units, n: None  # the engine before the change
    try:
        net = Net()
        model = fully_shard(net, fsdp_unit_modules=[Block], sharding_strategy=strategy, **DB)
    finally:
        MegatronFSDP._root_grad_slot = original
    return net, model


def _train(rank: int, world: int, strategy: str, own_buffer: bool) -> Dict[str, Any]:
    net, model = _build(strategy, own_buffer)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    losses: List[torch.Tensor] = []
    for step in range(4):
        net.use_side = step % 2 == 0  # odd steps: the root's `side` gets no gradient
        for micro in range(2):
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(4 * world, 5, 6, generator=g), torch.randn(4 * world, 5, 3, generator=g)
            loss = nn.functional.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4])
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    root = model.root_unit
    slots = {u.grad_buffer.tensor.untyped_storage().data_ptr() for u in model.units}
    return {"losses": losses, "state": model.full_state_dict(), "root_kind": root.grad_buffer.kind,
            "root_in_unit_slot": root.grad_buffer.tensor.untyped_storage().data_ptr() in slots}


def _job(rank: int, world: int) -> Dict[str, Any]:
    return {s: (_train(rank, world, s, False), _train(rank, world, s, True)) for s in STRATEGIES}


@pytest.mark.parametrize("world", [1, 2])
def test_the_root_in_a_slot_trains_like_a_root_with_its_own_buffer(world):
    for rank, res in enumerate(run_gloo(_job, world)):
        for strategy, (slot, own) in res.items():
            assert slot["root_kind"] == "slot" and slot["root_in_unit_slot"], (strategy, slot["root_kind"])
            assert own["root_kind"] == "persistent" and not own["root_in_unit_slot"]
            assert all(torch.equal(a, b) for a, b in zip(slot["losses"], own["losses"])), (rank, strategy)
            for k, v in own["state"].items():
                assert torch.equal(v, slot["state"][k]), f"rank {rank} {strategy}: {k} differs"


def _storage_job(rank: int, world: int) -> Dict[str, Any]:
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        _, model = _build(strategy, False)
        grad_storages = {u.grad_buffer.tensor.untyped_storage().data_ptr(): u.grad_buffer.tensor.untyped_storage().nbytes()
                         for u in model.all_units()}
        out[strategy] = {"root_kind": model.root_unit.grad_buffer.kind, "grad_bytes": sum(grad_storages.values()),
                         "slot_bytes": model.slot_numel * 4, "root_bytes": model.root_unit.grad_numel * 4}
    return out


def test_the_engine_keeps_no_root_sized_gradient_buffer():
    res = run_gloo(_storage_job, 2)[0]
    zero3 = res["optim_grads_params"]
    # 3 units, fp32 main gradients, no fused weights: one gradient slot is all the gradient storage
    assert zero3["root_kind"] == "slot" and zero3["grad_bytes"] == zero3["slot_bytes"], zero3
    assert res["optim"]["root_kind"] == "persistent"  # ZeRO-1 keeps a full gradient buffer per unit


def _late_fuse_job(rank: int, world: int) -> str:
    torch.manual_seed(0)
    net = FusedNet(False)
    model = fully_shard(net, fsdp_unit_modules=[type(net.layers[0])], sharding_strategy="optim_grads_params", **DB)
    net.head.fuse_wgrad_accumulation = True  # after fully_shard: the root already borrows a slot
    try:
        model(torch.randn(2, 5, 6)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_root_te_module_fused_after_fully_shard_raises():
    msg = run_gloo(_late_fuse_job, 1)[0]
    assert "root unit" in msg and "borrows gradient slot" in msg and "before fully_shard" in msg, msg
