"""Hybrid sharding (HSDP) in megatron_fsdp on 4 Gloo ranks as a 2 x 2 mesh ``(replicate, shard)``.

One 4-rank spawn (module fixture); the tests assert on what the ranks return. What must hold (``torch.equal``):

- every strategy trained 3 steps under HSDP equals a single-process reference that adds the ranks' gradients
  in the engine's defined order ([Note: hybrid sharding] in megatron_fsdp/_hsdp.py: pre-scale by 1/4, sum
  within each shard row, sum the rows): each rank's loss and every final parameter;
- the two-groups form (``replicate_group=``, ``shard_group=``) trains the same bits as ``mesh=``; HSDP as 2 x 1
  (shard groups of one rank, the layout of 2 GPUs) equals its reference for every strategy;
- HSDP + partial graphs (protocol backend, ZeRO-3 double buffer) equals eager HSDP, and the all-reduce across
  replicas never runs inside a (simulated) capture; a full-iteration graph (protocol) equals eager HSDP and
  holds the all-reduce across replicas;
- a DCP checkpoint saved at 2 x 2 loads at 1 x 4 and at 1 x 2 with the same parameters and optimizer state,
  and 2 more steps at 1 x 2 after the load equal the reference continued at 1 x 2; it loads into PyTorch
  FSDP2 HSDP on the same mesh with the same parameters;
- inconsistent group arguments are refused, naming them.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD, R, S = 4, 2, 2
CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=8)
GLOBAL_BATCH = 8
STEPS = 2
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CPU = torch.device("cpu")


def _gpt():
    from fsdp_cudagraph.apps.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**CFG)
    return GPT(cfg), cfg


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _rows(step: int, cfg, k: int, world: int):
    from fsdp_cudagraph.apps.model import synthetic_batch

    x, y = synthetic_batch(step, GLOBAL_BATCH, cfg, CPU)
    per = GLOBAL_BATCH // world
    return x[k * per:(k + 1) * per], y[k * per:(k + 1) * per]


def _step(model, opt, cfg, step: int, k: int, world: int) -> torch.Tensor:
    from fsdp_cudagraph.apps.model import loss_fn

    x, y = _rows(step, cfg, k, world)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


def _shard(gpt, **kw):
    from fsdp_cudagraph.apps.model import TransformerBlock
    from megatron_fsdp import fully_shard

    return fully_shard(gpt, fsdp_unit_modules=[TransformerBlock], **kw)


def _full_opt(model, opt) -> Dict[str, Dict[str, torch.Tensor]]:
    from tests.engine._common import full_optimizer_state

    return full_optimizer_state(model, opt)


# ---------------------------------------------------------------------------------------------- rank side
def _train(rank: int, steps: int, **kw) -> Dict[str, Any]:
    gpt, cfg = _gpt()
    model = _shard(gpt, **kw)
    opt = _sgd(model.optimizer_parameters())
    losses = [_step(model, opt, cfg, s, rank, WORLD) for s in range(steps)]
    return {"losses": losses, "params": model.state_dict()}


def _collective_order(rank: int, mesh) -> List[str]:
    """The collectives one eager HSDP step issues, in order (the engine's collective log)."""
    from megatron_fsdp import CaptureGuardMode, capture_guard

    gpt, cfg = _gpt()
    model = _shard(gpt, mesh=mesh, sharding_strategy="optim_grads_params")
    opt = _sgd(model.optimizer_parameters())
    log: List[str] = []
    with capture_guard(CaptureGuardMode.REFUSE, collective_log=log):
        _step(model, opt, cfg, 0, rank, WORLD)
    return [c for c in log if "gradients" in c]


def _two_by_one(rank: int) -> Dict[str, Any]:
    """HSDP as 2 x 1 (the 2-GPU layout: shard groups of one rank) on ranks 0 and 1, every strategy."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(WORLD)]
    out: Dict[str, Any] = {}
    if rank < 2:
        for strategy in STRATEGIES:
            gpt, cfg = _gpt()
            model = _shard(gpt, replicate_group=pair, shard_group=singles[rank], sharding_strategy=strategy)
            opt = _sgd(model.optimizer_parameters())
            out[strategy] = {"losses": [_step(model, opt, cfg, s, rank, 2) for s in range(STEPS)],
                             "params": model.state_dict()}
    dist.barrier()
    return out


def _graphed(rank: int, mesh, graphed: bool) -> Dict[str, Any]:
    from tests.engine._common import protocol_layer_graphs

    gpt, cfg = _gpt()
    model = _shard(gpt, mesh=mesh, sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                   fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    graphs, out = None, {"losses": []}
    if graphed:
        graphs = protocol_layer_graphs(model)
    model.trace = []
    for s in range(5):
        if graphs is not None and s == 1:
            out["callables"] = graphs.capture().callables
        out["losses"].append(_step(model, opt, cfg, s, rank, WORLD))
    out["captured_phases"] = sorted({p for p, _, cap in model.trace if cap})
    model.trace = None
    if graphs is not None:
        graphs.delete()
    out["params"] = model.state_dict()
    return out


def _full_iteration(rank: int, mesh, graphed: bool) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph
    from fsdp_cudagraph.apps.model import loss_fn

    gpt, cfg = _gpt()
    model = _shard(gpt, mesh=mesh, sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                   fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    fwd = lambda m, x, y: loss_fn(m(x), y)  # noqa: E731
    out: Dict[str, Any] = {"losses": []}
    if not graphed:
        for s in range(5):
            out["losses"].append(_step(model, opt, cfg, s, rank, WORLD))
    else:
        g = FullIterationCudaGraph(model, fwd, CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                               cuda_graph_warmup_steps=2))
        for s in range(5):
            out["losses"].append(g.step([_rows(s, cfg, rank, WORLD)]).detach().clone().reshape(()))
            g.optimizer_step(opt)
            opt.zero_grad()
        report = g.reports.get("train")
        out["collectives"] = list(report.collectives) if report else None
        g.delete()
    out["params"] = model.state_dict()
    return out


def _dcp(rank: int, mesh, ckpt: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out: Dict[str, Any] = {}
    gpt, cfg = _gpt()
    model = _shard(gpt, mesh=mesh, sharding_strategy="optim_grads_params")
    opt = _sgd(model.optimizer_parameters())
    for s in range(2):
        _step(model, opt, cfg, s, rank, WORLD)
    out["saved"] = (model.state_dict(), _full_opt(model, opt))
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=ckpt)

    def load(m, o, group=None):
        sd = {"model": m.sharded_state_dict(), "optim": m.optimizer_state_dict(o)}
        dcp.load(sd, checkpoint_id=ckpt, process_group=group)
        m.load_sharded_state_dict(sd["model"])
        m.load_optimizer_state_dict(o, sd["optim"])

    flat = _shard(_gpt()[0], sharding_strategy="optim_grads_params")  # 1 x 4
    flat_opt = _sgd(flat.optimizer_parameters())
    load(flat, flat_opt)
    out["1x4"] = (flat.state_dict(), _full_opt(flat, flat_opt))
    # into PyTorch FSDP2 HSDP on the same 2 x 2 mesh: its DTensors (Replicate, Shard(0)) load our checkpoint
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    fsdp2 = _gpt()[0]
    for layer in fsdp2.layers:
        fsdp2_shard(layer, mesh=mesh)
    fsdp2_shard(fsdp2, mesh=mesh)
    sd = {"model": fsdp2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    fsdp2.load_state_dict(sd["model"])
    out["fsdp2_hsdp"] = {n: p.full_tensor().clone() for n, p in fsdp2.named_parameters()}
    out["fsdp2_placements"] = [type(p).__name__ for p in fsdp2.layers[0].attn.qkv.weight.placements]
    pair = dist.new_group([0, 1])
    if rank < 2:  # 1 x 2 on ranks 0 and 1, then 2 more steps there
        two = _shard(_gpt()[0], process_group=pair, sharding_strategy="optim")
        two_opt = _sgd(two.optimizer_parameters())
        load(two, two_opt, pair)
        out["1x2"] = (two.state_dict(), _full_opt(two, two_opt))
        out["1x2_losses"] = [_step(two, two_opt, cfg, s, rank, 2) for s in (2, 3)]
        out["1x2_params"] = two.state_dict()
    dist.barrier()
    return out


def _refusals(rank: int, mesh) -> Dict[str, str]:
    import torch.distributed as dist

    out = {}
    cases = {
        "mesh_and_group": dict(mesh=mesh, process_group=dist.group.WORLD),
        "half_pair": dict(shard_group=mesh.get_group(1)),
        "mesh_and_groups": dict(mesh=mesh, replicate_group=mesh.get_group(0), shard_group=mesh.get_group(1)),
        "same_group_twice": dict(replicate_group=mesh.get_group(1), shard_group=mesh.get_group(1)),
    }
    # rows {0,1} {2,3} with columns {0,3} {1,2}: every pair meets in one rank, but they form no mesh
    rows = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    cols = [dist.new_group(c) for c in ([0, 3], [1, 2])]
    cases["not_a_mesh"] = dict(shard_group=rows[rank // 2], replicate_group=cols[0 if rank in (0, 3) else 1])
    for name, kw in cases.items():
        try:
            _shard(_gpt()[0], **kw)
            out[name] = ""
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    return out


def _job(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    res: Dict[str, Any] = {s: _train(rank, STEPS, mesh=mesh, sharding_strategy=s) for s in STRATEGIES}
    for strategy in ("no_shard", "optim_grads", "optim_grads_params"):  # gradient slots reused under the all-reduce
        res[f"{strategy}+double_buffer"] = _train(rank, STEPS, mesh=mesh, sharding_strategy=strategy,
                                                  fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    res["groups"] = _train(rank, STEPS, replicate_group=mesh.get_group(0), shard_group=mesh.get_group(1),
                           sharding_strategy="optim_grads_params")
    res["order"] = _collective_order(rank, mesh)
    res["2x1"] = _two_by_one(rank)
    res["eager"] = _graphed(rank, mesh, False)
    res["graphed"] = _graphed(rank, mesh, True)
    res["full_eager"] = _full_iteration(rank, mesh, False)
    res["full_graphed"] = _full_iteration(rank, mesh, True)
    res["dcp"] = _dcp(rank, mesh, ckpt)
    res["refusals"] = _refusals(rank, mesh)
    return res


# ---------------------------------------------------------------------------------------------- reference
def _reference(schedule: List[tuple]) -> Dict[str, Any]:
    """One process: for each (replicate, shard) in ``schedule`` one step over R*S slices, gradients added in
    the engine's order (pre-scale by 1/(R*S), sum within each shard row, sum the rows), then SGD.

    One intra-op thread, as the ranks run: CPU kernels such as LayerNorm's backward split their reductions
    by thread, which would reorder the reference's own sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(schedule)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(schedule: List[tuple]) -> Dict[str, Any]:
    gpt, cfg = _gpt()
    opt = _sgd(gpt.parameters())
    losses = []
    from fsdp_cudagraph.apps.model import loss_fn

    for step, (r, s) in enumerate(schedule):
        world = r * s
        per_rank = []
        step_losses = []
        for k in range(world):
            x, y = _rows(step, cfg, k, world)
            loss = loss_fn(gpt(x), y)
            loss.backward()
            step_losses.append(loss.detach().clone())
            per_rank.append([(p.grad if p.grad is not None else torch.zeros_like(p)) * (1.0 / world)
                             for p in gpt.parameters()])
            gpt.zero_grad(set_to_none=True)
        for i, p in enumerate(gpt.parameters()):
            rows = []
            for a in range(r):
                row = per_rank[a * s][i]
                for b in range(1, s):
                    row = row + per_rank[a * s + b][i]
                rows.append(row)
            total = rows[0]
            for row in rows[1:]:
                total = total + row
            p.grad = total
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return {"losses": losses, "params": {n: p.detach() for n, p in gpt.state_dict().items()}}


def _equal_dicts(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD, str(tmp_path_factory.mktemp("hsdp_ckpt")))


@pytest.mark.parametrize("strategy", STRATEGIES + ["no_shard+double_buffer", "optim_grads+double_buffer",
                                                 "optim_grads_params+double_buffer"])
def test_hsdp_training_equals_reference(runs, strategy):
    ref = _reference([(R, S)] * STEPS)
    for rank, res in enumerate(runs):
        run = res[strategy]
        assert all(torch.equal(run["losses"][s], ref["losses"][s][rank]) for s in range(STEPS)), (rank, run["losses"])
        assert not _equal_dicts(run["params"], ref["params"]), (rank, _equal_dicts(run["params"], ref["params"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hsdp_2x1_equals_reference(runs, strategy):
    ref = _reference([(2, 1)] * STEPS)
    for rank in (0, 1):
        run = runs[rank]["2x1"][strategy]
        assert all(torch.equal(run["losses"][s], ref["losses"][s][rank]) for s in range(STEPS)), (rank, run["losses"])
        assert not _equal_dicts(run["params"], ref["params"]), (rank, _equal_dicts(run["params"], ref["params"]))


def test_all_reduce_across_replicas_overlaps_the_next_unit(runs):
    # a unit's all-reduce is issued after the next unit's reduce-scatter (it runs during that unit's backward)
    # and before the one after; the root's comes last
    expected = ["reduce-scatter of gradients of unit layers.1", "reduce-scatter of gradients of unit layers.0",
                "all-reduce of gradients of unit layers.1 across replicas",
                "reduce-scatter of gradients of unit <root>",
                "all-reduce of gradients of unit layers.0 across replicas",
                "all-reduce of gradients of unit <root> across replicas"]
    for res in runs:
        assert res["order"] == expected, res["order"]


def test_groups_form_equals_mesh_form(runs):
    for res in runs:
        assert all(torch.equal(a, b) for a, b in zip(res["groups"]["losses"], res["optim_grads_params"]["losses"]))
        assert not _equal_dicts(res["groups"]["params"], res["optim_grads_params"]["params"])


def test_partial_graphs_equal_eager_hsdp(runs):
    for res in runs:
        eager, graphed = res["eager"], res["graphed"]
        assert graphed["callables"], "nothing was captured"
        assert all(torch.equal(a, b) for a, b in zip(graphed["losses"], eager["losses"])), (graphed["losses"], eager["losses"])
        assert not _equal_dicts(graphed["params"], eager["params"])
        # the capture regions held forward/backward of the callables only, never an FSDP phase
        assert not [p for p in graphed["captured_phases"] if p.startswith(("pre_", "post_"))], graphed["captured_phases"]


def test_full_iteration_graph_equals_eager_hsdp(runs):
    for res in runs:
        eager, graphed = res["full_eager"], res["full_graphed"]
        assert all(torch.equal(a, b) for a, b in zip(graphed["losses"], eager["losses"])), (graphed["losses"], eager["losses"])
        assert not _equal_dicts(graphed["params"], eager["params"])
        # the captured step holds the all-reduce across replicas of every unit with gradients
        assert graphed["collectives"] and any("across replicas" in c for c in graphed["collectives"]), graphed["collectives"]


def test_dcp_2x2_loads_at_1x4_and_1x2(runs):
    for rank, res in enumerate(runs):
        saved_params, saved_opt = res["dcp"]["saved"]
        for where in ("1x4",) + (("1x2",) if rank < 2 else ()):
            params, opt = res["dcp"][where]
            assert not _equal_dicts(params, saved_params), (where, rank)
            assert opt.keys() == saved_opt.keys()
            assert all(not _equal_dicts(opt[k], saved_opt[k]) for k in saved_opt), (where, rank)


def test_dcp_2x2_loads_into_fsdp2_hsdp(runs):
    for res in runs:
        assert res["dcp"]["fsdp2_placements"] == ["Replicate", "Shard"]
        assert not _equal_dicts(res["dcp"]["fsdp2_hsdp"], res["dcp"]["saved"][0])


def test_dcp_resume_at_1x2_equals_reference(runs):
    ref = _reference([(R, S), (R, S), (1, 2), (1, 2)])
    for rank in (0, 1):
        d = runs[rank]["dcp"]
        assert all(torch.equal(d["1x2_losses"][i], ref["losses"][2 + i][rank]) for i in range(2))
        assert not _equal_dicts(d["1x2_params"], ref["params"])


def test_inconsistent_groups_are_refused(runs):
    msgs = runs[0]["refusals"]
    assert "process_group and mesh" in msgs["mesh_and_group"]
    assert "shard_group without its partner" in msgs["half_pair"]
    assert "mesh and replicate_group and shard_group" in msgs["mesh_and_groups"]
    assert "share ranks" in msgs["same_group_twice"]
    for res in runs:  # every rank finds it (the check gathers each replica's shard group)
        assert "a (replicate, shard) mesh needs shard groups" in res["refusals"]["not_a_mesh"], res["refusals"]
