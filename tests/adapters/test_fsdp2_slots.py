"""FSDP2 ZeRO-3 with unsharded parameters in two preallocated slots (use_unsharded_slots): 2 Gloo ranks, protocol.

The reference GPT with 4 layers (layers 0 and 2 share slot 0, layers 1 and 3 slot 1) under FSDP2's default ZeRO-3
(``reshard_after_forward=True``, reshard after backward), ``use_unsharded_slots(model)``, trained eagerly and with
graphs captured at step 2 (whole layers, and attn+mlp; fp32, and bf16 parameters under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), Adam. Must hold on every rank (``torch.equal``):
every step's loss and every final parameter equal to plain eager FSDP2 (no slots, storage freed at every reshard);
every layer's unsharded parameters lie in one of the two slot buffers, each sized to the largest layer; training
goes on exactly after release_unsharded_slots between steps; a unit moved to another slot after capture is refused
(``assign``), and a unit moved behind the refusal's back is caught before its replay by the address check; more
units unsharded at once than slots (ZeRO-2) is refused mid-step naming ``num_slots``. One slot is exact too: FSDP2
claims a unit's slot at the copy-out of its all-gather (its pre-forward / pre-backward), after the previous unit
resharded, so even its backward prefetch holds only the comm buffer.
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


def _build(slots: Optional[int], bf16: bool = False, reshard_after_forward: bool = True):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    from fsdp_cudagraph.apps.model import GPT, GPTConfig
    from fsdp_cudagraph import use_unsharded_slots

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2, seq_len=16)
    model = GPT(cfg)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in model.layers:
        fsdp2_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fsdp2_shard(model, mp_policy=mp)
    if slots is not None:
        use_unsharded_slots(model, num_slots=slots)
    return model, cfg


def _in_slots(model) -> Dict[str, Any]:
    """Which slot buffer each layer's unsharded parameters lie in (None: outside every slot)."""
    from fsdp_cudagraph.engines.fsdp2.storage import fsdp_params as _fsdp_params
    from fsdp_cudagraph.engines.fsdp2.storage import slots_of

    slots = slots_of(model)
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in slots.buffers]
    where = {}
    for i, layer in enumerate(model.layers):
        found = set()
        for fp in _fsdp_params(layer):
            p = fp._unsharded_param
            lo, hi = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
            found.add(next((k for k, (a, b) in enumerate(spans) if a <= lo and hi <= b), None))
        where[i] = sorted(found, key=str)
    return {"where": where, "slot_bytes": slots.slot_bytes, "num_buffers": len(slots.buffers),
            "layer_bytes": max(sum(fp._unsharded_param.numel() * fp._unsharded_param.element_size()
                                   for fp in _fsdp_params(layer)) for layer in model.layers)}


def _train(rank: int, world: int, slots: Optional[int], scope: Optional[List[str]], *, bf16: bool = False,
           move: Optional[str] = None, zero2: bool = False, release_at: Optional[int] = None) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch
    from fsdp_cudagraph.engines.fsdp2.storage import release_unsharded_slots, slots_of

    model, cfg = _build(slots, bf16, reshard_after_forward=not zero2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graphs = None
    if scope is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scope,
                                                          cuda_graph_warmup_steps=CAPTURE_AT), backend="protocol")
    out: Dict[str, Any] = {"losses": [], "error": None}
    for step in range(STEPS):
        if step == release_at:  # back to FSDP2's own storage between steps: training goes on unchanged
            release_unsharded_slots(model)
            out["released"] = slots_of(model) is None
        if graphs is not None and step == CAPTURE_AT:
            out["callables"] = graphs.capture().callables
            if move == "assign":
                try:
                    slots_of(model).assign(model.layers[0], 1)
                    out["assign_error"] = None
                except RuntimeError as exc:
                    out["assign_error"] = str(exc)
            elif move == "behind":  # negative control: the unit's slot changed without assign()
                s = slots_of(model)
                g = s._group_of(model.layers[0])
                s._slot_of[id(g)] = 1
        x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
        try:
            loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
            loss.backward()
        except RuntimeError as exc:
            out["error"] = str(exc)
            break
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().clone())
        if slots is not None and step == 0:
            out["slots"] = _in_slots(model)
    if graphs is not None and graphs.captured:
        out["replays"] = {n: model.get_submodule(n).__dict__["forward"].replays for n in out["callables"]}
        graphs.delete()
    if out["error"] is None:
        out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    return {"eager": _train(rank, world, None, None),
            "slots_eager": _train(rank, world, 2, None),
            "released": _train(rank, world, 2, None, release_at=2),
            "slots_layers": _train(rank, world, 2, []),
            "slots_attn_mlp": _train(rank, world, 2, ["attn", "mlp"]),
            "eager_bf16": _train(rank, world, None, None, bf16=True),
            "slots_bf16_layers": _train(rank, world, 2, [], bf16=True),
            "assign": _train(rank, world, 2, [], move="assign"),
            "behind": _train(rank, world, 2, [], move="behind"),
            "one_slot": _train(rank, world, 1, None),
            "zero2_slots": _train(rank, world, 2, None, zero2=True)}


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("name,ref", [("slots_eager", "eager"), ("slots_layers", "eager"),
                                      ("slots_attn_mlp", "eager"), ("slots_bf16_layers", "eager_bf16"),
                                      ("assign", "eager"), ("one_slot", "eager"),
                                      ("released", "eager")])
def test_slots_train_exactly_as_eager_fsdp2(runs, name, ref):
    for res in runs:
        run, eager = res[name], res[ref]
        assert run["error"] is None, run["error"]
        assert len(run["losses"]) == len(eager["losses"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"])), (run["losses"], eager["losses"])
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])
        assert run.get("released", True)
        if "replays" in run:
            assert run["replays"] and all(n == STEPS - CAPTURE_AT for n in run["replays"].values()), run["replays"]


def test_units_alternate_between_two_slots_of_the_largest_unit(runs):
    for res in runs:
        for name in ("slots_eager", "slots_layers", "slots_bf16_layers"):
            s = res[name]["slots"]
            assert s["where"] == {0: [0], 1: [1], 2: [0], 3: [1]}, s["where"]
            assert s["num_buffers"] == 2
            # each slot holds one unit: the largest, plus at most 255 alignment bytes per parameter
            assert s["layer_bytes"] <= s["slot_bytes"] < s["layer_bytes"] + 256 * 16, s


def test_moving_a_captured_unit_to_another_slot_is_refused(runs):
    for res in runs:
        msg = res["assign"]["assign_error"]
        assert msg is not None and "layers.0" in msg and "slot 0" in msg and "slot 1" in msg, msg


def test_a_unit_moved_behind_the_refusal_is_caught_before_replay(runs):
    for res in runs:
        run = res["behind"]
        assert run["error"] is not None and "captured at" in run["error"], run
        assert len(run["losses"]) == CAPTURE_AT


def test_units_unsharded_together_beyond_the_slots_are_refused_mid_step(runs):
    """ZeRO-2 (reshard_after_forward=False) keeps every layer unsharded from its forward to its backward: layer
    2 would overwrite layer 0 in slot 0. Refused at layer 2's all-gather, before any wrong number."""
    for res in runs:
        run = res["zero2_slots"]
        err = run["error"]
        assert err is not None and "layers.2" in err and "layers.0" in err and "num_slots=3" in err, run
        assert run["losses"] == []
