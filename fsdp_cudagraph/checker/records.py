"""What a command-line run needs around its result: the versions it ran with, its JSON record, a clean exit.

Shared by the checker (``python -m fsdp_cudagraph.check``), the alignment suites and demos in ``apps/``
and the benchmarks, so that the checker does not reach up into an application for them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any, Dict

import torch

from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON, TE_VERSION

__all__ = ["versions", "write_record", "exit_process"]


def _cudnn_version() -> Any:
    # With TE installed the process may load TE's cuDNN instead of torch's; torch then refuses to report
    # (it raises on the mismatch), and the loaded version is what matters for TE's attention.
    if not torch.cuda.is_available():
        return None
    try:
        return torch.backends.cudnn.version()
    except RuntimeError as exc:
        return f"error: {exc}"[:300]


def versions() -> Dict[str, Any]:
    commit = os.environ.get("GIT_COMMIT")  # a copy of the tree without .git (e.g. a GPU machine) passes it in
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - a tarball has no git
            commit = "unknown"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "te": str(TE_VERSION) if HAS_TE else f"absent ({TE_REASON})",
        "cudnn": _cudnn_version(),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit,
    }


def write_record(path: str, record: Dict[str, Any]) -> None:
    """Write a result record as JSON to ``path``, creating its folder (the records of every suite and benchmark)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def exit_process(code: int) -> None:
    """End an entry point's process with ``code`` through a normal interpreter exit, output flushed first.

    Call once the results are printed or written and the process group is destroyed. (This used to leave
    through ``os._exit`` to dodge an abort at exit after correct Gloo runs; the cause was a process group that
    outlived ``destroy_process_group()``: [Note: the engine does not keep its group alive] in
    ``megatron_fsdp/_fully_shard.py``.)
    """
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
