"""tests/gpu_utils.run_entry: an entry point past its time limit fails its test with where every process of it
stood (Python's fault handler, on SIGABRT to the whole process group), and leaves no process behind."""

import os
import sys

import pytest

from tests.gpu_utils import run_entry

# A parent that starts a child and both wait: the shape of torchrun and its ranks, the ranks hung.
HUNG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef hung_rank():\\n    time.sleep(600)\\nhung_rank()"])
print("CHILD-PID", child.pid, flush=True)
def hung_launcher():
    child.wait()
hung_launcher()
"""


def test_a_hung_entry_fails_naming_its_limit_and_where_it_stood(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_entry([sys.executable, "-c", HUNG], env=dict(os.environ), timeout=3)
    text = str(err.value)
    assert "still running after 3 s" in text and "FSDP_CUDAGRAPH_TEST_TIMEOUT" in text
    assert "hung_launcher" in text and "hung_rank" in text  # the launcher's and its child's tracebacks
    child = int(text.rsplit("CHILD-PID ", 1)[1].split()[0])
    assert _state(child) in (None, "Z"), _state(child)  # the child went with its group (a zombie at most)


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_an_entry_within_its_limit_returns_its_output():
    proc = run_entry([sys.executable, "-c", "print('done')"], env=dict(os.environ), timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
