"""FSDP2 as its users run it, under our partial graphs, on N GPUs: the two storage options and mixed precision.

    torchrun --nproc-per-node 2 tests/gpu/scripts/fsdp2_storage.py --out fsdp2-storage.json                  # NCCL, torch backend
    torchrun --nproc-per-node 2 tests/gpu/scripts/fsdp2_storage.py --out fsdp2-storage.json --device cpu     # Gloo, protocol

Rows: storage ``keep`` (``keep_unsharded_storage``) or ``slots`` (``use_unsharded_slots``, two slots; needs two or
more ranks) x precision ``bf16`` (the model cast to bf16) or ``mp`` (fp32 shards,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) x scope (whole layers, attn+mlp). Each row trains
the reference GPT eagerly under plain FSDP2 (its default ZeRO-3, storage freed at every reshard) and again with
the storage option and graphs captured at step 3, from a loop on the default stream: every loss and every final
parameter must be ``torch.equal`` on every rank. Rank 0 writes the JSON with ``ok``; the exit status is 1 when
it is false (used by tests/gpu/test_alignment.py and, on Gloo, tests/gpu/test_scripts_gloo.py).
"""

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.gpu_utils import init_script_ranks  # noqa: E402

STEPS, CAPTURE_AT = 8, 3
SCOPES = {"layers": [], "attn+mlp": ["attn", "mlp"]}


def train(storage: Optional[str], precision: str, scope: Optional[List[str]], device: torch.device,
          backend: str) -> Dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
    from fsdp_cudagraph import keep_unsharded_storage
    from fsdp_cudagraph import use_unsharded_slots

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, seq_len=100, moe_every=0)
    model = GPT(cfg).to(device)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    if precision == "mp":
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    else:
        model = model.to(low)
        mp = MixedPrecisionPolicy()
    for layer in model.layers:
        fsdp2_shard(layer, mp_policy=mp)
    fsdp2_shard(model, mp_policy=mp)
    if storage == "keep":
        keep_unsharded_storage(model)
    elif storage == "slots":
        use_unsharded_slots(model, num_slots=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    graphs = None
    if scope is not None:
        cfg_g = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scope, cuda_graph_warmup_steps=CAPTURE_AT)
        graphs = PartialCudaGraphs(model, cfg_g, backend=backend)
    losses = []
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            graphs.capture()
        x, y = synthetic_batch(step, 2 * world, cfg, device)
        loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().cpu())
    if graphs is not None:
        graphs.delete()
    params = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--port", type=int, default=29633)
    args = ap.parse_args()
    device = init_script_ranks(args.device, args.port)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        from fsdp_cudagraph import use_side_stream

        use_side_stream()
    backend = "torch" if args.device == "cuda" else "protocol"
    world = dist.get_world_size()
    rows = []
    for precision in ("bf16", "mp"):
        eager = train(None, precision, None, device, backend)
        for storage in ("keep", "slots"):
            if storage == "slots" and world < 2:
                rows.append({"storage": storage, "precision": precision, "skipped": "use_unsharded_slots needs 2+ ranks"})
                continue
            for name, scope in SCOPES.items():
                run = train(storage, precision, scope, device, backend)
                same = torch.equal(run["losses"], eager["losses"]) and all(
                    torch.equal(v, eager["params"][k]) for k, v in run["params"].items())
                rows.append({"storage": storage, "precision": precision, "scope": name, "equal": bool(same),
                             "losses": run["losses"].tolist()})
                if dist.get_rank() == 0:
                    print(f"{storage:5s} {precision:4s} {name:8s} {'EQUAL' if same else 'DIFFERS'}", flush=True)
    # every rank's verdict: the run is ok only where all ranks agree it is
    mine = torch.tensor([int(all(r.get("equal", True) for r in rows))], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    ok = bool(mine.item()) and any("equal" in r for r in rows)
    if dist.get_rank() == 0:
        from fsdp_cudagraph.checker.records import versions, write_record

        write_record(args.out, {"command": " ".join(sys.argv), "world_size": world, "versions": versions(),
                                "steps": STEPS, "capture_step": CAPTURE_AT, "rows": rows, "ok": ok})
        print(f"{sum(r.get('equal', False) for r in rows)}/{sum('equal' in r for r in rows)} rows equal; ok={ok}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    # [Note: a group another library keeps alive] in fsdp_cudagraph/checker/records.py: where a DeviceMesh outlives
    # the destroyed group (FSDP2's, or torch's DTensor caches after a DCP state dict), its Gloo group can abort the exit
    from fsdp_cudagraph.checker.records import exit_process

    exit_process(main())
