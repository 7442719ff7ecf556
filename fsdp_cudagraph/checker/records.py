"""What a command-line run needs around its result: the versions it ran with, its JSON record, a clean exit.

Shared by the checker (``python -m fsdp_cudagraph.check``), the alignment suites and demos in ``apps/``
and the benchmarks, so that the checker does not reach up into an application for them.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import subprocess
import sys
from typing import Any, Dict

import torch

from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON, TE_VERSION, te_cudnn_version

__all__ = ["commit", "versions", "write_record", "exit_process"]


def _cudnn_version() -> Any:
    # With TE installed the process may load TE's cuDNN instead of torch's; torch then refuses to report
    # (it raises on the mismatch), and the loaded version is what matters for TE's attention.
    if not torch.cuda.is_available():
        return None
    try:
        return torch.backends.cudnn.version()
    except RuntimeError as exc:
        found = re.search(r"compiled\s+against \(([\d, ]+)\) but found runtime version \(([\d, ]+)\)", str(exc))
        if found:
            built, loaded = (".".join(v.split(", ")) for v in found.groups())
            return f"{loaded} loaded (torch built against {built})"
        return f"error: {exc}"[:300]


def commit() -> str:
    """The commit a record ran at: ``$GIT_COMMIT`` where set (a copy of the tree without ``.git``, e.g. on a GPU
    machine, passes it in), else ``git rev-parse HEAD``, with ``+changes`` appended where tracked files differ from
    that commit (a record of uncommitted code, or of a copy whose ``.git`` is older than its files, must not cite
    the commit as if it had run it); ``unknown`` without git."""
    given = os.environ.get("GIT_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a tarball has no git
        return "unknown"
    return head + ("+changes" if changed else "")


def versions() -> Dict[str, Any]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "te": str(TE_VERSION) if HAS_TE else f"absent ({TE_REASON})",
        "cudnn": _cudnn_version(),
        # the one TE runs, which may differ from torch's ([Note: two cuDNNs in one process] in capture/te.py)
        "te_cudnn": ".".join(map(str, te_cudnn_version())) if HAS_TE else None,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit(),
    }


def write_record(path: str, record: Dict[str, Any]) -> None:
    """Write a result record as JSON to ``path``, creating its folder (the records of every suite and benchmark)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def exit_process(code: int) -> None:
    """End an entry point's process with ``code``, output flushed first.

    Call once the results are printed or written and the process group is destroyed. Normally a plain
    interpreter exit (``sys.exit``). [Note: a group another library keeps alive]: when a ``DeviceMesh`` is still
    alive after ``destroy_process_group()``, its process groups are too, and a Gloo worker thread still dropping
    the last collective's ``Work`` while the interpreter finalises aborts the rank after a correct run
    ("terminate called without an active exception"): the cause of [Note: the engine does not keep its group
    alive] in ``megatron_fsdp/_fully_shard.py``, which this project's engine and entry points no longer have
    (tests/apps/test_exit.py checks that the world group dies at destroy). FSDP2 has it: in torch 2.13, after
    ``fully_shard`` the sharded DTensor parameters stay alive, held from C++ where the garbage collector cannot
    reach them, and with them their mesh and its groups, after the model is gone (seen on CPU: a checker run
    with ``--engine fsdp2`` aborted so in both tries of one test during a full suite run, and in none of 20 runs
    alone). Our engine's DCP state dicts have it too: their DTensors' mesh stays cached by torch's DTensor
    redistribution planner (seen on CPU, torch 2.13: ``tests/gpu/scripts/dcp_worlds.py``'s resume phase aborted
    so once in a CI run, after a correct run). Then this leaves through ``os._exit``, which skips the
    interpreter's finalisation; stdout and stderr are flushed first and the status is kept. This module does not
    keep any group itself.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if _a_mesh_outlived_destroy():
        os._exit(code)
    sys.exit(code)


def _a_mesh_outlived_destroy() -> bool:
    """After ``destroy_process_group()``: is a DeviceMesh (and so its process groups) still alive?"""
    import torch.distributed as dist  # noqa: PLC0415 - only at exit

    if not dist.is_available() or dist.is_initialized() or "torch.distributed.device_mesh" not in sys.modules:
        return False  # no group destroyed yet, or no mesh was ever made
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which some deprecated torch objects warn on
    return any(type(o) is DeviceMesh for o in gc.get_objects())
