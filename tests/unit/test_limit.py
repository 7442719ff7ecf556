"""benchmarks/tools/limit.py: the GPU record's time limit stops a hung command's whole process group, printing
every Python process's stacks first, and otherwise passes the command's exit status through."""

import os
import subprocess
import sys

from tests.gpu_utils import HUNG_LAUNCHER, ROOT, process_state

TOOL = os.path.join(ROOT, "benchmarks", "tools", "limit.py")


def test_a_hung_command_is_stopped_with_every_processs_stacks():
    proc = subprocess.run([sys.executable, TOOL, "3", sys.executable, "-c", HUNG_LAUNCHER], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert "still running after 3 s" in proc.stderr
    assert "hung_launcher" in proc.stderr and "hung_rank" in proc.stderr, proc.stderr[-3000:]
    child = int(proc.stdout.split("CHILD-PID ", 1)[1].split()[0])
    assert process_state(child) in (None, "Z"), process_state(child)


def test_exit_status_and_bad_arguments():
    ok = subprocess.run([sys.executable, TOOL, "30", sys.executable, "-c", "import sys; sys.exit(3)"], timeout=60)
    assert ok.returncode == 3
    bad = subprocess.run([sys.executable, TOOL, "soon", "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "SECONDS must be a number, got 'soon'" in bad.stderr


def test_a_command_killed_by_a_signal_kills_the_wrapper_by_the_same_signal():
    # what tests/gpu_utils.run_entry reads to retry a teardown abort (-6), as from the command itself
    code = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    proc = subprocess.run([sys.executable, TOOL, "30", sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -6, (proc.returncode, proc.stderr[-2000:])
