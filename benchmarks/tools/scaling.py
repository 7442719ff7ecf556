"""Scaling of step time and peak memory per GPU, 1 -> N GPUs, from the perf suite's JSON (and bench_peers').

    python benchmarks/tools/scaling.py perf_goals-1gpu.json perf_goals-2gpu.json \
        [--peers peers-1gpu.json peers-2gpu.json] [--png scaling.png] [--out scaling.json]

Each perf-suite file is ``bench_partial_graphs.py --suite full`` at one world size (the same per-rank micro
batch, so the global batch grows with N: weak scaling). Per config and column: the median step time, tokens/s
per GPU, and the column's own peak per GPU (``own_peak_gib``, [Note: a column's own peak] in
bench_full_iteration.py; the measured peak where a file predates it), at each world size, and step(N) /
step(1): 1.0 is perfect weak scaling; what exceeds it is communication the step did not hide. The floor
(matmuls + the optimizer's share of the parameters at the measured rates) is listed beside them: under
ZeRO-3 it falls as N grows, because each rank updates 1/N of the parameters.
The peers files (``bench_peers.py --engine all``) add NVIDIA Megatron-FSDP's eager column, launch-like
config, same arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

COLUMNS = ("eager", "partial", "full_iteration", "fsdp2", "fsdp2_graph")


def _load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def suite_rows(files: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (config, column) present in every file: per world size its step ms, tokens/s per GPU and
    own peak GiB per GPU, plus the step ratio to the smallest world size."""
    files = sorted(files, key=lambda d: d["world_size"])
    rows = []
    for config in files[0]["suites"]["full"]:
        for column in COLUMNS:
            per = []
            for d in files:
                cfg = d["suites"]["full"].get(config, {})
                c = cfg.get("columns", {}).get(column)
                if c is None or "step_ms" not in c:
                    break
                per.append({"world_size": d["world_size"], "step_ms": c["step_ms"],
                            "tokens_per_s_per_gpu": c["tokens_per_s"] / d["world_size"],
                            "peak_gib": c.get("own_peak_gib", c["peak_memory_gib"]),
                            "floor_ms": (cfg.get("floor") or {}).get("floor_ms")})
            else:
                base = per[0]["step_ms"]
                rows.append({"config": config, "column": column, "runs": per,
                             "step_vs_smallest": [p["step_ms"] / base for p in per]})
    return rows


def peers_rows(files: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The same rows from bench_peers' summaries (engines every file ran)."""
    files = sorted(files, key=lambda d: d["nproc_per_node"])
    engines = [e for e in files[0]["summary"] if isinstance(files[0]["summary"][e], dict)
               and "median_step_ms" in files[0]["summary"][e]]
    rows = []
    for e in engines:
        runs = [d["summary"].get(e) for d in files]
        if any(r is None or "median_step_ms" not in r for r in runs):
            continue
        per = [{"world_size": d["nproc_per_node"], "step_ms": r["median_step_ms"],
                "tokens_per_s_per_gpu": r["tokens_per_s"] / d["nproc_per_node"], "peak_gib": r["peak_memory_gib"],
                "floor_ms": None} for d, r in zip(files, runs)]
        rows.append({"config": "peers", "column": e, "runs": per,
                     "step_vs_smallest": [p["step_ms"] / per[0]["step_ms"] for p in per]})
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    sizes = [p["world_size"] for p in rows[0]["runs"]] if rows else []
    head = ["config", "column"] + [f"step ms @{n}" for n in sizes] + [f"x @{n}" for n in sizes[1:]] \
        + [f"tok/s/GPU @{n}" for n in sizes] + [f"peak GiB/GPU @{n}" for n in sizes] + [f"floor ms @{n}" for n in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["config"], r["column"]] + [f"{p['step_ms']:.2f}" for p in r["runs"]] \
            + [f"{x:.3f}" for x in r["step_vs_smallest"][1:]] + [f"{p['tokens_per_s_per_gpu']:.0f}" for p in r["runs"]] \
            + [f"{p['peak_gib']:.2f}" for p in r["runs"]] \
            + ["-" if p["floor_ms"] is None else f"{p['floor_ms']:.2f}" for p in r["runs"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(2, len(configs), figsize=(5 * len(configs), 7), squeeze=False)
    for j, config in enumerate(configs):
        sel = [r for r in rows if r["config"] == config]
        sizes = [p["world_size"] for p in sel[0]["runs"]]
        width = 0.8 / len(sizes)
        for k, n in enumerate(sizes):
            xs = [i + k * width for i in range(len(sel))]
            axes[0][j].bar(xs, [r["runs"][k]["step_ms"] for r in sel], width, label=f"{n} GPU")
            axes[1][j].bar(xs, [r["runs"][k]["peak_gib"] for r in sel], width, label=f"{n} GPU")
        for ax, unit in zip((axes[0][j], axes[1][j]), ("step ms", "peak GiB per GPU")):
            ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(sel))])
            ax.set_xticklabels([r["column"] for r in sel], rotation=20, fontsize=8)
            ax.set_title(f"{config}: {unit}", fontsize=10)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suites", nargs="+", help="bench_partial_graphs --suite full JSON, one per world size")
    p.add_argument("--peers", nargs="*", default=[], help="bench_peers --engine all JSON, one per world size")
    p.add_argument("--png", default=None)
    p.add_argument("--out", default=None, help="the rows as JSON")
    args = p.parse_args(argv)
    suites = [_load(f) for f in args.suites]
    sizes = sorted(d["world_size"] for d in suites)
    if len(set(sizes)) != len(sizes):
        sys.exit(f"scaling: two perf-suite files have the same world size ({sizes}); give one per world size")
    rows = suite_rows(suites)
    if args.peers:
        rows += peers_rows([_load(f) for f in args.peers])
    print(table(rows))
    device = (suites[0].get("versions") or {}).get("device", "?")
    if args.png:
        plot(rows, args.png, f"Weak scaling {sizes[0]} -> {sizes[-1]} x {device} (same micro-batch per rank)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"inputs": args.suites + args.peers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
