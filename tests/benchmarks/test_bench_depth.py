"""``benchmarks/bench_depth.py`` on CPU (Gloo, one rank, protocol backend): the script's path runs end to end and
every graphed column trains bit-for-bit like its engine's eager column (the figures themselves need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_depth_cpu_smoke(tmp_path):
    out = tmp_path / "depth.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_depth.py"), "--device", "cpu", "--layers", "2", "3",
           "--steps", "2", "--runs", "1", "--capture-step", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "MASTER_PORT": str(29000 + os.getpid() % 500)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs a GPU" in proc.stdout or "figures need a GPU" in proc.stdout
    record = json.loads(out.read_text())
    for layers in ("2", "3"):
        row = record["results"][layers]
        graphed = [c for c in row if c.endswith("_graphed")]
        assert sorted(graphed) == ["fsdp2_graphed", "fsdp2_mp_graphed", "ours_graphed"]  # plain_graphed: CUDA only
        for c in graphed:
            flags = [v for k, v in row[c].items() if k.startswith("equal_to_")]
            assert flags == [True], (layers, c, row[c])
            assert len(row[c]["losses"]) == 1 + 2 + 2  # capture step + 2 warm steps + one run of 2
    assert set(record["ms_per_layer"]) >= {"ours_graphed", "ours_graphed_growth"}
