"""``bench_engines.py``'s record: the floor with communication, each column's multiple of it and MFU, the goal
verdicts, the losses of one engine against another's, the table, and ``--merge`` of several records of one setup.
No CUDA here: the CPU tests call it on synthetic rows.

[Note: losses across engines]
A speed goal between two engines means something only if both train the same model. Two engines start from the
same weights and batches and compute the forward in bf16 with the same kernels, so the first loss is the same
(bit-equal in every record so far: ours, FSDP2 and NVIDIA on olmoe at 1, 2 and 4 GPUs, ours and FSDP2 EP on
qwen3moe); after the first update they drift apart by bf16 rounding (where the fp32 main weights come from, in
which order gradients are summed): at most 1.8e-4 relative over 9 to 11 steps in those records (olmoe, 4 GPUs,
NVIDIA against ours; FSDP2 EP against ours EP on qwen3moe at 4096: 1.0e-4; on 2 x H200 at EP 2, NVIDIA EP and
FSDP2 EP against ours EP: at most 8.7e-5, first losses bit-equal). :data:`LOSS_PAIRS` are checked with
``FIRST_LOSS_RTOL = 1e-5`` on the first loss and ``LOSS_RTOL = 2e-3`` (about 10x the largest drift measured) on
every loss; a column whose experts were sharded or exchanged
over the wrong ranks trains another model from step 0 and is far outside. Not seen by it: a gradient scale
error that Adam normalises away. DISAGREE fails the run, like a failed goal. :data:`EXACT_FIRST_LOSS` pairs
(NVIDIA against ours on megatron-core's GPTModel, ``--config mcore70b``: the same bf16 weights into the same
forward) must start bit-equal: their first-loss bound is 0.

[Note: the FP8 floor]
An FP8 column runs the layers' GEMMs in FP8 and the rest in bf16: TE's recipes and torchao's float8 leave
attention (QK^T, AV) and the LM head in bf16. Its floor is the bf16 floor with the matmul part recomputed:
``6 x tokens x unit_matmul_params`` (the layers' matmul weights) at the FP8 rate measured in the same run
(``torch._scaled_mm`` of E4M3 operands, ``_flops.fp8_matmul_peak_tflops``), the other model FLOPs at the bf16 rate;
optimizer and collectives as in bf16 (the parameters' all-gather counted at 2 bytes an element; the FP8-weight
columns gather 1, so for them the collective part is an upper bound). The FP8
columns' ``x_floor`` is against it (``floor["fp8"]``); MFU stays against the bf16 rate, as Megatron reports it. A
column with attention in FP8 too (TE's ``fp8_dpa``) has the attention FLOPs at the FP8 rate as well
(``floor["fp8_attention"]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from typing import Any, Dict, List, Optional, Tuple

import _flops
import _perf_goals as goals

__all__ = ["assemble", "table", "merge", "LOSS_PAIRS", "FIRST_LOSS_RTOL", "LOSS_RTOL", "EXACT_FIRST_LOSS",
           "loss_agreement"]

#: (column, reference column) trained by different engines on the same model: see [Note: losses across engines]
LOSS_PAIRS = [("nvidia_ep_eager", "ours_ep_eager"), ("fsdp2_ep_eager", "ours_ep_eager"),
              ("ours_ep_groups_eager", "ours_ep_eager"), ("nvidia_mcore_tp_eager", "ours_mcore_tp_eager")]
FIRST_LOSS_RTOL = 1e-5
LOSS_RTOL = 2e-3
#: pairs whose first loss must be bit-equal: the same megatron-core model and bf16 weights under both engines
#: (``_engines_mcore.py``), the forward the same code on the same values
EXACT_FIRST_LOSS = {("nvidia_mcore_tp_eager", "ours_mcore_tp_eager")}


def loss_agreement(column: str, reference: str, losses: List[float], ref_losses: List[float]) -> Dict[str, Any]:
    """``column``'s losses against ``reference``'s, step by step: the first loss's relative difference, the largest
    over every step, and AGREE or DISAGREE under the bounds of [Note: losses across engines] (the first loss
    bit-equal for :data:`EXACT_FIRST_LOSS`)."""
    if not losses or len(losses) != len(ref_losses):
        raise ValueError(f"{column}: {len(losses)} losses against {len(ref_losses)} of {reference}: compare runs of "
                         "the same --warmup and --steps (at least one step)")
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)]
    first_rtol = 0.0 if (column, reference) in EXACT_FIRST_LOSS else FIRST_LOSS_RTOL
    ok = rel[0] <= first_rtol and max(rel) <= LOSS_RTOL
    return {"column": column, "reference": reference, "first_rel_diff": rel[0], "max_rel_diff": max(rel),
            "first_rtol": first_rtol, "rtol": LOSS_RTOL, "verdict": "AGREE" if ok else "DISAGREE"}


def assemble(args: argparse.Namespace, world: int, rates: Dict[str, Any], columns: Dict[str, Dict[str, Any]],
             skipped: Dict[str, str]) -> Dict[str, Any]:
    """Floor, multiples, MFU, goal verdicts and the table from the rates and the columns' rows."""
    counts = next((r["counts"] for r in columns.values() if "counts" in r), None)
    floor: Optional[Dict[str, Any]] = None
    flops = None
    by_bytes = "all_to_all_gbps" in rates  # MoE configs measure the exchange's rate: floors per column
    tp = counts.get("tensor_parallel_size", 1) if counts is not None else 1
    if counts is not None:
        tokens = args.micro_batch * getattr(args, "micro_batches", 1) * counts["seq_len"]
        # model FLOPs of a data-parallel rank's micro-batch; its TP ranks share them (Megatron's count: TP does
        # not change the model FLOPs per token, the head's replicated GEMM is not counted again)
        flops = _flops.transformer_flops_per_step(matmul_params=counts["matmul_params"],
                                                  num_layers=counts["num_layers"], seq_len=counts["seq_len"],
                                                  attn_hidden=counts.get("attn_hidden", counts["hidden_size"]),
                                                  tokens=tokens) / tp
        if "matmul_tflops" in rates:
            # with TP: one TP rank's slice (``rank_params``: its layers' 1/TP and the root, replicated over TP) under
            # ZeRO-3 over the data-parallel ranks; the TP collectives inside the layers are not in it
            params, dp = counts.get("rank_params", counts["num_params"]), world // tp
            base = goals.floor_ms(flops=flops, bytes_moved=goals.optimizer_bytes(params, dp),
                                  matmul_tflops=rates["matmul_tflops"], copy_gbps=rates["copy_gbps"])
            with_comm = functools.partial(
                goals.floor_with_comm_ms, optimizer_ms=base["optimizer_ms"], num_params=params,
                first_unit_params=counts["root_params"], last_unit_params=counts["root_params"], world_size=dp,
                all_gather_gbps=rates.get("all_gather_gbps"), reduce_scatter_gbps=rates.get("reduce_scatter_gbps"))
            floor = with_comm(matmul_ms=base["matmul_ms"])
            floor["model_flops_per_rank"] = flops
            if "fp8_matmul_tflops" in rates and "unit_matmul_params" in counts:
                # [Note: the FP8 floor]
                fp8_flops = 6 * tokens * counts["unit_matmul_params"] / tp
                floor["fp8"] = with_comm(matmul_ms=(fp8_flops / rates["fp8_matmul_tflops"]
                                                    + (flops - fp8_flops) / rates["matmul_tflops"]) / 1e12 * 1e3)
                floor["fp8"]["fp8_flops_share"] = fp8_flops / flops
                attention = flops - 6 * tokens * counts["matmul_params"] / tp  # QK^T and AV
                fp8_attention = fp8_flops + attention
                floor["fp8_attention"] = with_comm(matmul_ms=(fp8_attention / rates["fp8_matmul_tflops"] + (
                    flops - fp8_attention) / rates["matmul_tflops"]) / 1e12 * 1e3)
                floor["fp8_attention"]["fp8_flops_share"] = fp8_attention / flops
            if tp > 1:
                floor["tensor_parallel"] = (f"TP {tp} x DP {dp}: FSDP's collectives over the {dp} data-parallel "
                                            "rank(s) of one TP slice; the TP collectives inside the layers are not "
                                            "in the floor")
    for r in columns.values():
        if "step_ms" in r:
            if floor is not None and r.get("comm_bytes", {}).get("all_to_all") is not None and by_bytes:
                # [Note: the floor with the token exchange]: each column's own bytes, at the measured rates
                r["floor_bytes"] = goals.floor_from_bytes_ms(matmul_ms=floor["matmul_ms"],
                                                             optimizer_ms=floor["optimizer_ms"],
                                                             moved=r["comm_bytes"], rates=rates)
                r["x_floor"] = r["step_ms"] / r["floor_bytes"]["floor_ms"]
            elif floor is not None and r.get("fp8") and "fp8" in floor:  # against the floor of its own GEMMs
                r["x_floor"] = r["step_ms"] / floor["fp8_attention" if r.get("fp8_attention") else "fp8"]["floor_ms"]
            elif floor is not None:
                r["x_floor"] = r["step_ms"] / floor["floor_ms"]
            if flops is not None:
                r["model_tflops_per_gpu"] = flops / (r["step_ms"] * 1e-3) / 1e12
            if flops is not None and "matmul_tflops" in rates:
                r["mfu"] = flops / (r["step_ms"] * 1e-3) / (rates["matmul_tflops"] * 1e12)
    for graphed, eager in (("ours_partial", "ours_eager"), ("ours_full", "ours_eager"),
                           ("fsdp2_keep_partial", "fsdp2_eager"), ("fsdp2_slots_partial", "fsdp2_eager"),
                           ("nvidia_partial", "nvidia_eager"), ("ours_ep_partial", "ours_ep_eager"),
                           ("fsdp2_ep_partial", "fsdp2_ep_eager"), ("nvidia_ep_partial", "nvidia_ep_eager"),
                           ("ours_tp_partial", "ours_tp_eager"),
                           ("ours_tp_full", "ours_tp_eager"), ("fsdp2_tp_partial", "fsdp2_tp_eager"),
                           ("ours_tp_kept_eager", "ours_tp_eager"),
                           ("ours_mcore_tp_partial", "ours_mcore_tp_eager"),
                           ("nvidia_mcore_tp_partial", "nvidia_mcore_tp_eager"),
                           # the graphed FP8 columns train with --fp8-recipe: their eager twin is that recipe's
                           ("ours_fp8_partial", f"ours_fp8_{getattr(args, 'fp8_recipe', 'current')}_eager"),
                           ("ours_fp8_full", f"ours_fp8_{getattr(args, 'fp8_recipe', 'current')}_eager"),
                           ("ours_fp8_gather_partial", "ours_fp8_gather_eager"),
                           ("ours_fp8_attention_partial", "ours_fp8_attention_eager"),
                           # the kept bf16 shards gather the same bits ([Note: cast on gather])
                           ("ours_kept_eager", "ours_eager"),
                           ("ours_fp8_attention_kept_eager", "ours_fp8_attention_eager")):
        a, b = columns.get(graphed, {}), columns.get(eager, {})
        if "losses" in a and "losses" in b:
            a["losses_equal_to_" + eager] = a["losses"] == b["losses"]
    # with deterministic kernels a graphed column must train bit for bit like its eager column
    unequal = [c for c, r in columns.items() if getattr(args, "deterministic", False)
               and any(v is False for k, v in r.items() if k.startswith("losses_equal_to_"))]
    seq = counts["seq_len"] if counts is not None else None
    applicable = [g for g in goals.ENGINE_GOALS if g.config == args.config and g.seq in (None, seq)
                  and g.tp in (None, tp)]
    na = [g for g in applicable if g.num in skipped or g.den in skipped]
    run_goals = [g for g in applicable if g not in na]
    cfg = {args.config: {"columns": {c: r for c, r in columns.items() if c not in skipped},
                         "floor_ms": floor["floor_ms"] if floor else None, "skip": args.warmup}}
    ev = goals.evaluate(cfg, run_goals)
    ev["not_applicable"] = [{**dataclasses.asdict(g), "verdict": "N/A",
                             "why": skipped.get(g.num) or skipped.get(g.den)} for g in na]
    ev["loss_checks"] = [loss_agreement(c, ref, columns[c]["losses"], columns[ref]["losses"])
                         for c, ref in LOSS_PAIRS
                         if "losses" in columns.get(c, {}) and "losses" in columns.get(ref, {})]
    ev["failed"] = ev["failed"] or any(r["verdict"] == "DISAGREE" for r in ev["loss_checks"]) or bool(unequal)
    ev["graphed_not_equal_to_eager"] = unequal
    return {"rates": rates, "floor": floor, "evaluation": ev, "table": table(args, columns, skipped, floor, ev)}


def table(args: argparse.Namespace, columns: Dict[str, Dict[str, Any]], skipped: Dict[str, str],
          floor: Optional[Dict[str, Any]], ev: Dict[str, Any]) -> str:
    def f(r: Dict[str, Any], k: str, fmt: str) -> str:
        return fmt.format(r[k]) if k in r else "-"

    moved = any("comm_bytes" in r for r in columns.values())
    kinds = ["all_gather", "reduce_scatter", "all_to_all"]
    header = " GB moved: all-gather / reduce-scatter / all-to-all"
    if any(r.get("comm_bytes", {}).get(f"tp_{k}") for r in columns.values() for k in kinds + ["all_reduce"]):
        kinds += ["all_reduce", "tp_all_gather", "tp_reduce_scatter", "tp_all_reduce"]
        header += " / all-reduce / TP all-gather / TP reduce-scatter / TP all-reduce"
    lines = ["| column | step ms | x floor | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | host ms/step | capture s | "
             "first losses |" + (header + " |" if moved else ""),
             "| --- |" + " --- |" * (10 if moved else 9)]
    for c, r in columns.items():
        if c in skipped:
            lines.append(f"| {c} | skipped: {skipped[c][:80]} |" + " |" * 8)
        elif "step_ms" not in r:
            lines.append(f"| {c} | FAILED: {r.get('error', '?')[:120]} |" + " |" * 8)
        else:
            lines.append(f"| {c} | {r['step_ms']:.1f} | {f(r, 'x_floor', '{:.2f}')} | "
                         f"{r['tokens_per_s_per_gpu']:.0f} | {f(r, 'model_tflops_per_gpu', '{:.1f}')} | "
                         f"{f(r, 'mfu', '{:.1%}')} | {r['peak_memory_gib']:.2f} | "
                         f"{r['host_ms']:.1f} | {f(r, 'capture_s', '{:.1f}')} | "
                         + ", ".join(f"{v:.4f}" for v in r["losses"][:3]) + " |"
                         + (" " + " / ".join(f"{r['comm_bytes'].get(k, 0) / 1e9:.2f}" for k in kinds) + " |"
                            if moved and "comm_bytes" in r else " - |" if moved else ""))
    per_column = {c: r["floor_bytes"] for c, r in columns.items() if "floor_bytes" in r}
    if per_column:
        lines += [""] + [f"floor of {c}: {fl['floor_ms']:.1f} ms ({fl['bound']}-bound): matmul {fl['matmul_ms']:.1f}, "
                         f"all-to-all {fl['all_to_all_ms']:.1f}, FSDP collectives {fl['fsdp_comm_ms']:.1f}, optimizer "
                         f"{fl['optimizer_ms']:.1f} (its own bytes at the measured rates)" for c, fl in per_column.items()]
    elif floor is not None:
        lines += ["", f"floor {floor['floor_ms']:.1f} ms ({floor['bound']}-bound): matmul {floor['matmul_ms']:.1f}, "
                  f"optimizer {floor['optimizer_ms']:.1f}, collectives {floor['comm_ms']:.1f} (all-gather "
                  f"{floor['all_gather_ms']:.1f}, reduce-scatter {floor['reduce_scatter_ms']:.1f}; not overlappable: "
                  f"first gather {floor['first_gather_ms']:.1f}, last reduce-scatter "
                  f"{floor['last_reduce_scatter_ms']:.1f})"] + ([floor["tensor_parallel"]] if "tensor_parallel" in floor else [])
        if "fp8" in floor:
            f8 = floor["fp8"]
            lines.append(f"FP8 floor {f8['floor_ms']:.1f} ms (the FP8 columns' x floor): matmul {f8['matmul_ms']:.1f} "
                         f"({f8['fp8_flops_share']:.0%} of the FLOPs, the layers' GEMMs, at the measured FP8 rate; "
                         f"attention and the LM head at the bf16 rate), optimizer {f8['optimizer_ms']:.1f}")
            fa = floor["fp8_attention"]
            lines.append(f"FP8 attention floor {fa['floor_ms']:.1f} ms (the columns with FP8 attention): matmul "
                         f"{fa['matmul_ms']:.1f} ({fa['fp8_flops_share']:.0%} of the FLOPs at the FP8 rate)")
    lines += ["", "| goal | ratio | goal | noise | verdict |", "| --- | --- | --- | --- | --- |"]
    for r in ev["goals"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['name']} | {ratio} | <= {r['goal']:.3f} | {r['noise'] * 100:.1f}% | {r['verdict']} |")
    for r in ev["not_applicable"]:
        lines.append(f"| {r['name']} | - | <= {r['goal']:.3f} | - | N/A ({r['why'][:60]}) |")
    for c in ev.get("graphed_not_equal_to_eager", []):
        lines.append(f"| {c}: losses `==` its eager column's, deterministic kernels | - | equal | - | NOT EQUAL |")
    for r in ev.get("loss_checks", []):
        first = "equal" if r["first_rtol"] == 0 else f"<= {r['first_rtol']:.0e}"
        lines.append(f"| losses of {r['column']} / {r['reference']} (first; every step) | {r['first_rel_diff']:.1e}; "
                     f"{r['max_rel_diff']:.1e} | {first}; <= {r['rtol']:.0e} | - | {r['verdict']} |")
    return "\n".join(lines)


def merge(paths: List[str]) -> Tuple[argparse.Namespace, int, Dict[str, Any], Dict[str, Dict[str, Any]],
                                        Dict[str, str], List[Dict[str, Any]]]:
    """Columns of several records of the same config, depth and world size (e.g. two halves of the columns run
    as two commands under a per-command time limit), with the first record's rates; and each record's path,
    command and versions (the measurements' machines, not the merging one's)."""
    records = []
    for path in paths:
        with open(path) as fh:
            records.append(json.load(fh))
    key = ("config", "layers", "seq", "micro_batch", "layers_impl", "backend", "fuse_wgrad", "moe_experts", "cpu_smoke",
           "tensor_parallel", "vocab_parallel", "micro_batches", "fp8_recipe", "ep_chunks", "fp8_cache_quantized_params")
    # records made before a flag existed ran without it
    absent = {"vocab_parallel": False, "micro_batches": 1, "fp8_recipe": "current", "ep_chunks": 2,
              "fp8_cache_quantized_params": False}
    first = records[0]
    for path, r in zip(paths[1:], records[1:]):
        diff = {k: (first["config"].get(k, absent.get(k)), r["config"].get(k, absent.get(k))) for k in key
                if first["config"].get(k, absent.get(k)) != r["config"].get(k, absent.get(k))}
        if diff or r["world_size"] != first["world_size"]:
            raise ValueError(f"--merge {path}: not the same run setup as {paths[0]} ({diff}, world size "
                             f"{first['world_size']} vs {r['world_size']}); merge records of one config, depth and "
                             "world size only")
    columns: Dict[str, Dict[str, Any]] = {}
    for path, r in zip(paths, records):
        for c, row in r["columns"].items():
            if c in columns and "skipped" not in row and "skipped" not in columns[c]:
                raise ValueError(f"--merge: column {c} appears in more than one record (again in {path}); run each "
                                 "column once")
            if c not in columns or "skipped" in columns[c]:
                columns[c] = row
    rates = next((r["rates"] for r in records if r.get("rates")), {})
    skipped = {c: row["skipped"] for c, row in columns.items() if "skipped" in row}
    parts = [{"path": path, "command": r.get("command"), "versions": r.get("versions")}
             for path, r in zip(paths, records)]
    return argparse.Namespace(**first["config"]), first["world_size"], rates, columns, skipped, parts
