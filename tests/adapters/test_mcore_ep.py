"""megatron-core's GPTModel with expert parallelism (``expert_model_parallel_size`` > 1) under our engine, on Gloo.

The model is ``fsdp_cudagraph.apps.mcore_gpt``'s dropless MoE (4 experts, top-2, local spec: ``SequentialMLP``,
``TopKRouter``), built after ``parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)``, so each
rank builds its ``4 / EP`` local experts (``local_experts.0 ..`` on every EP rank) and the dispatcher exchanges
tokens over megatron-core's EP group. The engine (``megatron_fsdp.fully_shard``, ZeRO-3, double buffer) gets
megatron-core's own groups (``ModelSpec.expert_groups``: ``get_expert_model_parallel_group()``,
``get_expert_data_parallel_group()``); every rank trains its own micro-batch. Two spawned jobs (module fixtures):
2 ranks at EP=2 and 4 ranks at EP=2. What must hold:

- megatron-core's layout is the engine's ([Note: expert parallelism] in megatron_fsdp/_expert.py): EP groups
  contiguous ({0,1}; {0,1},{2,3}), EDP groups strided ({0},{1}; {0,2},{1,3}), and the engine holds exactly those;
- the experts are sharded over the EDP group only: each rank holds ``4 / EP`` local experts, every layer's
  expert bucket names only them, its flat shard count (``shard_size``) is ``W / EP`` and its group is
  megatron-core's EDP group; the dense buckets are sharded over all ``W`` ranks;
- graphed (scope ``attn_router``: ``self_attention`` and ``mlp.router`` graphed, dispatch, experts and combine
  eager between graphs; protocol backend) against eager: every loss and final parameter ``torch.equal`` on
  every rank, every call after capture replayed, with the alltoall and (2 ranks) the allgather dispatcher;
- negative control: the last router's graph scaled by 1.01 is named as the culprit;
- against EP=1 (same ranks, same batches, the EP=1 model's weights with each EP rank's experts sliced out of it,
  megatron-core's local index ``i`` on EP rank ``q`` being global expert ``q * 4/EP + i``): every rank's losses
  and final parameters within ``RTOL`` ([Note: mcore EP tolerance]), the EP ranks' experts together being every
  global expert; a router weight nudged by 1e-3 is not within it (2 ranks);
- misuse refused with the value, the rule and the fix: EP on the dense model, EP not dividing the experts or the
  world size, engine fsdp2 with EP (the app and the checker's builder), NVIDIA's engine on expert groups whose
  model has no parameter named ``*.experts.*`` (NVIDIA's test for an expert), NVIDIA's ``mcore`` wrapper on
  groups other than parallel_state's.

[Note: mcore EP tolerance]
fp32, deterministic. EP=2 computes every token's forward from the same weights as EP=1; what differs is where the
sums run: an expert's rows arrive from both ranks of its EP group and its weight gradient is one matmul over all of
them, summed over the EDP group by the engine, where EP=1 sums each rank's rows and reduce-scatters the partial
sums over all ranks. That regroups fp32 additions: a few ulp per gradient element. Adam would amplify an ulp
where a gradient element nearly cancels (its first update is ``lr * g / (|g| + eps)``), so these runs use
``eps = 1e-3`` as tests/engine/test_ep_training.py does and for the same reason. Measured (4 steps, torch 2.13 CPU,
megatron-core 0.16.1): on 2 ranks the losses bit-equal and the parameters within 2.3e-7 relative (the largest
difference over the tensor's largest magnitude); on 4 ranks losses within 9.8e-8 and parameters within 2.0e-7;
not ``torch.equal``. ``RTOL = 2e-6`` leaves a margin of about 9x; the negative control (one router weight of the
EP run nudged by 1e-3 before training, 2 ranks) moves the parameters by 1.8e-2 relative, and must exceed
``1000 * RTOL``.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps import mcore_gpt
from tests.dist_utils import outcome, run_gloo

pytestmark = pytest.mark.skipif(not mcore_gpt.HAS_MCORE, reason=mcore_gpt.MCORE_REASON)

CPU = torch.device("cpu")
STEPS = 5
CAPTURE_AT = 2
AGREE_STEPS = 4
RTOL = 2e-6
SEED = 1234
LAYERS = ["decoder.layers.0", "decoder.layers.1"]
CALLABLES = [f"{l}.{m}" for l in LAYERS for m in ("self_attention", "mlp.router")]
LOCAL_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.local_experts\.)(?P<i>\d+)(?P<rest>\..*)$")


def _shape(model: str, ep: int) -> mcore_gpt.MCoreShape:
    return mcore_gpt.base_shape(CPU, model, expert_parallel_size=ep)


def _check(model: str, ep: int, perturb: Optional[str] = None) -> Dict[str, Any]:
    report = mcore_gpt.run(model=model, engine="megatron_fsdp", scope="attn_router", device=CPU, steps=STEPS,
                           capture_step=CAPTURE_AT, backend="protocol", perturb=perturb, shape=_shape(model, ep))
    return {"equal": report.equal, "params_equal": report.params_equal, "steps": report.steps,
            "callables": report.callables, "calls": report.calls, "culprit": report.culprit,
            "precision": report.precision}


def _layout(ep: int) -> Dict[str, Any]:
    """megatron-core's groups and the engine's, and how the engine sharded the experts."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp import fully_shard

    spec = mcore_gpt.spec("moe_alltoall", CPU, _shape("moe_alltoall", ep))
    ep_group, edp_group = spec.expert_groups
    sharded = fully_shard(spec.model, fsdp_unit_modules=[TransformerLayer], sharding_strategy="optim_grads_params",
                          fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                          expert_parallel_group=ep_group, expert_data_parallel_group=edp_group)
    ranks = dist.get_process_group_ranks
    units = [{"name": u.name, "is_expert": u.is_expert, "shard_size": u.shard_size, "group": ranks(u.group),
              "names": list(u.layout.names), "shard_numel": u.main_shard.numel(),
              "total_numel": u.layout.total_numel} for u in sharded.units]
    return {"mcore_ep": ranks(ps.get_expert_model_parallel_group()),
            "mcore_edp": ranks(ps.get_expert_data_parallel_group()),
            "engine_ep": ranks(sharded.expert_parallel_group), "engine_edp": ranks(sharded.expert_data_parallel_group),
            "num_local_experts": [layer.mlp.num_local_experts for layer in spec.model.decoder.layers],
            "units": units}


# ---------------------------------------------------------------------------------------------- against EP=1


def _global_name(name: str, ep_rank: int, num_local: int) -> str:
    """A local expert's parameter name -> the EP=1 model's name of the same global expert."""
    m = LOCAL_EXPERT.match(name)
    if m is None:
        return name
    return f"{m.group('prefix')}{ep_rank * num_local + int(m.group('i'))}{m.group('rest')}"


def _train_plain(ep: int, start: Dict[str, torch.Tensor], *, nudge_router: bool = False
                 ) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Train the model at ``ep`` from the EP=1 weights ``start`` (its experts sliced for this EP rank); this rank's
    losses and final parameters, the experts renamed to their global index."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp import fully_shard

    shape = _shape("moe_alltoall", ep)
    mcore_gpt.init_parallel_state(SEED, CPU, ep)
    torch.manual_seed(SEED)
    model = mcore_gpt.build(shape, CPU)
    ep_rank, num_local = ps.get_expert_model_parallel_rank(), shape.num_experts // ep
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[_global_name(n, ep_rank, num_local)])
        if nudge_router:
            model.decoder.layers[1].mlp.router.weight[0, 0] += 1e-3
    groups = mcore_gpt.expert_groups()
    kw = {} if groups is None else dict(expert_parallel_group=groups[0], expert_data_parallel_group=groups[1])
    sharded = fully_shard(model, fsdp_unit_modules=[TransformerLayer], sharding_strategy="optim_grads_params",
                          fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True, **kw)
    opt = torch.optim.Adam(sharded.optimizer_parameters(), lr=1e-3, eps=1e-3)  # [Note: mcore EP tolerance]
    losses = []
    for step in range(AGREE_STEPS):
        loss = mcore_gpt.loss(sharded, mcore_gpt.batch(step, shape, CPU, seed=SEED))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    with sharded.summon_full_params():  # state_dict() refuses names that repeat across EP ranks (local_experts.0)
        params = {_global_name(n, ep_rank, num_local): p.detach().clone() for n, p in sharded.module.named_parameters()}
    return losses, params


def _agreement(ep: int, *, control: bool) -> Dict[str, Any]:
    mcore_gpt.init_parallel_state(SEED, CPU, 1)
    torch.manual_seed(SEED)
    start = {n: p.detach().clone() for n, p in mcore_gpt.build(_shape("moe_alltoall", 1), CPU).named_parameters()}
    ref_losses, ref = _train_plain(1, start)
    out: Dict[str, Any] = {}
    for name, nudge in (("ep", False), ("nudged", True))[:2 if control else 1]:
        losses, params = _train_plain(ep, start, nudge_router=nudge)
        out[name] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param": max(float((params[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in params),
            "names": sorted(params)}
    out["ref_names"] = sorted(ref)
    return out


# ---------------------------------------------------------------------------------------------- misuse


def _misuse() -> Dict[str, str]:
    from megatron.core import parallel_state as ps

    from fsdp_cudagraph.check import check_alignment
    from fsdp_cudagraph.engines.registry import registered_builders

    out: Dict[str, str] = {}

    def catch(key: str, fn: Any, *exc: type) -> None:
        out[key] = outcome(fn, *exc)

    catch("app_fsdp2", lambda: mcore_gpt.run(model="moe_alltoall", engine="fsdp2", scope="attn_router", device=CPU,
                                             shape=_shape("moe_alltoall", 2)), NotImplementedError)
    catch("checker_fsdp2", lambda: check_alignment(mcore_gpt.moe_alltoall_ep, steps=3, capture_step=1,
                                                   backend="protocol", device=CPU, engine="fsdp2",
                                                   cuda_graph_modules=["attn", "moe_router"]), NotImplementedError)
    catch("world", lambda: mcore_gpt.init_parallel_state(SEED, CPU, 4), ValueError)
    # NVIDIA's builder refuses before it builds NVIDIA's engine (so on the CPU too)
    nvidia = registered_builders()["nvidia"]
    spec = mcore_gpt.spec("moe_alltoall", CPU, _shape("moe_alltoall", 2))
    ep_group, edp_group = spec.expert_groups
    common = dict(unit_modules=["TransformerLayer"], make_optimizer=lambda ps_: torch.optim.Adam(ps_), device=CPU,
                  sharding_strategy="optim_grads_params", compute_dtype=None)
    catch("nvidia_mcore_groups", lambda: nvidia.build(spec.model, options={"wrapper": "mcore"},
                                                      expert_groups=(edp_group, ep_group), **common), ValueError)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    catch("nvidia_unmarked", lambda: nvidia.build(plain, expert_groups=(ep_group, edp_group),
                                                  **dict(common, unit_modules=[torch.nn.Linear])), ValueError)
    assert ps.get_expert_model_parallel_world_size() == 2
    return out


# ---------------------------------------------------------------------------------------------- the jobs


def _job(rank: int, world: int, ep: int) -> Dict[str, Any]:
    with mcore_gpt.cpu_shims():
        res: Dict[str, Any] = {"layout": _layout(ep), "alltoall": _check("moe_alltoall", ep),
                               "perturbed": _check("moe_alltoall", ep, perturb="decoder.layers.1.mlp.router"),
                               "agreement": _agreement(ep, control=world == 2)}
        if world == 2:
            res["allgather"] = _check("moe_allgather", ep)
            res["misuse"] = _misuse()
        else:
            res["nvidia_mesh"] = _nvidia_expert_mesh()
    return res


def _nvidia_expert_mesh() -> Dict[str, Any]:
    """The expert device mesh the nvidia builder hands NVIDIA's fully_shard (built from megatron-core's groups; the
    engine itself needs CUDA, the mesh does not)."""
    from fsdp_cudagraph.engines.nvidia.build import _expert_mesh

    mcore_gpt.init_parallel_state(SEED, CPU, 2)
    mesh = _expert_mesh(CPU, mcore_gpt.expert_groups())
    ranks = dist.get_process_group_ranks
    return {"names": list(mesh.mesh_dim_names), "shape": list(mesh.mesh.shape),
            "fsdp": ranks(mesh["fsdp"].get_group()), "tp": ranks(mesh["tp"].get_group())}


@pytest.fixture(scope="module")
def two() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2, 2)


@pytest.fixture(scope="module")
def four() -> List[Dict[str, Any]]:
    return run_gloo(_job, 4, 2)


JOBS = ["two", "four"]


@pytest.mark.gloo
@pytest.mark.parametrize("job", JOBS)
def test_megatron_core_groups_are_the_engines_layout(job: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(job)
    world, ep = len(results), 2
    for rank, r in enumerate(results):
        lay = r["layout"]
        first = rank // ep * ep
        assert lay["mcore_ep"] == lay["engine_ep"] == list(range(first, first + ep)), (rank, lay)  # contiguous
        assert lay["mcore_edp"] == lay["engine_edp"] == list(range(rank % ep, world, ep)), (rank, lay)  # strided


@pytest.mark.gloo
@pytest.mark.parametrize("job", JOBS)
def test_experts_sharded_over_the_edp_group_only(job: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(job)
    world, ep, experts = len(results), 2, 4
    for rank, r in enumerate(results):
        lay = r["layout"]
        assert lay["num_local_experts"] == [experts // ep] * len(LAYERS)
        expert_units = [u for u in lay["units"] if u["is_expert"]]
        assert [u["name"] for u in expert_units] == [f"{l} [experts]" for l in LAYERS], lay["units"]
        for u in expert_units:
            assert u["shard_size"] == world // ep and u["group"] == lay["mcore_edp"], u
            assert u["shard_numel"] * (world // ep) == u["total_numel"], u
            indices = {int(LOCAL_EXPERT.match(n).group("i")) for n in u["names"]}
            assert indices == set(range(experts // ep)) and all(".experts." in n for n in u["names"]), u["names"]
        for u in lay["units"]:
            if not u["is_expert"]:
                assert u["shard_size"] == world and u["group"] == list(range(world)), u
                assert not any(".experts." in n for n in u["names"]), u["names"]


def _assert_equal(results: List[Dict[str, Any]], key: str) -> None:
    for rank, r in enumerate(results):
        rep = r[key]
        assert rep["callables"] == CALLABLES, (rank, rep["callables"])
        assert len(rep["steps"]) == STEPS and all(s["equal"] for s in rep["steps"]), (rank, rep["steps"])
        assert rep["equal"] and rep["params_equal"], (rank, rep)
        assert "expert parallel 2" in rep["precision"], rep["precision"]
        for name, c in rep["calls"].items():
            assert c["replays"] == STEPS - CAPTURE_AT and c["eager_calls"] == 0, (rank, name, c)
    # each rank trained its own micro-batch
    assert len({r[key]["steps"][0]["eager_loss"] for r in results}) == len(results)


@pytest.mark.gloo
@pytest.mark.parametrize("job", JOBS)
def test_attn_router_graphs_bit_exact_at_ep2(job: str, request: pytest.FixtureRequest) -> None:
    _assert_equal(request.getfixturevalue(job), "alltoall")


@pytest.mark.gloo
def test_allgather_dispatcher_bit_exact_at_ep2(two: List[Dict[str, Any]]) -> None:
    _assert_equal(two, "allgather")


@pytest.mark.gloo
@pytest.mark.parametrize("job", JOBS)
def test_perturbed_router_is_named(job: str, request: pytest.FixtureRequest) -> None:
    for r in request.getfixturevalue(job):
        rep = r["perturbed"]
        assert not rep["equal"] and not rep["params_equal"]
        assert all(s["equal"] for s in rep["steps"][:CAPTURE_AT]) and not rep["steps"][CAPTURE_AT]["equal"]
        assert rep["culprit"] == "decoder.layers.1.mlp.router"


@pytest.mark.gloo
@pytest.mark.parametrize("job", JOBS)
def test_agrees_with_ep1(job: str, request: pytest.FixtureRequest) -> None:
    """[Note: mcore EP tolerance]: the EP=2 run from the EP=1 weights stays within RTOL of EP=1; a router weight
    nudged by 1e-3 does not."""
    for rank, r in enumerate(request.getfixturevalue(job)):
        a = r["agreement"]
        assert set(a["ep"]["names"]) <= set(a["ref_names"]), sorted(set(a["ep"]["names"]) - set(a["ref_names"]))
        assert a["ep"]["loss"] <= RTOL and a["ep"]["param"] <= RTOL, (rank, a["ep"]["loss"], a["ep"]["param"])
        if "nudged" in a:  # the control runs on 2 ranks (the same code path; 4 ranks would add 15 s)
            assert a["nudged"]["param"] > 1000 * RTOL, (rank, a["nudged"])


@pytest.mark.gloo
def test_nvidia_expert_mesh_is_the_edp_group(four: List[Dict[str, Any]]) -> None:
    """NVIDIA's fully_shard shards ``*.experts.*`` parameters over its expert mesh's ``fsdp`` dimension: the builder
    makes that dimension megatron-core's EDP group, with a trivial ``tp`` dimension."""
    for rank, r in enumerate(four):
        m = r["nvidia_mesh"]
        assert m == {"names": ["fsdp", "tp"], "shape": [2, 1], "fsdp": [rank % 2, rank % 2 + 2], "tp": [rank]}, m


@pytest.mark.gloo
def test_every_global_expert_is_checked(two: List[Dict[str, Any]]) -> None:
    """The EP ranks' experts, renamed to their global index, are together the EP=1 model's parameters."""
    names = set().union(*(r["agreement"]["ep"]["names"] for r in two))
    assert names == set(two[0]["agreement"]["ref_names"])


@pytest.mark.gloo
def test_misuse_refused(two: List[Dict[str, Any]]) -> None:
    m = two[0]["misuse"]
    assert m["app_fsdp2"].startswith("NotImplementedError") and "expert_parallel_size=2" in m["app_fsdp2"] \
        and "--engine megatron_fsdp" in m["app_fsdp2"], m["app_fsdp2"]
    assert m["checker_fsdp2"].startswith("NotImplementedError") and "EP=2" in m["checker_fsdp2"] \
        and "Megatron-LM" in m["checker_fsdp2"], m["checker_fsdp2"]
    assert m["world"].startswith("ValueError") and "does not divide the world size 2" in m["world"], m["world"]
    assert "are not megatron-core's parallel-state groups" in m["nvidia_mcore_groups"], m["nvidia_mcore_groups"]
    assert "'.experts.'" in m["nvidia_unmarked"] and "EP=2" in m["nvidia_unmarked"], m["nvidia_unmarked"]


@pytest.mark.parametrize("kw,words", [
    (dict(model="dense", expert_parallel_size=2), "on the dense model"),
    (dict(model="moe_alltoall", expert_parallel_size=3), "does not divide num_experts=4"),
    (dict(model="moe_alltoall", expert_parallel_size=0), "positive integer"),
])
def test_shape_refusals(kw: Dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        mcore_gpt.base_shape(CPU, kw.pop("model"), **kw)


def test_world_and_engine_refusals_without_a_group() -> None:
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        mcore_gpt.check_expert_parallel_world(4, 6)
    mcore_gpt.check_expert_parallel_world(2, 4)
    with pytest.raises(NotImplementedError, match="Megatron-LM refuses --use-torch-fsdp2"):
        mcore_gpt.check_engine_expert_parallel("fsdp2", 2)
    for engine in ("megatron_fsdp", "nvidia"):
        mcore_gpt.check_engine_expert_parallel(engine, 2)
    mcore_gpt.check_engine_expert_parallel("fsdp2", 1)
