"""Peak matmul rate and model FLOPs per step: the MFU arithmetic that bench_partial_graphs and
bench_full_iteration share (its own module, so that neither benchmark imports the other for it).
"""

from __future__ import annotations

import functools
import statistics

from typing import Optional

import torch

from _common import cuda_time_ms
from fsdp_cudagraph.apps.model import GPTConfig

__all__ = ["matmul_peak_tflops", "fp8_matmul_peak_tflops", "copy_bandwidth_gbps", "adam_step_ms",
           "model_flops_per_step", "active_matmul_params", "transformer_flops_per_step", "collective_rates_gbps"]


def matmul_peak_tflops(device: torch.device) -> float:
    """Measured bf16 matmul rate (8192^3, random data, median of 10 after warmup)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = cuda_time_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def fp8_matmul_peak_tflops(device: torch.device) -> float:
    """Measured FP8 matmul rate: ``torch._scaled_mm`` of two 8192^2 E4M3 tensors with per-tensor scales into bf16
    (TE's FP8 GEMMs and torchao's run on the same tensor cores), median of 10 after warmup."""
    a = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    times = cuda_time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                         warmup=3, iters=10)
    return 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in 1e9 bytes/s, counting bytes read + written (1 GiB
    buffers, median of 10 after warmup): the rate memory-bound kernels such as Adam's can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = cuda_time_ms(functools.partial(dst.copy_, src), warmup=3, iters=10)
    del src, dst
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def adam_step_ms(device: torch.device, numel: int, *, fused: bool) -> float:
    """Measured time of one ``torch.optim.Adam`` step over one flat fp32 parameter of ``numel`` elements
    (``fused=False``: torch's default multi-tensor path; ``True``: the fused kernel), median of 5 after 2
    warmup steps: the optimizer part of a step next to its floor (32 bytes per element at the copy
    bandwidth). One flat tensor is the best case of the multi-tensor path (one kernel launch per op)."""
    p = torch.nn.Parameter(torch.zeros(numel, dtype=torch.float32, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.Adam([p], lr=1e-4, fused=fused, foreach=None if fused else True)
    times = cuda_time_ms(opt.step, warmup=2, iters=5)
    del opt, p
    return statistics.median(times)


def model_flops_per_step(cfg: GPTConfig, tokens: int) -> float:
    """6 * params * tokens for the matmuls plus attention (12 * layers * seq * hidden per token, causal /2)."""
    h, f, L, s = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.seq_len
    per_layer = 4 * h * h + 2 * h * f
    dense = 6 * tokens * (L * per_layer + h * cfg.vocab_size)
    attn = 6 * tokens * L * s * h  # 12*L*s*h forward+backward, halved by the causal mask
    return float(dense + attn)


def active_matmul_params(model: torch.nn.Module, *, top_k: int = 1, num_experts: int = 1) -> float:
    """Matmul weights one token passes through: every parameter of 2+ dimensions except embedding tables
    (lookups, no matmul); a parameter whose name contains ``experts`` counts ``top_k / num_experts`` of its size
    (a token visits top_k of the experts). Count before sharding (full shapes)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in tables:
            continue
        total += p.numel() * (top_k / num_experts if "experts" in name else 1.0)
    return total


def transformer_flops_per_step(*, matmul_params: float, num_layers: int, seq_len: int, attn_hidden: int,
                               tokens: int) -> float:
    """6 x matmul parameters x tokens (forward + backward) plus causal attention: 12 x layers x seq x
    ``attn_hidden`` per token (QK^T and AV, forward and backward), halved by the causal mask."""
    return float(6 * tokens * matmul_params + 6 * tokens * num_layers * seq_len * attn_hidden)


def collective_rates_gbps(device: torch.device, numel: int, *, all_to_all_numel: Optional[int] = None) -> dict:
    """Measured rates of a ``numel``-element all-gather (bf16) and reduce-scatter (fp32) over the default group,
    each alone, in 1e9 bytes per second through one rank: ``(W - 1) / W`` of the full tensor's bytes over the
    median time (CUDA events on a GPU, wall time on CPU; 3 warmup, 10 timed). Empty on one rank (nothing
    moves). Every rank must call it. See [Note: the floor with communication] in ``_perf_goals.py``.
    ``all_to_all_numel``: also an even bf16 all-to-all of that many elements per rank (``all_to_all_gbps``: the
    ``(W - 1) / W`` this rank sends to the others over its time), the rate of an MoE's token exchange."""
    import time
    import warnings

    import torch.distributed as dist

    world = dist.get_world_size()
    if world < 2:
        return {}
    numel = (numel + world - 1) // world * world
    share = (world - 1) / world
    out = {"numel": numel}
    kinds = [("all_gather", torch.bfloat16, numel), ("reduce_scatter", torch.float32, numel)]
    if all_to_all_numel:
        kinds.append(("all_to_all", torch.bfloat16, (all_to_all_numel + world - 1) // world * world))
    for name, dtype, n in kinds:
        full = torch.ones(n, dtype=dtype, device=device)
        part = torch.ones(n // world, dtype=dtype, device=device)
        if name == "all_gather":
            fn = functools.partial(dist.all_gather_into_tensor, full, part)
        elif name == "reduce_scatter":
            fn = functools.partial(dist.reduce_scatter_tensor, part, full)
        else:
            part = torch.empty_like(full)
            fn = functools.partial(dist.all_to_all_single, part, full)
        with warnings.catch_warnings():  # torch 2.13 renames these two (FutureWarning); 2.11 has only these names
            warnings.simplefilter("ignore", FutureWarning)
            if device.type == "cuda":
                times = cuda_time_ms(fn, warmup=3, iters=10)
            else:
                for _ in range(3):
                    fn()
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        out[f"{name}_ms"] = ms
        out[f"{name}_gbps"] = share * n * full.element_size() / (ms * 1e-3) / 1e9
        del full, part
    return out
