"""CPU smoke of benchmarks/bench_hsdp.py on 4 Gloo ranks (torchrun, --cpu-smoke --replicate 2 --align): both
engines, flat 1 x 4 and HSDP 2 x 2; every column's graphed run (protocol backend) equals its eager run; the
all-reduce bytes counted on the replicate group equal each unit's padded gradient shard (4 bytes an element);
flat moves nothing on a replicate group and HSDP's slow dimension carries fewer bytes than flat's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu_utils import ROOT

pytestmark = pytest.mark.gloo


def test_bench_hsdp_cpu_smoke(tmp_path):
    out = tmp_path / "hsdp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "benchmarks", "bench_hsdp.py"), "--cpu-smoke", "--replicate", "2", "--align",
           "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["ok"] is True
    cols = {(c["engine"], c["topology"]): c for c in record["columns"]}
    assert set(cols) == {(e, t) for e in ("megatron_fsdp", "fsdp2") for t in ("flat", "hsdp")}
    for (engine, topology), c in cols.items():
        assert c["graphed_equal"] is True, (engine, topology)
        if topology == "hsdp":
            assert c["count_matches"] is True and c["slow_counted"] == {"all_reduce": c["slow_dim"]["slow_issued"]["all_reduce"]}
            assert set(c["bytes_per_step_by_group"]) == {"shard", "replicate"}
            flat = cols[(engine, "flat")]
            assert sum(c["slow_counted"].values()) < sum(flat["slow_counted"].values())
        else:
            assert set(c["bytes_per_step_by_group"]) == {"world"}
