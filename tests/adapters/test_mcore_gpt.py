"""megatron-core's own GPTModel (dense and dropless MoE) under our engine with partial graphs, on 2 Gloo ranks.

The models are ``fsdp_cudagraph.apps.mcore_gpt``'s: megatron-core's ``GPTModel`` with its local layer spec
(``SequentialMLP`` experts, ``TopKRouter``, the ``alltoall`` or ``allgather`` token dispatcher), TP = PP =
EP = 1 over the Gloo default group, ``TransformerLayer`` as the FSDP unit of this project's ``fully_shard``,
the protocol backend (TE's warmup/capture schedule and hook calls without CUDA graphs). ``cpu_shims`` replaces
three CUDA-only calls (the current device, the CUDA RNG tracker's fork around zero dropout, the alltoall
dispatcher's side stream); routing, permutation, experts and loss are megatron-core's.

Must hold on every rank (``torch.equal``): every loss and every final parameter of the graphed run equal to
the eager run, for the dense model (whole layers; attention + MLP) and the MoE model with each dispatcher
(attention + router graphed, preprocess, experts and combine eager), and the MoE model under PyTorch FSDP2
(the checker's ``fsdp2`` engine); every call after capture replays; a
perturbed router graph (negative control) is reported as the first callable to differ. Refusals: whole MoE
layers through the checker (the experts' ``cuda_graph_unsafe`` tag, 1 rank); without a process group
``moe_preprocess``, ``moe``, whole MoE layers, Megatron's own graphs on, CPU without the shims.

Skipped without megatron-core (the reason names the pip line). NVIDIA Megatron-FSDP needs CUDA: its rows are
in ``tests/gpu/scripts/mcore_gpt.py``.
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn

from fsdp_cudagraph.apps import mcore_gpt
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.skipif(not mcore_gpt.HAS_MCORE, reason=mcore_gpt.MCORE_REASON)

WORLD = 2
STEPS = 5
CAPTURE_AT = 2


def _case(rank: int, world: int, model: str, scope: Optional[str], tags: Optional[List[str]],
          perturb: Optional[str], engine: str) -> Dict[str, Any]:
    from fsdp_cudagraph.check import check_alignment

    device = torch.device("cpu")
    original = torch.cuda.current_device
    with mcore_gpt.cpu_shims():
        shape = mcore_gpt.base_shape(device, model)
        built: Dict[str, str] = {}

        def factory(dev: torch.device) -> Any:
            spec = mcore_gpt.spec(model, dev, shape)
            built.update(mcore_gpt.layout(spec.model))
            return spec

        if tags is not None:  # the checker's way: cuda_graph_modules over the factory's tags
            report = check_alignment(factory, steps=STEPS, capture_step=CAPTURE_AT, backend="protocol",
                                     cuda_graph_modules=tags, compute_dtype=torch.float32, device=device,
                                     perturb=perturb, engine=engine)
        else:
            patterns = mcore_gpt.scope_patterns(scope, moe=shape.num_experts is not None)
            report = check_alignment(factory, steps=STEPS, capture_step=CAPTURE_AT, backend="protocol",
                                     cuda_graph_module_patterns=list(patterns), compute_dtype=torch.float32,
                                     device=device, perturb=perturb, engine=engine)
    return {"equal": report.equal, "params_equal": report.params_equal, "steps": report.steps,
            "callables": report.callables, "calls": report.calls, "culprit": report.culprit, "built": built,
            "restored": torch.cuda.current_device is original}


def _run(model: str, scope: Optional[str] = None, tags: Optional[List[str]] = None,
         perturb: Optional[str] = None, engine: str = "megatron_fsdp") -> List[Dict[str, Any]]:
    return run_gloo(_case, WORLD, model, scope, tags, perturb, engine)


def _assert_equal(results: List[Dict[str, Any]], callables: List[str]) -> None:
    for rank, r in enumerate(results):
        assert r["restored"], f"rank {rank}: cpu_shims left torch.cuda.current_device replaced"
        assert r["callables"] == callables, (rank, r["callables"])
        assert len(r["steps"]) == STEPS and all(s["equal"] for s in r["steps"]), (rank, r["steps"])
        assert r["params_equal"] and r["equal"], (rank, r)
        for name, c in r["calls"].items():  # every call after capture replayed its graph
            assert c["replays"] == STEPS - CAPTURE_AT and c["eager_calls"] == 0, (rank, name, c)
    # the ranks trained on different batches: their losses differ (so equality above is per rank, not trivial)
    assert results[0]["steps"][0]["eager_loss"] != results[1]["steps"][0]["eager_loss"]


LAYERS = ["decoder.layers.0", "decoder.layers.1"]


@pytest.mark.gloo
def test_dense_whole_layers_bit_exact() -> None:
    results = _run("dense", "layer")
    built = results[0]["built"]
    assert (built["spec"], built["model"], built["mlp"]) == ("local", "GPTModel", "MLP") and "experts" not in built
    _assert_equal(results, LAYERS)


@pytest.mark.gloo
def test_dense_attn_mlp_tags_bit_exact() -> None:
    results = _run("dense", tags=["attn", "mlp"])
    _assert_equal(results, [f"{l}.{m}" for l in LAYERS for m in ("self_attention", "mlp")])


@pytest.mark.gloo
@pytest.mark.parametrize("model,dispatcher", [("moe_alltoall", "MoEAlltoAllTokenDispatcher"),
                                              ("moe_allgather", "MoEAllGatherTokenDispatcher")])
def test_moe_attn_router_bit_exact(model: str, dispatcher: str) -> None:
    results = _run(model, "attn_router")
    built = results[0]["built"]
    assert (built["spec"], built["mlp"], built["dispatcher"], built["experts"]) == (
        "local", "MoELayer", dispatcher, "SequentialMLP")
    assert (built["moe_grouped_gemm"], built["moe_permute_fusion"]) == (False, False)
    _assert_equal(results, [f"{l}.{m}" for l in LAYERS for m in ("self_attention", "mlp.router")])


@pytest.mark.gloo
def test_moe_router_under_fsdp2_bit_exact() -> None:
    """The same Megatron scopes under PyTorch FSDP2 (keep_unsharded_storage, the checker's fsdp2 engine)."""
    results = _run("moe_alltoall", tags=["attn", "moe_router"], engine="fsdp2")
    _assert_equal(results, [f"{l}.{m}" for l in LAYERS for m in ("self_attention", "mlp.router")])


@pytest.mark.gloo
def test_moe_perturbed_router_is_named() -> None:
    """Negative control: the router's graphed probabilities scaled by 1.01 change the losses and are blamed."""
    target = "decoder.layers.1.mlp.router"
    results = _run("moe_allgather", tags=["attn", "moe_router"], perturb=target)
    for r in results:
        assert not r["equal"] and not r["params_equal"]
        assert all(s["equal"] for s in r["steps"][:CAPTURE_AT]) and not r["steps"][CAPTURE_AT]["equal"]
        assert r["culprit"] == target


# ---------------------------------------------------------------------------------------------- refusals


def _whole_moe_layers(rank: int, world: int) -> str:
    from fsdp_cudagraph.check import check_alignment

    with mcore_gpt.cpu_shims():
        try:
            check_alignment(mcore_gpt.moe_allgather, steps=3, capture_step=1, backend="protocol",
                            device=torch.device("cpu"))
        except ValueError as exc:
            return str(exc)
    return "no error"


@pytest.mark.gloo
def test_whole_moe_layers_refused_by_the_library() -> None:
    """Without the app's scope check (the checker's default: whole FSDP units), the experts' cuda_graph_unsafe
    tag makes PartialCudaGraphs refuse the MoE layers when it selects them: on the protocol backend nothing
    else would notice that a dropless expert syncs on the host."""
    (message,) = run_gloo(_whole_moe_layers, 1)
    assert "contains 'decoder.layers.0.mlp.experts'" in message and "tokens_per_expert" in message, message


@pytest.mark.parametrize("scope,words", [("moe_preprocess", "not an nn.Module"), ("moe", "tolist"),
                                         ("layer", "graph the experts"), ("attn_mlp", "graph the experts")])
def test_moe_scopes_refused(scope: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        mcore_gpt.scope_patterns(scope, moe=True)


def test_dense_refuses_router_scope_and_unknown() -> None:
    with pytest.raises(ValueError, match="has none"):
        mcore_gpt.scope_patterns("attn_router", moe=False)
    with pytest.raises(ValueError, match="not one of"):
        mcore_gpt.scope_patterns("everything", moe=False)
    assert mcore_gpt.scope_patterns("layer", moe=False) == ()


def test_megatron_graphs_on_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].config = types.SimpleNamespace(cuda_graph_impl="transformer_engine")
    with pytest.raises(ValueError, match="cuda_graph_impl='transformer_engine'"):
        mcore_gpt.check_megatron_graphs_off(model)
    model[0].config = types.SimpleNamespace(cuda_graph_impl="none")
    model[0].cudagraph_manager = object()
    with pytest.raises(ValueError, match="cudagraph_manager"):
        mcore_gpt.check_megatron_graphs_off(model)


def test_cpu_without_shims_refused() -> None:
    with pytest.raises(RuntimeError, match="cpu_shims"):
        mcore_gpt.build(mcore_gpt.MCoreShape(), torch.device("cpu"))


def test_bad_dispatcher_refused() -> None:
    with pytest.raises(ValueError, match="flex"):
        mcore_gpt.MCoreShape(num_experts=4, moe_token_dispatcher_type="flex")


def test_nvidia_wrapper_option_refusals() -> None:
    """The checker's nvidia builder: an unknown wrapper, and wrapper='mcore' on a model without megatron-core's
    TransformerConfig, are refused before NVIDIA's engine is built (so on the CPU too)."""
    from fsdp_cudagraph.engines.build import check_options
    from fsdp_cudagraph.engines.registry import registered_builders
    ENGINES = registered_builders()

    builder = ENGINES["nvidia"]
    assert check_options(builder, {"wrapper": "mcore"}) == {"wrapper": "mcore"}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    common = dict(unit_modules=[nn.Linear], make_optimizer=lambda ps: torch.optim.Adam(ps),
                  device=torch.device("cpu"), sharding_strategy="optim_grads_params", compute_dtype=None)
    with pytest.raises(ValueError, match="wrapper='ddp' is not one of"):
        builder.build(model, options={"wrapper": "ddp"}, **common)
    with pytest.raises(ValueError, match="TransformerConfig"):
        builder.build(model, options={"wrapper": "mcore"}, **common)
