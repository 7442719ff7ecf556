"""Activation offloading under megatron_fsdp on 2 Gloo ranks: eager and with partial graphs (protocol backend).

The reference GPT (dense and MoE layers) sharded with ZeRO-3 and the double buffer trains 6 steps, capture
before step 2, in six ways: eager without offloading (the reference), eager with offloading, protocol graphs
of [attn, mlp] without and with offloading of the same modules (groups inside graphs), protocol graphs of
[attn] with the mlp/moe blocks offloaded outside the graphs at fraction 0.5, and whole-layer graphs with
attn/mlp/moe offloaded inside them. Every run's per-step losses and final parameters must equal the
reference's with ``torch.equal`` on every rank: offloading is a copy. One spawned job runs all six.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
from fsdp_cudagraph.offload.offloader import ActivationOffloader
from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

STEPS, CAPTURE_AT, PER_RANK = 6, 2, 4

#: name -> (graphed modules or None for eager, offloaded modules, fraction)
VARIANTS: Dict[str, tuple] = {
    "eager": (None, [], 1.0),
    "eager_offload": (None, ["attn", "mlp", "moe"], 1.0),
    "graphs": (["attn", "mlp"], [], 1.0),
    "graphs_offload_inside": (["attn", "mlp"], ["attn", "mlp"], 1.0),
    "graphs_offload_outside": (["attn"], ["mlp", "moe"], 0.5),
    "layer_graphs_offload_inside": ([], ["attn", "mlp", "moe"], 1.0),
}


def _run(rank: int, world: int, graph: Optional[List[str]], offload: List[str], fraction: float) -> Dict[str, Any]:
    cfg = GPTConfig(moe_every=2)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    config = CudaGraphConfig(
        cuda_graph_impl="local" if graph is not None else "none", cuda_graph_modules=graph or [],
        cuda_graph_warmup_steps=CAPTURE_AT, use_megatron_fsdp=True, fsdp_double_buffer=True,
        fsdp_db_use_persist_buf_on_alloc_fail=True, activation_offload_modules=offload,
        activation_offload_fraction=fraction, activation_offload_min_bytes=0,
    )
    graphs = PartialCudaGraphs(model, config, backend="protocol") if graph is not None else None
    off = graphs.offload if graphs is not None else (ActivationOffloader.from_config(model, config) if offload else None)
    losses = []
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            graphs.capture()
        x, y = synthetic_batch(step, PER_RANK * world, cfg, torch.device("cpu"))
        loss = loss_fn(model(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    info = None
    if off is not None:
        info = {"records": [(r.name, r.graphed_in, r.offload, r.total_bytes) for r in off.records],
                "captured_bytes": off.captured_bytes, "allocations": off.pool.num_allocations,
                "in_use": off.pool.num_in_use,
                "num_captured": sum(len(b) for r in off.records for b in (r.captured or {}).values())}
    state = model.full_state_dict()
    if graphs is not None:
        graphs.delete()
    elif off is not None:
        off.delete()
    return {"losses": losses, "state": state, "info": info}


def _job(rank: int, world: int) -> Dict[str, Any]:
    return {name: _run(rank, world, *spec) for name, spec in VARIANTS.items()}


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "eager"])
def test_offloading_trains_bit_identically(results, variant):
    for rank in results:
        ref, run = rank["eager"], rank[variant]
        assert len(run["losses"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(ref["losses"], run["losses"]))
        assert ref["state"].keys() == run["state"].keys()
        assert all(torch.equal(ref["state"][k], run["state"][k]) for k in ref["state"])


def test_groups_lie_where_the_boundary_rule_says_and_copies_are_made(results):
    for rank in results:
        inside = rank["graphs_offload_inside"]["info"]
        assert {g for _, g, _, _ in inside["records"]} == {n for n, _, _, _ in inside["records"]}  # each is its callable
        # after the last backward only the graph-owned buffers are out of the pool
        assert inside["captured_bytes"] > 0 and inside["in_use"] == inside["num_captured"] > 0
        outside = rank["graphs_offload_outside"]["info"]
        assert all(g is None for _, g, _, _ in outside["records"]) and outside["captured_bytes"] == 0
        assert outside["in_use"] == 0
        assert [off for _, _, off, _ in outside["records"]] == [True, True, False, False]  # fraction 0.5 of 4 groups
        layers = rank["layer_graphs_offload_inside"]["info"]
        assert all(g == n.rsplit(".", 1)[0] for n, g, _, _ in layers["records"])  # inside their layer's graph
        assert all(b > 0 for _, _, _, b in rank["eager_offload"]["info"]["records"])
