"""PyTorch FSDP2 with expert parallelism (torchtitan's layout) under partial graphs: Gloo, CPU, protocol backend.

Two spawned jobs (module fixtures), on 4 ranks and on 2. Model: the reference GPT, 2 layers, every layer a dropless
MoE with 4 experts, top-2, ``split`` experts, fp32, Adam (``eps=1e-3``, [Note: EP tolerance of the GPT] in
``tests/graphs/test_moe_ep.py``), clipped every step to ``MAX_NORM`` by ``engines.fsdp2.clip_grad_norm_``. Sharded
with ``shard_fsdp2(model, layers, expert_parallel_size=EP)`` (each ``experts`` module its own ``fully_shard`` over
the expert-data-parallel mesh with the gradient divide factor ``W``; layers and root over the world) and
``keep_unsharded_storage``. Each rank trains its slice of one global batch per step. What must hold:

- EP=2 (2 and 4 ranks) and EP=4 (4 ranks) against FSDP2 at EP=1 on the same ranks and batches: every global loss,
  every step's gradient norm (before clipping) and every final parameter (experts merged over the EP group with
  ``merge_expert_state_dicts``) within ``RTOL``, and the first step's inf-norm; at EP=1 (one mesh) the norm is
  torch's ``get_total_norm`` of the DTensor gradients;
- graphed (``PartialCudaGraphs``, scopes ``attn moe_router moe_preprocess``, capture at ``CAPTURE_AT``, the experts
  and their FSDP2 group eager between graphs), with kept storage and with two slots, against eager at the same EP:
  every loss, norm and final parameter ``torch.equal``, every callable replayed, every group resharded between
  steps, the experts' DTensors on the strided EDP ranks;
- negative controls: the experts' divide factor put back to FSDP2's default (an average over the EDP mesh) fails the
  EP=1 comparison (norms and parameters); a router weight nudged by 1e-3 fails it; each rank holding the next EP
  rank's experts fails it;
- misuse refused with the value, the rule and the fix: EP not dividing the world; HSDP with EP; the model's EP
  group strided (not the mesh's contiguous row); EP=2 experts sharded at ``expert_parallel_size=1`` (what FSDP2
  did silently before: each rank gathered a mix of two ranks' experts); ``expert_parallel_size=2`` on an EP=1
  model; ``state_dict()``, ``load_state_dict()``, DCP's ``get_model_state_dict`` and ``get_state_dict``; scope
  ``moe`` and whole layers; torch's ``clip_grad_norm_`` on the two meshes fails loudly ("must have the same mesh");
- the alignment checker with ``engine="fsdp2"`` and ``engine_options={"expert_parallel_size": 2}`` (the builder's
  path; kept storage and slots) finds graphed equal to eager.

[Note: FSDP2 EP tolerance]
fp32, deterministic. As under megatron_fsdp ([Note: EP tolerance of the GPT]) every token's forward runs on the
same rows at any EP; what differs is the grouping of the experts' gradient sums (per rank then reduce-scatter over
the world at EP=1; the owner's one matmul over its EP group, then SUM over EDP and a division by ``W`` at EP=k)
(and the batch size of the experts' matmuls), so the rounding of the gradient norm and of every later step.
Measured (4 steps, torch 2.13 CPU; ``test_measured_distances`` prints them with ``-s``): losses equal, norms within
1.1e-7 relative, parameters within 2.9e-7 (the maximum difference over the tensor's largest magnitude; 2.8e-7 at
EP=2 and 2.2e-7 at EP=4 on 4 ranks, 2.9e-7 on 2); not ``torch.equal``. ``RTOL = 2e-6`` leaves a margin of about 7x.
The negative controls: the default divide factor moves the norms by 18% and the parameters by 7e-2; a router
weight nudged by 1e-3 the parameters by 5.6e-3 (the norms by only 4e-6); experts on the wrong ranks, 1.6.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from fsdp_cudagraph.apps.model import GPTConfig, slice_expert_state_dict
from tests.dist_utils import run_gloo
from tests.graphs.test_moe_ep import _full_params, _rel  # EP runs merged to the EP=1 shape, relative distance

pytestmark = pytest.mark.gloo

RTOL = 2e-6
STEPS = 4
CAPTURE_AT = 2
ROWS = 2  # sequences per rank per step
MAX_NORM = 0.5
SCOPE = ["attn", "moe_router", "moe_preprocess"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, moe_every=1, num_experts=4,
             moe_top_k=2, ffn_hidden_size=48)
CALLABLES = sorted(f"layers.{i}.{m}" for i in range(2) for m in ("attn", "moe.router", "moe.preprocess"))


def _cfg(ep: int) -> GPTConfig:
    return GPTConfig(moe_experts="split", expert_parallel_size=ep, **MODEL)


def _model(ep: int, *, group: Any = None, wrong_rank: bool = False, nudge_router: bool = False):
    import torch.distributed as dist

    import megatron_fsdp

    from fsdp_cudagraph.apps.model import GPT

    if group is None and ep > 1:
        group = megatron_fsdp.expert_parallel_groups(ep)[0]
    torch.manual_seed(0)
    model = GPT(_cfg(ep), expert_parallel_group=group)
    with torch.no_grad():
        if wrong_rank:  # every rank holds the next EP rank's experts
            torch.manual_seed(0)
            full = GPT(_cfg(1)).state_dict()
            q = (dist.get_rank(group) + 1) % ep
            model.load_state_dict(slice_expert_state_dict(full, expert_parallel_size=ep, ep_rank=q))
        if nudge_router:
            model.layers[1].moe.router.gate.weight[0, 0] += 1e-3
    return model


def _build(ep: int, *, default_factor: bool = False, storage: str = "keep", **kw: Any):
    from fsdp_cudagraph import keep_unsharded_storage, use_unsharded_slots
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    model = _model(ep, **kw)
    shard_fsdp2(model, list(model.layers), expert_parallel_size=ep)
    if default_factor:  # negative control: FSDP2's default, an average over the experts' own (EDP) mesh
        for layer in model.layers:
            layer.moe.experts.set_gradient_divide_factor(None)
            layer.moe.experts.set_force_sum_reduction_for_comms(False)
    if storage == "slots":
        use_unsharded_slots(model)
    else:
        keep_unsharded_storage(model)
    return model


def _train(rank: int, world: int, ep: int, *, graphed: bool = False, **build: Any) -> Dict[str, Any]:
    import torch.distributed as dist

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch
    from fsdp_cudagraph.engines.fsdp2 import clip_grad_norm_, grad_norm

    model = _build(ep, **build)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-3)
    graphs = None
    if graphed:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=SCOPE),
                                   backend="protocol")
    losses: List[float] = []
    norms: List[float] = []
    torch_norms: List[float] = []
    report = None
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            report = graphs.capture()
        x, y = synthetic_batch(step, ROWS * world, _cfg(1), torch.device("cpu"))
        sl = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = loss_fn(model(x[sl]), y[sl])
        loss.backward()
        if ep == 1:  # one mesh: torch's own clipping is the reference norm
            torch_norms.append(float(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters()]).full_tensor()))
        if step == 0:
            inf_norm = float(grad_norm(model, float("inf")))
        norms.append(float(clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    from torch.distributed.tensor import DTensor

    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    out: Dict[str, Any] = {"losses": losses, "norms": norms, "params": params, "torch_norms": torch_norms,
                           "inf_norm": inf_norm,
                           # between steps every group, the experts' included, is resharded: DTensors registered
                           "resharded": all(isinstance(p, DTensor) for p in model.parameters()),
                           "experts_mesh": [model.layers[i].moe.experts.w1.device_mesh.mesh.flatten().tolist()
                                            for i in range(2)]}
    if graphs is not None:
        out["callables"] = sorted(report.callables)
        out["replays"] = {c.name: c.module.__dict__["forward"].replays for c in graphs.callables}
        graphs.delete()
    return out


def _refused(fn) -> Optional[str]:
    try:
        fn()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _refusals(rank: int, world: int) -> Dict[str, Optional[str]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    out: Dict[str, Optional[str]] = {}
    out["ep3"] = _refused(lambda: shard_fsdp2(_model(1), expert_parallel_size=3))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = _refused(lambda: shard_fsdp2(_model(2), mesh=hsdp, expert_parallel_size=2))
    strided = None
    for members in ([0, 2], [1, 3]):  # every rank creates every group
        g = dist.new_group(members)
        if rank in members:
            strided = g
    out["strided"] = _refused(lambda: shard_fsdp2(_model(2, group=strided), expert_parallel_size=2))
    out["ep_left_at_1"] = _refused(lambda: shard_fsdp2(_model(2)))
    out["ep2_on_ep1_model"] = _refused(lambda: shard_fsdp2(_model(1), expert_parallel_size=2))
    model = _build(2)
    out["state_dict"] = _refused(lambda: model.state_dict())
    out["load_state_dict"] = _refused(lambda: model.load_state_dict({}))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out["dcp"] = _refused(lambda: get_model_state_dict(model))
    out["dcp_with_optimizer"] = _refused(lambda: get_state_dict(model, torch.optim.Adam(model.parameters())))
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    x, y = synthetic_batch(0, ROWS * world, _cfg(1), torch.device("cpu"))
    loss_fn(model(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS]).backward()
    try:  # torch's clipping on gradients over two meshes: refused by DTensor, loudly (our clip_grad_norm_ instead)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip"] = None
    except RuntimeError as exc:
        out["torch_clip"] = str(exc)
    for name, modules in (("moe", ["moe"]), ("layers", [])):
        out[name] = _refused(lambda: PartialCudaGraphs(model, CudaGraphConfig(
            cuda_graph_impl="local", cuda_graph_modules=modules), backend="protocol"))
    out["rank"] = rank  # type: ignore[assignment]
    return out


def _four(rank: int, world: int) -> Dict[str, Any]:
    res: Dict[str, Any] = {"ref": _train(rank, world, 1)}
    for ep in (2, 4):
        res[f"ep{ep}"] = _train(rank, world, ep)
        res[f"ep{ep}/graphed"] = _train(rank, world, ep, graphed=True)
        res[f"ep{ep}/slots/graphed"] = _train(rank, world, ep, graphed=True, storage="slots")
    res["ep2/default_factor"] = _train(rank, world, 2, default_factor=True)
    res["ep2/nudged_router"] = _train(rank, world, 2, nudge_router=True)
    res["ep4/wrong_rank"] = _train(rank, world, 4, wrong_rank=True)
    res["refused"] = _refusals(rank, world)
    return res


def _ep2_spec(device: torch.device) -> Any:
    """A checker factory: the EP=2 GPT, each rank training its slice of the global batch."""
    import torch.distributed as dist

    from fsdp_cudagraph.apps.model import TransformerBlock, loss_fn, synthetic_batch
    from fsdp_cudagraph.check import ModelSpec

    rank, world = dist.get_rank(), dist.get_world_size()

    def batch(step: int) -> Any:
        x, y = synthetic_batch(step, ROWS * world, _cfg(1), device)
        return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
    return ModelSpec(model=_model(2), unit_modules=[TransformerBlock], batch=batch,
                     loss=lambda m, b: loss_fn(m(b[0]), b[1]))


def _checker(rank: int, world: int) -> Dict[str, Any]:
    """The alignment checker under engine fsdp2 with engine_options expert_parallel_size=2 (the builder's path)."""
    from fsdp_cudagraph.check import check_alignment

    out: Dict[str, Any] = {}
    for storage in ("keep", "slots"):
        report = check_alignment(_ep2_spec, steps=4, capture_step=2, backend="protocol", cuda_graph_modules=SCOPE,
                                 engine="fsdp2", engine_options={"storage": storage, "expert_parallel_size": 2},
                                 device=torch.device("cpu"))
        out[storage] = report.equal
    return out


def _two(rank: int, world: int) -> Dict[str, Any]:
    return {"ref": _train(rank, world, 1), "ep2": _train(rank, world, 2), "checker": _checker(rank, world),
            "ep2/graphed": _train(rank, world, 2, graphed=True),
            "ep2/default_factor": _train(rank, world, 2, default_factor=True),
            "ep2/wrong_rank": _train(rank, world, 2, wrong_rank=True)}


@pytest.fixture(scope="module")
def four() -> List[Dict[str, Any]]:
    return run_gloo(_four, 4)


@pytest.fixture(scope="module")
def two() -> List[Dict[str, Any]]:
    return run_gloo(_two, 2)


def _distance(per_rank: List[Dict[str, Any]], run: str, ep: int, ref: str = "ref") -> Dict[str, float]:
    """Worst relative loss, norm and parameter difference of ``run`` against ``ref`` (EP=1)."""
    for r in per_rank:
        assert r[run]["losses"] == per_rank[0][run]["losses"] and r[run]["norms"] == per_rank[0][run]["norms"]
    got, want = _full_params(per_rank, run, ep), _full_params(per_rank, ref, 1)
    assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in want)
    a, b = per_rank[0][run], per_rank[0][ref]
    return {"loss": max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])),
            "norm": max(abs(x - y) / abs(y) for x, y in zip(a["norms"], b["norms"])),
            "param": max(_rel(got[k], want[k]) for k in want)}


def _equal(per_rank: List[Dict[str, Any]], a: str, b: str) -> bool:
    for r in per_rank:
        if r[a]["losses"] != r[b]["losses"] or r[a]["norms"] != r[b]["norms"]:
            return False
        pa, pb = r[a]["params"], r[b]["params"]
        if pa.keys() != pb.keys() or not all(torch.equal(pa[k], pb[k]) for k in pa):
            return False
    return True


def test_measured_distances(four, two):
    """Not a check: the distances behind [Note: FSDP2 EP tolerance] (``pytest -s`` prints them)."""
    for name, per_rank, run, ep in (("4 ranks", four, "ep2", 2), ("4 ranks", four, "ep4", 4),
                                    ("2 ranks", two, "ep2", 2), ("4 ranks", four, "ep2/default_factor", 2),
                                    ("2 ranks", two, "ep2/default_factor", 2),
                                    ("4 ranks", four, "ep2/nudged_router", 2), ("4 ranks", four, "ep4/wrong_rank", 4),
                                    ("2 ranks", two, "ep2/wrong_rank", 2)):
        print(name, run, _distance(per_rank, run, ep))


@pytest.mark.parametrize("world,ep", [(4, 2), (4, 4), (2, 2)])
def test_ep_matches_ep1(four, two, world, ep):
    d = _distance(four if world == 4 else two, f"ep{ep}", ep)
    assert d["loss"] <= RTOL and d["norm"] <= RTOL and d["param"] <= RTOL, d


def test_ep1_norm_is_torchs(four, two):
    """At EP=1 (one mesh) the clipping function's norm is torch's ``get_total_norm`` of the DTensor gradients."""
    for per_rank in (four, two):
        for r in per_rank:
            ref = r["ref"]
            assert max(abs(a - b) / b for a, b in zip(ref["norms"], ref["torch_norms"])) <= 1e-6, ref
            assert ref["norms"][0] > MAX_NORM  # the clipping bites


@pytest.mark.parametrize("world,run", [(4, "ep2"), (4, "ep4"), (2, "ep2")])
def test_graphed_equals_eager(four, two, world, run):
    per_rank = four if world == 4 else two
    assert _equal(per_rank, f"{run}/graphed", run)
    for r in per_rank:
        got = r[f"{run}/graphed"]
        assert got["callables"] == CALLABLES, got["callables"]
        assert sorted(got["replays"]) == CALLABLES
        assert all(n == STEPS - CAPTURE_AT for n in got["replays"].values()), got["replays"]


def test_negative_controls(four, two):
    for per_rank in (four, two):
        d = _distance(per_rank, "ep2/default_factor", 2)  # the factor matters: gradients EP times too large
        assert d["norm"] > 1e3 * RTOL and d["param"] > 1e3 * RTOL, d
    nudged = _distance(four, "ep2/nudged_router", 2)
    assert nudged["param"] > 10 * RTOL, nudged
    for per_rank, run, ep in ((four, "ep4/wrong_rank", 4), (two, "ep2/wrong_rank", 2)):
        wrong = _distance(per_rank, run, ep)
        assert wrong["loss"] > 10 * RTOL and wrong["param"] > 10 * RTOL, wrong


def test_slots_and_resharding(four):
    """The experts' FSDP2 group reshards between steps like every other group (its hooks run eagerly around the
    eager experts); with unsharded-parameter slots (the experts units laid out for the EDP mesh's size, or, at
    EP=4 where that mesh is one rank, held like the root) graphed training equals eager with kept storage."""
    for r in four:
        for run in ("ep2", "ep2/graphed", "ep4/graphed", "ep2/slots/graphed", "ep4/slots/graphed"):
            assert r[run]["resharded"], run
    for q, r in enumerate(four):
        assert r["ep2"]["experts_mesh"] == [[q % 2, q % 2 + 2]] * 2  # the strided EDP ranks
        assert r["ep4"]["experts_mesh"] == [[q]] * 2
    for run in ("ep2", "ep4"):
        assert _equal(four, f"{run}/slots/graphed", run), run


def test_inf_norm_matches_ep1(four, two):
    for per_rank, run in ((four, "ep2"), (four, "ep4"), (two, "ep2")):
        for r in per_rank:
            assert abs(r[run]["inf_norm"] - r["ref"]["inf_norm"]) <= RTOL * r["ref"]["inf_norm"], run


def test_misuse_refused(four):
    for q, r in enumerate(four):
        msg = r["refused"]
        assert msg["ep3"].startswith("ValueError: expert_parallel_size=3 does not divide the world size 4"), msg["ep3"]
        assert "pass a divisor of 4" in msg["ep3"]
        assert msg["hsdp"].startswith("NotImplementedError: expert_parallel_size=2 with a 2-D dense mesh"), msg["hsdp"]
        assert "HSDP without it" in msg["hsdp"]
        mine, mesh_row = [q % 2, q % 2 + 2], [q // 2 * 2, q // 2 * 2 + 1]
        assert (f"[rank {q}] layers.0.moe.experts's ep_group has ranks {mine} but the FSDP2 expert mesh's "
                f"expert-parallel row of this rank is {mesh_row}") in msg["strided"], msg["strided"]
        assert "megatron_fsdp.expert_parallel_groups(2)[0]" in msg["strided"]
        assert (f"[rank {q}] layers.0.moe.experts exchanges tokens over an expert-parallel group of 2 ranks but the "
                "model is sharded with expert_parallel_size=1") in msg["ep_left_at_1"], msg["ep_left_at_1"]
        assert "pass expert_parallel_size=2" in msg["ep_left_at_1"]
        assert "holds every expert" in msg["ep2_on_ep1_model"] and "pass expert_parallel_size=1" in msg["ep2_on_ep1_model"]
        for key, what in (("state_dict", "state_dict()"), ("load_state_dict", "load_state_dict()"),
                          ("dcp", "state_dict()"), ("dcp_with_optimizer", "state_dict()")):
            assert msg[key].startswith(f"NotImplementedError: fsdp_cudagraph: {what} of an FSDP2 model with "
                                       "expert_parallel_size=2"), msg[key]
            assert "merge_expert_state_dicts" in msg[key]
        assert msg["torch_clip"] is not None and "must have the same mesh" in msg["torch_clip"], msg["torch_clip"]
        for key, callable_name in (("moe", "'layers.0.moe'"), ("layers", "'layers.0'")):
            got = msg[key]
            assert got is not None and got.startswith("ValueError: graphed callable " + callable_name), got
            for words in ("'layers.0.moe.experts'", "expert_parallel_size=2", "all_to_all_single",
                          "'attn', 'moe_router', 'moe_preprocess'"):
                assert words in got, (words, got)


def test_checker_with_expert_parallel_engine_option(two):
    """``check_alignment(..., engine="fsdp2", engine_options={"expert_parallel_size": 2})`` shards through the
    builder with EP and finds the graphed run equal to the eager one, with kept storage and with slots."""
    for r in two:
        assert r["checker"] == {"keep": True, "slots": True}, r["checker"]
