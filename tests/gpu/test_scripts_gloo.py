"""The scripts the 2-GPU tests launch, run on Gloo (CPU) with the same phases, so that they cannot rot between
GPU runs: tests/gpu/scripts/dcp_worlds.py (a DCP checkpoint across world sizes, resumed bit for bit),
tests/gpu/scripts/fsdp2_storage.py (FSDP2's storage options and mixed precision under partial graphs),
tests/gpu/scripts/ep_align.py (our engine with expert parallelism, graphed against eager and EP against EP=1) and
tests/gpu/scripts/fsdp2_ep.py (FSDP2 with expert parallelism under partial graphs)."""

import os

import pytest

from tests.gpu_utils import ROOT, launcher, run_json

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
    # tests/gpu/scripts/ep_align.py on 2 Gloo ranks (protocol backend, split experts): its rows and controls
    cmd = launcher(2, [os.path.join(ROOT, "tests", "gpu", "scripts", "ep_align.py")]) + ["--device", "cpu"]
    result = run_json(cmd, tmp_path / "ep.json")
    assert result["ok"] and result["world_size"] == 2 and not result["errors"], result
    assert [r["row"] for r in result["rows"]] == ["ep2/graphed == ep2", "ep2 ~ ref"], result["rows"]
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
