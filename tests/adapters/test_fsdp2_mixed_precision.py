"""PartialCudaGraphs under FSDP2's standard mixed precision: 2 Gloo ranks, protocol backend.

fp32 sharded parameters, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every layer and
on the root (how FSDP2 and torchtitan train), with ``keep_unsharded_storage`` (ZeRO-3 at one address), the
reference GPT trained eagerly and with graphs captured at step 2 (whole layers, and attn+mlp), Adam; and the same
with ``output_dtype=float32`` on the layers (the root then without casts). FSDP2 casts each unit's inputs to bf16
in its pre-forward hook, its outputs in its post-forward hook and the bf16 gradients to fp32 before the
reduce-scatter in post-backward; under partial graphs those hooks run around each replay as around the eager call.
Must hold on every rank (``torch.equal``): every step's loss and every final (fp32) parameter equal to eager FSDP2
with the same policy; the graphs were captured from bf16 inputs and read the bf16 unsharded parameters while the
shards stay fp32; the policy matters (eager bf16 differs from eager fp32, so equality is not the fp32 run's).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
STEPS = 5
CAPTURE_AT = 2


def _policy(kind: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {
        "fp32": MixedPrecisionPolicy(),
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "bf16_out32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32),
    }[kind]


def _build(policy: str):
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    from fsdp_cudagraph.apps.model import GPT, GPTConfig
    from fsdp_cudagraph import keep_unsharded_storage

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, seq_len=16)
    model = GPT(cfg)
    for layer in model.layers:
        fsdp2_shard(layer, mp_policy=_policy(policy))
    # With output_dtype=fp32 the layers hand fp32 to the root's final LayerNorm, so the root keeps fp32
    # parameters (its bf16 LayerNorm would refuse fp32 input in eager FSDP2 too).
    fsdp2_shard(model, mp_policy=_policy("fp32" if policy == "bf16_out32" else policy))
    keep_unsharded_storage(model)
    return model, cfg


def _train(rank: int, world: int, policy: str, scope: Optional[List[str]]) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch
    from fsdp_cudagraph.engines import adapter_for

    model, cfg = _build(policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graphs = None
    if scope is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scope,
                                                          cuda_graph_warmup_steps=CAPTURE_AT), backend="protocol")
    out: Dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            out["callables"] = graphs.capture().callables
            out["sample_dtypes"] = {c.name: sorted({str(t.dtype) for t in c.sample_args if t.is_floating_point()})
                                    for c in graphs.callables}
            out["replay_dtypes"] = sorted({str(t.dtype) for c in graphs.callables
                                           for _, t in adapter_for(model).replay_tensors(c.module)})
        x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
        loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().clone())
    if graphs is not None:
        out["replays"] = {n: model.get_submodule(n).__dict__["forward"].replays for n in out["callables"]}
        graphs.delete()
    out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out["sharded_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    res = {"eager_fp32": _train(rank, world, "fp32", None),
           "eager_bf16": _train(rank, world, "bf16", None),
           "bf16_layers": _train(rank, world, "bf16", []),
           "bf16_attn_mlp": _train(rank, world, "bf16", ["attn", "mlp"]),
           "eager_bf16_out32": _train(rank, world, "bf16_out32", None),
           "bf16_out32_layers": _train(rank, world, "bf16_out32", []),
           "bf16_out32_attn_mlp": _train(rank, world, "bf16_out32", ["attn", "mlp"])}
    return res


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("policy,scope", [("bf16", "layers"), ("bf16", "attn_mlp"), ("bf16_out32", "layers"),
                                          ("bf16_out32", "attn_mlp")])
def test_graphed_mixed_precision_equals_eager_fsdp2(runs, policy, scope):
    for res in runs:
        eager, run = res[f"eager_{policy}"], res[f"{policy}_{scope}"]
        assert len(run["losses"]) == len(eager["losses"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"])), (run["losses"], eager["losses"])
        assert eager["params"].keys() == run["params"].keys()
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])
        assert run["replays"] and all(n == STEPS - CAPTURE_AT for n in run["replays"].values()), run["replays"]


@pytest.mark.parametrize("policy", ["bf16", "bf16_out32"])
def test_graphs_take_bf16_inputs_and_parameters_while_shards_stay_fp32(runs, policy):
    for res in runs:
        for scope in ("layers", "attn_mlp"):
            run = res[f"{policy}_{scope}"]
            # the recorded inputs are what the graphed forward sees: after FSDP2's input cast
            assert all(d == ["torch.bfloat16"] for d in run["sample_dtypes"].values()), run["sample_dtypes"]
            assert run["replay_dtypes"] == ["torch.bfloat16"], run["replay_dtypes"]
            assert run["sharded_dtypes"] == ["torch.float32"], run["sharded_dtypes"]


def test_the_policy_changes_the_numbers(runs):
    """Negative control: equality to eager bf16 is not equality to the fp32 run (the casts took effect)."""
    for res in runs:
        a, b = res["eager_bf16"], res["eager_fp32"]
        assert not all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        assert not all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])

