"""NCCL's AVG against the pre-scaled SUM it replaces ([Note: averaging in the collective]), on N GPUs.

    torchrun --nproc-per-node 2 tests/gpu/scripts/nccl_average.py --out avg.json

1. Collectives: for fp32 and bf16 gradients (values over the whole range, signed zeros and subnormals
   included), ``reduce_scatter`` and ``all_reduce`` with AVG equal, bit for bit (``torch.equal``), the same
   collective with SUM on inputs multiplied by ``1/world`` (the engine's fold before this change). bf16 is
   checked only where ``reduce_by_average`` picks AVG for it (a power-of-two world).
2. The engine: the reference GPT under ``megatron_fsdp`` (ZeRO-3 and NO_SHARD, bf16 compute) trains 4 steps with
   the collectives averaging (what it picks on NCCL) and again with the pre-scale forced: every loss and every
   final parameter ``torch.equal``.

Rank 0 writes the JSON with ``ok``; the exit status is 1 when it is false (used by tests/gpu/test_alignment.py).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch  # noqa: E402
from megatron_fsdp import fully_shard  # noqa: E402
from megatron_fsdp._reduce import reduce_by_average  # noqa: E402
from tests.gpu_utils import init_script_ranks  # noqa: E402

CFG = GPTConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=0)


def gradients_like(n: int, dtype: torch.dtype, rank: int, device: torch.device) -> torch.Tensor:
    """Normal values at many scales, plus zeros of both signs and the dtype's smallest subnormals."""
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 40, (n,), generator=g).float())
    tiny = torch.finfo(dtype).smallest_normal
    x[:16] = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 2, tiny / 4, 3 * tiny / 4, 1.0, -1.0, 0.5, 1 / 3, 1e-30,
                           -1e-30, 65504.0, 1e30, -1e30])
    return x.to(dtype).to(device)


def collectives(device: torch.device) -> List[Dict[str, Any]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if not reduce_by_average("nccl", world, dtype):
            continue
        x = gradients_like(1 << 20, dtype, rank, device)
        scaled = x.clone()
        scaled.mul_(1.0 / world)  # the fold's pre-scale
        n = x.numel() // world
        avg, ref = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(avg, x, op=dist.ReduceOp.AVG)
        dist.reduce_scatter_tensor(ref, scaled, op=dist.ReduceOp.SUM)
        ar_avg, ar_ref = x.clone(), scaled.clone()
        dist.all_reduce(ar_avg, op=dist.ReduceOp.AVG)
        dist.all_reduce(ar_ref, op=dist.ReduceOp.SUM)
        rows.append({"dtype": str(dtype), "reduce_scatter_equal": torch.equal(avg, ref),
                     "all_reduce_equal": torch.equal(ar_avg, ar_ref),
                     "differing": int((avg.view(-1) != ref.view(-1)).sum()) + int((ar_avg != ar_ref).sum())})
    return rows


def train(strategy: str, average: bool, device: torch.device):
    torch.manual_seed(0)
    model = fully_shard(GPT(CFG).to(device), fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                        compute_dtype=torch.bfloat16)
    picked = model.reduce_average
    if not average:
        model.reduce_average = False  # the fold pre-scales again
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    world, rank, losses = dist.get_world_size(), dist.get_rank(), []
    for step in range(4):
        x, y = synthetic_batch(step, 2 * world, CFG, device)
        loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return picked, losses, model.full_state_dict()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = init_script_ranks("cuda", 29547)
    rows = collectives(device)
    engine = {}
    for strategy in ("optim_grads_params", "no_shard"):
        picked, la, sa = train(strategy, True, device)
        _, lb, sb = train(strategy, False, device)
        engine[strategy] = {"engine_picked_average": picked,
                            "losses_equal": all(torch.equal(a, b) for a, b in zip(la, lb)),
                            "params_equal": all(torch.equal(sa[k], sb[k]) for k in sa)}
    ok = bool(rows) and all(r["reduce_scatter_equal"] and r["all_reduce_equal"] for r in rows) and all(
        e["engine_picked_average"] and e["losses_equal"] and e["params_equal"] for e in engine.values())
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank's verdict
    ok = bool(flag.item())
    if dist.get_rank() == 0:
        result = {"ok": ok, "world_size": dist.get_world_size(), "collectives": rows, "engine": engine}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
