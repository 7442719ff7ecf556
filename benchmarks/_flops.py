"""Peak matmul rate and model FLOPs per step: the MFU arithmetic that bench_partial_graphs and
bench_full_iteration share (its own module, so that neither benchmark imports the other for it).
"""

from __future__ import annotations

import functools
import statistics

import torch

from _common import cuda_time_ms
from fsdp_cudagraph.apps.model import GPTConfig

__all__ = ["matmul_peak_tflops", "copy_bandwidth_gbps", "adam_step_ms", "model_flops_per_step"]


def matmul_peak_tflops(device: torch.device) -> float:
    """Measured bf16 matmul rate (8192^3, random data, median of 10 after warmup)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = cuda_time_ms(lambda: a @ b, warmup=3, iters=10)
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
