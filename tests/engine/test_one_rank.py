"""No collective at one rank ([Note: no collective at one rank] in ``megatron_fsdp/_collectives.py``).

A group of one rank moves nothing, so the engine does its all-gathers and reduce-scatters there as copies and
skips its all-reduces and broadcasts: no call reaches torch.distributed. Must hold, on Gloo:

- one rank, every strategy, fp32 and bf16 compute (the cast-on-gather), gradient accumulation, a partial-graph
  run (protocol backend), clipping and a state dict: zero collective calls, and the losses, the final
  parameters and the state dict are ``torch.equal`` to the same run with the collectives forced on (the code of
  before);
- HSDP as 2 x 1 (shard groups of one rank): no all-gather or reduce-scatter is issued, the all-reduce across
  the replicas still is, and the result equals the same run with the collectives forced on;
- a gradient reduce-scatter whose result is added into the main gradient (the second micro-batch) copies nothing:
  the fold reads the gradient buffer in place; the first micro-batch's, which becomes the main gradient, copies.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, synthetic_batch
from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo
from tests.engine._common import accumulated_step, protocol_layer_graphs

pytestmark = pytest.mark.gloo

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, seq_len=16, moe_every=0)
STEPS = 4
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@contextlib.contextmanager
def _collectives_counted(forced: bool) -> Iterator[Dict[str, int]]:
    """Count the torch.distributed calls the engine makes (the live counts are yielded); ``forced``: every group
    is treated as having several ranks (the collectives of before). Everything is put back on exit."""
    from megatron_fsdp import _collectives as C

    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0, "local_reduce_scatters": 0,
              "local_reduce_scatter_copies": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    def local_reduce_scatter(output, full, *args, **kwargs):  # one rank: a copy unless the output is the input
        counts["local_reduce_scatters"] += 1
        counts["local_reduce_scatter_copies"] += int(output.data_ptr() != full.data_ptr())
        return saved[-1](output, full, *args, **kwargs)

    # C.dist is torch.distributed itself: its all_reduce and broadcast are wrapped in place
    saved = (C._one_rank, C._all_gather_single, C._reduce_scatter_single, dist.all_reduce, dist.broadcast,
             C.reduce_scatter)
    if forced:
        C._one_rank = lambda group: False
    C._all_gather_single = counting("all_gather", C._all_gather_single)
    C._reduce_scatter_single = counting("reduce_scatter", C._reduce_scatter_single)
    dist.all_reduce = counting("all_reduce", dist.all_reduce)
    dist.broadcast = counting("broadcast", dist.broadcast)
    if not forced:
        C.reduce_scatter = local_reduce_scatter
    try:
        yield counts
    finally:
        (C._one_rank, C._all_gather_single, C._reduce_scatter_single, dist.all_reduce, dist.broadcast,
         C.reduce_scatter) = saved


def _train(rank: int, world: int, strategy: str, dtype: torch.dtype, forced: bool, graphed: bool,
           **shard_kwargs: Any) -> Dict[str, Any]:
    """Train STEPS steps (two micro-batches each, clipped) and report losses, parameters and collective counts.

    ``forced``: every group is treated as having several ranks (the collectives of before).
    """
    with _collectives_counted(forced) as counts:
        torch.manual_seed(0)
        cfg = GPTConfig(**MODEL)
        model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                            compute_dtype=dtype, fsdp_double_buffer=True,
                            fsdp_db_use_persist_buf_on_alloc_fail=True, **shard_kwargs)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
        graphs = None
        if graphed:
            graphs = protocol_layer_graphs(model)
        losses: List[torch.Tensor] = []
        for step in range(STEPS):
            if graphs is not None and step == 1:
                graphs.capture()
            x, y = synthetic_batch(step, 4 * world, cfg, torch.device("cpu"))
            losses.append(accumulated_step(model, opt, x, y, rank))
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if graphs is not None:
            graphs.delete()
        return {"losses": losses, "state": state, "counts": dict(counts)}


def _one_rank_runs(rank: int, world: int) -> Dict[str, Any]:
    out = {}
    for strategy in STRATEGIES:
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{strategy}/{str(dtype).split('.')[-1]}"
            out[key] = {forced: _train(rank, world, strategy, dtype, forced, graphed=False) for forced in (False, True)}
    out["graphed"] = {forced: _train(rank, world, "optim_grads_params", torch.float32, forced, graphed=True)
                      for forced in (False, True)}
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_gloo(_one_rank_runs, 1)[0]


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    bad = [f"loss {i}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if not torch.equal(x, y)]
    bad += [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    return bad


def test_one_rank_issues_no_collective_and_trains_the_same_bits(one_rank):
    for key, runs in one_rank.items():
        mine, forced = runs[False], runs[True]
        assert sum(mine["counts"][k] for k in COLLECTIVES) == 0, (key, mine["counts"])
        assert forced["counts"]["all_gather"] + forced["counts"]["all_reduce"] > 0, (key, forced["counts"])
        assert _same(mine, forced) == [], (key, _same(mine, forced))


def test_one_rank_folds_accumulated_gradients_from_the_buffer(one_rank):
    """Two micro-batches a step: the first's reduce-scatter makes the main gradient (a copy), the second's is added
    into it from the gradient buffer itself (no copy), for both sharded strategies; the bits as above."""
    for key, runs in one_rank.items():
        if key.split("/")[0] not in ("optim_grads", "optim_grads_params"):
            continue
        counts = runs[False]["counts"]
        assert counts["local_reduce_scatters"] > 0 and counts["local_reduce_scatters"] % (2 * STEPS) == 0, (key, counts)
        assert counts["local_reduce_scatter_copies"] * 2 == counts["local_reduce_scatters"], (key, counts)


def _hsdp_2x1(rank: int, world: int) -> Dict[str, Any]:
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    return {forced: _train(rank, world, "optim_grads_params", torch.float32, forced, graphed=False,
                           replicate_group=pair, shard_group=singles[rank]) for forced in (False, True)}


def test_hsdp_2x1_gathers_nothing_and_reduces_across_replicas():
    for rank, runs in enumerate(run_gloo(_hsdp_2x1, 2)):
        mine, forced = runs[False], runs[True]
        assert mine["counts"]["all_gather"] == mine["counts"]["reduce_scatter"] == 0, (rank, mine["counts"])
        assert mine["counts"]["all_reduce"] > 0, (rank, mine["counts"])
        assert forced["counts"]["reduce_scatter"] > 0, (rank, forced["counts"])
        assert _same(mine, forced) == [], (rank, _same(mine, forced))


class _Stream:
    """A stand-in for a CUDA stream (this test runs on CPU): records what waits on it."""

    def __init__(self, name: str) -> None:
        self.name, self.device, self.waited_for = name, "cuda:0", []

    def wait_stream(self, other: "_Stream") -> None:
        self.waited_for.append(other.name)


def test_a_cuda_copy_orders_a_consumer_on_another_stream(monkeypatch):
    """On CUDA the one-rank copy's handle makes a consumer on another stream wait for the issuing stream, as
    NCCL's Work.wait() does; on the issuing stream it adds nothing."""
    from megatron_fsdp._collectives import _LocalCopy

    issuing, other = _Stream("issuing"), _Stream("other")
    current = {"stream": issuing}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    work = _LocalCopy(issuing)
    assert work.wait() and issuing.waited_for == [] and other.waited_for == []
    current["stream"] = other
    assert work.wait() and other.waited_for == ["issuing"]
