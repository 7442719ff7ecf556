"""Is the memory of partial graphs returned after ``PartialCudaGraphs.delete()``? (a diagnosis, one GPU)

Builds the reference GPT (4 layers, hidden 256, seq 128) under megatron_fsdp five times in one process, eager
twice then with whole-layer graphs (torch backend) three times, deletes everything each time and prints
``torch.cuda.memory_allocated()`` after ``gc.collect()``; then the same for plain
``torch.cuda.make_graphed_callables`` on a two-layer MLP without any of this project, and whether any CUDA
tensor above 10k elements is still reachable from Python.

    python benchmarks/diagnose/graph_memory.py

H100, torch 2.11.0+cu130 (2026-11-25, at `08d8793`): eager rows leave 65 MiB (the same after each); the graphed rows leave
455, 715, 975 MiB (the first 390 MiB more, each later one 260 MiB more); plain ``make_graphed_callables``
leaves 65 MiB more per build with no project code involved; no CUDA tensor is reachable from Python.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: F401,E402 - the repository root on sys.path
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _ours(dev: torch.device, graphed: bool) -> float:
    from megatron_fsdp import fully_shard

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch

    cfg = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=128)
    torch.cuda.set_stream(torch.cuda.default_stream(dev))
    gpt = GPT(cfg).to(dev)
    m = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                    compute_dtype=torch.bfloat16, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(m.optimizer_parameters(), lr=1e-3, fused=True)
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_warmup_steps=2, use_megatron_fsdp=True,
                             fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    g = PartialCudaGraphs(m, config) if graphed else None
    for s in range(5):
        if g is not None and s == 2:
            g.capture()
        x, y = synthetic_batch(s, 2, cfg, dev)
        loss_fn(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if g is not None:
        g.delete()
    del m, opt, g, gpt
    gc.collect()
    return torch.cuda.memory_allocated(dev) / 2**20


def _plain(dev: torch.device) -> float:
    mlp = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)).to(dev)
    x = torch.randn(512, 2048, device=dev, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed = torch.cuda.make_graphed_callables(mlp, (x,))
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graphed(torch.randn(512, 2048, device=dev, requires_grad=True)).sum().backward()
    torch.cuda.synchronize()
    del graphed, mlp, x
    gc.collect()
    return torch.cuda.memory_allocated(dev) / 2**20


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("diagnose/graph_memory.py needs a CUDA GPU; nothing to run here.")
        return 2
    dev = _common.init_process_group(cuda=True, default_port=29655)
    print("torch", torch.__version__)
    for graphed in (False, False, True, True, True):
        print(f"megatron_fsdp {'graphed' if graphed else 'eager  '}: allocated after delete {_ours(dev, graphed):.1f} MiB",
              flush=True)
    base = torch.cuda.memory_allocated(dev) / 2**20
    for _ in range(3):
        print(f"plain make_graphed_callables: allocated after delete {_plain(dev) - base:+.1f} MiB over the start",
              flush=True)
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() > 10000]
    print("CUDA tensors > 10k elements reachable from Python:", len(live))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
