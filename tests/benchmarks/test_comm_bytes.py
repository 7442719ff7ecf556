"""``benchmarks/_comm_bytes.py`` ([Note: counting a step's bytes]) on 2 Gloo ranks.

- each collective alone counts what the Note says (all-gather and reduce-scatter ``N (W-1)/W``, all-reduce twice
  that, all-to-all the rows sent to the other rank), and the original functions are back after the block;
- one training step of the reference GPT (4 experts, every layer MoE) under our engine: at EP=1 the experts are
  all-gathered and reduce-scattered with the rest and nothing is exchanged; at EP=2 on 2 ranks the experts never
  leave their rank (expert-data-parallel groups of one) and the tokens travel: the all-gather bytes fall by
  exactly the experts' bytes (fp32 here) gathered twice (forward and backward), the reduce-scatter bytes by the
  experts' gradients once, and the all-to-all bytes (the count exchange, the dispatch and the combine of each
  MoE layer) appear.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch

from tests.dist_utils import run_gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, moe_every=1, num_experts=4,
             moe_top_k=2, ffn_hidden_size=48, moe_experts="split")


def _alone(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from _comm_bytes import count_collectives

    original = dist.all_gather_into_tensor
    with count_collectives() as moved:
        out, part = torch.zeros(8), torch.ones(4)
        dist.all_gather_into_tensor(out, part)
        dist.reduce_scatter_tensor(part, out)
        dist.all_reduce(torch.ones(6))
        rows = torch.ones(5, 3)  # rank 0 sends 2 rows to itself and 3 to rank 1; rank 1 sends 1 and keeps 4
        splits = [2, 3] if rank == 0 else [1, 4]
        recv = [2, 1] if rank == 0 else [3, 4]
        dist.all_to_all_single(torch.empty(sum(recv), 3), rows, recv, splits)
    return {"moved": dict(moved), "restored": dist.all_gather_into_tensor is original}


def _step(rank: int, world: int, ep: int) -> Dict[str, int]:
    import megatron_fsdp
    from megatron_fsdp import fully_shard

    from _comm_bytes import count_collectives
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch

    group = megatron_fsdp.expert_parallel_groups(ep)[0] if ep > 1 else None
    torch.manual_seed(0)
    cfg = GPTConfig(expert_parallel_size=ep, **MODEL)
    model = fully_shard(GPT(cfg, expert_parallel_group=group), fsdp_unit_modules=[TransformerBlock],
                        sharding_strategy="optim_grads_params", expert_parallel_size=ep)
    x, y = synthetic_batch(0, 2 * world, GPTConfig(**MODEL), torch.device("cpu"))
    with count_collectives() as moved:
        loss_fn(model(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
    return dict(moved)


def _all(rank: int, world: int) -> Dict[str, Any]:
    return {"alone": _alone(rank, world), "ep1": _step(rank, world, 1), "ep2": _step(rank, world, 2)}


def test_counts() -> None:
    res = run_gloo(_all, 2)
    for rank, r in enumerate(res):
        moved = r["alone"]["moved"]
        assert r["alone"]["restored"]
        assert moved["all_gather"] == 32 // 2 and moved["reduce_scatter"] == 32 // 2  # 8 fp32 over 2 ranks
        assert moved["all_reduce"] == 2 * 24 // 2
        assert moved["all_to_all"] == (3 if rank == 0 else 1) * 3 * 4
    experts = 2 * 4 * 32 * 48 * 4  # per layer: w1 and w2 of 4 experts, fp32 bytes
    for r in res:
        ep1, ep2 = r["ep1"], r["ep2"]
        assert ep1["all_to_all"] == 0 and ep2["all_to_all"] > 0
        # forward and backward gathers of two layers' experts (half of each crosses the link) no longer happen
        assert ep1["all_gather"] - ep2["all_gather"] == 2 * 2 * experts // 2, (ep1, ep2)
        assert ep1["reduce_scatter"] - ep2["reduce_scatter"] == 2 * experts // 2, (ep1, ep2)
