"""Expert parallelism misuse in megatron_fsdp, refused with the value, the rule and the fix (one 4-rank Gloo job).

Each case runs on every rank and records the exception (type and message) or "ok"; refusals that depend on
other ranks' models are raised on every rank, so no rank is left waiting in a collective. Also: a model that
numbers its local experts from 0 on every EP rank trains, but its state dicts are refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
from torch import nn

from tests.dist_utils import run_gloo
from tests.engine import _moe_net as net

pytestmark = pytest.mark.gloo


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _ExpertsInRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _Layer()
        self.experts = nn.Linear(4, 4)

    def forward(self, x):
        return self.experts(self.layer(x))


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _job(rank: int, world: int) -> Dict[str, str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp
    from megatron_fsdp import fully_shard

    ep2, edp2 = megatron_fsdp.expert_parallel_groups(2)
    units = dict(fsdp_unit_modules=[net.Block])
    out: Dict[str, str] = {}
    out["not_dividing"] = _outcome(lambda: fully_shard(net.build(ep2), expert_parallel_size=3, **units))
    out["not_positive"] = _outcome(lambda: fully_shard(net.build(ep2), expert_parallel_size=0, **units))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = _outcome(lambda: fully_shard(net.build(ep2), mesh=mesh, expert_parallel_size=2, **units))
    out["one_group"] = _outcome(lambda: fully_shard(net.build(ep2), expert_parallel_group=ep2, **units))
    out["size_disagrees"] = _outcome(lambda: fully_shard(net.build(ep2), expert_parallel_size=4,
                                                         expert_parallel_group=ep2, expert_data_parallel_group=edp2,
                                                         **units))
    out["swapped_groups"] = _outcome(lambda: fully_shard(net.build(ep2), expert_parallel_group=ep2,
                                                         expert_data_parallel_group=ep2, **units))
    out["mesh_1d"] = _outcome(lambda: fully_shard(net.build(ep2), expert_mesh=init_device_mesh("cpu", (4,)), **units))
    out["mesh_and_groups"] = _outcome(lambda: fully_shard(net.build(ep2), expert_mesh=mesh, expert_parallel_group=ep2,
                                                          expert_data_parallel_group=edp2, **units))
    out["outside_units"] = _outcome(lambda: fully_shard(_ExpertsInRoot(), expert_parallel_size=2,
                                                        fsdp_unit_modules=[_Layer]))
    out["no_experts"] = _outcome(lambda: fully_shard(nn.Sequential(_Layer(), _Layer()), expert_parallel_size=2,
                                                     fsdp_unit_modules=[_Layer]))
    # rank 2 builds one local expert, its EDP peer rank 0 two
    uneven = dict(num_local=1) if rank == 2 else {}
    out["edp_peers_differ"] = _outcome(lambda: fully_shard(net.build(ep2, **uneven), expert_parallel_size=2, **units))

    def local_names() -> None:
        model = fully_shard(net.build(ep2, local_names=True), expert_parallel_size=2, **units)
        opt = net.adam(model.optimizer_parameters())
        x, y = net.local_rows(0, rank, world)
        net.loss_fn(model(x), y).backward()
        opt.step()
        assert torch.isfinite(model.total_grad_norm())
        out["local_names_trains"] = "ok"
        out["local_names_sharded_state_dict"] = _outcome(model.sharded_state_dict)
        model.state_dict()

    out["local_names_state_dict"] = _outcome(local_names)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_gloo(_job, 4)


def _expect(outcomes, case: str, kind: str, *fragments: str) -> None:
    for r, o in enumerate(outcomes):
        msg = o[case]
        assert msg.startswith(kind + ":"), f"rank {r}: {msg}"
        for f in fragments:
            assert f in msg, f"rank {r}: {f!r} not in {msg}"


def test_size_must_divide_the_world(outcomes):
    _expect(outcomes, "not_dividing", "ValueError", "expert_parallel_size=3", "does not divide", "divisor of 4")
    _expect(outcomes, "not_positive", "ValueError", "expert_parallel_size=0", "positive integer")


def test_hsdp_not_implemented(outcomes):
    _expect(outcomes, "hsdp", "NotImplementedError", "hybrid sharding", "expert-data-parallel", "HSDP without it")


def test_groups_must_agree(outcomes):
    _expect(outcomes, "one_group", "ValueError", "got expert_parallel_group= without expert_data_parallel_group=",
            "pass both")
    _expect(outcomes, "size_disagrees", "ValueError", "expert_parallel_size=4", "2 ranks", "expert_parallel_size=2")
    _expect(outcomes, "swapped_groups", "ValueError", "[rank ", "must meet only in this rank", "rows and columns")


def test_expert_mesh_must_be_two_dimensional(outcomes):
    _expect(outcomes, "mesh_1d", "ValueError", "2-D DeviceMesh", "a 1-D mesh", "init_device_mesh")
    _expect(outcomes, "mesh_and_groups", "ValueError", "expert_mesh= and expert groups", "pass one of")


def test_experts_must_live_in_units(outcomes):
    _expect(outcomes, "outside_units", "ValueError", "experts.weight", "no FSDP unit", "fsdp_unit_modules")
    _expect(outcomes, "no_experts", "ValueError", "expert_parallel_size=2", "no expert parameters", "is_expert = True")


def test_edp_peers_must_hold_the_same_experts(outcomes):
    _expect(outcomes, "edp_peers_differ", "ValueError", "unit layers.0", "rank 2", "rank 0", "expert-data-parallel peer",
            "same local experts")


def test_colliding_expert_names_train_but_refuse_state_dicts(outcomes):
    for o in outcomes:
        assert o["local_names_trains"] == "ok"
    _expect(outcomes, "local_names_sharded_state_dict", "NotImplementedError", "sharded_state_dict()", "same parameter "
            "names", "layers.0.moe.experts.0.w1", "global index", "stacked_expert_dims")
    _expect(outcomes, "local_names_state_dict", "NotImplementedError", "state_dict()", "training is not affected")
