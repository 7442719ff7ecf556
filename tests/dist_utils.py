"""Run a function on N Gloo ranks (CPU processes) and collect what each rank returns."""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
import tempfile
import traceback
import warnings
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_cudagraph.apps.train import exit_process


def outcome(fn: Callable[[], Any], *expected: type) -> str:
    """What calling ``fn`` did, as a rank job can return it: ``"no error"``, or ``"<Type>: <message>"`` of an
    exception of the ``expected`` types (any other propagates)."""
    try:
        fn()
    except expected as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple, env: dict) -> None:
    # A rank that the C++ side aborts prints every thread's Python stack first, so a CI log says where.
    faulthandler.enable(all_threads=True)
    os.environ.clear()  # the caller's environment as it is now, as a spawned rank sees it ([Note: ranks from a
    os.environ.update(env)  # fork server])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    code = 0
    try:
        result = fn(rank, world_size, *args)
        record = {"ok": True, "result": result}
    except BaseException:
        record, code = {"ok": False, "error": traceback.format_exc()}, 1
    try:
        # Free the job's objects (models, hooks and Work handles sit in reference cycles) while the process group
        # and the interpreter are both alive, then destroy the group.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    except BaseException:
        if code == 0:
            record, code = {"ok": False, "error": "destroy_process_group failed:\n" + traceback.format_exc()}, 1
    torch.save(record, os.path.join(outdir, f"{rank}.pt"))
    # The outcome is on disk; the exit status mirrors it (a normal interpreter exit).
    exit_process(code)


# [Note: ranks from a fork server]
# Each Gloo rank used to be a spawned interpreter that imported torch and the package again: a few seconds of CPU
# per rank, paid some hundred times by the suite on two cores. The ranks now fork from multiprocessing's fork
# server, started once per test process with torch, torch.distributed and the package imported
# (``set_forkserver_preload``), so a rank starts from those modules already loaded; the server is a fresh
# interpreter that has started nothing else (no threads, no process group, no CUDA), which is what makes forking
# it safe. What a spawned rank had and a forked one would not is restored explicitly: the caller's environment as
# it is at the call (the server's is the one it started with), passed to ``_worker``. The test module holding
# ``fn`` is imported in the rank, as under spawn. FSDP_CUDAGRAPH_TEST_START=spawn goes back to spawning.


def _start_method() -> str:
    method = os.environ.get("FSDP_CUDAGRAPH_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"FSDP_CUDAGRAPH_TEST_START={method!r}: use forkserver (default) or spawn")
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", "fsdp_cudagraph", "megatron_fsdp"])
    return method


def run_gloo(fn: Callable, world_size: int, *args: Any) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned Gloo ranks; return each rank's result.

    A rank that raises makes this raise with that rank's traceback. Ranks exit normally once their outcome is
    saved (see ``_worker``). A rank still killed by a signal while no rank raised, or a rendezvous whose port another
    process took between ``_free_port`` and rank 0's bind (``EADDRINUSE``, when other jobs share the host), is
    retried once on a fresh port, with a warning (its Python stacks are in the captured stderr); a second such
    failure raises.
    """
    for attempt in (1, 2):
        try:
            return _run_once(fn, world_size, args)
        except _AbortedWithoutError as exc:
            if attempt == 2:
                raise RuntimeError(f"distributed run failed twice without a Python error: {exc}") from None
            warnings.warn(f"run_gloo: {exc}; retrying once", RuntimeWarning)
    raise AssertionError("unreachable")


class _AbortedWithoutError(Exception):
    pass


def _run_once(fn: Callable, world_size: int, args: tuple) -> List[Any]:
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_worker, args=(world_size, _free_port(), outdir, fn, args, dict(os.environ)),
                               nprocs=world_size, join=True, start_method=_start_method())
        except Exception as exc:
            errors = []
            for r in range(world_size):
                path = os.path.join(outdir, f"{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"--- rank {r} ---\n{rec['error']}")
            if not errors and ("signal" in str(exc) or "EADDRINUSE" in str(exc)):
                raise _AbortedWithoutError(str(exc)[-2000:]) from None
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors or [str(exc)])) from None
        out = []
        for r in range(world_size):
            rec = torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
            out.append(rec["result"])
        return out
