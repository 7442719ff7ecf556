"""Plots for benchmarks/results/ from the JSON the benchmark and alignment scripts write.

    python benchmarks/tools/plot.py benchmarks/results/data/*.json --outdir benchmarks/results

Needs matplotlib (not a dependency of the package: only this script uses it). Each input file is recognised by its
content: an alignment run (``rows``), a partial-graph benchmark (``suites``), a profile of the compute step
(``floor`` and ``columns``: its line-by-line budget), the engines side by side (``evaluation`` and ``columns``:
benchmarks/bench_engines.py, tokens/s per GPU by column), an FP8 numerics run (``curves`` and ``gaps``:
benchmarks/fp8_numerics.py) or a peers benchmark (``engines``/``results``). Files it does not recognise are skipped
with a note.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List

plt: Any = None  # matplotlib.pyplot, imported by main() after the arguments parse (--help needs no matplotlib)


def _save(fig: Any, path: str) -> str:
    """Lay out, write and close ``fig``; its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_alignment(d: Dict[str, Any], name: str, outdir: str) -> str:
    rows = d["rows"][:6]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
    for ax, r in zip(axes.flat, rows):
        steps = range(len(r["eager_losses"]))
        ax.plot(steps, r["eager_losses"], "o-", label="eager", ms=5)
        ax.plot(steps, r["graphed_losses"], "x--", label="graphed", ms=7)
        ax.axvline(d["capture_step"], color="grey", lw=0.8, ls=":")
        ax.set_title(f"{r['backend']} {r['strategy']}\nscope={r['scope'] or 'whole layers'}: "
                     f"{'bit-equal' if r['equal'] else 'MISMATCH'}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
    axes.flat[0].legend()
    fig.suptitle(f"Eager vs partial graphs, {d['world_size']} GPU(s), {d['versions']['device']} "
                 f"(capture before step {d['capture_step']}, dotted)")
    return _save(fig, os.path.join(outdir, f"{name}.png"))


def plot_suites(d: Dict[str, Any], name: str, outdir: str) -> List[str]:
    paths = []
    suites = d["suites"]
    if "launch" in suites:
        rows = suites["launch"]
        labels = ["eager" if r["scope"] is None else ("graphed: whole layers" if r["scope"] == [] else "graphed: " + "+".join(r["scope"])) for r in rows]
        fig, ax = plt.subplots(figsize=(8, 4))
        bars = ax.barh(labels, [r["step_ms"] for r in rows], color=["tab:grey"] + ["tab:blue"] * (len(rows) - 1))
        for b, r in zip(bars, rows):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {r['step_ms']:.1f} ms ({r['ratio_to_eager']:.2f}x)", va="center")
        ax.set_xlabel("median step time (ms), lower is better")
        ax.set_title(f"8 TE layers, h1024 s512 mbs2, megatron_fsdp ZeRO-3, {d['world_size']} x {d['versions']['device']}")
        ax.invert_yaxis()
        paths.append(_save(fig, os.path.join(outdir, f"{name}-launch.png")))
    if "scaling" in suites:
        rows = suites["scaling"]
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for label, ax, key in (("layers", axes[0], "layers"), ("seq", axes[1], "seq")):
            sub = [r for r in rows if r["label"] == label]
            if key == "seq":  # the 8-layer point of the layer sweep is the seq-512 point of this sweep
                sub = sorted(sub + [r for r in rows if r["label"] == "layers" and r["layers"] == 8], key=lambda r: r["seq"])
            for graphed, style in ((False, "o-"), (True, "x--")):
                pts = [(r[key], r["step_ms"]) for r in sub if (r["scope"] is not None) == graphed]
                ax.plot(*zip(*pts), style, label="graphed (whole layers)" if graphed else "eager")
            ax.set_xlabel("number of layers" if key == "layers" else "sequence length")
            ax.set_ylabel("step time (ms)")
            ax.set_xscale("log", base=2)
            ax.legend()
        sub = [r for r in rows if r["label"] == "layers" and r["scope"] is not None]
        axes[2].plot([r["layers"] for r in sub], [r["capture_seconds"] for r in sub], "s-")
        axes[2].set_xlabel("number of layers")
        axes[2].set_ylabel("capture time (s)")
        axes[2].set_xscale("log", base=2)
        fig.suptitle(f"How cost grows (h1024, mbs2; {d['world_size']} x {d['versions']['device']})")
        paths.append(_save(fig, os.path.join(outdir, f"{name}-scaling.png")))
    return paths


def plot_vs_peers(peers: Dict[str, Any], partial: Dict[str, Any], outdir: str) -> str:
    """Eager peers (bench_peers) next to our eager and graphed step (bench_partial_graphs), same model config."""
    runs = peers["runs"]
    launch = {("eager" if r["scope"] is None else "graphed " + ("+".join(r["scope"]) or "whole layers")): r
              for r in partial["suites"]["launch"]}
    labels = ["FSDP2 eager", "Megatron-FSDP 0.6.1 eager", "megatron_fsdp eager", "megatron_fsdp eager (graph run)",
              "megatron_fsdp + graphs (whole layers)"]
    values = [runs["fsdp2"]["median_step_ms"], runs["mfsdp"]["median_step_ms"], runs["ours"]["median_step_ms"],
              launch["eager"]["step_ms"], launch["graphed whole layers"]["step_ms"]]
    best_peer = min(values[:2])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    bars = ax.barh(labels, values, color=["tab:grey", "tab:grey", "tab:blue", "tab:blue", "tab:green"])
    for b, v in zip(bars, values):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:.1f} ms ({v / best_peer:.2f} of best peer)", va="center")
    ax.axvline(0.4 * best_peer, color="tab:red", ls="--", lw=1)
    ax.text(0.4 * best_peer, len(values) - 0.45, " goal: 0.4 x best peer", color="tab:red", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.5)
    ax.set_xlabel("median step time (ms), lower is better")
    ax.set_title(f"8 TE layers h1024 s512 mbs2 vocab {peers['config']['vocab']}, 2 x {peers['device_name']}\n"
                 "peers and our eager: bench_peers run; graphed: bench_partial_graphs run (same lease)", fontsize=9)
    return _save(fig, os.path.join(outdir, "peers-vs-graphed-2gpu.png"))


def plot_step_budget(d: Dict[str, Any], name: str, outdir: str) -> str:
    """A ``profile_step.py`` result: per column, where its step goes beyond the floor (``budget_lines``)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "diagnose"))
    from profile_step import budget_lines

    cols = list(d["columns"])
    labels = [label for label, _ in budget_lines(d, cols[0])]
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.55 * len(labels) * len(cols) / 2))
    height = 0.8 / len(cols)
    for i, c in enumerate(cols):
        values = [ms for _, ms in budget_lines(d, c)]
        ys = [j + i * height for j in range(len(labels))]
        ax.barh(ys, values, height=height, label=f"{c}: {d['columns'][c]['step_ms']:.1f} ms")
        for y, v in zip(ys, values):
            ax.text(v + (0.1 if v >= 0 else -0.1), y, f"{v:+.2f}", va="center", ha="left" if v >= 0 else "right",
                    fontsize=7)
    ax.set_yticks([j + height * (len(cols) - 1) / 2 for j in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("ms per step beyond the floor")
    f = d["floor"]
    ax.set_title(f"Compute step on {d.get('world_size', 1)} GPU(s), {d['versions'].get('device', '')}:\nfloor "
                 f"{f['floor_ms']:.2f} ms (matmul {f['matmul_ms']:.2f} + optimizer/cast {f['optimizer_ms']:.2f}), "
                 f"commit {d['versions'].get('commit', '?')}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, os.path.join(outdir, f"{name}.png"))


def plot_engines(d: Dict[str, Any], name: str, outdir: str) -> str:
    """benchmarks/bench_engines.py: each column's tokens/s per GPU as a bar, its TFLOP/s and peak written beside it."""
    cols = [(c, r) for c, r in d["columns"].items() if "step_ms" in r]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(cols) + 1.4))
    names = [c for c, _ in cols][::-1]
    tokens = [r["tokens_per_s_per_gpu"] for _, r in cols][::-1]
    bars = ax.barh(names, tokens, color=["tab:green" if n.startswith("ours") else "tab:grey" for n in names])
    for bar, (_, r) in zip(bars, cols[::-1]):
        tflops = r.get("model_tflops_per_gpu")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f"  {bar.get_width():,.0f}" + (f"  ({tflops:.0f} TFLOP/s, " if tflops else "  (")
                + f"{r['peak_memory_gib']:.0f} GiB)", va="center", fontsize=8)
    cfg = d.get("config", {})
    ax.set_xlabel("tokens/s per GPU")
    ax.set_xlim(0, max(tokens) * 1.45)
    ax.set_title(f"{cfg.get('config', '')}: {cfg.get('layers')} layers, {d.get('world_size')} x "
                 f"{d.get('versions', {}).get('device', 'GPU')}", fontsize=10)
    return _save(fig, os.path.join(outdir, f"{name}.png"))


def plot_fp8_numerics(d: Dict[str, Any], name: str, outdir: str) -> str:
    """benchmarks/fp8_numerics.py: every run's loss curve (bf16 and each FP8 recipe) and each recipe's gap to bf16."""
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run, curve in d["curves"].items():
        ax.plot(range(len(curve)), curve, "-" if run == "bf16" else "--", lw=1.2, label=run)
    ax.axhline(d["ln_successors"], color="grey", lw=0.8, ls=":", label="ln K (the chain's entropy, at most)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("FP8 recipes beside bf16, same data")
    ax.legend(fontsize=8)
    bf16 = d["curves"]["bf16"]
    for run, curve in d["curves"].items():
        if run != "bf16":
            gx.plot(range(len(curve)), [(a - b) / b * 100 for a, b in zip(curve, bf16)], lw=1, label=run)
    gx.axhline(0, color="grey", lw=0.8)
    gx.set_xlabel("step")
    gx.set_ylabel("(FP8 - bf16) / bf16, %")
    gaps = ", ".join(f"{r} {100 * g:.2f}%" for r, g in d["gaps"].items())
    gx.set_title(f"gap over the last {d['config']['tail']} steps: {gaps}", fontsize=9)
    gx.legend(fontsize=8)
    return _save(fig, os.path.join(outdir, f"{name}.png"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*")
    p.add_argument("--outdir", default="benchmarks/results")
    p.add_argument("--peers-vs-graphed", nargs=2, metavar=("PEERS_JSON", "PARTIAL_JSON"),
                   help="also plot a bench_peers result beside a bench_partial_graphs launch suite")
    args = p.parse_args()
    global plt
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: F811
    if args.peers_vs_graphed:
        with open(args.peers_vs_graphed[0]) as a, open(args.peers_vs_graphed[1]) as b:
            print("wrote", plot_vs_peers(json.load(a), json.load(b), args.outdir))
    for f in args.files:
        with open(f) as fh:
            d = json.load(fh)
        name = os.path.splitext(os.path.basename(f))[0]
        if "rows" in d and "controls" in d:
            print("wrote", plot_alignment(d, name, args.outdir))
        elif "suites" in d:
            for path in plot_suites(d, name, args.outdir):
                print("wrote", path)
        elif "curves" in d and "gaps" in d:
            print("wrote", plot_fp8_numerics(d, name, args.outdir))
        elif "evaluation" in d and "columns" in d:
            print("wrote", plot_engines(d, name, args.outdir))
        elif "floor" in d and "columns" in d:
            print("wrote", plot_step_budget(d, name, args.outdir))
        else:
            print(f"skipped {f}: not an alignment or partial-graph result")


if __name__ == "__main__":
    main()
