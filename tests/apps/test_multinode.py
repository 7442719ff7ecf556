"""A multi-node launch, tested on one host: two torchrun agents (two "nodes" x 2 ranks, c10d rendezvous on a
free local port) run the demo under HSDP (``--hsdp 2``: shard within a node, replicate across the two) and
the alignment checker, on Gloo.

Must hold: both launches exit 0; the demo's eager and graphed (protocol backend) losses are bit-identical;
the two-node run's losses equal (``==`` on the floats of fp32 tensors, i.e. bit for bit) those of the same
job launched as one node of 4 ranks; the checker across the two nodes reports every step equal.
The commands are the ones docs/launch.md gives, with ``127.0.0.1`` as the rendezvous host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from tests.dist_utils import _free_port
from tests.gpu_utils import ROOT

pytestmark = pytest.mark.gloo

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DEMO = ["-m", "fsdp_cudagraph.apps.demo", "--steps", "5", "--hsdp", "2"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _two_nodes(args: List[str], tmp: Path, name: str) -> None:
    """Start the two agents of a 2 x 2 job on this host and wait for both; raise with their logs on failure."""
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{name}-{port}",
                          # one host: say which agent hosts the store (both would match the endpoint's host)
                          "--rdzv-conf", f"is_host={int(node == 0)}"] + args
        log = open(tmp / f"{name}-node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT), log))
    # A node that fails leaves the other waiting in torchrun's exit barrier (300 s): stop it at once instead.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
        if any(p.poll() not in (None, 0) for p, _ in procs):
            break
        time.sleep(0.2)
    codes = []
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            codes.append("killed")
        else:
            codes.append(proc.returncode)
        log.close()
    if codes != [0, 0]:
        logs = "\n".join((tmp / f"{name}-node{n}.log").read_text()[-3000:] for n in range(2))
        raise AssertionError(f"two-node launch {name} exited {codes}:\n{logs}")


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    _two_nodes(DEMO + ["--out", str(tmp / "two.json")], tmp, "demo")
    one = subprocess.run(TORCHRUN + ["--standalone", "--nproc-per-node", "4"] + DEMO + ["--out", str(tmp / "one.json")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    return json.loads((tmp / "two.json").read_text()), json.loads((tmp / "one.json").read_text())


def test_two_node_demo_equals_one_node(demo_runs):
    two, one = demo_runs
    assert two["world_size"] == one["world_size"] == 4 and two["hsdp"] == one["hsdp"] == 2
    assert two["nnodes"] == 2 and one["nnodes"] == 1
    assert two["bit_identical"] and one["bit_identical"]
    assert two["eager_losses"] == one["eager_losses"], (two["eager_losses"], one["eager_losses"])
    assert two["graphed_losses"] == one["graphed_losses"]


def test_checker_across_two_nodes(tmp_path):
    out = tmp_path / "check.json"
    _two_nodes(["-m", "fsdp_cudagraph.check", "--model", "tests.apps._models:gpt_factory", "--device", "cpu",
                "--steps", "4", "--json", str(out)], tmp_path, "check")
    report = json.loads(out.read_text())
    assert report["world_size"] == 4, report.get("world_size")
    assert report["equal"] is True, {k: report[k] for k in report if k != "steps"}
