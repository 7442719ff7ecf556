"""A DCP checkpoint across world sizes on NCCL: saved at 2 GPUs, loaded and saved again at 1, resumed at 2.

    torchrun --nproc-per-node 2 tests/gpu/scripts/dcp_worlds.py --phase save   --dir D --out save.json
    python                       tests/gpu/scripts/dcp_worlds.py --phase resave --dir D --out resave.json
    torchrun --nproc-per-node 2 tests/gpu/scripts/dcp_worlds.py --phase resume --dir D --out resume.json

The model is the reference GPT under ``megatron_fsdp`` (ZeRO-3, bf16 compute, double buffer, fp32 main
weights), trained with Adam and ``clip_grad_norm_`` on a global batch of 4 split over the ranks.

- ``save`` trains SAVE_AT steps, writes ``D/a`` with ``dcp.save``, keeps the full parameters and Adam state
  (``D/saved.pt``), then trains on to TOTAL steps: the uninterrupted losses and final parameters.
- ``resave`` (any other world size) loads ``D/a`` into a fresh model with other initial values; its full
  parameters and Adam state must equal ``D/saved.pt`` (``torch.equal``); it saves ``D/b`` from there.
- ``resume`` (the save's world size) loads ``D/b`` into a fresh model and trains from SAVE_AT to TOTAL: every
  loss and every final parameter must equal the uninterrupted run's (``torch.equal``, bit for bit).

Each phase's JSON (rank 0) carries ``ok``; the exit status is 1 when it is false (used by tests/gpu/test_alignment.py).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch  # noqa: E402
from megatron_fsdp import fully_shard  # noqa: E402
from tests.gpu_utils import init_script_ranks  # noqa: E402

SAVE_AT, TOTAL, GLOBAL_BATCH = 3, 6, 4
CFG = GPTConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, seq_len=64, moe_every=2)
KWARGS = dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
              fsdp_db_use_persist_buf_on_alloc_fail=True, compute_dtype=torch.bfloat16)


def build(seed: int, device: torch.device):
    torch.manual_seed(seed)
    model = fully_shard(GPT(CFG).to(device), fsdp_unit_modules=[TransformerBlock], **KWARGS)
    return model, torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)


def train_step(model, opt, step: int, device: torch.device) -> torch.Tensor:
    """One step on this rank's slice of the global batch; the global mean loss (a tensor, for torch.equal)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    x, y = synthetic_batch(step, GLOBAL_BATCH, CFG, device, seed=1234)
    lo = rank * per_rank
    loss = loss_fn(model(x[lo : lo + per_rank]), y[lo : lo + per_rank])
    loss.backward()
    model.clip_grad_norm_(0.5)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / world).cpu()


def full_state(model, opt) -> Dict[str, Any]:
    """Full parameters and Adam state on the CPU (collectives: every rank calls it)."""
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    optim = {}
    for name, entry in model.optimizer_state_dict(opt)["state"].items():
        optim[name] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                       for k, v in entry.items() if isinstance(v, torch.Tensor)}
    return {"params": params, "optim": optim}


def restore(model, opt, directory: str) -> None:
    msd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
    model.load_sharded_state_dict(msd)
    model.load_optimizer_state_dict(opt, osd)


def save(model, opt, directory: str) -> None:
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=directory)


def differing(actual: Dict[str, Any], expected: Dict[str, Any], prefix: str = "") -> List[str]:
    """Keys whose tensors are not torch.equal (or missing), recursively."""
    bad = [f"{prefix}{k} (missing)" for k in expected if k not in actual]
    for k in expected:
        if k not in actual:
            continue
        if isinstance(expected[k], dict):
            bad += differing(actual[k], expected[k], f"{prefix}{k}.")
        elif not torch.equal(actual[k], expected[k]):
            bad.append(f"{prefix}{k}")
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["save", "resave", "resume"], required=True)
    p.add_argument("--dir", required=True, help="folder for the checkpoints and the kept reference state")
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: Gloo, to check the script")
    args = p.parse_args()
    device = init_script_ranks(args.device, port=29513)
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: Dict[str, Any] = {"phase": args.phase, "world_size": world,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "save_at": SAVE_AT, "total": TOTAL}
    if args.phase == "save":
        model, opt = build(0, device)
        initial = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        for step in range(SAVE_AT):
            train_step(model, opt, step, device)
        save(model, opt, os.path.join(args.dir, "a"))
        saved = full_state(model, opt)
        losses = [train_step(model, opt, step, device) for step in range(SAVE_AT, TOTAL)]
        final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        trained = [k for k in initial if not torch.equal(initial[k], saved["params"][k])]
        if rank == 0:
            torch.save({"saved": saved, "losses": losses, "final": final, "world_size": world},
                       os.path.join(args.dir, "saved.pt"))
        rec.update(losses=[x.item() for x in losses], params_trained=len(trained), params=len(initial),
                   ok=len(trained) == len(initial))
    else:
        ref = torch.load(os.path.join(args.dir, "saved.pt"))
        model, opt = build(1, device)  # other initial values: the load must replace every one of them
        restore(model, opt, os.path.join(args.dir, "a" if args.phase == "resave" else "b"))
        if args.phase == "resave":
            bad = differing(full_state(model, opt), ref["saved"])
            save(model, opt, os.path.join(args.dir, "b"))
            rec.update(saved_at_world=ref["world_size"], differing=bad[:20], ok=not bad)
        else:
            losses = [train_step(model, opt, step, device) for step in range(SAVE_AT, TOTAL)]
            final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            equal = [torch.equal(a, b) for a, b in zip(losses, ref["losses"])]
            bad = differing(final, ref["final"])
            rec.update(losses=[x.item() for x in losses], uninterrupted=[x.item() for x in ref["losses"]],
                       losses_equal=equal, differing=bad[:20],
                       ok=world == ref["world_size"] and len(equal) == TOTAL - SAVE_AT and all(equal) and not bad)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
        print(json.dumps({k: v for k, v in rec.items() if k != "differing"}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    # [Note: a group another library keeps alive] in fsdp_cudagraph/checker/records.py: where a DeviceMesh outlives
    # the destroyed group (FSDP2's, or torch's DTensor caches after a DCP state dict), its Gloo group can abort the exit
    from fsdp_cudagraph.checker.records import exit_process

    exit_process(main())
