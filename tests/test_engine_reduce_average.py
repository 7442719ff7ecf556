"""The gradient collectives average where the backend can ([Note: averaging in the collective],
``megatron_fsdp/_fully_shard.py``).

- ``reduce_by_average`` picks AVG only where it gives the pre-scale's bits: NCCL, more than one rank, fp32/fp64
  gradients at any world size, fp16/bf16 at a power-of-two world size;
- on Gloo (no AVG) the engine keeps the pre-scale;
- the wiring, on 2 Gloo ranks with the collectives replaced by a stand-in for NCCL's AVG (each rank's input
  multiplied by ``1/world`` as it is loaded, then summed): the fold passes the unscaled gradients, the
  collective averages, and training is ``torch.equal`` to the pre-scale path, every strategy. Averaging twice
  (fold and collective) or not at all would halve or double every gradient and fail.
The NCCL side (AVG equals the pre-scaled SUM bit for bit on 2 GPUs) is ``test_gpu.py``'s
``test_nccl_average_equals_prescaled_sum_2gpu``.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import _collectives, fully_shard
from megatron_fsdp._fully_shard import reduce_by_average
from tests.dist_utils import run_gloo

STRATEGIES = ["no_shard", "optim_grads", "optim_grads_params"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, seq_len=16, moe_every=0)


@pytest.mark.parametrize("backend,world,dtype,expected", [
    ("nccl", 2, torch.float32, True),
    ("nccl", 3, torch.float32, True),
    ("nccl", 6, torch.float64, True),
    ("nccl", 4, torch.bfloat16, True),
    ("nccl", 8, torch.float16, True),
    ("nccl", 3, torch.bfloat16, False),  # NCCL would round 1/3 to bf16; the fold multiplies in fp32
    ("nccl", 6, torch.float16, False),
    ("nccl", 1, torch.float32, False),  # nothing to scale
    ("gloo", 2, torch.float32, False),  # no AVG
])
def test_reduce_by_average(backend, world, dtype, expected):
    assert reduce_by_average(backend, world, dtype) is expected


def _train(rank: int, world: int, strategy: str, emulate_avg: bool) -> Dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    assert not model.reduce_average and model.grad_scale == 1.0 / world  # Gloo keeps the pre-scale
    if emulate_avg:
        model.reduce_average, model.grad_scale = True, 1.0  # what the engine picks on NCCL
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    for step in range(3):
        x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
        loss_fn(model(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def _job(rank: int, world: int) -> Dict[str, Any]:
    real_rs, real_ar = _collectives._reduce_scatter_single, dist.all_reduce
    seen: List[str] = []

    def premul(t: torch.Tensor, op: Any) -> torch.Tensor:  # NCCL's AVG: each input times 1/world, then SUM
        seen.append(str(op))
        return t * (1.0 / world) if op == dist.ReduceOp.AVG else t

    def rs(output, full, op, group, async_op):
        return real_rs(output, premul(full, op), op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def ar(tensor, op, group, async_op):
        if op != dist.ReduceOp.AVG:
            return real_ar(tensor, op=op, group=group, async_op=async_op)
        tensor.mul_(1.0 / world)
        seen.append(str(op))
        return real_ar(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    out = {}
    for strategy in STRATEGIES:
        prescaled = _train(rank, world, strategy, emulate_avg=False)
        _collectives._reduce_scatter_single, _collectives.dist.all_reduce = rs, ar
        try:
            seen.clear()
            averaged = _train(rank, world, strategy, emulate_avg=True)
        finally:
            _collectives._reduce_scatter_single, _collectives.dist.all_reduce = real_rs, real_ar
        out[strategy] = {"prescaled": prescaled, "averaged": averaged, "avg_ops": sum("AVG" in s for s in seen)}
    return out


def test_the_fold_skips_its_scale_when_the_collective_averages_two_ranks():
    for rank, res in enumerate(run_gloo(_job, 2)):
        for strategy, r in res.items():
            assert r["avg_ops"] > 0, f"rank {rank} {strategy}: no collective averaged"
            for k, v in r["prescaled"].items():
                assert torch.equal(v, r["averaged"][k]), f"rank {rank} {strategy}: {k} differs from the pre-scale path"
