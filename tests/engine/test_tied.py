"""Tied parameters in the engine's state dicts: every name the unwrapped model's ``state_dict()`` holds, on the
full path and the DCP path ([Note: tied parameters] in ``megatron_fsdp/_fully_shard.py``).

The model ties its LM head to the token embedding (both in the root unit) and two norms of one unit to each
other (inside ``layers.0``): the unit plan keeps one copy of each, under its first name.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_cudagraph.apps.model import GPTConfig
from tests.dist_utils import run_gloo
from tests.engine._common import adam, build_gpt, fsdp_step, shard

TIES = {"head.weight": "tok.weight", "layers.0.mlp.ln.weight": "layers.0.attn.ln.weight"}


def _tied_gpt(seed: int) -> Tuple[nn.Module, GPTConfig]:
    gpt, cfg = build_gpt(seed=seed)
    gpt.head.weight = gpt.tok.weight
    gpt.layers[0].mlp.ln.weight = gpt.layers[0].attn.ln.weight
    return gpt, cfg


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for k in expected:
        assert torch.equal(actual[k], expected[k]), k


def test_state_dict_holds_every_name_of_a_tied_parameter(one_rank_group):
    model = shard(_tied_gpt(0)[0])
    plain = _tied_gpt(1)[0]
    sd = model.state_dict()
    assert sorted(sd) == sorted(plain.state_dict())  # the head's key was missing
    assert model.tied_names == TIES
    for name, first in TIES.items():
        assert sd[name] is sd[first]  # one tensor under both names, as nn.Module gives
    result = plain.load_state_dict(sd)  # strict: failed with "Missing key(s) in state_dict: head.weight"
    assert not result.missing_keys and not result.unexpected_keys
    assert plain.head.weight is plain.tok.weight
    _assert_same(plain.state_dict(), sd)


def test_load_state_dict_from_the_plain_model_takes_both_names(one_rank_group):
    model = shard(_tied_gpt(0)[0])
    plain = _tied_gpt(1)[0]
    result = model.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same(model.state_dict(), plain.state_dict())


def test_load_state_dict_takes_a_tied_parameter_from_either_name(one_rank_group):
    model = shard(_tied_gpt(0)[0])
    plain = _tied_gpt(1)[0]
    sd = plain.state_dict()
    del sd["tok.weight"]  # only the head's name left
    with pytest.raises(RuntimeError, match=r"missing keys \['tok\.weight'\]"):  # as the unwrapped model's
        model.load_state_dict(sd)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["tok.weight"] and not result.unexpected_keys
    _assert_same(model.state_dict(), plain.state_dict())


def test_load_state_dict_refuses_tied_names_that_disagree(one_rank_group):
    model = shard(_tied_gpt(0)[0])
    before = model.state_dict()
    sd = {k: v.clone() for k, v in _tied_gpt(1)[0].state_dict().items()}
    sd["head.weight"] += 1.0
    with pytest.raises(ValueError, match=r"tok\.weight and head\.weight name one tied parameter but hold different "
                                         r"values; .*drop head\.weight and load with strict=False"):
        model.load_state_dict(sd)
    _assert_same(model.state_dict(), before)  # refused before anything was written


def _dcp_save_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    gpt, cfg = _tied_gpt(0)
    model = shard(gpt, sharding_strategy="optim_grads_params")
    opt = adam(model.optimizer_parameters())
    for step in range(2):
        fsdp_step(model, opt, step, cfg, rank, world)
    sharded = model.sharded_state_dict()
    same = {name: sharded[name] is sharded[first] for name, first in TIES.items()}
    dcp.save({"model": sharded}, checkpoint_id=directory)
    return dict(params=model.state_dict(), same=same)


def _dcp_load_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    model = shard(_tied_gpt(1)[0], sharding_strategy="optim_grads")
    sharded = model.sharded_state_dict()
    dcp.load({"model": sharded}, checkpoint_id=directory)
    model.load_sharded_state_dict(sharded)
    return dict(params=model.state_dict())


@pytest.mark.gloo
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the plain load, in this process
def test_dcp_checkpoint_holds_every_name_of_a_tied_parameter(tmp_path):
    """Saved at 2 ranks: the same DTensor under both names (DCP stores each name, the same values); loads into
    the plain tied model and into the wrapper at 1 rank."""
    directory = str(tmp_path)
    saved_ranks = run_gloo(_dcp_save_job, 2, directory)
    saved = saved_ranks[0]["params"]
    assert all(all(r["same"].values()) for r in saved_ranks)
    plain = _tied_gpt(2)[0]
    plain_sd = plain.state_dict()
    dcp.load({"model": plain_sd}, checkpoint_id=directory)  # every key of the plain model is in the checkpoint
    _assert_same(plain.state_dict(), saved)
    [loaded] = run_gloo(_dcp_load_job, 1, directory)
    _assert_same(loaded["params"], saved)
