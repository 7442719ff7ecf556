"""tests/gpu_utils.run_entry: an entry point past its time limit fails its test with where every process of it
stood (Python's fault handler, on SIGABRT to the whole process group), and leaves no process behind."""

import os
import sys

import pytest

from tests.gpu_utils import HUNG_LAUNCHER, process_state, run_entry


def test_a_hung_entry_fails_naming_its_limit_and_where_it_stood():
    with pytest.raises(AssertionError) as err:
        run_entry([sys.executable, "-c", HUNG_LAUNCHER], env=dict(os.environ), timeout=3)
    text = str(err.value)
    assert "still running after 3 s" in text and "FSDP_CUDAGRAPH_TEST_TIMEOUT" in text
    assert "hung_launcher" in text and "hung_rank" in text  # the launcher's and its child's tracebacks
    child = int(text.rsplit("CHILD-PID ", 1)[1].split()[0])
    assert process_state(child) in (None, "Z"), process_state(child)  # gone with its group (a zombie at most)


def test_an_entry_within_its_limit_returns_its_output():
    proc = run_entry([sys.executable, "-c", "print('done')"], env=dict(os.environ), timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
