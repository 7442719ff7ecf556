"""The gradient collectives average where the backend can ([Note: averaging in the collective],
``megatron_fsdp/_reduce.py``).

- ``reduce_by_average`` picks AVG only where it gives the pre-scale's bits: NCCL, more than one rank, fp32/fp64
  gradients at any world size, fp16/bf16 at a power-of-two world size;
- on Gloo (no AVG) the engine keeps the pre-scale;
- the backend is that of the model's device, also for a group made without a named backend (``"undefined"``)
  or with one per device type (``"cpu:gloo,cuda:nccl"``);
- the wiring, on 2 Gloo ranks with the collectives replaced by a stand-in for NCCL's AVG (each rank's input
  multiplied by ``1/world`` as it is loaded, then summed): the fold passes the unscaled gradients, the
  collective averages, and training is ``torch.equal`` to the pre-scale path, every strategy. Averaging twice
  (fold and collective) or not at all would halve or double every gradient and fail.
The NCCL side (AVG equals the pre-scaled SUM bit for bit on 2 GPUs) is ``tests/gpu/test_alignment.py``'s
``test_nccl_average_equals_prescaled_sum_2gpu``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import _collectives, fully_shard
from megatron_fsdp._collectives import backend_for
from megatron_fsdp._reduce import reduce_by_average
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


@pytest.mark.parametrize("reported,device,expected", [
    ("nccl", "cuda", "nccl"), ("gloo", "cpu", "gloo"),
    ("undefined", "cuda", "nccl"), ("undefined", "cpu", "gloo"),  # init_process_group() without a backend
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
])
def test_the_backend_of_the_models_device(monkeypatch, reported, device, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: reported)
    assert backend_for(None, torch.device(device)) == expected


_UNDEFINED = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group()  # no backend named: torch makes Gloo (and NCCL where it can) and reports 'undefined'
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard
cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, seq_len=16, moe_every=0)
model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock])
x, y = synthetic_batch(0, 2, cfg, torch.device("cpu"))
loss_fn(model(x), y).backward()
print(dist.get_backend(), model.backend, all(u.main_shard.grad is not None for u in model.all_units() if u.grad_numel))
dist.destroy_process_group()
"""


def test_a_process_group_without_a_named_backend_trains():
    import subprocess
    import sys

    from tests.dist_utils import _free_port
    from tests.gpu_utils import ROOT

    env = dict(os.environ, PORT=str(_free_port()), PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _UNDEFINED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["undefined", "gloo", "True"], proc.stdout


def _train(rank: int, world: int, strategy: str, emulate_avg: bool) -> Dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    assert not model.reduce_average and model.grad_scale == 1.0 / world  # Gloo keeps the pre-scale
    if emulate_avg:
        model.reduce_average = True  # what the engine picks on NCCL (the fold's scale follows)
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
