"""The hardware floor of a training step and the verdicts of the performance goals: pure arithmetic, no GPU.

``bench_partial_graphs.py --suite full`` measures two device rates (bf16 matmul FLOP/s, device copy bytes/s),
times the columns of ``bench_full_iteration`` and hands both to :func:`evaluate` with the performance goals, :data:`GOALS`;
``bench_engines.py`` adds the collective rates for :func:`floor_with_comm_ms` and evaluates
:data:`ENGINE_GOALS` (the engines-at-scale and MoE goals). This module stays free of CUDA so that ``tests/benchmarks/test_perf_goals.py``
checks it on CPU.

[Note: the floor of a step]
A step cannot be faster than its matmuls at the device's measured matmul rate plus its memory-bound optimizer
traffic at the device's measured copy bandwidth::

    floor = model_flops_per_step / matmul_rate + optimizer_bytes / copy_bandwidth

``model_flops_per_step`` is ``_flops.model_flops_per_step`` (6 x matmul parameters x tokens, plus causal
attention) for this rank's tokens. ``optimizer_bytes`` counts, per parameter this rank owns (``params /
world``, ZeRO-3): fp32 Adam reading and writing param, grad, exp_avg and exp_avg_sq (4 tensors x 4 bytes x 2 =
32 bytes) plus the bf16 compute copy (read the fp32 param, write bf16: 6 bytes), 38 bytes in all. Both rates
are measured in the same run (a large GEMM, a large device-to-device copy counting bytes read + written), so
the floor moves with the clock of the device it runs on. It leaves out elementwise kernels (norms, GELU,
softmax, embedding, loss), communication and launch gaps: those are what the multiple of the floor measures.

[Note: the floor with communication]
Under ZeRO-3 on W ranks each step moves, through every rank's link, (W - 1) / W of: the bf16 compute
parameters gathered in forward, gathered again in backward, and the gradients reduce-scattered (fp32 where
gradients reduce in fp32: ours, FSDP2 with ``reduce_dtype=fp32``, NVIDIA with fp32 main gradients).
``bench_engines.py`` times one layer-sized all-gather and one layer-sized reduce-scatter alone (NCCL, after
warmup, median) in the same run, giving the two rates. The collectives of a step can overlap its matmuls,
except the first unit's forward gather (nothing to compute before it arrives) and the last unit's
reduce-scatter (nothing but the optimizer after it), and the optimizer runs after all of them::

    floor = first_gather + max(matmul, all_gathers + reduce_scatters - first_gather - last_reduce_scatter)
            + last_reduce_scatter + optimizer

On one rank nothing moves and this is [Note: the floor of a step]. It still leaves out elementwise kernels,
launch gaps, and the contention of overlapped collectives with matmuls for SMs and memory bandwidth.

[Note: noise and the exit code]
The same run measures its own noise two ways and, for each goal, takes the larger:
  * repeat: the eager column is run twice (``eager`` and ``eager_repeat``, same spec, one early and one
    late); ``|a - b| / min(a, b)`` of their median step times (peak memory: of their peaks);
  * spread (step times only): half the inter-quartile range of the per-step times (after ``--skip``) over
    their median, of each of the goal's two columns (the floor has none); with two or three timed steps,
    half their range over the median.
A ratio with goal ``<= g`` is PASS when ``ratio <= g``, NOISE when ``g < ratio <= g * (1 + noise)`` (outside
the goal by less than the run-to-run noise: not a regression we can tell from chance) and FAIL when
``ratio > g * (1 + noise)``. The benchmark exits 1 when any goal FAILs, 0 otherwise (NOISE is reported, not
fatal); a ratio that cannot be computed (a column failed or was not run) is MISSING and also exits 1.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["ADAM_BYTES_PER_PARAM", "CAST_BYTES_PER_PARAM", "Goal", "GOALS", "ENGINE_GOALS", "param_count",
           "optimizer_bytes", "floor_ms", "zero3_comm_bytes", "floor_with_comm_ms", "floor_from_bytes_ms", "relative_spread", "repeat_noise",
           "verdict", "evaluate", "format_table"]

#: fp32 param, grad, exp_avg, exp_avg_sq, each read and written by Adam.
ADAM_BYTES_PER_PARAM = 4 * 4 * 2
#: the bf16 compute copy: read the fp32 param (4), write bf16 (2).
CAST_BYTES_PER_PARAM = 4 + 2


def param_count(*, vocab_size: int, hidden_size: int, num_layers: int, ffn_hidden_size: int, seq_len: int) -> int:
    """Parameters of the reference GPT (``apps/model.py``, dense layers): embeddings, layers, final norm, head.

    Per layer: LayerNorm + QKV (with bias) + projection, LayerNorm + fc1 + fc2 (with biases).
    """
    h, f = hidden_size, ffn_hidden_size
    layer = (2 * h + 3 * h * h + 3 * h) + (h * h + h) + (2 * h + h * f + f + f * h + h)
    return vocab_size * h + seq_len * h + num_layers * layer + 2 * h + h * vocab_size


def optimizer_bytes(num_params: int, world_size: int = 1) -> float:
    """Bytes one rank's optimizer step and bf16 cast move: 38 per owned parameter (see [Note: the floor of a step])."""
    if num_params < 0 or world_size < 1:
        raise ValueError(f"num_params={num_params}, world_size={world_size}: need num_params >= 0 and world_size >= 1")
    return (ADAM_BYTES_PER_PARAM + CAST_BYTES_PER_PARAM) * num_params / world_size


def floor_ms(*, flops: float, bytes_moved: float, matmul_tflops: float, copy_gbps: float) -> Dict[str, float]:
    """The step floor in ms and its two parts: ``flops / matmul rate`` and ``bytes / copy bandwidth``.

    ``matmul_tflops`` in 1e12 FLOP/s, ``copy_gbps`` in 1e9 bytes/s (read + written).
    """
    if matmul_tflops <= 0 or copy_gbps <= 0:
        raise ValueError(f"matmul_tflops={matmul_tflops}, copy_gbps={copy_gbps}: the measured rates must be > 0; "
                         "re-run the measurement on an idle GPU")
    compute = flops / (matmul_tflops * 1e12) * 1e3
    memory = bytes_moved / (copy_gbps * 1e9) * 1e3
    return {"floor_ms": compute + memory, "matmul_ms": compute, "optimizer_ms": memory}


def zero3_comm_bytes(num_params: int, world_size: int, *, param_bytes: int = 2, grad_bytes: int = 4) -> Dict[str, float]:
    """Bytes one rank sends (= receives) per ZeRO-3 step for ``num_params`` parameters over ``world_size`` ranks.

    See [Note: the floor with communication]: an all-gather of the ``param_bytes``-wide compute parameters in
    forward and again in backward, a reduce-scatter of the ``grad_bytes``-wide gradients, each moving
    ``(W - 1) / W`` of the full tensor through every rank's link (ring algorithms; 0 on one rank).
    """
    if num_params < 0 or world_size < 1 or param_bytes <= 0 or grad_bytes <= 0:
        raise ValueError(f"num_params={num_params}, world_size={world_size}, param_bytes={param_bytes}, "
                         f"grad_bytes={grad_bytes}: need num_params >= 0, world_size >= 1 and positive byte widths")
    share = (world_size - 1) / world_size
    return {"all_gather_bytes": 2 * num_params * param_bytes * share,
            "reduce_scatter_bytes": num_params * grad_bytes * share}


def floor_with_comm_ms(*, matmul_ms: float, optimizer_ms: float, num_params: int, first_unit_params: int,
                       last_unit_params: int, world_size: int, all_gather_gbps: Optional[float],
                       reduce_scatter_gbps: Optional[float], param_bytes: int = 2,
                       grad_bytes: int = 4) -> Dict[str, float]:
    """The step floor counting ZeRO-3's collectives, see [Note: the floor with communication].

    ``matmul_ms`` and ``optimizer_ms`` are :func:`floor_ms`'s parts; ``*_gbps`` the collective rates measured in
    the same run, in 1e9 bytes per second through one rank (bytes one rank moves over the collective's time);
    None only on one rank, where nothing moves. ``first_unit_params`` is what the first all-gather of the step
    brings (nothing to overlap it with), ``last_unit_params`` what the last reduce-scatter reduces (nothing after
    it but the optimizer).
    """
    if not 0 <= first_unit_params <= num_params or not 0 <= last_unit_params <= num_params:
        raise ValueError(f"first_unit_params={first_unit_params}, last_unit_params={last_unit_params}, "
                         f"num_params={num_params}: a unit holds between 0 and all of the model's parameters")
    total = zero3_comm_bytes(num_params, world_size, param_bytes=param_bytes, grad_bytes=grad_bytes)
    first = zero3_comm_bytes(first_unit_params, world_size, param_bytes=param_bytes, grad_bytes=grad_bytes)
    last = zero3_comm_bytes(last_unit_params, world_size, param_bytes=param_bytes, grad_bytes=grad_bytes)
    moves = total["all_gather_bytes"] + total["reduce_scatter_bytes"] > 0
    if moves and (not all_gather_gbps or not reduce_scatter_gbps or all_gather_gbps <= 0 or reduce_scatter_gbps <= 0):
        raise ValueError(f"all_gather_gbps={all_gather_gbps}, reduce_scatter_gbps={reduce_scatter_gbps} on "
                         f"{world_size} ranks: the measured collective rates must be > 0 where bytes move; re-run "
                         "the measurement")

    def ms(nbytes: float, gbps: Optional[float]) -> float:
        return nbytes / (gbps * 1e9) * 1e3 if nbytes else 0.0

    ag_ms = ms(total["all_gather_bytes"], all_gather_gbps)
    rs_ms = ms(total["reduce_scatter_bytes"], reduce_scatter_gbps)
    first_ms = ms(first["all_gather_bytes"] / 2, all_gather_gbps)  # the forward gather of the first unit only
    last_ms = ms(last["reduce_scatter_bytes"], reduce_scatter_gbps)
    hidden_comm = ag_ms + rs_ms - first_ms - last_ms
    return {"floor_ms": first_ms + max(matmul_ms, hidden_comm) + last_ms + optimizer_ms,
            "compute_floor_ms": matmul_ms + optimizer_ms, "comm_ms": ag_ms + rs_ms, "all_gather_ms": ag_ms,
            "reduce_scatter_ms": rs_ms, "first_gather_ms": first_ms, "last_reduce_scatter_ms": last_ms,
            "matmul_ms": matmul_ms, "optimizer_ms": optimizer_ms, **total,
            "bound": "communication" if hidden_comm > matmul_ms else "compute"}


def relative_spread(values: Sequence[float]) -> float:
    """Half the inter-quartile range over the median; with 2 or 3 values (too few for quartiles), half their
    range over the median, so that a run of two or three timed steps does not report itself noiseless; 0 for
    one value (nothing to compare)."""
    vals = sorted(values)
    med = statistics.median(vals) if vals else 0.0
    if len(vals) < 2 or not med:
        return 0.0
    if len(vals) < 4:
        return (vals[-1] - vals[0]) / 2 / med
    q1, _, q3 = statistics.quantiles(vals, n=4)
    return (q3 - q1) / 2 / med


def repeat_noise(a: Optional[float], b: Optional[float]) -> float:
    """``|a - b| / min(a, b)`` of one quantity measured twice in the same run (0 if either is missing)."""
    if a is None or b is None or min(a, b) <= 0:
        return 0.0
    return abs(a - b) / min(a, b)


def verdict(ratio: Optional[float], goal: float, noise: float) -> str:
    """PASS, NOISE, FAIL or MISSING for ``ratio <= goal``, see [Note: noise and the exit code]."""
    if ratio is None:
        return "MISSING"
    if ratio <= goal:
        return "PASS"
    if ratio <= goal * (1 + noise):
        return "NOISE"
    return "FAIL"


@dataclass(frozen=True)
class Goal:
    """``num / den <= goal`` for one config, on step time (``ms``), peak memory (``mem``) or the bytes a rank
    moves per step (``bytes``, :mod:`_comm_bytes`); ``seq``: only for that sequence length (None: any); ``tp``: only
    at that tensor-parallel size (None: any)."""

    name: str
    config: str
    kind: str  # "ms", "mem", "bytes" (every kind) or "gather" (the all-gather bytes alone)
    num: str  # a column, or "floor"
    den: str
    goal: float
    seq: Optional[int] = None
    tp: Optional[int] = None


#: The performance goals. "full" is the ``full_iteration`` column (optimizer eager), the one of the goals' table.
GOALS: List[Goal] = [
    Goal("eager step / floor", "compute", "ms", "eager", "floor", 1.3),
    Goal("eager step / FSDP2 eager", "compute", "ms", "eager", "fsdp2", 0.8),
    Goal("partial step / eager", "compute", "ms", "partial", "eager", 1.0),
    Goal("full-iteration step / eager", "compute", "ms", "full_iteration", "eager", 1.0),
    Goal("full-iteration step / FSDP2 captured whole", "launch", "ms", "full_iteration", "fsdp2_graph", 0.8),
    Goal("eager peak / FSDP2 peak", "compute", "mem", "eager", "fsdp2", 1.0),
    Goal("partial peak / eager peak", "compute", "mem", "partial", "eager", 1.1),
    Goal("full-iteration peak / eager peak", "compute", "mem", "full_iteration", "eager", 1.05),
    Goal("partial peak / eager peak", "launch", "mem", "partial", "eager", 1.1),
    Goal("full-iteration peak / eager peak", "launch", "mem", "full_iteration", "eager", 1.05),
]


#: The engines-at-scale goals (config ``llama8b``), the MoE goals (``olmoe``, ``qwen3moe``) and the tensor-parallel
#: goals (``llama70b``, and ``mcore70b`` on megatron-core's GPTModel; the same tokens per GPU per step in every column
#: of one run) over ``bench_engines.py``'s columns.
#: A tokens/s goal "a >= x * b" with the same tokens per step is the step-time goal "a / b <= 1 / x".
ENGINE_GOALS: List[Goal] = [
    Goal("ours eager step / floor with communication", "llama8b", "ms", "ours_eager", "floor", 1.2),
    Goal("ours eager step / FSDP2 eager (tokens/s >= 1.25x)", "llama8b", "ms", "ours_eager", "fsdp2_eager", 0.8),
    Goal("ours eager step / NVIDIA eager (tokens/s >= 1.25x)", "llama8b", "ms", "ours_eager", "nvidia_eager", 0.8),
    Goal("ours eager peak / FSDP2 eager peak", "llama8b", "mem", "ours_eager", "fsdp2_eager", 1.0),
    Goal("ours partial step / ours eager", "llama8b", "ms", "ours_partial", "ours_eager", 1.0),
    Goal("ours bf16 shards kept: eager step / ours eager (never slower)", "llama8b", "ms", "ours_kept_eager",
         "ours_eager", 1.0),
    Goal("FSDP2 keep + partial step / FSDP2 eager", "llama8b", "ms", "fsdp2_keep_partial", "fsdp2_eager", 1.0),
    Goal("FSDP2 slots + partial step / FSDP2 eager", "llama8b", "ms", "fsdp2_slots_partial", "fsdp2_eager", 1.0),
    Goal("NVIDIA partial step / NVIDIA eager", "llama8b", "ms", "nvidia_partial", "nvidia_eager", 1.0),
    Goal("ours partial peak / ours eager peak", "llama8b", "mem", "ours_partial", "ours_eager", 1.05),
    Goal("FSDP2 keep + partial peak / FSDP2 eager peak", "llama8b", "mem", "fsdp2_keep_partial", "fsdp2_eager", 1.05),
    Goal("FSDP2 slots + partial peak / FSDP2 eager peak", "llama8b", "mem", "fsdp2_slots_partial", "fsdp2_eager",
         1.05),
    Goal("NVIDIA partial peak / NVIDIA eager peak", "llama8b", "mem", "nvidia_partial", "nvidia_eager", 1.05),
    Goal("ours partial step / ours eager", "olmoe", "ms", "ours_partial", "ours_eager", 0.8),
    Goal("FSDP2 + partial step / FSDP2 eager", "olmoe", "ms", "fsdp2_keep_partial", "fsdp2_eager", 0.8),
    Goal("NVIDIA partial step / NVIDIA eager", "olmoe", "ms", "nvidia_partial", "nvidia_eager", 0.8),
    Goal("ours partial step / FSDP2 eager (tokens/s >= 1.3x)", "olmoe", "ms", "ours_partial", "fsdp2_eager",
         1 / 1.3),
    Goal("ours full-iteration step / FSDP2 eager (tokens/s >= 1.3x)", "olmoe", "ms", "ours_full", "fsdp2_eager",
         1 / 1.3),
    Goal("ours partial peak / ours eager peak", "olmoe", "mem", "ours_partial", "ours_eager", 1.05),
    Goal("ours full-iteration peak / ours eager peak", "olmoe", "mem", "ours_full", "ours_eager", 1.05),
    Goal("FSDP2 + partial peak / FSDP2 eager peak", "olmoe", "mem", "fsdp2_keep_partial", "fsdp2_eager", 1.05),
    Goal("NVIDIA partial peak / NVIDIA eager peak", "olmoe", "mem", "nvidia_partial", "nvidia_eager", 1.05),
    Goal("ours EP bytes moved per step / today's layout (ours eager)", "qwen3moe", "bytes", "ours_ep_eager",
         "ours_eager", 0.35),
    Goal("ours EP + partial step / ours EP eager", "qwen3moe", "ms", "ours_ep_partial", "ours_ep_eager", 0.85,
         seq=1024),
    Goal("ours EP + partial step / ours EP eager (never slower)", "qwen3moe", "ms", "ours_ep_partial",
         "ours_ep_eager", 1.0, seq=4096),
    Goal("ours EP eager step / NVIDIA EP eager (tokens/s >= 1.2x)", "qwen3moe", "ms", "ours_ep_eager",
         "nvidia_ep_eager", 1 / 1.2),
    Goal("ours EP eager peak / NVIDIA EP eager peak", "qwen3moe", "mem", "ours_ep_eager", "nvidia_ep_eager", 1.0),
    Goal("ours EP with overlapped expert groups, eager step / ours EP eager (never slower)", "qwen3moe", "ms",
         "ours_ep_groups_eager", "ours_ep_eager", 1.0),
    Goal("ours TP + partial step / ours TP eager", "llama70b", "ms", "ours_tp_partial", "ours_tp_eager", 0.9,
         seq=4096, tp=4),
    Goal("ours TP + partial step / ours TP eager (never slower)", "llama70b", "ms", "ours_tp_partial",
         "ours_tp_eager", 1.0),
    Goal("ours TP eager step / FSDP2 + DTensor TP eager (tokens/s per GPU >= 1.15x)", "llama70b", "ms",
         "ours_tp_eager", "fsdp2_tp_eager", 1 / 1.15),
    Goal("ours TP eager step / FSDP2 + DTensor TP, logits gathered (tokens/s per GPU >= 1.15x)", "llama70b", "ms",
         "ours_tp_eager", "fsdp2_tp_gathered_eager", 1 / 1.15),
    Goal("ours TP, bf16 shards kept: eager step / ours TP eager (never slower)", "llama70b", "ms",
         "ours_tp_kept_eager", "ours_tp_eager", 1.0),
    Goal("ours TP, bf16 shards kept: eager step / FSDP2 + DTensor TP eager (tokens/s per GPU >= 1.15x)", "llama70b",
         "ms", "ours_tp_kept_eager", "fsdp2_tp_eager", 1 / 1.15),
    Goal("ours TP eager step / NVIDIA TP eager (tokens/s per GPU >= 1.1x)", "llama70b", "ms", "ours_tp_eager",
         "nvidia_tp_eager", 1 / 1.1),
    Goal("ours mcore TP eager step / NVIDIA mcore TP eager (tokens/s per GPU >= 1.1x)", "mcore70b", "ms",
         "ours_mcore_tp_eager", "nvidia_mcore_tp_eager", 1 / 1.1),
    Goal("ours mcore TP + partial step / ours mcore TP eager (never slower)", "mcore70b", "ms",
         "ours_mcore_tp_partial", "ours_mcore_tp_eager", 1.0),
    Goal("NVIDIA mcore TP + partial step / NVIDIA mcore TP eager (never slower)", "mcore70b", "ms",
         "nvidia_mcore_tp_partial", "nvidia_mcore_tp_eager", 1.0),
    Goal("ours FP8 (current) eager step / ours bf16 eager (tokens/s >= 1.35x)", "llama8b_fp8", "ms",
         "ours_fp8_current_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 (delayed) eager step / ours bf16 eager (tokens/s >= 1.35x)", "llama8b_fp8", "ms",
         "ours_fp8_delayed_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 (block) eager step / ours bf16 eager (tokens/s >= 1.35x)", "llama8b_fp8", "ms",
         "ours_fp8_block_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 (current) eager step / NVIDIA FP8 eager (tokens/s >= 1.1x)", "llama8b_fp8", "ms",
         "ours_fp8_current_eager", "nvidia_fp8_eager", 1 / 1.1),
    Goal("ours FP8 (current) eager step / FSDP2 + torchao float8 (tokens/s >= 1.3x)", "llama8b_fp8", "ms",
         "ours_fp8_current_eager", "fsdp2_float8_eager", 1 / 1.3),
    Goal("ours FP8 + partial step / ours FP8 (current) eager", "llama8b_fp8", "ms", "ours_fp8_partial",
         "ours_fp8_current_eager", 1.0),
    Goal("ours FP8 whole-step step / ours FP8 (current) eager", "llama8b_fp8", "ms", "ours_fp8_full",
         "ours_fp8_current_eager", 1.0),
    Goal("ours FP8 weights gathered as FP8: all-gather bytes / ours bf16", "llama8b_fp8", "gather",
         "ours_fp8_gather_eager", "ours_eager", 0.55),
    Goal("ours FP8 weights gathered as FP8: eager peak / ours bf16 eager peak", "llama8b_fp8", "mem",
         "ours_fp8_gather_eager", "ours_eager", 1.0),
    Goal("ours FP8 weights gathered as FP8: eager step / ours bf16 eager (tokens/s >= 1.35x)", "llama8b_fp8", "ms",
         "ours_fp8_gather_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 weights gathered as FP8: eager step / NVIDIA FP8 eager (tokens/s >= 1.1x)", "llama8b_fp8", "ms",
         "ours_fp8_gather_eager", "nvidia_fp8_eager", 1 / 1.1),
    Goal("ours FP8 weights gathered as FP8: eager step / NVIDIA's, FP8 weights gathered as FP8 (tokens/s >= 1.1x)",
         "llama8b_fp8", "ms", "ours_fp8_gather_eager", "nvidia_fp8_gather_eager", 1 / 1.1),
    Goal("ours FP8 weights gathered as FP8: eager step / FSDP2 + torchao float8 (tokens/s >= 1.3x)", "llama8b_fp8",
         "ms", "ours_fp8_gather_eager", "fsdp2_float8_eager", 1 / 1.3),
    Goal("ours FP8 weights gathered as FP8 + partial step / eager (never slower)", "llama8b_fp8", "ms",
         "ours_fp8_gather_partial", "ours_fp8_gather_eager", 1.0),
    Goal("ours FP8 weights gathered as FP8 + FP8 attention: eager step / ours bf16 eager (tokens/s >= 1.35x)",
         "llama8b_fp8", "ms", "ours_fp8_gather_attention_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 weights gathered as FP8 + FP8 attention: eager step / NVIDIA FP8 with FP8 attention (tokens/s "
         ">= 1.1x)", "llama8b_fp8", "ms", "ours_fp8_gather_attention_eager", "nvidia_fp8_attention_eager", 1 / 1.1),
    Goal("ours FP8 (delayed) with FP8 attention, eager step / ours bf16 eager (tokens/s >= 1.35x)", "llama8b_fp8",
         "ms", "ours_fp8_attention_eager", "ours_eager", 1 / 1.35),
    Goal("ours FP8 with FP8 attention, eager step / NVIDIA's under the same recipe (tokens/s >= 1.1x)",
         "llama8b_fp8", "ms", "ours_fp8_attention_eager", "nvidia_fp8_attention_eager", 1 / 1.1),
    Goal("ours FP8 with FP8 attention + partial step / eager (never slower)", "llama8b_fp8", "ms",
         "ours_fp8_attention_partial", "ours_fp8_attention_eager", 1.0),
    Goal("ours FP8 with FP8 attention, bf16 shards kept: eager step / without them (never slower)", "llama8b_fp8",
         "ms", "ours_fp8_attention_kept_eager", "ours_fp8_attention_eager", 1.0),
    Goal("ours FP8 with FP8 attention, bf16 shards kept: eager step / NVIDIA's under the same recipe (tokens/s >= "
         "1.1x)", "llama8b_fp8", "ms", "ours_fp8_attention_kept_eager", "nvidia_fp8_attention_eager", 1 / 1.1),
    Goal("ours bf16 shards kept: eager step / ours eager (never slower)", "llama8b_fp8", "ms", "ours_kept_eager",
         "ours_eager", 1.0),
]


def floor_from_bytes_ms(*, matmul_ms: float, optimizer_ms: float, moved: Dict[str, float],
                        rates: Dict[str, Any]) -> Dict[str, Any]:
    """The step floor from the bytes one rank moved in a step, by kind (:mod:`_comm_bytes`), at the rates
    measured in the same run.

    [Note: the floor with the token exchange]
    FSDP's all-gathers and reduce-scatters (and the few all-reduces) run on their own stream and can hide under
    the compute; an MoE's all-to-alls cannot: the experts wait for their tokens and the next layer for the
    combined output. So ``floor = max(matmul + all-to-all, all-gather + reduce-scatter + all-reduce) +
    optimizer``, each collective's bytes over its measured rate (the all-reduce at the reduce-scatter's). Unlike
    :func:`floor_with_comm_ms` it charges no unhidden first gather or last reduce-scatter, so it is the lower
    of the two for the same bytes; it takes what was moved, so it fits any layout (EP moves its experts'
    bytes into all-to-all rows)."""
    def ms(kind: str, rate: str) -> float:
        nbytes = moved.get(kind, 0)
        if not nbytes:
            return 0.0
        gbps = rates.get(rate)
        if not gbps or gbps <= 0:
            raise ValueError(f"{kind}: {nbytes} bytes moved but no measured {rate} in {sorted(rates)}; measure the "
                             "rate in the same run (bench_engines measures it for MoE configs)")
        return nbytes / (gbps * 1e9) * 1e3

    a2a = ms("all_to_all", "all_to_all_gbps")
    fsdp = ms("all_gather", "all_gather_gbps") + ms("reduce_scatter", "reduce_scatter_gbps") + ms(
        "all_reduce", "reduce_scatter_gbps")
    critical = matmul_ms + a2a
    return {"floor_ms": max(critical, fsdp) + optimizer_ms, "matmul_ms": matmul_ms, "optimizer_ms": optimizer_ms,
            "all_to_all_ms": a2a, "fsdp_comm_ms": fsdp,
            "bound": "communication (FSDP)" if fsdp > critical else "compute + all-to-all" if a2a else "compute"}


def _value(columns: Dict[str, Dict[str, Any]], floor: Optional[float], name: str, kind: str) -> Optional[float]:
    if name == "floor":
        return floor if kind == "ms" else None
    return _measure(columns.get(name) or {}, kind)


def _measure(row: Dict[str, Any], kind: str) -> Optional[float]:
    """A column's step time, or its own peak (bench_full_iteration's [Note: a column's own peak]) where the
    row has one, else its peak as measured."""
    if kind == "ms":
        return row.get("step_ms")
    if kind == "bytes":
        return float(sum(row["comm_bytes"].values())) if "comm_bytes" in row else None
    if kind == "gather":
        return float(row["comm_bytes"].get("all_gather", 0)) if "comm_bytes" in row else None
    return row.get("own_peak_gib", row.get("peak_memory_gib"))


def evaluate(configs: Dict[str, Dict[str, Any]], goals: Sequence[Goal] = GOALS) -> Dict[str, Any]:
    """Floors' multiples, noise and every goal's verdict.

    ``configs``: name -> {"columns": {column: {"step_ms", "step_ms_all", "peak_memory_gib"}}, "floor_ms": float
    or None}; a column without ``step_ms`` failed. Returns {"configs": {name: {"repeat_noise_ms", "spread":
    {column: x}, "noise_mem", "floor_ms", "floor_multiple": {column: x}}}, "goals": [one dict per goal with
    "ratio", "noise", "verdict"], "failed": bool}.
    """
    out: Dict[str, Any] = {"configs": {}, "goals": []}
    for name, cfg in configs.items():
        cols, floor = cfg["columns"], cfg.get("floor_ms")
        eager, again = cols.get("eager") or {}, cols.get("eager_repeat") or {}
        spreads = {c: relative_spread(r["step_ms_all"][cfg.get("skip", 0):]) for c, r in cols.items()
                   if r.get("step_ms_all")}
        repeat_ms = repeat_noise(eager.get("step_ms"), again.get("step_ms"))
        noise_mem = repeat_noise(_measure(eager, "mem"), _measure(again, "mem"))
        multiples = {c: r["step_ms"] / floor for c, r in cols.items() if "step_ms" in r and floor}
        out["configs"][name] = {"repeat_noise_ms": repeat_ms, "spread": spreads, "noise_mem": noise_mem,
                                "floor_ms": floor, "floor_multiple": multiples}
    for g in goals:
        if g.config not in configs:
            continue
        cfg = configs[g.config]
        num = _value(cfg["columns"], cfg.get("floor_ms"), g.num, g.kind)
        den = _value(cfg["columns"], cfg.get("floor_ms"), g.den, g.kind)
        ratio = num / den if num is not None and den else None
        c = out["configs"][g.config]
        if g.kind == "ms":
            noise = max(c["repeat_noise_ms"], c["spread"].get(g.num, 0.0), c["spread"].get(g.den, 0.0))
        elif g.kind in ("bytes", "gather"):
            noise = 0.0  # counted, not timed
        else:
            noise = c["noise_mem"]
        out["goals"].append({**asdict(g), "ratio": ratio, "noise": noise, "verdict": verdict(ratio, g.goal, noise)})
    out["failed"] = any(r["verdict"] in ("FAIL", "MISSING") for r in out["goals"])
    return out


def format_table(configs: Dict[str, Dict[str, Any]], ev: Dict[str, Any], columns: Sequence[str]) -> str:
    """Markdown: each config's step time and multiple of the floor per column, peaks, then the goals."""
    lines = ["| config | quantity | " + " | ".join(columns) + " |", "| --- | --- |" + " --- |" * len(columns)]
    for name, cfg in configs.items():
        cols = cfg["columns"]
        mult = ev["configs"][name]["floor_multiple"]

        def cell(c: str, fmt: str, key: str) -> str:
            r = cols.get(c)
            if r is None:
                return "-"
            return fmt.format(r[key]) if key in r else "failed"

        lines.append(f"| {name} | step ms | " + " | ".join(cell(c, "{:.2f}", "step_ms") for c in columns) + " |")
        lines.append(f"| {name} | x floor ({cfg.get('floor_ms') or 0:.2f} ms) | "
                     + " | ".join(f"{mult[c]:.2f}" if c in mult else "-" for c in columns) + " |")
        lines.append(f"| {name} | peak GiB | " + " | ".join(cell(c, "{:.2f}", "peak_memory_gib") for c in columns) + " |")
        if any("own_peak_gib" in r for r in cols.values()):
            own = [cols.get(c) for c in columns]
            lines.append(f"| {name} | own peak GiB | " + " | ".join(
                "-" if r is None else "failed" if _measure(r, "mem") is None else f"{_measure(r, 'mem'):.2f}"
                for r in own) + " |")
    lines += ["", "| config | goal | ratio | goal | noise | verdict |", "| --- | --- | --- | --- | --- | --- |"]
    for r in ev["goals"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['config']} | {r['name']} | {ratio} | <= {r['goal']:.2f} | {r['noise'] * 100:.1f}% | "
                     f"{r['verdict']} |")
    return "\n".join(lines)
