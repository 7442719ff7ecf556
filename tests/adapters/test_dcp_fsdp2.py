"""CPU Gloo tests: megatron_fsdp checkpoints are DTensor checkpoints that PyTorch FSDP2 reads and writes.

A model trained under megatron_fsdp is saved with ``dcp.save``, loaded into the same architecture wrapped by
``torch.distributed.fsdp.fully_shard`` (FSDP2, through ``torch.distributed.checkpoint.state_dict``), trained
there, saved again and loaded back into megatron_fsdp: parameters and Adam state must match bit for bit
(``torch.equal``) at each hand-over. Saving and loading our state dicts must not warn about deprecated
formats (FutureWarning, or a DeprecationWarning from torch.distributed).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_cudagraph.apps.model import TransformerBlock
from tests.dist_utils import run_gloo
from tests.engine._common import adam, build_gpt, fsdp_step, full_optimizer_state, shard

STEPS = 2


def _no_deprecation_warnings():
    """A context in which FutureWarning, and DeprecationWarning raised from torch.distributed, are errors."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("error", category=FutureWarning)
    warnings.filterwarnings("error", category=DeprecationWarning, module=r"torch\.distributed")
    return ctx


def _fsdp2(seed: int, world: int):
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    gpt, cfg = build_gpt(seed)
    mesh = init_device_mesh("cpu", (world,))
    for m in gpt.modules():
        if isinstance(m, TransformerBlock):
            fsdp2_shard(m, mesh=mesh)
    fsdp2_shard(gpt, mesh=mesh)
    return gpt, cfg, adam(gpt.parameters())


def _fsdp2_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """FSDP2's full parameters and optimizer state (per parameter name), gathered on every rank."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in osd["state"].items()}
    return {k: v.clone() for k, v in msd.items()}, state


def _interop_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    ours_dir, theirs_dir = os.path.join(directory, "megatron_fsdp"), os.path.join(directory, "fsdp2")
    out: Dict[str, Any] = {}
    # 1. Train under megatron_fsdp and save; the dicts are DTensors, Shard(0), in the unwrapped model's shapes.
    gpt, cfg = build_gpt(0)
    model = shard(gpt, sharding_strategy="optim_grads_params")
    opt = adam(model.optimizer_parameters())
    for step in range(STEPS):
        fsdp_step(model, opt, step, cfg, rank, world)
    msd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
    out["placements"] = {k: (type(v).__name__, tuple(v.placements), tuple(v.shape)) for k, v in msd.items()
                         if isinstance(v, torch.Tensor)}
    out["plain_shapes"] = {k: tuple(v.shape) for k, v in build_gpt(0)[0].state_dict().items()}
    ctx = _no_deprecation_warnings()
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ours_dir)
    finally:
        ctx.__exit__(None, None, None)
    out["ours_saved"] = dict(params=model.state_dict(), optim=full_optimizer_state(model, opt))

    # 2. Load into FSDP2 (other initial values), the way FSDP2 users load.
    fsdp2, _, fsdp2_opt = _fsdp2(1, world)
    msd2, osd2 = get_state_dict(fsdp2, fsdp2_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=ours_dir)
    set_state_dict(fsdp2, fsdp2_opt, model_state_dict=msd2, optim_state_dict=osd2)
    params, state = _fsdp2_full(fsdp2, fsdp2_opt)
    out["fsdp2_loaded"] = dict(params=params, optim=state)

    # 3. Train FSDP2 a step further and save from it.
    fsdp_step(fsdp2, fsdp2_opt, STEPS, cfg, rank, world)
    msd2, osd2 = get_state_dict(fsdp2, fsdp2_opt)
    dcp.save({"model": msd2, "optim": osd2}, checkpoint_id=theirs_dir)
    params, state = _fsdp2_full(fsdp2, fsdp2_opt)
    out["fsdp2_saved"] = dict(params=params, optim=state)

    # 4. Load back into a fresh megatron_fsdp model.
    fresh = shard(build_gpt(2)[0], sharding_strategy="optim_grads")
    fresh_opt = adam(fresh.optimizer_parameters())
    msd, osd = fresh.sharded_state_dict(), fresh.optimizer_state_dict(fresh_opt)
    ctx = _no_deprecation_warnings()
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=theirs_dir)
        fresh.load_sharded_state_dict(msd)
        fresh.load_optimizer_state_dict(fresh_opt, osd)
    finally:
        ctx.__exit__(None, None, None)
    out["ours_loaded"] = dict(params=fresh.state_dict(), optim=full_optimizer_state(fresh, fresh_opt))
    return out


@pytest.fixture(scope="module")
def interop_runs(tmp_path_factory):
    return run_gloo(_interop_job, 2, str(tmp_path_factory.mktemp("interop")))


def _assert_same(actual: Dict[str, Any], expected: Dict[str, Any], where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for k in expected:
        if isinstance(expected[k], dict):
            _assert_same(actual[k], expected[k], f"{where}.{k}")
        else:
            assert torch.equal(torch.as_tensor(actual[k]), torch.as_tensor(expected[k])), f"{where}.{k}"


@pytest.mark.gloo
def test_sharded_state_dict_is_dtensors_in_the_plain_models_shapes(interop_runs):
    for run in interop_runs:
        assert {k: v[2] for k, v in run["placements"].items()} == run["plain_shapes"]
        for key, (kind, placements, _) in run["placements"].items():
            assert kind == "DTensor", key
            assert placements == (Shard(0),), key


@pytest.mark.gloo
def test_megatron_fsdp_checkpoint_loads_into_fsdp2_and_back(interop_runs):
    for run in interop_runs:
        saved, loaded = run["ours_saved"], run["fsdp2_loaded"]
        _assert_same(loaded["params"], saved["params"], "fsdp2 params")
        _assert_same(loaded["optim"], saved["optim"], "fsdp2 optimizer")
        assert loaded["optim"]["head.weight"]["step"].item() == STEPS
        back, theirs = run["ours_loaded"], run["fsdp2_saved"]
        assert any(not torch.equal(theirs["params"][k], saved["params"][k]) for k in saved["params"])  # it trained
        _assert_same(back["params"], theirs["params"], "megatron_fsdp params")
        _assert_same(back["optim"], theirs["optim"], "megatron_fsdp optimizer")
        assert back["optim"]["head.weight"]["step"].item() == STEPS + 1
