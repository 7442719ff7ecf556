"""The README's usage loop, line for line, on the default CUDA stream -- and the same loop without graphs.

    python examples/readme_loop.py [--impl transformer_engine|local] [--scope attn mlp] [--seq-len 100]
    torchrun --nproc-per-node 2 examples/readme_loop.py ...

The README's block is pasted below unchanged except for where its names come from (``my_gpt``,
``MyTransformerLayer``, ``loader``, ``loss_fn``); nothing here touches CUDA streams. Both runs use
deterministic kernels (``use_deterministic_kernels``): bit equality needs them, graphs or not. The eager run is the same
loop with ``graphs`` replaced by ``match_graph_attention`` (TE attention picks the backend a graph would, so
that the two can be compared bit for bit). It prints both loss columns and exits 1 unless every step's
loss and every final parameter are ``torch.equal``.

CUDA graphs need a CUDA GPU (and ``--impl transformer_engine`` needs TE). Without one the loop runs on Gloo with
the CPU protocol backend (``PartialCudaGraphs(..., backend="protocol")``: the same capture schedule and hook
rerouting, no graphs, no speed-up), bf16 compute on the CPU, and says so; ``--impl`` and TE do not apply there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # deterministic kernels in both runs
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, match_graph_attention
from fsdp_cudagraph.apps.train import init_distributed, use_deterministic_kernels
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard


def run(args: argparse.Namespace, graphed: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    impl = args.impl if cuda else "local"  # the CPU runs the protocol backend: no TE, no graphs
    cfg = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=args.seq_len,
                    use_te=cuda and args.impl == "transformer_engine")
    my_gpt = GPT(cfg)  # the README's names
    MyTransformerLayer = my_gpt.unit_class  # noqa: N806
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    loader = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, 2 * world, cfg, device)
        loader.append((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
    losses = []

    def loss_fn_recorded(logits, targets):  # the README's loss_fn, recording each step's loss
        loss = loss_fn(logits, targets)
        losses.append(loss.detach())
        return loss

    # ---------------------------------------------------------------- the README's block, as written
    model = fully_shard(
        my_gpt.to(device), fsdp_unit_modules=[MyTransformerLayer], sharding_strategy="optim_grads_params",
        compute_dtype=torch.bfloat16, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
    )
    optimizer = torch.optim.Adam(model.optimizer_parameters(), lr=1e-4, fused=True)   # fp32 main shards
    config = CudaGraphConfig(
        cuda_graph_impl=impl, cuda_graph_modules=args.scope, cuda_graph_warmup_steps=3,
        use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
    )
    # on CPU: backend="protocol" (the same hook schedule, no graphs), as the README's comment says
    graphs = (PartialCudaGraphs(model, config, **({} if cuda else {"backend": "protocol"})) if graphed
              else match_graph_attention(model, config))
    for step, (x, y) in enumerate(loader):
        if graphed and step == config.cuda_graph_warmup_steps:
            graphs.capture()                   # after real eager steps; hooks restored even if it fails
        loss_fn_recorded(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    graphs.delete() if graphed else graphs.uninstall()
    # ---------------------------------------------------------------- end of the README's block
    return {"losses": losses, "state": model.full_state_dict(), "report": graphs.report if graphed else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="transformer_engine", choices=["transformer_engine", "local"])
    p.add_argument("--scope", nargs="*", default=["attn", "mlp"])
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    use_deterministic_kernels()  # torch's flash SDPA backward is not deterministic past one key block otherwise
    device = init_distributed(default_port=29517)
    if not cuda and dist.get_rank() == 0:
        print("No CUDA GPU here: CUDA graphs need one (and --impl transformer_engine needs TE on it). Running the "
              "README loop on Gloo with the CPU protocol backend: the same capture schedule and hook rerouting, no "
              "graphs, no speed-up.")
    start_stream = torch.cuda.current_stream() == torch.cuda.default_stream() if cuda else "n/a (CPU)"
    eager = run(args, graphed=False)
    if cuda:  # a fresh user process would start the graphed run on the default stream too
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(torch.cuda.default_stream())
    graphed = run(args, graphed=True)
    loss_eq = [torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])]
    params_eq = all(torch.equal(eager["state"][k], graphed["state"][k]) for k in eager["state"])
    flag = torch.tensor([int(all(loss_eq) and params_eq)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ok = bool(flag.item())
    if dist.get_rank() == 0:
        for i, (a, b) in enumerate(zip(eager["losses"], graphed["losses"])):
            print(f"{i:3d}  eager {a.item():.6f}  graphed {b.item():.6f}  {'equal' if torch.equal(a, b) else 'DIFFERENT'}")
        rep = graphed["report"]
        impl = args.impl if cuda else "protocol (CPU)"
        print(f"impl {impl}, scope {args.scope or 'whole layers'}, seq {args.seq_len}, world {dist.get_world_size()}, "
              f"started on the default stream: {start_stream}; callables {len(rep.callables)}; "
              f"attention {rep.attention_backends or 'no TE attention'}")
        print(f"README loop bit-identical to eager: {ok} (losses {sum(loss_eq)}/{len(loss_eq)}, params {params_eq})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "impl": impl, "scope": args.scope,
                           "seq_len": args.seq_len, "world_size": dist.get_world_size(), "ok": ok,
                           "losses_equal": loss_eq, "params_equal": params_eq,
                           "eager_losses": [float(x) for x in eager["losses"]],
                           "graphed_losses": [float(x) for x in graphed["losses"]],
                           "attention_backends": rep.attention_backends, "torch": torch.__version__}, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
