"""torchrun script: megatron_fsdp on NCCL against a single-GPU plain-torch reference (used by test_gpu.py).

    torchrun --nproc-per-node 2 tests/gpu_engine_parity.py OUT.json

fp32 compute: per-step loss and final parameters within rtol 1e-4 (TF32 is off; only the order of the
gradient sums differs, as on Gloo, plus cuBLAS kernels chosen per shape). bf16 compute with fp32 main
weights: per-step loss within 2e-2 relative of the fp32 reference (bf16 has 8 mantissa bits).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.train import RunSpec, run_training  # noqa: E402


def reference(cfg: GPTConfig, steps: int, batch: int, device: torch.device) -> list:
    torch.manual_seed(1234)
    model = GPT(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, batch, cfg, device, seed=1234)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    cfg = GPTConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=2)
    ref = reference(cfg, 10, 2 * world, device)
    out = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        for dtype in (torch.float32, torch.bfloat16):
            r = run_training(RunSpec(model=cfg, steps=10, sharding_strategy=strategy, compute_dtype=dtype,
                                     side_stream=False), device)
            local_losses = torch.stack(r.losses)
            dist.all_reduce(local_losses)
            got = (local_losses / world).tolist()
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            out[f"{strategy}/{str(dtype).split('.')[-1]}"] = {"max_rel_loss_diff": rel, "tol": tol, "ok": rel <= tol,
                                                               "losses": got}
    if dist.get_rank() == 0:
        out["reference"] = ref
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        for k, v in out.items():
            if k != "reference":
                print(f"{k:28s} max rel loss diff {v['max_rel_loss_diff']:.2e} (tol {v['tol']:.0e}) {'OK' if v['ok'] else 'FAIL'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
