"""Shared by the GPU test files: run a user-facing entry point on N GPUs and read back its JSON verdicts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = "needs a CUDA GPU: CUDA graphs and NCCL only exist there (this machine has torch.cuda.is_available() == False)"


def gpu_env() -> dict:
    """This workplace's rule for NCCL on its machines (NVLink multicast off), plus the repository on the path."""
    return dict(os.environ, PYTHONPATH=ROOT, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                NVSHMEM_DISABLE_NVLS="1")


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


def run_json(cmd: Sequence[str], out: str, *, name: str = "", tail: int = 6000) -> dict:
    """Run ``cmd --out <out>`` from the repository root; keep the JSON; fail with the output's tail on a non-zero
    exit; return the JSON."""
    proc = subprocess.run(list(cmd) + ["--out", str(out)], cwd=ROOT, env=gpu_env(), capture_output=True, text=True)
    keep(str(out), name or os.path.basename(str(out)))
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    with open(out) as f:
        return json.load(f)
