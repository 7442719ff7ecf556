"""tests/gpu_utils.run_entry: an entry point past its time limit fails its test with where every process of it
stood (Python's fault handler, on SIGABRT to the whole process group), and leaves no process behind; one that
aborted at teardown (itself, or a rank under torchrun) or found its port taken runs once more."""

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


#: What torchrun prints when one rank aborts at teardown after a correct run ([Note: a group another library keeps
#: alive] in fsdp_cudagraph/checker/records.py): the abort, the fault handler, the launcher's own traceback.
RANK_ABORTED_ONCE = """
import os, sys
mark = sys.argv[1]
if not os.path.exists(mark):
    open(mark, "w").write("1")
    print('{"ok": true}')
    sys.stderr.write("terminate called without an active exception\\nFatal Python error: Aborted\\n\\n"
                     "Thread 0x7f (most recent call first):\\n  <no Python frame>\\n"
                     "Traceback (most recent call last):\\n  File \\"run.py\\", line 1032, in <module>\\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\\n"
                     "  traceback : Signal 6 (SIGABRT) received by PID 21278\\n" + sys.argv[2])
    sys.exit(1)
print("second run")
"""


@pytest.mark.parametrize("own_error", [False, True])
def test_a_rank_aborted_at_teardown_under_torchrun_runs_again(tmp_path, own_error):
    """Retried once; a rank that also raised an error of its own (a second traceback) is the test's to report."""
    extra = "Traceback (most recent call last):\n  File \"rank.py\"\nValueError: wrong\n" if own_error else ""
    cmd = [sys.executable, "-c", RANK_ABORTED_ONCE, str(tmp_path / "mark"), extra]
    if own_error:
        proc = run_entry(cmd, env=dict(os.environ), timeout=60)
        assert proc.returncode == 1 and "ValueError: wrong" in proc.stderr
        return
    with pytest.warns(RuntimeWarning, match="aborted at teardown"):
        proc = run_entry(cmd, env=dict(os.environ), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "second run"


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
