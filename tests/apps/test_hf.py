"""Unmodified HuggingFace causal LMs under megatron_fsdp with partial graphs: 2 Gloo ranks, protocol backend, fp32.

Models: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` from ``fsdp_cudagraph.apps.hf_models`` (tiny configs,
random weights, ``attn_implementation="sdpa"``, ``use_cache=False``); FSDP units = the decoder-layer class.
Their layers are called with None, bools, a (cos, sin) tuple and keyword tensors, and the attention
modules return ``(tensor, None)``. Every step passes ``is_causal`` through HF's ``**kwargs`` to the layers
and attention modules; step 4 changes it to False (a changed constant), step 5 changes it back.

Must hold (per rank, ``torch.equal``): the losses and the final parameters of every graphed run equal
the eager run's; callables whose call changed run eagerly at step 4 with one warning per callable naming
``is_causal`` and replay again at step 5, callables whose call did not change (the MLPs) replay
throughout; strict mode raises naming ``is_causal``; a KV cache in the call is refused at capture naming
the layer argument that carried it (whatever the installed transformers calls it). A negative control replays despite the change and must differ at step 4.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch

from fsdp_cudagraph.apps.hf_models import HAS_TRANSFORMERS, TRANSFORMERS_REASON
from tests.dist_utils import run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.skipif(not HAS_TRANSFORMERS, reason=TRANSFORMERS_REASON or "ok")]

WORLD = 2
STEPS = 6
CAPTURE_AT = 2
CHANGED_STEP = 4  # is_causal=False at this step only
LAYERS = ["model.layers.0", "model.layers.1"]
ATTN = "model.layers.*.self_attn"
MLP = "model.layers.*.mlp"
RUNS: Dict[str, List[Optional[Sequence[str]]]] = {"llama": [None, [], [ATTN], [MLP]], "qwen2": [None, [], [ATTN]]}


def _train(family: str, patterns: Optional[Sequence[str]], *, strict: bool = False, use_cache: bool = False,
           force_replay: bool = False) -> Dict[str, Any]:
    """Train STEPS steps; ``patterns=None``: eager, ``[]``: whole layers, else pattern scopes."""
    from megatron_fsdp import fully_shard
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, SignatureChangedWarning
    from fsdp_cudagraph.capture import args as _args
    from fsdp_cudagraph.apps import hf_models

    shape = hf_models.HFShape()
    torch.manual_seed(0)
    model, layer_cls = hf_models.build(family, shape, torch.device("cpu"))
    model = fully_shard(model, fsdp_unit_modules=[layer_cls], sharding_strategy="optim_grads_params",
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    graphs = None
    if patterns is not None:
        cfg = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_module_patterns=list(patterns),
                              cuda_graph_warmup_steps=CAPTURE_AT, cuda_graph_num_warmup_iters=2,
                              cuda_graph_strict_signature=strict)
        graphs = PartialCudaGraphs(model, cfg, backend="protocol")
    out: Dict[str, Any] = {"losses": [], "error": None, "callables": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SignatureChangedWarning)
        for step in range(STEPS):
            if graphs is not None and step == CAPTURE_AT:
                try:
                    out["callables"] = graphs.capture().callables
                except TypeError as exc:
                    out["error"] = ("TypeError", str(exc))
                    break
                if force_replay:  # negative control: replay whatever the call (what a graph alone would do)
                    for n in out["callables"]:
                        d = model.module.get_submodule(n).__dict__["forward"]
                        d._mismatch = lambda sig, args, kwargs, d=d: d.graphed(*_args.flatten((args, kwargs))[0])[0]
            inputs = dict(hf_models.batch(step, shape, torch.device("cpu")), is_causal=step != CHANGED_STEP,
                          use_cache=use_cache)
            try:
                loss = hf_models.loss(model, inputs)
            except ValueError as exc:
                out["error"] = ("ValueError", str(exc))
                break
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.detach().clone())
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, SignatureChangedWarning)]
    if graphs is not None and graphs.captured:
        out["counts"] = {n: (model.module.get_submodule(n).__dict__["forward"].replays,
                             model.module.get_submodule(n).__dict__["forward"].eager_calls) for n in out["callables"]}
        out["unknown_hooks"] = graphs.report.unknown_hooks
        graphs.delete()
    if out["error"] is None:
        out["state"] = model.full_state_dict()
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    for family, runs in RUNS.items():
        for patterns in runs:
            res[(family, None if patterns is None else tuple(patterns))] = _train(family, patterns)
    res["strict"] = _train("llama", [], strict=True)
    res["cache"] = _train("llama", [], use_cache=True)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    res["layer_params"] = list(inspect.signature(LlamaDecoderLayer.forward).parameters)
    res["forced"] = _train("llama", [], force_replay=True)
    return res


@pytest.fixture(scope="module")
def hf() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


def _same_losses(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [(f, tuple(p)) for f, runs in RUNS.items() for p in runs if p is not None]


@pytest.mark.parametrize("family,patterns", CASES, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
def test_hf_graphed_training_equals_eager(hf, family, patterns):
    for rank, res in enumerate(hf):
        eager, run = res[(family, None)], res[(family, patterns)]
        assert run["error"] is None, run["error"]
        assert len(eager["losses"]) == STEPS and len({x.item() for x in eager["losses"]}) == STEPS
        assert _same_losses(eager["losses"], run["losses"]), (rank, eager["losses"], run["losses"])
        assert eager["state"].keys() == run["state"].keys()
        assert all(torch.equal(eager["state"][k], run["state"][k]) for k in eager["state"]), f"rank {rank}"
        assert run["unknown_hooks"] == []
    assert not torch.equal(hf[0][(family, None)]["losses"][0], hf[1][(family, None)]["losses"][0])  # own data


@pytest.mark.parametrize("family,patterns", CASES, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
def test_hf_changed_constant_falls_back_once_per_callable(hf, family, patterns):
    graphed_steps = STEPS - CAPTURE_AT
    for res in hf:
        run = res[(family, patterns)]
        if patterns == (MLP,):
            # the MLP's call never carries is_causal: it replays every step and never warns
            assert run["callables"] == [f"{layer}.mlp" for layer in LAYERS]
            assert run["counts"] == {n: (graphed_steps, 0) for n in run["callables"]}
            assert run["warnings"] == []
            continue
        expected = LAYERS if patterns == () else [f"{layer}.self_attn" for layer in LAYERS]
        assert run["callables"] == expected
        assert run["counts"] == {n: (graphed_steps - 1, 1) for n in expected}
        assert len(run["warnings"]) == len(expected), run["warnings"]
        for name, msg in zip(expected, run["warnings"]):
            assert f"graphed callable {name} was called differently than at capture" in msg, msg
            assert "`is_causal` was True (bool) at capture, now False (bool)" in msg, msg


def test_hf_forced_replay_of_a_changed_constant_differs(hf):
    """Negative control: replaying the step-4 call with capture's constants gives another loss than eager."""
    for res in hf:
        eager, forced = res[("llama", None)]["losses"], res["forced"]["losses"]
        assert _same_losses(eager[:CHANGED_STEP], forced[:CHANGED_STEP])
        assert not torch.equal(eager[CHANGED_STEP], forced[CHANGED_STEP])


def test_hf_strict_mode_raises_naming_the_argument(hf):
    for res in hf:
        run = res["strict"]
        kind, msg = run["error"]
        assert kind == "ValueError" and "graphed callable model.layers.0" in msg, msg
        assert "`is_causal` was True (bool) at capture, now False (bool)" in msg and "cuda_graph_strict_signature" in msg
        assert _same_losses(run["losses"], res[("llama", None)]["losses"][:CHANGED_STEP])


def test_hf_kv_cache_in_the_call_is_refused_at_capture(hf):
    for res in hf:
        kind, msg = res["cache"]["error"]
        assert kind == "TypeError" and "graphed callable model.layers.0" in msg, msg
        # The message names the argument that carried the cache, whatever this transformers release calls it
        # (`past_key_values` up to 5.23, `cache` in 5.24's LlamaDecoderLayer.forward): read it from the message
        # and check it is a real parameter of the layer's forward, so a wrong or missing name still fails.
        named = re.search(r"`(\w+)` \(transformers\.cache_utils\.DynamicCache\)", msg)
        assert named is not None and "use_cache=False" in msg, msg
        assert named.group(1) in res["layer_params"], (named.group(1), res["layer_params"], msg)
        assert len(res["cache"]["losses"]) == CAPTURE_AT  # the eager steps before capture trained normally
