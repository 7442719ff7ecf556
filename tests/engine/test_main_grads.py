"""Main gradients live like ``.grad`` ([Note: main gradients live like .grad], ``megatron_fsdp/_unit.py``).

On 1 and 2 Gloo ranks, every strategy:

- ``optimizer.zero_grad(set_to_none=True)`` frees each unit's fp32 main gradient (nothing in the engine keeps
  it), and training that way is ``torch.equal`` to training with ``set_to_none=False``, where the same tensor
  stays bound, is zeroed in place and added into;
- a ``main_shard.grad`` the engine did not create raises at the next reduction, naming the unit and the fix;
- a full-iteration graph (protocol backend) keeps the main gradients it captured: every replay binds the same
  tensors, whatever ``zero_grad(set_to_none=True)`` did in between; a second graph on the same model writes the
  same ones; deleting one graph keeps them for the other, deleting both lets ``zero_grad`` free them again.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict, List

import torch

from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, seq_len=16, moe_every=0)
STEPS = 4


def _build(strategy: str):
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    gpt = GPT(cfg)
    model = fully_shard(gpt, fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    return cfg, model, torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)


def _batch(cfg: GPTConfig, step: int, rank: int, world: int):
    x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
    return x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]


def _train(rank: int, world: int, strategy: str, set_to_none: bool) -> Dict[str, Any]:
    cfg, model, opt = _build(strategy)
    freed: List[bool] = []
    same_tensor: List[bool] = []
    previous: List[Any] = []
    for step in range(STEPS):
        x, y = _batch(cfg, step, rank, world)
        loss_fn(model(x), y).backward()
        grads = [u.main_shard.grad for u in model.all_units() if u.grad_numel]
        assert all(g is not None for g in grads)
        if previous:
            same_tensor.append(all(a is b for a, b in zip(previous, grads)))
        opt.step()
        refs = [weakref.ref(u._main_grad_data) for u in model.all_units() if u.grad_numel]
        opt.zero_grad(set_to_none=set_to_none)
        del grads
        gc.collect()
        freed.append(all(r() is None for r in refs))
        previous = [u.main_shard.grad for u in model.all_units() if u.grad_numel] if not set_to_none else []
    return {"state": model.full_state_dict(), "freed": freed, "same_tensor": same_tensor}


def _job(rank: int, world: int) -> Dict[str, Any]:
    return {s: (_train(rank, world, s, True), _train(rank, world, s, False)) for s in STRATEGIES}


def _misuse_job(rank: int, world: int) -> str:
    cfg, model, opt = _build("optim_grads_params")
    x, y = _batch(cfg, 0, rank, world)
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    unit = model.units[1]
    unit.main_shard.grad = torch.zeros_like(unit.main_shard)
    try:
        loss_fn(model(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _check(results: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for strategy, (released, kept) in res.items():
            assert all(released["freed"]), f"rank {rank} {strategy}: zero_grad(set_to_none=True) left a main gradient alive"
            assert not any(kept["freed"]), f"rank {rank} {strategy}: set_to_none=False lost the bound main gradient"
            assert all(kept["same_tensor"]), f"rank {rank} {strategy}: set_to_none=False rebound another tensor"
            for k, v in released["state"].items():
                assert torch.equal(v, kept["state"][k]), f"rank {rank} {strategy}: {k} differs between the modes"


def test_set_to_none_frees_main_grads_one_rank():
    _check(run_gloo(_job, 1))


def test_set_to_none_frees_main_grads_two_ranks():
    _check(run_gloo(_job, 2))


def test_a_foreign_main_shard_grad_raises():
    for msg in run_gloo(_misuse_job, 2):
        assert "main_shard.grad of unit layers.1 is a tensor the engine did not create" in msg, msg
        assert "zero_grad()" in msg, msg


def _graph(model) -> FullIterationCudaGraph:
    return FullIterationCudaGraph(model, lambda m, x, y: loss_fn(m(x), y),
                                  CudaGraphConfig(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=1))


def _train_graphed(g, model, opt, cfg, steps, rank: int, world: int) -> List[List[int]]:
    bound = []
    for step in steps:
        g.step([_batch(cfg, step, rank, world)])
        bound.append([id(u.main_shard.grad) for u in model.all_units() if u.grad_numel])
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
    return bound


def _freed_after_a_step(model, opt, cfg, rank: int, world: int) -> bool:
    x, y = _batch(cfg, 9, rank, world)
    loss_fn(model(x), y).backward()
    refs = [weakref.ref(u._main_grad_data) for u in model.all_units() if u.grad_numel]
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    return all(r() is None for r in refs)


def _replay_job(rank: int, world: int) -> Dict[str, Any]:
    cfg, model, opt = _build("optim_grads_params")
    first, second = _graph(model), _graph(model)
    out: Dict[str, Any] = {"bound": _train_graphed(first, model, opt, cfg, range(4), rank, world),
                           "counters": dict(first.counters)}
    out["second"] = _train_graphed(second, model, opt, cfg, range(4, 7), rank, world)  # captured at its 2nd step
    first.delete()  # the second graph still writes the kept main gradients
    out["after_first_deleted"] = _train_graphed(second, model, opt, cfg, range(7, 9), rank, world)
    out["kept_while_second_lives"] = not _freed_after_a_step(model, opt, cfg, rank, world)
    second.delete()
    out["freed_after_both_deleted"] = _freed_after_a_step(model, opt, cfg, rank, world)
    return out


def test_a_full_iteration_graph_keeps_the_main_grads_it_captured():
    for rank, out in enumerate(run_gloo(_replay_job, 2)):
        b = out["bound"]  # step 0 eager, step 1 captured (and replayed), 2-3 replays
        assert out["counters"]["train_replays"] == 3, out["counters"]  # the capture step replays too
        assert b[1] == b[2] == b[3], f"rank {rank}: a replay bound other main gradients than capture: {b}"
        assert out["second"][1:] == [b[1]] * 2 and out["after_first_deleted"] == [b[1]] * 2, out
        assert out["kept_while_second_lives"], f"rank {rank}: deleting one graph released what another still writes"
        assert out["freed_after_both_deleted"], f"rank {rank}: main gradients stayed kept after every graph was deleted"
