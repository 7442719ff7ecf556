"""Shared by the tests that run a user-facing entry point in a subprocess (on N GPUs, or its CPU smoke mode)
and read back its JSON verdicts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = "needs a CUDA GPU: CUDA graphs and NCCL only exist there (this machine has torch.cuda.is_available() == False)"


def gpu_env() -> dict:
    """NCCL with NVLink multicast off (the GPU machines of the records refuse it), the repository on the path in
    front of the caller's own PYTHONPATH (packages installed there, e.g. megatron-core, stay importable: a test
    that skips on their absence in this process must find them in the child too), and a free ``MASTER_PORT`` for
    a one-process launch (the entry points' default ports are fixed, and two GPU test runs may share a host;
    torchrun sets its own)."""
    from tests.dist_utils import _free_port

    path = os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return dict(os.environ, PYTHONPATH=path, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                NVSHMEM_DISABLE_NVLS="1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))


def launcher(nproc: int, target: Sequence[str]) -> List[str]:
    """``python <target>`` on one GPU, ``torchrun --nproc-per-node N <target>`` on more (target: a script path
    or ``["-m", module]``)."""
    if nproc == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]


def keep(path: str, name: str) -> None:
    """Copy a result file to $FSDP_CUDAGRAPH_RESULTS (when set) so that a GPU run can be recorded."""
    dest = os.environ.get("FSDP_CUDAGRAPH_RESULTS")
    if dest and os.path.exists(path):
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(path, os.path.join(dest, name))


#: What a C++ abort at interpreter exit prints (Gloo, rarely, under load, after a run that finished correctly).
TEARDOWN_ABORT = "terminate called without an active exception"


#: Seconds an entry point may run before it counts as hung (FSDP_CUDAGRAPH_TEST_TIMEOUT overrides; a call's own
#: ``timeout`` wins). A hung multi-rank run would otherwise hold the GPUs until the whole pytest process is killed,
#: taking every later test of that process with it and saying nothing of where it stood. The longest entry measured
#: (test_alignment_2gpu with TE, 2 x H200, 1ca97bc) took 248 s; the limit leaves room for the full matrices and a
#: loaded machine, inside gpu_record.sh's 560 s per pytest process.
ENTRY_TIMEOUT_S = 480.0


#: The time limit every entry point runs under (its stacks printed before a hung run is stopped).
LIMIT_TOOL = os.path.join(ROOT, "benchmarks", "tools", "limit.py")


def run_entry(cmd: Sequence[str], *, env: Optional[dict] = None, timeout: Optional[float] = None):
    """``subprocess.run`` from the repository root, retried once when the process (or a rank under ``torchrun``)
    was killed by SIGABRT at teardown with no Python error, or when its rendezvous port was taken between choosing
    it and binding it (``EADDRINUSE``: other runs share the host; 2 of 40 tests of one GPU suite run beside another job on 4 x H200 at
    ``1d5df27``), then on a fresh ``MASTER_PORT`` (the policy ``tests.dist_utils.run_gloo`` applies to spawned
    ranks). The entry
    runs under ``benchmarks/tools/limit.py``: in a process group of its own with Python's fault handler on; past its
    time limit the whole group gets SIGABRT (every rank prints where each of its threads stands), then SIGKILL, and
    the test fails with that output's tail, naming the limit."""
    from tests.dist_utils import _free_port

    limit = timeout or float(os.environ.get("FSDP_CUDAGRAPH_TEST_TIMEOUT", ENTRY_TIMEOUT_S))
    env = env or gpu_env()
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, LIMIT_TOOL, str(limit), *cmd], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        out, err = proc.stdout, proc.stderr
        if proc.returncode == 124 and "\nlimit.py: " in "\n" + err:
            raise AssertionError(f"{' '.join(cmd[:6])} ...: still running after {limit:.0f} s (the limit: the call's "
                                 f"timeout, else FSDP_CUDAGRAPH_TEST_TIMEOUT, default {ENTRY_TIMEOUT_S:.0f}); where "
                                 f"each process stood when it was stopped:\n{out[-6000:]}\n{err[-12000:]}")
        done = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
        aborted = TEARDOWN_ABORT in err and (
            (done.returncode == -6 and "Traceback" not in err)  # the process itself
            # a rank under torchrun: the launcher's traceback (ChildFailedError naming the SIGABRT) and none other
            or (done.returncode != 0 and "ChildFailedError" in err and "Signal 6 (SIGABRT)" in err
                and err.count("Traceback (most recent call last)") == 1))
        port_taken = done.returncode != 0 and "EADDRINUSE" in err
        if not (aborted or port_taken) or attempt == 2:
            return done
        if port_taken:
            env = dict(env, MASTER_PORT=str(_free_port()))
        why = "its port was taken (EADDRINUSE)" if port_taken else "aborted at teardown without a Python error"
        warnings.warn(f"{cmd[:3]}: {why}; retrying once", RuntimeWarning)
    raise AssertionError("unreachable")


def graphed_rows(result: dict) -> tuple:
    """(the graphed runs that a "graphed == eager" row compares, every graphed run) of an alignment script's result
    (``tests/gpu/scripts/ep_align.py``): equal when every graphed run has its row. Other "==" rows compare eager
    layouts (expert groups against one group) and are not counted."""
    compared = {r["row"].split(" == ")[0] for r in result["rows"] if " == " in r["row"]}
    return ({n for n in compared if n.endswith("/graphed")},
            {n for n in result["runs"] if n.endswith("/graphed")})


def run_json(cmd: Sequence[str], out: str, *, name: str = "", tail: int = 6000) -> dict:
    """Run ``cmd --out <out>`` from the repository root; keep the JSON; fail with the output's tail on a non-zero
    exit; return the JSON."""
    proc = run_entry(list(cmd) + ["--out", str(out)])
    keep(str(out), name or os.path.basename(str(out)))
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    with open(out) as f:
        return json.load(f)


def init_script_ranks(device: str, port: int):
    """Start-up of a test script run by ``torchrun`` (or plain ``python``: one rank): the process group on NCCL
    (``device="cuda"``, TF32 off) or Gloo (``"cpu"``, one thread), and this rank's device."""
    import torch
    import torch.distributed as dist

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)  # plain `python` runs one rank
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu")


#: A launcher and its one rank, both hung (the shape of a hung ``torchrun``, which starts each rank in a session of
#: its own): the child's pid is printed as ``CHILD-PID <pid>``; the tests of the time limits (run_entry,
#: benchmarks/tools/limit.py) stop it.
HUNG_LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef hung_rank():\\n    time.sleep(600)\\nhung_rank()"],
                         start_new_session=True)
print("CHILD-PID", child.pid, flush=True)
def hung_launcher():
    child.wait()
hung_launcher()
"""


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` (``Z``: a zombie), None when it is gone (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


class RowGuard:
    """The end of every row of a script that runs rows on several ranks ([Note: a row that raises on one rank]).

    [Note: a row that raises on one rank]
    A script records a row that raises and goes on to the next, so that one failing row does not hide the others.
    When the row raised on one rank only, the other ranks may still be inside it, blocked in a collective the
    failing rank will never issue; the failing rank then meets them in the next row's first collective, and the
    run hangs until a time limit stops it, the error unprinted (megatron-core's EP rows with TE's layers stalled in
    that shape three times; once this guard printed it, the error was TE's fused permute refusing an EP rank that
    received no tokens). So the failing rank prints its traceback at once, tagged with its rank (:meth:`failed`), and
    every rank meets the others after each row at a monitored barrier of a Gloo group of its own
    (:meth:`end_of_row`): a rank that does not arrive within ``timeout_s`` is named, and the process leaves with
    status 3, which makes ``torchrun`` stop the blocked ranks. One rank: nothing to meet.
    """

    def __init__(self, timeout_s: float = 180.0) -> None:
        import datetime

        import torch.distributed as dist

        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.multi = dist.is_initialized() and dist.get_world_size() > 1
        # A collective of every rank, so made here, at start-up, where every rank passes. The group's own timeout
        # bounds the wait of ranks other than 0 (the barrier's bounds rank 0's): each names a rank that never came.
        self.group = dist.new_group(backend="gloo", timeout=self.timeout) if self.multi else None

    @staticmethod
    def failed(what: str, exc: BaseException) -> Dict[str, Any]:
        """The record of a row that raised on this rank, its traceback printed now (stderr, the rank named)."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        tb = traceback.format_exc()
        print(f"[rank {rank}] row {what} raised {type(exc).__name__}: {exc}\n{tb}", file=sys.stderr, flush=True)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb[-3000:]}

    def end_of_row(self, what: str) -> None:
        """Wait for every rank to finish row ``what``; name the ones that do not and leave (status 3)."""
        if not self.multi:
            return
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            print(f"[rank {dist.get_rank()}] after row {what}: not every rank finished it within "
                  f"{self.timeout_s:.0f} s (a rank still blocked in it, in a collective a rank that raised never "
                  f"issued): {exc}", file=sys.stderr, flush=True)
            os._exit(3)

