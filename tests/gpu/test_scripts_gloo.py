"""The scripts the 2-GPU tests launch, run on Gloo (CPU) with the same phases, so that they cannot rot between
GPU runs: tests/gpu/scripts/dcp_worlds.py (a DCP checkpoint across world sizes, resumed bit for bit),
tests/gpu/scripts/fsdp2_storage.py (FSDP2's storage options and mixed precision under partial graphs),
tests/gpu/scripts/ep_align.py (our engine with expert parallelism, graphed against eager and EP against EP=1) and
tests/gpu/scripts/fsdp2_ep.py (FSDP2 with expert parallelism under partial graphs); and the scripts' row guard
(``tests/gpu_utils.RowGuard``): a row that raises on one rank while another is blocked inside it stops the run,
naming both, instead of hanging."""

import os
import subprocess
import sys
import time

import pytest

from tests.gpu_utils import ROOT, gpu_env, graphed_rows, launcher, run_json

SCRIPT = os.path.join(ROOT, "tests", "gpu", "scripts", "dcp_worlds.py")


@pytest.mark.gloo
def test_dcp_worlds_script_on_gloo(tmp_path):
    results = {}
    for phase, nproc in (("save", 2), ("resave", 1), ("resume", 2)):
        cmd = launcher(nproc, [SCRIPT]) + ["--phase", phase, "--dir", str(tmp_path), "--device", "cpu"]
        results[phase] = run_json(cmd, tmp_path / f"{phase}.json")
        assert results[phase]["ok"] and results[phase]["world_size"] == nproc, results[phase]
    assert results["resume"]["losses"] == results["save"]["losses"]  # the uninterrupted run's, bit for bit
    assert results["resave"]["saved_at_world"] == 2 and not results["resave"]["differing"]


@pytest.mark.gloo
def test_fsdp2_storage_script_on_gloo(tmp_path):
    # tests/gpu/scripts/fsdp2_storage.py on 2 Gloo ranks (protocol backend): both storage options, both precisions
    cmd = launcher(2, [os.path.join(ROOT, "tests", "gpu", "scripts", "fsdp2_storage.py")]) + [
        "--device", "cpu"]
    result = run_json(cmd, tmp_path / "storage.json")
    assert result["ok"] and result["world_size"] == 2, result
    rows = [r for r in result["rows"] if "equal" in r]
    assert len(rows) == 8 and all(r["equal"] for r in rows), rows


@pytest.mark.gloo
def test_ep_align_script_on_gloo(tmp_path):
    # tests/gpu/scripts/ep_align.py on 2 Gloo ranks (protocol backend, split experts, one group and two): its rows
    # and controls
    cmd = launcher(2, [os.path.join(ROOT, "tests", "gpu", "scripts", "ep_align.py")]) + ["--device", "cpu"]
    result = run_json(cmd, tmp_path / "ep.json")
    assert result["ok"] and result["world_size"] == 2 and not result["errors"], result
    assert [r["row"] for r in result["rows"]] == ["ep2/graphed == ep2", "ep2/groups/graphed == ep2/groups",
                                                  "ep2/groups == ep2", "ep2 ~ ref"], result["rows"]
    graphed, runs = graphed_rows(result)  # the GPU test's check (tests/gpu/test_alignment.py)
    assert graphed == runs == {"ep2/graphed", "ep2/groups/graphed"}, (graphed, runs)
    assert len(result["controls"]) == 3 and all(c["caught"] for c in result["controls"]), result["controls"]


@pytest.mark.gloo
def test_fsdp2_ep_script_on_gloo(tmp_path):
    # tests/gpu/scripts/fsdp2_ep.py on 2 Gloo ranks (protocol backend), 5 steps: EP=2 against EP=1, graphed (kept
    # storage and slots) against eager, the default divide factor caught
    cmd = launcher(2, [os.path.join(ROOT, "tests", "gpu", "scripts", "fsdp2_ep.py")]) + ["--device", "cpu",
                                                                                           "--steps", "5"]
    result = run_json(cmd, tmp_path / "ep.json")
    assert result["ok"] and result["world_size"] == 2, result
    assert [r["row"] for r in result["rows"]] == ["eager vs EP=1", "graphed (keep) vs eager", "graphed (slots) vs eager",
                                                  "default divide factor vs EP=1 (must differ)"], result["rows"]


#: Two rows on two Gloo ranks: in row "one" rank 1 raises while rank 0 enters an all-reduce rank 1 never issues (the
#: shape of megatron-core's EP stall); with BOTH_PASS every rank finishes both rows.
_GUARDED = """
import os, sys
import torch, torch.distributed as dist
from tests.gpu_utils import RowGuard
dist.init_process_group("gloo")
guard = RowGuard(timeout_s=3)
for what in ("one", "two"):
    try:
        if what == "one" and dist.get_rank() == 1 and not os.environ.get("BOTH_PASS"):
            raise ValueError("a failure on rank 1 only")
        dist.all_reduce(torch.ones(1))
    except ValueError as exc:
        RowGuard.failed(what, exc)
    guard.end_of_row(what)
print("finished", dist.get_rank(), flush=True)
"""


@pytest.mark.gloo
@pytest.mark.parametrize("both_pass", [False, True])
def test_a_row_failing_on_one_rank_stops_the_run_naming_it(tmp_path, both_pass):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    env = dict(gpu_env(), PYTHONPATH=ROOT, **({"BOTH_PASS": "1"} if both_pass else {}))
    t0 = time.monotonic()
    proc = subprocess.run(launcher(2, [str(script)]), env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    took = time.monotonic() - t0
    if both_pass:
        assert proc.returncode == 0 and proc.stdout.count("finished") == 2, proc.stdout + proc.stderr
        return
    assert proc.returncode != 0 and "finished" not in proc.stdout, proc.stdout + proc.stderr
    assert "[rank 1] row one raised ValueError: a failure on rank 1 only" in proc.stderr, proc.stderr[-3000:]
    assert "after row one: not every rank finished it" in proc.stderr, proc.stderr[-3000:]
    assert took < 90, took  # stopped by the guard, not by a time limit

