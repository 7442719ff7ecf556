"""Expert parallelism in megatron_fsdp against the EP=1 reference, on Gloo.

Two spawned jobs (module fixtures): one on 4 ranks, one on 2. The 4-rank job trains ``MoENet`` (tests/engine/
_moe_net.py) with EP=2 (``expert_parallel_size=2``; ``optim`` through a 2-D ``expert_mesh``) and EP=4 (explicit
groups from ``megatron_fsdp.expert_parallel_groups``) under several strategies, with and without clipping, and saves a DCP
checkpoint of an EP=2 run; the 2-rank job trains EP=2 on 2 ranks and loads that checkpoint. What must hold:

- the layout of [Note: expert parallelism] (megatron_fsdp/_expert.py): EP groups {0,1},{2,3}, EDP {0,2},{1,3};
- in backward, the layer before gathers both its buckets while the later layer computes (partners prefetch
  together);
- under ``fsdp_double_buffer`` dense buckets use unshard slots 0/1 and expert buckets 2/3, every buffer at
  the same address at every step;
- every run's per-step global loss, its clipping norms and its final parameters equal the single-process EP=1
  reference's within ``RTOL`` ([Note: EP tolerance]); dense parameters are bit-equal across ranks;
- a checkpoint saved at 4 ranks EP=2 loads at 2 ranks EP=2 with bit-equal parameters and optimizer state, and
  two more steps there equal (``torch.equal``) the same 2-rank model loaded from the gathered full state, and
  the reference continued within ``RTOL``; the same checkpoint loads into the EP=1 model (all experts on every
  rank) with bit-equal parameters and continues the reference too. A unit plan with every expert its own unit
  (expert-only units nested in the blocks) trains like the rest.

[Note: EP tolerance]
Everything is fp32 and deterministic; the runs differ from the reference only in how the gradient's terms are
grouped: the reference sums every token's contribution in one backward; a rank sums its tokens' contributions
to the dense parameters and an expert owner those of the tokens its EP group sent, and the reduce-scatter adds
the partial sums. That reorders fp32 additions: a few ulp per gradient element. Adam would amplify them without
bound where a gradient element nearly cancels (its update is ``lr * g / (|g| + eps)`` at the first step, a sign
of ``g`` for ``|g| << eps``), so the tests use ``eps = 1e-3``: the update's derivative in ``g`` is at most
``lr / eps = 10``, and an ulp-level difference stays ulp-level. Measured: parameters within 1.7e-7 relative
(maximum difference over the tensor's largest magnitude) after 4 steps, losses and norms within 1.2e-7;
``RTOL = 1e-6`` leaves a margin of about 6x and is far below what a real error gives (expert gradients divided
by the EDP size instead of the world: the second loss already differs by 3e-3 relative).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch

from tests.dist_utils import run_gloo
from tests.engine import _moe_net as net

pytestmark = pytest.mark.gloo

RTOL = 1e-6
STEPS = 4
CLIP = 0.05  # far below the gradients' norm (2 to 4 in these steps), so every step clips
CASES = {
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
    "optim_grads": dict(sharding_strategy="optim_grads"),
    "optim": dict(sharding_strategy="optim"),
    "no_shard": dict(sharding_strategy="no_shard"),
    # every expert its own unit (an expert-only unit) nested in a block (the block's dense bucket)
    "zero3+expert_units": dict(sharding_strategy="optim_grads_params", fsdp_unit_modules=[net.Block, net.Expert]),
}


def _shard(model, **kw):
    from megatron_fsdp import fully_shard

    kw.setdefault("fsdp_unit_modules", [net.Block])
    return fully_shard(model, **kw)


def _train(rank: int, world: int, model, opt, steps: range, clip: Any = None) -> Dict[str, List[float]]:
    import torch.distributed as dist

    losses, norms, addresses = [], [], []
    for step in steps:
        x, y = net.local_rows(step, rank, world)
        loss = net.loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(model.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        addresses.append(model.buffer_addresses())
    return {"losses": losses, "norms": norms, "addresses": addresses}


def _run(rank: int, world: int, ep: int, kw: Dict[str, Any], *, explicit: Any, clip: Any = None):
    """``explicit``: False passes ``expert_parallel_size``, True the two groups, "mesh" a 2-D expert mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import megatron_fsdp

    groups = megatron_fsdp.expert_parallel_groups(ep)
    if explicit == "mesh":
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        how: Dict[str, Any] = dict(expert_mesh=mesh)
    elif explicit:
        how = dict(expert_parallel_group=groups[0], expert_data_parallel_group=groups[1])
    else:
        how = dict(expert_parallel_size=ep)
    model = _shard(net.build(groups[0]), **kw, **how)
    opt = net.adam(model.optimizer_parameters())
    out = _train(rank, world, model, opt, range(STEPS), clip)
    out["params"] = model.state_dict()
    return model, opt, out


def _four_ranks(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import megatron_fsdp

    res: Dict[str, Any] = {}
    model, _, res["ep2/zero3"] = _run(rank, world, 2, CASES["zero3"], explicit=False)
    res["layout"] = {
        "ep": dist.get_process_group_ranks(model.expert_parallel_group),
        "edp": dist.get_process_group_ranks(model.expert_data_parallel_group),
        "units": [(u.name, u.is_expert, u.shard_size, u.grad_numel) for u in model.units],
    }
    for name, kw in CASES.items():
        if name != "zero3":
            res[f"ep2/{name}"] = _run(rank, world, 2, kw, explicit="mesh" if name == "optim" else False)[2]
        res[f"ep4/{name}"] = _run(rank, world, 4, kw, explicit=True)[2]
    res["ep2/zero3+clip"] = _run(rank, world, 2, CASES["zero3+double_buffer"], explicit=False, clip=CLIP)[2]
    res["ep4/no_shard+clip"] = _run(rank, world, 4, CASES["no_shard"], explicit=True, clip=CLIP)[2]

    # The checkpoint: EP=2 at 4 ranks, STEPS steps, saved with the full state beside it.
    model, opt, _ = _run(rank, world, 2, CASES["zero3"], explicit=False)
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=ckpt)
    full_opt = {}
    for u in model.all_units():
        from megatron_fsdp._state_dict import gather_region

        for k, v in opt.state[u.main_shard].items():
            if v.dim() == 0:
                for n in u.layout.names:
                    full_opt.setdefault(n, {})[k] = v.clone()
            else:
                full = gather_region(model, u.layout, v, u)
                for n, view in zip(u.layout.names, u.layout.views(full)):
                    full_opt.setdefault(n, {})[k] = view.clone()
    res["saved"] = {"params": model.state_dict(), "optim": full_opt}
    # The order of the engine's collectives in one step (ZeRO-3, on-demand buffers)
    from megatron_fsdp import CaptureGuardMode, capture_guard

    model = _shard(net.build(megatron_fsdp.expert_parallel_groups(2)[0]), expert_parallel_size=2)
    x, y = net.local_rows(0, rank, world)
    log: List[str] = []
    with capture_guard(CaptureGuardMode.REFUSE, collective_log=log):
        net.loss_fn(model(x), y).backward()
    res["collectives"] = log
    # inf-norm clipping on the same gradients as the reference's: one backward, no step
    x, y = net.local_rows(0, rank, world)
    fresh = _shard(net.build(megatron_fsdp.expert_parallel_groups(2)[0]), expert_parallel_size=2)
    net.loss_fn(fresh(x), y).backward()
    res["inf_norm"] = float(fresh.total_grad_norm(float("inf")))
    res["two_norm"] = float(fresh.total_grad_norm(2.0))
    return res


def _two_ranks(rank: int, world: int, ckpt: str, saved: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import megatron_fsdp

    res: Dict[str, Any] = {}
    res["ep2/zero3"] = _run(rank, world, 2, CASES["zero3"], explicit=False)[2]
    res["ep2/zero3+double_buffer+clip"] = _run(rank, world, 2, CASES["zero3+double_buffer"], explicit=True,
                                               clip=CLIP)[2]
    groups = megatron_fsdp.expert_parallel_groups(2)

    def resumed(from_dcp: bool):
        model = _shard(net.build(groups[0], seed=7), expert_parallel_size=2)  # other values: the load must replace them
        opt = net.adam(model.optimizer_parameters())
        sd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
        if from_dcp:
            dcp.load({"model": sd, "optim": osd}, checkpoint_id=ckpt)
            model.load_sharded_state_dict(sd)
            model.load_optimizer_state_dict(opt, osd)
        else:
            own = set(model.state_dict())
            model.load_state_dict(saved["params"])  # the other EP rank's experts are skipped
            osd["state"] = {n: {k: v for k, v in st.items()} for n, st in saved["optim"].items() if n in own}
            model.load_optimizer_state_dict(opt, osd)
        after_load = {"params": model.state_dict(),
                      "optim": {n: {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in st.items()}
                                for n, st in model.optimizer_state_dict(opt)["state"].items()}}
        out = _train(rank, world, model, opt, range(STEPS, STEPS + 2))
        out["params"] = model.state_dict()
        return after_load, out

    res["dcp_after_load"], res["dcp_continued"] = resumed(True)
    res["full_after_load"], res["full_continued"] = resumed(False)
    # The same checkpoint into the EP=1 model (every expert on every rank): a global expert's key and shape do not
    # depend on EP ([Note: expert parallelism], Checkpoints).
    model = _shard(net.build(None, seed=7))
    opt = net.adam(model.optimizer_parameters())
    sd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
    dcp.load({"model": sd, "optim": osd}, checkpoint_id=ckpt)
    model.load_sharded_state_dict(sd)
    model.load_optimizer_state_dict(opt, osd)
    res["ep1_after_load"] = model.state_dict()
    res["ep1_continued"] = _train(rank, world, model, opt, range(STEPS, STEPS + 2))
    res["ep1_continued"]["params"] = model.state_dict()
    return res


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep_ckpt"))


@pytest.fixture(scope="module")
def four(ckpt_dir):
    return run_gloo(_four_ranks, 4, os.path.join(ckpt_dir, "ep2_w4"))


@pytest.fixture(scope="module")
def two(ckpt_dir, four):
    full_params = net.merge_states([r["saved"]["params"] for r in four])
    full_optim: Dict[str, Dict[str, torch.Tensor]] = {}
    for r in four:
        for n, st in r["saved"]["optim"].items():
            full_optim.setdefault(n, st)
    return run_gloo(_two_ranks, 2, os.path.join(ckpt_dir, "ep2_w4"), {"params": full_params, "optim": full_optim})


@pytest.fixture(scope="module")
def reference():
    return {"plain": net.reference_run(STEPS), "clip": net.reference_run(STEPS, clip=CLIP),
            "continued": net.reference_run(STEPS + 2)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_run(per_rank: List[Dict[str, Any]], ref: Dict[str, Any]) -> None:
    for r in per_rank:
        assert r["losses"] == per_rank[0]["losses"]  # the global loss, the same on every rank
        assert r["norms"] == per_rank[0]["norms"]
    for got, want in zip(per_rank[0]["losses"], ref["losses"]):
        assert abs(got - want) <= RTOL * abs(want), (got, want)
    for got, want in zip(per_rank[0]["norms"], ref["norms"]):
        assert abs(got - want) <= RTOL * abs(want), (got, want)
    assert len(per_rank[0]["norms"]) == len(ref["norms"]) or not per_rank[0]["norms"]
    params = net.merge_states([r["params"] for r in per_rank])
    assert params.keys() == ref["params"].keys()
    bad = {k: _rel(params[k], v) for k, v in ref["params"].items() if _rel(params[k], v) > RTOL}
    assert not bad, bad


def test_group_layout(four):
    assert [r["layout"]["ep"] for r in four] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["layout"]["edp"] for r in four] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    units = four[0]["layout"]["units"]
    # each block: a dense bucket over the 4 ranks, an expert bucket over its 2 EDP ranks
    assert [(n, e, s) for n, e, s, _ in units] == [("layers.0", False, 4), ("layers.0 [experts]", True, 2),
                                                   ("layers.1", False, 4), ("layers.1 [experts]", True, 2)]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_four_ranks_match_reference(four, reference, ep, case):
    _check_run([r[f"ep{ep}/{case}"] for r in four], reference["plain"])


@pytest.mark.parametrize("ep", [2, 4])
def test_double_buffer_addresses_fixed(four, ep):
    for r in four:
        steps = r[f"ep{ep}/zero3+double_buffer"]["addresses"]
        assert all(a == steps[0] for a in steps)  # every buffer at the same address every step
        slots = {name: a["param_slot"] for name, a in steps[0].items()}
        assert slots == {"layers.0": 0, "layers.0 [experts]": 2, "layers.1": 1, "layers.1 [experts]": 3, "<root>": None}
        assert steps[0]["layers.0"]["param"] != steps[0]["layers.0 [experts]"]["param"]


def test_backward_prefetches_both_buckets_of_a_layer(four):
    log = four[0]["collectives"]
    first_reduce_of_layer1 = min(i for i, c in enumerate(log) if c.startswith("reduce-scatter of gradients of unit "
                                                                              "layers.1"))
    for bucket in ("layers.0", "layers.0 [experts]"):  # gathered again for backward while layers.1 computes
        last_gather = max(i for i, c in enumerate(log) if c == f"all-gather of unit {bucket}")
        assert last_gather < first_reduce_of_layer1, log
    # each bucket reduces on its own group: an expert bucket's reduce-scatter names it
    assert "reduce-scatter of gradients of unit layers.1 [experts]" in log


def test_clipping_matches_reference(four, two, reference):
    _check_run([r["ep2/zero3+clip"] for r in four], reference["clip"])
    _check_run([r["ep4/no_shard+clip"] for r in four], reference["clip"])
    _check_run([r["ep2/zero3+double_buffer+clip"] for r in two], reference["clip"])
    assert len(four[0]["ep2/zero3+clip"]["norms"]) == STEPS


def test_total_norms_match_reference(four):
    model = net.build(None)
    x, y = net.batch(0)
    net.loss_fn(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    two_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    inf_norm = float(max(g.abs().max() for g in grads))
    for r in four:
        assert abs(r["two_norm"] - two_norm) <= RTOL * two_norm
        assert abs(r["inf_norm"] - inf_norm) <= RTOL * inf_norm


def test_two_ranks_match_reference(two, reference):
    _check_run([r["ep2/zero3"] for r in two], reference["plain"])


def test_checkpoint_loads_at_another_world_size(four, two, reference):
    saved = net.merge_states([r["saved"]["params"] for r in four])
    loaded = net.merge_states([r["dcp_after_load"]["params"] for r in two])
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    for r in two:  # optimizer state of this rank's parameters, as saved
        for n, st in r["dcp_after_load"]["optim"].items():
            for k, v in st.items():
                want = next(x["saved"]["optim"][n][k] for x in four if n in x["saved"]["optim"])
                assert torch.equal(v, want), (n, k)
    # resuming from DCP == resuming from the gathered full state, bit for bit; and both continue the reference
    for r in two:
        assert r["dcp_continued"]["losses"] == r["full_continued"]["losses"]
        assert r["dcp_continued"]["params"].keys() == r["full_continued"]["params"].keys()
        assert all(torch.equal(v, r["full_continued"]["params"][k]) for k, v in r["dcp_continued"]["params"].items())
    ref = reference["continued"]
    continued = {"losses": ref["losses"][STEPS:], "norms": [], "params": ref["params"]}
    _check_run([r["dcp_continued"] for r in two], continued)


def test_checkpoint_loads_at_expert_parallel_size_one(four, two, reference):
    saved = net.merge_states([r["saved"]["params"] for r in four])
    for r in two:
        assert r["ep1_after_load"].keys() == saved.keys()
        assert all(torch.equal(r["ep1_after_load"][k], saved[k]) for k in saved)
    ref = reference["continued"]
    _check_run([r["ep1_continued"] for r in two], {"losses": ref["losses"][STEPS:], "norms": [], "params": ref["params"]})
