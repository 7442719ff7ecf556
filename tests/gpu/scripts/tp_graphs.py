"""Tensor parallelism on NCCL with CUDA graphs: the reference GPT at TP=2 under megatron_fsdp, 1x2 or 2x2.

    torchrun --nproc-per-node 2 tests/gpu/scripts/tp_graphs.py --out tp-2gpu.json   # 1 (dp) x 2 (tp)
    torchrun --nproc-per-node 4 tests/gpu/scripts/tp_graphs.py --out tp-4gpu.json   # 2 (dp) x 2 (tp)

Torch layers with grouped-query attention (8 query, 4 key/value heads), fp32 (TF32 off, math attention: deterministic kernels), ``fully_shard(process_group=dp,
tensor_parallel_group=tp)`` with ZeRO-3 and double buffering, Adam (eps 1e-3), ``clip_grad_norm_(1.0)``; each DP
rank trains its rows of one global batch. Rows:

- ``eager`` against the TP=1 model trained on the whole global batch on each rank's GPU: losses, clipping norms
  and the TP ranks' merged parameters within ``RTOL`` (the TP=1 and TP=2 runs group their sums differently);
- ``attn+mlp`` and ``layers``: ``PartialCudaGraphs`` with the torch backend (``torch.cuda.make_graphed_callables``;
  the layers' TP all-gathers and reduce-scatters are captured into the graphs, FSDP's stay outside), captured at
  step ``CAPTURE_AT``: every loss and every parameter ``torch.equal`` to ``eager``.

``--device cpu`` runs the same rows on Gloo with the protocol backend (a smoke test of the script).

Rank 0 writes the JSON with ``ok``; the exit status is 1 when it is false (tests/gpu/test_alignment.py). The ranks
leave without ``destroy_process_group()`` ([Note: no destroy after captured NCCL collectives] below).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_fsdp  # noqa: E402
from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs  # noqa: E402
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch  # noqa: E402
from fsdp_cudagraph.apps.tp import merge_tp_state_dicts  # noqa: E402
from tests.gpu_utils import init_script_ranks  # noqa: E402
from fsdp_cudagraph.apps.train import use_sdpa_math  # noqa: E402

TP, STEPS, CAPTURE_AT, GLOBAL_ROWS, CLIP = 2, 6, 2, 8, 1.0
MODEL = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, seq_len=128)  # GQA
RTOL = 1e-4  # fp32 on the GPU, differently grouped sums, Adam with eps 1e-3 (tests/engine/test_tp_training.py)
SCOPES = {"attn+mlp": ["attn", "mlp"], "layers": []}


def cfg(tp: int) -> GPTConfig:
    return GPTConfig(tensor_parallel_size=tp, sequence_parallel=tp > 1, **MODEL)


def train(dev: torch.device, groups: Any, scope: Optional[str]) -> Dict[str, Any]:
    tp_group, dp_group = groups
    torch.manual_seed(0)
    model = megatron_fsdp.fully_shard(GPT(cfg(TP), tensor_parallel_group=tp_group).to(dev),
                                      fsdp_unit_modules=[TransformerBlock], process_group=dp_group,
                                      tensor_parallel_group=tp_group, sharding_strategy="optim_grads_params",
                                      fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3, eps=1e-3)
    graphs = None
    if scope is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=SCOPES[scope],
                                                          cuda_graph_warmup_steps=CAPTURE_AT),
                                   backend="torch" if dev.type == "cuda" else "protocol")
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    per = GLOBAL_ROWS // dp
    losses: List[float] = []
    norms: List[float] = []
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            graphs.capture()
        x, y = synthetic_batch(step, GLOBAL_ROWS, cfg(1), dev)
        loss = loss_fn(model(x[dp_rank * per:(dp_rank + 1) * per]), y[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        norms.append(float(model.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    params = {k: v.cpu() for k, v in model.state_dict().items()}
    out: Dict[str, Any] = {"losses": losses, "norms": norms, "params": params}
    if graphs is not None:
        out["replays"] = {c.name: c.module.__dict__["forward"].replays for c in graphs.callables}
        graphs.delete()
    return out


def reference(dev: torch.device) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(cfg(1)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = synthetic_batch(step, GLOBAL_ROWS, cfg(1), dev)
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dev = init_script_ranks(args.device, 29531)
    use_sdpa_math()  # deterministic, so that graphed and eager can be compared bit for bit
    groups = megatron_fsdp.tensor_parallel_groups(TP)
    runs = {"eager": train(dev, groups, None)}
    for scope in SCOPES:
        runs[scope] = train(dev, groups, scope)
    ref = reference(dev)
    tp_group = groups[0]
    peers: List[Any] = [None] * TP
    dist.all_gather_object(peers, runs["eager"]["params"], group=tp_group)
    merged = merge_tp_state_dicts(peers, num_heads=MODEL["num_heads"], num_kv_heads=MODEL["num_kv_heads"])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    dist_eager = {"param": max(rel(merged[k], v) for k, v in ref["params"].items()),
                  "loss": max(abs(a - b) / abs(b) for a, b in zip(runs["eager"]["losses"], ref["losses"])),
                  "norm": max(abs(a - b) / abs(b) for a, b in zip(runs["eager"]["norms"], ref["norms"]))}
    rows = [{"row": "eager vs TP=1", **dist_eager, "ok": all(v <= RTOL for v in dist_eager.values())}]
    for scope in SCOPES:
        g, e = runs[scope], runs["eager"]
        equal = g["losses"] == e["losses"] and g["norms"] == e["norms"] and all(
            torch.equal(g["params"][k], e["params"][k]) for k in e["params"])
        replays_ok = all(n == STEPS - CAPTURE_AT for n in g["replays"].values())
        rows.append({"row": f"graphed {scope} vs eager", "equal": equal, "replays": g["replays"],
                     "ok": equal and replays_ok})
    verdicts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, rows)
    ok = all(r["ok"] for rs in verdicts for r in rs)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ok": ok, "world_size": dist.get_world_size(), "tp": TP, "rows": verdicts,
                       "losses": runs["eager"]["losses"], "reference_losses": ref["losses"],
                       "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else None}, f, indent=1)
        print(json.dumps({"ok": ok, "rows": verdicts[0]}, indent=1))
    dist.barrier()
    # [Note: no destroy after captured NCCL collectives] With the TP collectives captured into CUDA graphs (and the
    # graphs deleted), destroy_process_group() hung in every try on 2 and 4 H200s (torch 2.11, NCCL 2.28.9) after the
    # results were written: pytorch/pytorch#115388 (ncclCommDestroy after a capture of NCCL operations). The ranks
    # leave without it, once every rank has passed the barrier, output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)

if __name__ == "__main__":
    main()
