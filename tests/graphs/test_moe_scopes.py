"""The dropless MoE under graphs on 2 Gloo ranks (protocol backend): Megatron's scopes, ``moe``, full iteration.

Model: the reference GPT, 2 layers (``layers.1`` is a dropless MoE, 4 experts, top-2), fp32, Adam. Trained by
the alignment checker (``check_alignment``: eager, then graphed from step 2; every loss and every final
parameter ``torch.equal`` on every rank) under this project's ``megatron_fsdp`` and under PyTorch FSDP2:

- ``attn moe_router moe_preprocess`` with ``moe_experts="split"`` (the experts' ``counts.tolist()`` and
  per-expert matmuls run eagerly between the preprocess graph and the next layer's attention graph) and with
  ``grouped_mm``: bit-exact, every selected callable replayed;
- ``moe`` (the whole MoE block in one graph) with ``grouped_mm`` and with ``capacity`` (drop-and-pad, factor 1):
  bit-exact;
- negative control: the preprocess graph's outputs scaled by 1.01 after capture are detected and blamed;
- ``moe`` with ``split`` refused when PartialCudaGraphs selects it, naming the callable, the experts and the fix.

Full iteration (``FullIterationCudaGraph``, protocol backend, ``megatron_fsdp``): ``grouped_mm`` bit-exact to
the eager loop; ``split`` refused when built.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
ROWS = 2  # sequences per rank per step
STEPS = 5
CAPTURE_AT = 2
SCOPE = ["attn", "moe_router", "moe_preprocess"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, moe_every=2, num_experts=4,
             moe_top_k=2)
MEGATRON_CALLABLES = ["layers.0.attn", "layers.1.attn", "layers.1.moe.router", "layers.1.moe.preprocess"]


def _factory(experts: str):
    from fsdp_cudagraph.apps.model import GPTConfig, moe_checker_spec

    return lambda device: moe_checker_spec(GPTConfig(moe_experts=experts, **MODEL), device, micro_batch_size=ROWS)


def _check(experts: str, scope: List[str], engine: str, perturb=None) -> Dict[str, Any]:
    from fsdp_cudagraph.check import check_alignment

    rep = check_alignment(_factory(experts), steps=STEPS, capture_step=CAPTURE_AT, backend="protocol",
                          cuda_graph_modules=scope, engine=engine, perturb=perturb,
                          device=torch.device("cpu"))  # Gloo ranks, also on a machine with a GPU
    return rep.to_dict()


def _full_iteration(experts: str) -> Dict[str, Any]:
    """FullIterationCudaGraph vs the eager loop, or the refusal when built."""
    from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
    from megatron_fsdp import fully_shard
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = GPTConfig(moe_experts=experts, **MODEL)

    def run(graphed: bool):
        torch.manual_seed(0)
        model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock], sharding_strategy="optim_grads_params",
                            fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        step_fn = lambda m, x, y: loss_fn(m(x), y)  # noqa: E731
        g = None
        if graphed:
            g = FullIterationCudaGraph(model, step_fn, CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                                       cuda_graph_warmup_steps=CAPTURE_AT),
                                       backend="protocol")
        losses = []
        for step in range(STEPS):
            x, y = synthetic_batch(step, ROWS * WORLD, cfg, torch.device("cpu"))
            b = [(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])]
            if g is None:
                loss = step_fn(model, *b[0])
                loss.backward()
                losses.append(loss.detach().reshape(1))
                opt.step()
            else:
                losses.append(g.step(b).reshape(1))
                g.optimizer_step(opt)
            opt.zero_grad()
        return losses, model.full_state_dict(), (g.counters if g is not None else None)

    try:
        graphed = run(True)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None, "eager": run(False), "graphed": graphed}


def _cli() -> Dict[str, Any]:
    """The checker's command line on a factory of apps/model.py, as the GPU commands run it."""
    import json
    import tempfile

    from fsdp_cudagraph.checker.check import main

    import unittest.mock

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/r.json"
        # main() ends by destroying the process group; the rank's harness destroys it itself
        with unittest.mock.patch.object(dist, "destroy_process_group", lambda *a, **k: None):
            rc = main(["--model", "fsdp_cudagraph.apps.model:moe_split", "--modules", *SCOPE, "--steps", "4",
                       "--capture-step", "2", "--device", "cpu", "--json", path])
        rep = None
        if dist.get_rank() == 0:
            with open(path) as f:
                rep = json.load(f)
        return {"rc": rc, "report": rep}


def _job(rank: int, world: int) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import GPT, GPTConfig

    out: Dict[str, Any] = {}
    for engine in ("megatron_fsdp", "fsdp2"):
        out[(engine, "split", "megatron")] = _check("split", SCOPE, engine)
        out[(engine, "grouped_mm", "megatron")] = _check("grouped_mm", SCOPE, engine)
        out[(engine, "grouped_mm", "moe")] = _check("grouped_mm", ["moe"], engine)
        out[(engine, "capacity", "moe")] = _check("capacity", ["moe"], engine)
    out["perturbed"] = _check("split", SCOPE, "megatron_fsdp", perturb="layers.1.moe.preprocess")
    try:
        PartialCudaGraphs(GPT(GPTConfig(moe_experts="split", **MODEL)),
                          CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["moe"]), backend="protocol")
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    out["full_grouped_mm"] = _full_iteration("grouped_mm")
    out["full_split"] = _full_iteration("split")
    out["cli"] = _cli()
    return out


@pytest.fixture(scope="module")
def ranks() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("engine", ["megatron_fsdp", "fsdp2"])
@pytest.mark.parametrize("experts,scope", [("split", "megatron"), ("grouped_mm", "megatron"), ("grouped_mm", "moe"),
                                           ("capacity", "moe")])
def test_moe_graphs_bit_exact(ranks, engine, experts, scope):
    for res in ranks:
        rep = res[(engine, experts, scope)]
        assert rep["equal"] and rep["params_equal"], rep
        assert rep["first_mismatch_step"] is None and len(rep["steps"]) == STEPS
        want = MEGATRON_CALLABLES if scope == "megatron" else ["layers.1.moe"]
        assert sorted(rep["callables"]) == sorted(want), rep["callables"]
        assert all(rep["calls"][n]["replays"] == STEPS - CAPTURE_AT for n in want), rep["calls"]


def test_perturbed_preprocess_graph_is_detected_and_named(ranks):
    for res in ranks:
        rep = res["perturbed"]
        assert not rep["equal"] and not rep["params_equal"]
        assert rep["first_mismatch_step"] == CAPTURE_AT
        assert rep["culprit"] == "layers.1.moe.preprocess", rep["culprit"]


def test_checker_command_line_on_the_moe_factory(ranks):
    assert all(r["cli"]["rc"] == 0 for r in ranks), [r["cli"] for r in ranks]
    rep = ranks[0]["cli"]["report"]
    assert rep is not None and rep["equal"] and rep["params_equal"], rep


def test_whole_moe_with_host_sync_experts_is_refused(ranks):
    for res in ranks:
        msg = res["refused"]
        assert msg is not None
        for words in ("'layers.1.moe'", "'layers.1.moe.experts'", "counts.tolist()", "moe_experts='grouped_mm'",
                      "'moe_router', 'moe_preprocess'"):
            assert words in msg, (words, msg)


def test_full_iteration_grouped_mm_bit_exact(ranks):
    for res in ranks:
        run = res["full_grouped_mm"]
        assert run["error"] is None, run["error"]
        (el, es, _), (gl, gs, counters) = run["eager"], run["graphed"]
        assert len(el) == len(gl) == STEPS and all(torch.equal(a, b) for a, b in zip(el, gl)), (el, gl)
        assert es.keys() == gs.keys() and all(torch.equal(es[k], gs[k]) for k in es)
        assert counters["train_replays"] == STEPS - CAPTURE_AT and counters["train_fallbacks"] == 0, counters


def test_full_iteration_split_refused(ranks):
    for res in ranks:
        msg = res["full_split"]["error"]
        assert msg is not None and "FullIterationCudaGraph's model" in msg and "layers.1.moe.experts" in msg, msg
