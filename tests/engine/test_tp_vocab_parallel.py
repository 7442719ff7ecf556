"""The vocabulary-parallel embedding and LM head of the TP GPT (``GPTConfig(vocab_parallel=True)``), on Gloo.

One spawned job of 2 ranks as 1 (dp) x 2 (tp), the model and tolerance of tests/engine/test_tp_training.py
([Note: TP tolerance]): 2 layers, 4 heads, vocabulary 64 (32 ids per TP rank), ``fully_shard(...,
tensor_parallel_size=2)``, zero3 with double buffering, clipping at every step. What must hold
([Note: tensor parallelism of the reference GPT] in ``apps/tp.py``):

- each TP rank's initial ``tok``/``head`` rows equal the TP=1 model's for the same seed, tagged as TP shards along
  dim 0 (the engine keys them per TP rank in ``sharded_state_dict``);
- training: per-step losses, clipping norms and the merged final parameters equal the single-process TP=1
  reference within ``RTOL``, and the same run with ``vocab_parallel=False`` within ``RTOL`` (both split the same
  function; the vocabulary split only regroups the head's GEMM);
- per-layer graphs (scopes ``attn mlp``, protocol backend) equal eager bit for bit with the split;
- negative controls, each must miss the reference: the logits gather's backward summing over TP (a reduce-scatter)
  instead of taking this rank's slice, and the embedding's mask off by one (each rank drops its first id).
  Measured (torch 2.13 CPU): the sum doubles every gradient, so the clipping norms are off by 1.0 (relative) while
  the clipped Adam updates hide it in the parameters (6.7e-7); the mask moves the parameters by 0.16, the losses
  by 2.2e-3. The good runs: parameters within 6.1e-7 of TP=1 and 5.0e-7 of ``vocab_parallel=False``, losses
  equal, norms within 7.8e-8;
- no process group: slice/merge round trips with the split, a model without it keeps ``tok``/``head``
  replicated, merging split dicts without ``vocab_parallel=True`` is refused, and the config refusals.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from fsdp_cudagraph.apps.model import GPT, GPTConfig
from fsdp_cudagraph.apps.tp import merge_tp_state_dicts, slice_tp_state_dict, tp_kind
from tests.dist_utils import run_gloo
from tests.engine.test_tp_training import CLIP, MODEL, RTOL, STEPS, TP, adam, reference_run, train

pytestmark = pytest.mark.gloo

CAPTURE_AT = 2
VP_KEYS = ("tok.weight", "head.weight")


def vp_cfg(vocab_parallel: bool = True) -> GPTConfig:
    return GPTConfig(tensor_parallel_size=TP, sequence_parallel=True, vocab_parallel=vocab_parallel, **MODEL)


def _sum_backward(ctx: Any, grad: torch.Tensor) -> Any:
    """Negative control: the logits gather's backward as a reduce-scatter along the vocabulary (sum over TP)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    total = grad.contiguous().clone()
    dist.all_reduce(total, group=ctx.group)
    per = grad.shape[-1] // size
    return total[..., rank * per:(rank + 1) * per].contiguous(), None


def _mask_off_by_one(tokens: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """Negative control: the embedding's mask drops each rank's first id (``<= 0`` for ``< 0``)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    per = weight.shape[0]
    local = tokens - dist.get_rank(group) * per
    outside = (local <= 0) | (local >= per)
    return F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)


def _shard(vocab_parallel: bool) -> Any:
    import megatron_fsdp
    from fsdp_cudagraph.apps.model import TransformerBlock

    torch.manual_seed(0)
    gpt = GPT(vp_cfg(vocab_parallel), tensor_parallel_group=megatron_fsdp.tensor_parallel_groups(TP)[0])
    return megatron_fsdp.fully_shard(gpt, fsdp_unit_modules=[TransformerBlock], sharding_strategy="optim_grads_params",
                                     fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                                     tensor_parallel_size=TP)


def _run(rank: int, world: int, *, vocab_parallel: bool = True, patch: Optional[str] = None,
         fused_loss: bool = False) -> Dict[str, Any]:
    from fsdp_cudagraph.apps import tp as tp_mod

    saved = (tp_mod._GatherVocab.backward, tp_mod.vocab_parallel_embedding)
    if patch == "sum_backward":
        tp_mod._GatherVocab.backward = staticmethod(_sum_backward)
    elif patch == "mask_off_by_one":
        tp_mod.vocab_parallel_embedding = _mask_off_by_one
    try:
        model = _shard(vocab_parallel)
        opt = adam(model.optimizer_parameters())
        out = train(model, opt, range(STEPS), rank, world, TP, CLIP, fused_loss=fused_loss)
    finally:
        tp_mod._GatherVocab.backward, tp_mod.vocab_parallel_embedding = saved
    out["params"] = model.state_dict()
    return out


def _graphed(rank: int, world: int, scopes: Optional[List[str]]) -> Dict[str, Any]:
    """Eager (``scopes=None``) or per-layer graphs of ``scopes`` (protocol backend) captured at CAPTURE_AT."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    model = _shard(True)
    opt = adam(model.optimizer_parameters())
    graphs = None
    if scopes is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scopes,
                                                          cuda_graph_num_warmup_iters=2), backend="protocol")
    out: Dict[str, Any] = {"losses": train(model, opt, range(CAPTURE_AT), rank, world, TP)["losses"]}
    if graphs is not None:
        out["callables"] = sorted(graphs.capture().callables)
    out["losses"] += train(model, opt, range(CAPTURE_AT, STEPS), rank, world, TP)["losses"]
    out["params"] = model.state_dict()
    if graphs is not None:
        out["replays"] = {c.name: c.module.__dict__["forward"].replays for c in graphs.callables}
        graphs.delete()
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    import megatron_fsdp

    res: Dict[str, Any] = {"rank": rank}
    torch.manual_seed(0)
    gpt = GPT(vp_cfg(), tensor_parallel_group=megatron_fsdp.tensor_parallel_groups(TP)[0])
    res["initial"] = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    res["tags"] = {k: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None),
                       getattr(p, "sequence_parallel", False)) for k, p in gpt.named_parameters() if k in VP_KEYS}
    res["tp_rank"] = dist.get_rank(gpt.tensor_parallel_group)
    res["keys"] = sorted(_shard(True).sharded_state_dict())
    for name, kw in (("vp", {}), ("plain", dict(vocab_parallel=False)), ("sum_backward", dict(patch="sum_backward")),
                     ("mask_off_by_one", dict(patch="mask_off_by_one")), ("fused", dict(fused_loss=True)),
                     ("fused_mask_off_by_one", dict(fused_loss=True, patch="mask_off_by_one"))):
        res[name] = _run(rank, world, **kw)
    res["eager"] = _graphed(rank, world, None)
    res["attn+mlp"] = _graphed(rank, world, ["attn", "mlp"])
    return res


@pytest.fixture(scope="module")
def two() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return reference_run(STEPS, clip=CLIP)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def merged(per_rank: List[Dict[str, Any]], run: str, *, vocab_parallel: bool = True) -> Dict[str, torch.Tensor]:
    return merge_tp_state_dicts([r[run]["params"] for r in per_rank], num_heads=MODEL["num_heads"],
                                vocab_parallel=vocab_parallel)


def distance(per_rank: List[Dict[str, Any]], run: str, ref: Dict[str, Any], *, vocab_parallel: bool = True
             ) -> Dict[str, float]:
    for r in per_rank:  # the global loss and norm, the same on every rank
        assert r[run]["losses"] == per_rank[0][run]["losses"] and r[run]["norms"] == per_rank[0][run]["norms"]
    got = merged(per_rank, run, vocab_parallel=vocab_parallel)
    assert got.keys() == ref["params"].keys() and len(per_rank[0][run]["norms"]) == len(ref["norms"]) == STEPS
    return {"param": max(_rel(got[k], v) for k, v in ref["params"].items()),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(per_rank[0][run]["losses"], ref["losses"])),
            "norm": max(abs(a - b) / abs(b) for a, b in zip(per_rank[0][run]["norms"], ref["norms"]))}


def _within(d: Dict[str, float]) -> None:
    assert all(v <= RTOL for v in d.values()), d


def test_initial_slices_and_tags(two):
    torch.manual_seed(0)
    full = GPT(GPTConfig(**MODEL)).state_dict()
    for r in two:
        want = slice_tp_state_dict(full, tensor_parallel_size=TP, tp_rank=r["tp_rank"], num_heads=MODEL["num_heads"],
                                   vocab_parallel=True)
        assert r["initial"].keys() == want.keys()
        assert all(torch.equal(r["initial"][k], want[k]) for k in want)
        q, per = r["tp_rank"], MODEL["vocab_size"] // TP
        assert torch.equal(r["initial"]["tok.weight"], full["tok.weight"][q * per:(q + 1) * per])
        assert torch.equal(r["initial"]["head.weight"], full["head.weight"][q * per:(q + 1) * per])
        assert r["tags"] == {k: (True, 0, False) for k in VP_KEYS}, r["tags"]
        assert f"tok.weight@tp{q}of{TP}" in r["keys"] and f"head.weight@tp{q}of{TP}" in r["keys"], r["keys"]
        assert "pos.weight" in r["keys"]  # the positional embedding stays replicated


def test_trains_like_the_reference(two, reference):
    _within(distance(two, "vp", reference))


def test_loss_from_the_vocabulary_slices_trains_like_the_reference(two, reference):
    """``model(x, y)`` with the split: the loss from each rank's vocabulary slice, the logits never gathered
    (``vocab_parallel_cross_entropy``), through the engine's wrapper; the same training as the gathered logits'
    within the tolerance, and a wrong embedding still caught through it."""
    _within(distance(two, "fused", reference))
    d = distance(two, "fused", {"params": merged(two, "vp"), "losses": two[0]["vp"]["losses"],
                                "norms": two[0]["vp"]["norms"]})
    _within(d)
    assert distance(two, "fused_mask_off_by_one", reference)["param"] > 100 * RTOL


def test_same_as_replicated_vocabulary(two, reference):
    _within(distance(two, "plain", reference, vocab_parallel=False))
    vp, plain = two[0]["vp"], two[0]["plain"]
    assert max(abs(a - b) / abs(b) for a, b in zip(vp["losses"], plain["losses"])) <= RTOL
    assert max(abs(a - b) / abs(b) for a, b in zip(vp["norms"], plain["norms"])) <= RTOL
    a, b = merged(two, "vp"), merged(two, "plain", vocab_parallel=False)
    assert max(_rel(a[k], b[k]) for k in b) <= RTOL


def test_graphed_equals_eager(two):
    for r in two:
        assert r["attn+mlp"]["losses"] == r["eager"]["losses"]
        got, want = r["attn+mlp"]["params"], r["eager"]["params"]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        names = ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]
        assert r["attn+mlp"]["callables"] == sorted(names)
        assert r["attn+mlp"]["replays"] == {c: STEPS - CAPTURE_AT for c in names}, r["attn+mlp"]["replays"]
    # the eager run is the "vp" run without clipping: it must train too (a loss that moves)
    assert two[0]["eager"]["losses"][0] != two[0]["eager"]["losses"][-1]


@pytest.mark.parametrize("run", ["sum_backward", "mask_off_by_one"])
def test_negative_controls(two, reference, run):
    d = distance(two, run, reference)
    assert max(d.values()) > 100 * RTOL, d


# ------------------------------------------------------------------ no process group


def test_state_dict_round_trip():
    torch.manual_seed(0)
    full = GPT(GPTConfig(**MODEL)).state_dict()
    for tp in (2, 4):
        parts = [slice_tp_state_dict(full, tensor_parallel_size=tp, tp_rank=q, num_heads=4, vocab_parallel=True)
                 for q in range(tp)]
        per = MODEL["vocab_size"] // tp
        assert parts[1]["tok.weight"].shape == parts[1]["head.weight"].shape == (per, MODEL["hidden_size"])
        assert torch.equal(parts[1]["head.weight"], full["head.weight"][per:2 * per])
        assert torch.equal(parts[1]["pos.weight"], full["pos.weight"])
        back = merge_tp_state_dicts(parts, num_heads=4, vocab_parallel=True)
        assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
        with pytest.raises(ValueError, match=r"tok\.weight differs between TP ranks 0 and 1.*pass vocab_parallel=True"):
            merge_tp_state_dicts(parts, num_heads=4)
    # without vocab_parallel the same keys are replicated: passed through whole, and merged as replicated
    plain = [slice_tp_state_dict(full, tensor_parallel_size=2, tp_rank=q, num_heads=4) for q in range(2)]
    for k in VP_KEYS:
        assert tp_kind(k) is None and tp_kind(k, vocab_parallel=True) == "column"
        assert all(torch.equal(p[k], full[k]) for p in plain)
    back = merge_tp_state_dicts(plain, num_heads=4)
    assert all(torch.equal(back[k], full[k]) for k in full)


@pytest.mark.parametrize("kw,words", [
    (dict(tensor_parallel_size=1, sequence_parallel=False),
     ["vocab_parallel=True with tensor_parallel_size=1", "vocab_parallel=False"]),
    (dict(vocab_size=63), ["tensor_parallel_size=2 does not divide vocab_size=63", "multiple of 2"]),
])
def test_config_misuse_refused(kw, words):
    base = {**MODEL, "tensor_parallel_size": TP, "sequence_parallel": True, "vocab_parallel": True, **kw}
    with pytest.raises(ValueError) as info:
        GPTConfig(**base)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
