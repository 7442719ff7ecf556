"""A plain ``optimizer.state_dict()`` of an optimizer over ``model.optimizer_parameters()`` holds one rank's main
shards. It loads back at the same world size (each rank its own); saved at 2 ranks and loaded at 1 it is refused
with the sharded path as the fix, at the load or, for a load before the optimizer's first step, at that step
(``megatron_fsdp/_guards.py``). On Gloo."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

import pytest
import torch

from tests.dist_utils import run_gloo
from tests.engine._common import adam, build_gpt, fsdp_step, shard


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the test compares type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _save_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    gpt, cfg = build_gpt(0)
    model = shard(gpt)
    opt = adam(model.optimizer_parameters())
    fsdp_step(model, opt, 0, cfg, rank, world)
    path = os.path.join(directory, f"optim{rank}.pt")
    torch.save(opt.state_dict(), path)
    # The same world size and strategy, each rank its own file: loads, and steps.
    fresh = shard(build_gpt(1)[0])
    fresh_opt = adam(fresh.optimizer_parameters())
    fresh_opt.load_state_dict(torch.load(path))
    fsdp_step(fresh, fresh_opt, 1, cfg, rank, world)
    fresh_opt.load_state_dict(fresh_opt.state_dict())  # an optimizer that stepped: the load pre-hook passes it
    fsdp_step(fresh, fresh_opt, 2, cfg, rank, world)
    return dict(saved_shape=tuple(opt.state[model.optimizer_parameters()[0]]["exp_avg"].shape))


def _load_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    gpt, cfg = build_gpt(1)
    model = shard(gpt)
    saved = torch.load(os.path.join(directory, "optim0.pt"))
    # Loaded before the optimizer's first step: torch takes any sizes, so the step refuses it.
    early = adam(model.optimizer_parameters())
    early.load_state_dict(saved)
    first_step = _error(lambda: fsdp_step(model, early, 0, cfg, rank, world))
    model.zero_grad()
    # Loaded into an optimizer that has stepped: the load itself refuses it.
    stepped = adam(model.optimizer_parameters())
    fsdp_step(model, stepped, 0, cfg, rank, world)
    load = _error(lambda: stepped.load_state_dict(saved))
    return dict(first_step=first_step, load=load, shape=tuple(model.optimizer_parameters()[0].shape),
                unit=model.named_optimizer_parameters()[0][0])


@pytest.mark.gloo
def test_plain_optimizer_state_saved_at_2_ranks_is_refused_at_1(tmp_path):
    saved = run_gloo(_save_job, 2, str(tmp_path))
    [loaded] = run_gloo(_load_job, 1, str(tmp_path))
    got, want = saved[0]["saved_shape"], loaded["shape"]
    assert got != want
    shapes = (f"state 'exp_avg' of shape {got} for the main shard of unit {loaded['unit']}, which needs shape {want} "
              "here (world size 1, strategy optim_grads_params)")
    fix = ("save model.optimizer_state_dict(optimizer) with torch.distributed.checkpoint.save, and load it with "
           "torch.distributed.checkpoint.load into model.optimizer_state_dict(optimizer), then "
           "model.load_optimizer_state_dict(optimizer, state)")
    for case, opening in (("load", "Adam.load_state_dict() got "),
                          ("first_step", "Adam was loaded, before its first step, with ")):
        message = loaded[case]
        assert message.startswith(f"ValueError: [rank 0] megatron_fsdp: {opening}{shapes}"), message
        assert "A plain optimizer.state_dict() holds one rank's shards" in message
        assert message.endswith(fix), message
