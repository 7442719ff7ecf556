"""PartialCudaGraphs on a model under PyTorch FSDP2's hybrid sharding (HSDP): 4 Gloo ranks as a 2 x 2 mesh
``(replicate, shard)``, protocol backend.

The reference GPT, every layer and the root under ``fully_shard(..., mesh=init_device_mesh("cpu", (2, 2)))``,
with ``keep_unsharded_storage`` or with two unsharded-parameter slots (``use_unsharded_slots``, sized from the
shard dimension), trained eagerly and with whole layers captured at step 1, fp32, Adam. Must hold on every
rank (``torch.equal``): every step's loss and every final parameter of the graphed run equal those of eager
FSDP2 HSDP; the slots hold ``shard size x local shard`` elements per parameter (the shard dimension, not the
world); the graphs replayed every step after capture.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 4
STEPS = 4
CAPTURE_AT = 1


def _build(mesh, storage: str):
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    from fsdp_cudagraph.apps.model import GPT, GPTConfig
    from fsdp_cudagraph import keep_unsharded_storage
    from fsdp_cudagraph import use_unsharded_slots

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=8)
    model = GPT(cfg)
    for layer in model.layers:
        fsdp2_shard(layer, mesh=mesh)
    fsdp2_shard(model, mesh=mesh)
    slots = None
    if storage == "keep":
        keep_unsharded_storage(model)
    else:
        slots = use_unsharded_slots(model, 2)
    return model, cfg, slots


def _train(rank: int, mesh, storage: str, graphed: bool) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    model, cfg, slots = _build(mesh, storage)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graphs = None
    if graphed:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[],
                                                          cuda_graph_warmup_steps=CAPTURE_AT), backend="protocol")
    out: Dict[str, Any] = {"losses": []}
    if slots is not None:
        fp = model.layers[0].attn.qkv.weight
        fps = [fp for fps in slots._layout.values() for fp, _, _, _ in fps]
        # the slot's room per parameter: the gathered output over the shard dimension (2 ranks), not the world
        out["slot_numels"] = {fp._module_info.param_name: slots._where[id(fp)][1] for fps_ in [fps] for fp in fps_}
        out["full_numels"] = {fp._module_info.param_name: fp._orig_size.numel() for fp in fps}
        out["local_rows"] = int(fp.to_local().shape[0])
        out["placements"] = [type(p).__name__ for p in fp.placements]
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            out["callables"] = graphs.capture().callables
        x, y = synthetic_batch(step, 2 * WORLD, cfg, torch.device("cpu"))
        loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().clone())
    if graphs is not None:
        out["replays"] = {n: model.get_submodule(n).__dict__["forward"].replays for n in out["callables"]}
        graphs.delete()
    out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {f"{storage}_{'graphed' if g else 'eager'}": _train(rank, mesh, storage, g)
            for storage in ("keep", "slots") for g in (False, True)}


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("storage", ["keep", "slots"])
def test_graphed_fsdp2_hsdp_equals_eager(runs, storage):
    for res in runs:
        eager, run = res[f"{storage}_eager"], res[f"{storage}_graphed"]
        assert all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"])), (run["losses"], eager["losses"])
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])
        assert run["replays"] and all(n == STEPS - CAPTURE_AT for n in run["replays"].values()), run["replays"]


def test_hsdp_replicas_agree_and_shard_over_the_shard_dim(runs):
    # the replicas (ranks 0 and 2, 1 and 3) end with the same parameters; the mesh is (Replicate, Shard)
    for k in runs[0]["keep_eager"]["params"]:
        assert torch.equal(runs[0]["keep_eager"]["params"][k], runs[2]["keep_eager"]["params"][k])
    slots = runs[0]["slots_eager"]
    assert slots["placements"] == ["Replicate", "Shard"], slots["placements"]
    assert slots["local_rows"] == 3 * 32 // 2  # qkv.weight (96 x 32) split over the 2 ranks of the shard dim
    # every parameter of this model divides evenly by 2: its slot room is exactly its full size (4 ranks: twice)
    assert slots["slot_numels"] == slots["full_numels"], (slots["slot_numels"], slots["full_numels"])
