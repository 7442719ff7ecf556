"""What every benchmark shares: the import path, the process group, CUDA-event timing, the JSON record.

A script in ``benchmarks/`` starts with ``import _common`` (its own folder is ``sys.path[0]`` when it runs,
under ``python`` and under ``torchrun`` alike); a script one folder down (``diagnose/``, ``tools/``) first puts
``benchmarks/`` on the path::

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _common  # noqa: E402

Importing this module puts the repository root and ``benchmarks/`` on ``sys.path``, so a checkout that is
not pip-installed runs as it is, and bare-name imports between scripts (``import _flops``,
``import bench_full_iteration``, ``from graph_memory_snapshot import frame_site``) resolve from any folder.

Records: every JSON a benchmark writes carries ``record_fields()`` (command, world size, versions with the
device, torch, CUDA, NCCL, cuDNN, TE and the commit) plus its own ``config`` and results, and is written by
``fsdp_cudagraph.checker.records.write_record`` (benchmarks/README.md, "Record format").
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
# Subfolders first so that the root's names win: a script found by bare name in diagnose/ or tools/.
for _p in (os.path.join(BENCHMARKS, "tools"), os.path.join(BENCHMARKS, "diagnose"), BENCHMARKS, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_cudagraph.checker.records import versions  # noqa: E402

__all__ = ["ROOT", "NVLS_OFF", "init_process_group", "cuda_time_ms", "record_fields"]

#: NVLink multicast off (the GPU machines used for the records refuse it), set before NCCL starts.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_process_group(*, cuda: bool, default_port: int) -> torch.device:
    """Join the default process group and return this rank's device: NCCL on GPU ``LOCAL_RANK``, else Gloo on CPU.

    Under ``torchrun`` the environment names the ranks; a plain ``python`` run becomes a one-rank group on
    ``MASTER_PORT`` (default ``default_port``: each script has its own, so two runs on one machine do not meet).
    An already initialised group is kept.
    """
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("init_process_group(cuda=True): no CUDA device is visible; run on a GPU or pass cuda=False "
                           "(the script's CPU smoke mode)")
    for k, v in NVLS_OFF.items():
        os.environ.setdefault(k, v)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(default_port)))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
        return device
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return torch.device("cpu")


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int, iters: int) -> List[float]:
    """Milliseconds of ``fn`` per call on the current stream, ``iters`` calls after ``warmup`` untimed ones.

    Each call sits between two CUDA events; one synchronize at the end reads them all, so the host does not
    wait between calls (a per-call synchronize would time the launch gap too). Report the median.
    """
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def record_fields() -> Dict[str, Any]:
    """The fields every benchmark record starts with: the command as run, the world size, the versions."""
    return {"command": " ".join([os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0]]
                                + sys.argv[1:]),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "versions": versions()}
