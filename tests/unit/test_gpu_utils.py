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


PORT_TAKEN_ONCE = """
import os, sys
mark = sys.argv[1]
if not os.path.exists(mark):
    open(mark, "w").write(os.environ["MASTER_PORT"])
    sys.exit("DistNetworkError: The server socket has failed to listen on any local network address. port: "
             + os.environ["MASTER_PORT"] + ", code: -98, name: EADDRINUSE, message: address already in use")
print(open(mark).read(), os.environ["MASTER_PORT"])
"""


def test_an_entry_whose_port_was_taken_runs_again_on_another(tmp_path):
    env = dict(os.environ, MASTER_PORT="29999")
    with pytest.warns(RuntimeWarning, match="EADDRINUSE"):
        proc = run_entry([sys.executable, "-c", PORT_TAKEN_ONCE, str(tmp_path / "mark")], env=env, timeout=60)
    first, second = proc.stdout.split()
    assert proc.returncode == 0 and first == "29999" and second != first
    # any other failure is the test's to report, not retried
    (tmp_path / "mark").unlink()
    proc = run_entry([sys.executable, "-c", "import sys; sys.exit('boom')"], env=env, timeout=60)
    assert proc.returncode == 1 and "boom" in proc.stderr
