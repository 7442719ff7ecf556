"""benchmarks/tools/pytest_verdict.py: the per-file verdict of a GPU suite run, read from pytest's own JUnit XML
(a real pytest run in a subprocess, over a planted file with a pass, a failure, a child's error and a skip)."""

import os
import subprocess
import sys

from tests.gpu_utils import ROOT

TOOL = os.path.join(ROOT, "benchmarks", "tools", "pytest_verdict.py")
PLANTED = '''
import subprocess, sys, pytest

def test_passes():
    assert 1 + 1 == 2

def test_child_fails():
    proc = subprocess.run([sys.executable, "-c", "raise RuntimeError('target is on cpu, model on cuda:0')"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

@pytest.mark.skip(reason="needs 2 CUDA GPUs, this machine has 1")
def test_skipped():
    pass
'''


def _run_planted(tmp_path, body: str, name: str) -> str:
    test_file = tmp_path / f"test_{name}.py"
    test_file.write_text(body)
    xml = tmp_path / f"{name}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
                    "--junitxml", str(xml), "--rootdir", str(tmp_path)], cwd=tmp_path, capture_output=True)
    return str(xml)


def test_one_line_per_file_with_the_childs_error_and_the_skip_reason(tmp_path):
    red = _run_planted(tmp_path, PLANTED, "planted")
    green = _run_planted(tmp_path, "def test_ok():\n    pass\n", "green")
    proc = subprocess.run([sys.executable, TOOL, red, green, "--json", str(tmp_path / "v.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    planted = next(ln for ln in lines if "test_planted.py" in ln)
    assert planted.startswith("RED") and "1 passed, 1 failed, 1 skipped" in planted
    assert "RuntimeError: target is on cpu, model on cuda:0" in planted
    assert "needs 2 CUDA GPUs, this machine has 1" in planted
    assert any(ln.startswith("green") and "test_green.py: 1 passed" in ln for ln in lines)
    assert lines[-1].startswith("RED: 2 passed, 1 failed")


def test_all_green_exits_zero(tmp_path):
    xml = _run_planted(tmp_path, "def test_ok():\n    pass\n", "ok")
    proc = subprocess.run([sys.executable, TOOL, xml], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("GREEN"), proc.stdout
