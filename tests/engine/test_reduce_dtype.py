"""Reducing gradients in bf16 while the main gradients stay fp32 (``fully_shard(reduce_dtype=...)``,
[Note: reducing in another dtype] in ``megatron_fsdp/_reduce.py``), on Gloo.

- The bits: on 1 and 2 ranks, every strategy that reduce-scatters, the first step's fp32 main gradient of every unit
  equals, ``torch.equal``, what the rule says: each rank's fold output (the fp32 run's collective input,
  recorded) rounded to bf16, summed over the ranks in bf16, this rank's shard cast to fp32.
- The storage: gradient buffers (slots included) are bf16, half the fp32 run's bytes; main gradients and Adam
  state are fp32.
- Micro-batches accumulate in fp32: after a second backward the main gradient is the first one plus the
  second's reduced bf16 shard (by the same rule), added in fp32.
- A non-floating ``reduce_dtype`` is refused with the fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp import _collectives, fully_shard
from tests.dist_utils import run_gloo
from tests.engine._slot_net import Block, Net  # three units; the root holds the input and output layers

pytestmark = pytest.mark.gloo

DB = dict(fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
STRATEGIES = {"optim": {}, "optim_grads": {}, "optim_grads_params": {}, "optim_grads_params+db": DB}


def _batch(seed: int, rank: int, world: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4 * world, 5, 6, generator=g), torch.randn(4 * world, 5, 3, generator=g)
    return x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def _build(strategy: str, reduce_dtype):
    torch.manual_seed(0)
    name = strategy.split("+")[0]
    return fully_shard(Net(), fsdp_unit_modules=[Block], sharding_strategy=name, reduce_dtype=reduce_dtype,
                       **STRATEGIES[strategy])


def _main_grads(model) -> Dict[str, torch.Tensor]:
    return {u.name: u.main_shard.grad.detach().clone() for u in model.all_units() if u.grad_numel}


def _reduced_shard(full: torch.Tensor, n: int, rank: int, world: int) -> torch.Tensor:
    """The rule: every rank's collective input rounded to bf16, summed in bf16 in rank order; this rank's part."""
    mine = full.to(torch.bfloat16)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    total = every[0]
    for other in every[1:]:
        total = total + other
    return total[rank * n:(rank + 1) * n]


@contextlib.contextmanager
def _recording(inputs: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Keep each unit's collective input (the fold's output) of the backwards run inside, by unit."""
    real = _collectives.reduce_scatter

    def record(output, full, group, what, **kw):
        inputs.setdefault(what, full.detach().clone())
        return real(output, full, group, what, **kw)

    _collectives.reduce_scatter = record
    try:
        yield
    finally:
        _collectives.reduce_scatter = real


def _job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for strategy in STRATEGIES:
        # the fp32 run, recording each unit's collective input at its first backward
        inputs: Dict[str, torch.Tensor] = {}
        model = _build(strategy, None)
        with _recording(inputs):
            x, y = _batch(0, rank, world)
            nn.functional.mse_loss(model(x), y).backward()
        fp32_bytes = {u.name: u.grad_buffer.tensor.untyped_storage().nbytes() for u in model.all_units()}

        # the bf16-reduce run: same model, same batch
        model = _build(strategy, torch.bfloat16)
        x, y = _batch(0, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        got = _main_grads(model)
        ok = {}
        for u in model.all_units():
            if u.grad_numel:
                want = _reduced_shard(inputs[f"gradients of unit {u.name}"], u.main_shard.numel(), rank, world).float()
                ok[u.name] = got[u.name].dtype == torch.float32 and torch.equal(got[u.name], want)
        bf16_bytes = {u.name: u.grad_buffer.tensor.untyped_storage().nbytes() for u in model.all_units()}
        buffer_dtypes = {str(u.grad_buffer.tensor.dtype) for u in model.all_units()}

        # micro-batches: the second backward's reduced bf16 shard is added to the first's main gradient in fp32
        inputs.clear()
        with _recording(inputs):
            x2, y2 = _batch(1, rank, world)
            nn.functional.mse_loss(model(x2), y2).backward()
        both = _main_grads(model)
        for u in model.all_units():
            if u.grad_numel:
                second = _reduced_shard(inputs[f"gradients of unit {u.name}"], u.main_shard.numel(), rank, world)
                ok[u.name + " +micro-batch"] = torch.equal(both[u.name], got[u.name] + second.float())
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
        opt.step()
        adam_dtypes = {str(v.dtype) for st in opt.state.values() for v in st.values() if v.numel() > 1}
        out[strategy] = {"ok": ok, "buffer_dtypes": buffer_dtypes, "adam_dtypes": adam_dtypes,
                         "bytes": (fp32_bytes, bf16_bytes)}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_reduction_follows_its_rule_and_keeps_fp32_main_grads(world):
    for rank, res in enumerate(run_gloo(_job, world)):
        for strategy, r in res.items():
            assert r["ok"] and all(r["ok"].values()), (rank, strategy, r["ok"])
            assert r["buffer_dtypes"] == {"torch.bfloat16"} and r["adam_dtypes"] == {"torch.float32"}, r
            fp32_bytes, bf16_bytes = r["bytes"]
            assert all(2 * bf16_bytes[k] == fp32_bytes[k] for k in fp32_bytes), (strategy, r["bytes"])


def _bad_dtype_job(rank: int, world: int) -> str:
    try:
        fully_shard(Net(), fsdp_unit_modules=[Block], reduce_dtype=torch.int32)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_non_floating_reduce_dtype_is_refused():
    msg = run_gloo(_bad_dtype_job, 1)[0]
    assert "reduce_dtype=torch.int32" in msg and "floating-point" in msg, msg


def test_the_demo_reduces_in_bf16_when_asked():
    """The main job's option (``apps.demo --reduce-dtype bf16``) on 2 Gloo ranks: it says so, and its eager and
    graphed (protocol backend on CPU) columns stay bit-identical."""
    import subprocess

    from tests.gpu_utils import ROOT, gpu_env, launcher

    cmd = launcher(2, ["-m", "fsdp_cudagraph.apps.demo"]) + ["--reduce-dtype", "bf16", "--steps", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradients reduced in bf16" in proc.stdout and "losses bit-identical: True" in proc.stdout, proc.stdout
