"""Tensor parallelism in megatron_fsdp: the (dp, tp) grid against the TP=1 reference, on Gloo.

Two spawned jobs (module fixtures): 4 ranks as 2 (dp) x 2 (tp), and 2 ranks as 1 x 2. Model: the reference GPT
(``fsdp_cudagraph/apps/model.py``, torch layers), 2 layers, 4 heads, ``GPTConfig(tensor_parallel_size=2,
sequence_parallel=True)`` ([Note: tensor parallelism of the reference GPT] in ``apps/tp.py``), sharded with
``fully_shard(..., tensor_parallel_size=2)`` ([Note: tensor parallelism] in ``megatron_fsdp/_tensor.py``); each DP
rank trains its rows of one global batch, the TP ranks of a DP rank the same rows. What must hold:

- the layout: TP groups {0,1},{2,3} (contiguous), DP groups {0,2},{1,3} (strided), units sharded over DP only;
- every run's per-step global loss, its clipping norms and its final parameters (the TP ranks' ``state_dict()``
  merged with ``merge_tp_state_dicts``) equal the single-process TP=1 reference's on the same global batch within
  ``RTOL`` ([Note: TP tolerance]), under every strategy, double buffering, explicit groups, and on 2 ranks;
  replicated parameters stay bit-equal across TP ranks (the merge checks);
- the engine sums the sequence-parallel gradients over TP before each unit's DP reduce-scatter (collective log);
- the global 2-norm and inf-norm of one backward's gradients equal the reference's;
- a DCP checkpoint saved at 4 ranks (2x2) loads at 2 ranks (1x2) with bit-equal parameters and optimizer state, and
  two more steps there match the reference continued; loading it at another TP is refused;
- grouped-query attention (4 query, 2 key/value heads) at 1x2 against its TP=1 reference;
- negative controls: each rank holding the other TP rank's slice, and the layernorm gradients left without
  their TP all-reduce (``sequence_parallel`` tags removed), fail the reference check;
- misuse refused with the value, the rule and the fix (also TP ranks whose replicated parameters differ, and TP
  shards without their ``tensor_model_parallel`` tag).

[Note: TP tolerance]
fp32 and deterministic. The TP run computes the same function as TP=1 with other groupings of its sums: each GEMM
of a row-parallel layer sums half its inner dimension per rank and the reduce-scatter adds the halves; the
column-parallel layers' input gradients likewise; the sequence-parallel gradients are sums over each rank's
positions, then over TP; and the reduce-scatter over DP adds the DP ranks' parts. A few ulp per element. Adam uses
``eps = 1e-3`` for the reason of tests/engine/test_ep_training.py ([Note: EP tolerance]): its update's derivative
in ``g`` is then bounded, and ulp-level differences stay ulp-level. Measured (4 steps, torch 2.13 CPU): losses
within 1.2e-7 relative (bit-equal at 1x2), clipping norms within 7.8e-8, parameters within 1.5e-6 relative (the
maximum difference over the tensor's largest magnitude; 1.2e-6 at 1x2, 8.9e-7 with grouped-query attention, 9.7e-7
after the checkpoint's two more steps). ``RTOL = 1e-5`` leaves a margin of about 7x and is five orders below what the negative controls give:
swapped slices move the merged parameters by 1.9, layernorm gradients without their TP sum by 1.5 (their losses
by 1e-3).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest
import torch

from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_cudagraph.apps.tp import merge_tp_state_dicts, slice_tp_state_dict
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

RTOL = 1e-5
STEPS = 4
GLOBAL_ROWS = 4  # sequences per step: 2 per DP rank at 2x2, 4 at 1x2
CLIP = 0.05  # below the gradients' global norm (0.4 to 1.3 in these steps), so every step clips
TP = 2
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16, ffn_hidden_size=64)
CASES = {
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
    "optim_grads": dict(sharding_strategy="optim_grads"),
    "optim": dict(sharding_strategy="optim"),
    "no_shard": dict(sharding_strategy="no_shard"),
}


GQA = dict(num_kv_heads=2)  # grouped-query attention: 2 query heads per key/value head, one key/value head per TP rank


def cfg(tp: int, gqa: bool = False) -> GPTConfig:
    return GPTConfig(tensor_parallel_size=tp, sequence_parallel=tp > 1, **MODEL, **(GQA if gqa else {}))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)  # eps: [Note: TP tolerance]


def build(tp: int, group: Any, *, seed: int = 0, swap: bool = False, strip_sp: bool = False, gqa: bool = False
          ) -> GPT:
    """The TP model of ``seed``; ``swap``: this rank holds the next TP rank's slice; ``strip_sp``: no
    ``sequence_parallel`` tags (the engine then leaves the layernorm gradients unsummed over TP)."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = GPT(cfg(tp, gqa), tensor_parallel_group=group)
    if swap:
        torch.manual_seed(seed)
        full = GPT(cfg(1)).state_dict()
        other = (dist.get_rank(group) + 1) % tp
        model.load_state_dict(slice_tp_state_dict(full, tensor_parallel_size=tp, tp_rank=other,
                                                  num_heads=MODEL["num_heads"]))
    if strip_sp:
        for p in model.parameters():
            if hasattr(p, "sequence_parallel"):
                del p.sequence_parallel
    return model


def rows(step: int, rank: int, world: int, tp: int) -> Any:
    """This rank's rows of global batch ``step``: its DP rank's slice (TP ranks of one DP rank share it)."""
    x, y = synthetic_batch(step, GLOBAL_ROWS, cfg(1), torch.device("cpu"))
    dp, dp_rank = world // tp, rank // tp
    per = GLOBAL_ROWS // dp
    return x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]


def train(model: Any, opt: Any, steps: range, rank: int, world: int, tp: int, clip: Optional[float] = None,
          *, fused_loss: bool = False) -> Dict[str, Any]:
    """``fused_loss``: the model computes its loss (``model(x, y)``) instead of ``loss_fn(model(x), y)``."""
    import torch.distributed as dist

    losses, norms, addresses = [], [], []
    for step in steps:
        x, y = rows(step, rank, world, tp)
        loss = model(x, y) if fused_loss else loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(model.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the TP ranks of a DP rank hold the same loss
        losses.append(float(total) / world)
        addresses.append(model.buffer_addresses())
    return {"losses": losses, "norms": norms, "addresses": addresses}


def _run(rank: int, world: int, kw: Dict[str, Any], *, explicit: bool = False, clip: Optional[float] = None,
         **model_kw: Any):
    import megatron_fsdp
    from fsdp_cudagraph.apps.model import TransformerBlock

    tp_group, dp_group = megatron_fsdp.tensor_parallel_groups(TP)
    how = dict(process_group=dp_group, tensor_parallel_group=tp_group) if explicit else dict(tensor_parallel_size=TP)
    model = megatron_fsdp.fully_shard(build(TP, tp_group, **model_kw), fsdp_unit_modules=[TransformerBlock],
                                      **kw, **how)
    opt = adam(model.optimizer_parameters())
    out = train(model, opt, range(STEPS), rank, world, TP, clip)
    out["params"] = model.state_dict()
    return model, opt, out


def _full_optim(model: Any, opt: Any) -> Dict[str, Dict[str, torch.Tensor]]:
    from megatron_fsdp._state_dict import gather_region

    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for u in model.all_units():
        for k, v in opt.state[u.main_shard].items():
            full = v.clone() if v.dim() == 0 else gather_region(model, u.layout, v, u)
            for n, view in zip(u.layout.names, u.layout.views(full) if v.dim() else [v] * len(u.layout.names)):
                out.setdefault(n, {})[k] = view.clone()
    return out


def _norms_of_one_backward(rank: int, world: int) -> Dict[str, float]:
    import megatron_fsdp
    from fsdp_cudagraph.apps.model import TransformerBlock

    model = megatron_fsdp.fully_shard(build(TP, megatron_fsdp.tensor_parallel_groups(TP)[0]),
                                      fsdp_unit_modules=[TransformerBlock], tensor_parallel_size=TP)
    x, y = rows(0, rank, world, TP)
    loss_fn(model(x), y).backward()
    return {"two": float(model.total_grad_norm(2.0)), "inf": float(model.total_grad_norm(float("inf")))}


def _nudged(model: GPT, group: Any) -> GPT:
    """TP rank 1's final layernorm differs from TP rank 0's (a replicated parameter that is not)."""
    import torch.distributed as dist

    if dist.get_rank(group) == 1:
        with torch.no_grad():
            model.ln_f.weight[0] += 1e-3
    return model


def _untagged(model: GPT) -> GPT:
    """TP shards without their tensor_model_parallel tag: the engine would take them for replicated."""
    for p in model.parameters():
        if hasattr(p, "tensor_model_parallel"):
            del p.tensor_model_parallel
    return model


def _refusals(rank: int, world: int) -> Dict[str, Optional[str]]:
    import torch.distributed as dist

    import megatron_fsdp
    from fsdp_cudagraph.apps.model import TransformerBlock

    tp_group, dp_group = megatron_fsdp.tensor_parallel_groups(TP)
    strided = None
    for members in ([0, 2], [1, 3]):  # every rank creates every group
        g = dist.new_group(members)
        if rank in members:
            strided = g
    calls = {
        "hsdp": lambda: (build(TP, tp_group), dict(tensor_parallel_size=TP, replicate_group=dp_group,
                                                   shard_group=dp_group)),
        "ep": lambda: (build(TP, tp_group), dict(tensor_parallel_size=TP, expert_parallel_size=2)),
        "not_dividing": lambda: (build(1, None), dict(tensor_parallel_size=3)),
        "group_ranks": lambda: (build(TP, strided), dict(tensor_parallel_size=TP)),
        "engine_without_tp": lambda: (build(TP, tp_group), dict()),
        "group_without_dp": lambda: (build(TP, tp_group), dict(tensor_parallel_group=tp_group)),
        "size_and_process_group": lambda: (build(TP, tp_group), dict(tensor_parallel_size=TP,
                                                                     process_group=dp_group)),
        "size_mismatch": lambda: (build(TP, tp_group), dict(tensor_parallel_size=4, tensor_parallel_group=tp_group,
                                                            process_group=dp_group)),
        "not_a_grid": lambda: (build(TP, tp_group), dict(tensor_parallel_group=tp_group, process_group=tp_group)),
        "replicated_differ": lambda: (_nudged(build(TP, tp_group), tp_group), dict(tensor_parallel_size=TP)),
        "untagged_shards": lambda: (_untagged(build(TP, tp_group)), dict(tensor_parallel_size=TP)),
    }
    out: Dict[str, Optional[str]] = {}
    for name, make in calls.items():
        model, kw = make()
        try:
            megatron_fsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock], **kw)
            out[name] = None
        except (ValueError, NotImplementedError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _four(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_fsdp import CaptureGuardMode, capture_guard

    res: Dict[str, Any] = {"rank": rank}
    model, _, res["zero3"] = _run(rank, world, CASES["zero3"])
    res["layout"] = {"tp": dist.get_process_group_ranks(model.tensor_parallel_group),
                     "dp": dist.get_process_group_ranks(model.group),
                     "units": [(u.name, u.shard_size) for u in model.all_units()],
                     "sizes": (model.tensor_parallel_size, model.world_size, model.dp_world_size)}
    for name, kw in CASES.items():
        if name != "zero3":
            res[name] = _run(rank, world, kw)[2]
    res["zero3+explicit"] = _run(rank, world, CASES["zero3"], explicit=True)[2]
    res["zero3+double_buffer+clip"] = _run(rank, world, CASES["zero3+double_buffer"], clip=CLIP)[2]
    res["no_shard+clip"] = _run(rank, world, CASES["no_shard"], clip=CLIP)[2]
    res["swapped"] = _run(rank, world, CASES["zero3"], swap=True)[2]
    res["no_tp_sum"] = _run(rank, world, CASES["zero3"], strip_sp=True)[2]
    res["norms"] = _norms_of_one_backward(rank, world)
    # the collective order of one step
    model, _, _ = _run(rank, world, CASES["zero3"])
    x, y = rows(0, rank, world, TP)
    log: List[str] = []
    with capture_guard(CaptureGuardMode.REFUSE, collective_log=log):
        loss_fn(model(x), y).backward()
    res["collectives"] = log
    # the checkpoint: 2x2, STEPS steps, with the full state beside it
    model, opt, _ = _run(rank, world, CASES["zero3"])
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=ckpt)
    res["saved"] = {"params": model.state_dict(), "optim": _full_optim(model, opt),
                    "keys": sorted(model.sharded_state_dict())}
    res["refused"] = _refusals(rank, world)
    return res


def _two(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import megatron_fsdp
    from fsdp_cudagraph.apps.model import TransformerBlock

    res: Dict[str, Any] = {"rank": rank}
    res["zero3"] = _run(rank, world, CASES["zero3"])[2]
    res["zero3+double_buffer+clip"] = _run(rank, world, CASES["zero3+double_buffer"], clip=CLIP)[2]
    res["no_shard"] = _run(rank, world, CASES["no_shard"])[2]
    res["swapped"] = _run(rank, world, CASES["zero3"], swap=True)[2]
    res["gqa"] = _run(rank, world, CASES["zero3"], gqa=True)[2]
    # the 2x2 checkpoint at 1x2
    tp_group = megatron_fsdp.tensor_parallel_groups(TP)[0]
    model = megatron_fsdp.fully_shard(build(TP, tp_group, seed=7), fsdp_unit_modules=[TransformerBlock],
                                      tensor_parallel_size=TP)  # other values: the load must replace them
    opt = adam(model.optimizer_parameters())
    sd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
    dcp.load({"model": sd, "optim": osd}, checkpoint_id=ckpt)
    model.load_sharded_state_dict(sd)
    model.load_optimizer_state_dict(opt, osd)
    res["after_load"] = {"params": model.state_dict(), "optim": _full_optim(model, opt)}
    res["continued"] = train(model, opt, range(STEPS, STEPS + 2), rank, world, TP)
    res["continued"]["params"] = model.state_dict()
    # at another TP: the plain model (TP=1, DP=2) finds no key for the TP shards
    plain = megatron_fsdp.fully_shard(build(1, None), fsdp_unit_modules=[TransformerBlock])
    try:
        dcp.load({"model": plain.sharded_state_dict()}, checkpoint_id=ckpt)
        res["other_tp"] = None
    except CheckpointException as exc:  # wraps each rank's error (a BaseException)
        res["other_tp"] = str(exc)
    try:
        plain.load_sharded_state_dict(sd)  # the TP=2 dict handed to the TP=1 model
        res["other_tp_dict"] = None
    except ValueError as exc:
        res["other_tp_dict"] = str(exc)
    return res


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_ckpt"))


@pytest.fixture(scope="module")
def four(ckpt_dir):
    return run_gloo(_four, 4, os.path.join(ckpt_dir, "tp2_w4"))


@pytest.fixture(scope="module")
def two(ckpt_dir, four):
    return run_gloo(_two, 2, os.path.join(ckpt_dir, "tp2_w4"))


def reference_run(num_steps: int, *, clip: Optional[float] = None, gqa: bool = False) -> Dict[str, Any]:
    """The TP=1 model on the whole global batch, one process: per-step loss (and norm), final parameters."""
    torch.manual_seed(0)
    model = GPT(cfg(1, gqa))
    opt = adam(model.parameters())
    losses, norms = [], []
    for step in range(num_steps):
        x, y = synthetic_batch(step, GLOBAL_ROWS, cfg(1), torch.device("cpu"))
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def reference():
    return {"plain": reference_run(STEPS), "clip": reference_run(STEPS, clip=CLIP),
            "continued": reference_run(STEPS + 2), "gqa": reference_run(STEPS, gqa=True)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def merged(per_rank: List[Dict[str, Any]], run: str, *, check_replicated: bool = True) -> Dict[str, torch.Tensor]:
    """The TP=1-shaped parameters of a run: each DP rank's TP ranks merged; every DP rank must agree."""
    kv = GQA["num_kv_heads"] if run == "gqa" else None
    rows_ = [merge_tp_state_dicts([per_rank[d * TP + q][run]["params"] for q in range(TP)],
                                  num_heads=MODEL["num_heads"], num_kv_heads=kv, check_replicated=check_replicated)
             for d in range(len(per_rank) // TP)]
    for other in rows_[1:]:
        assert all(torch.equal(other[k], rows_[0][k]) for k in rows_[0])
    return rows_[0]


def distance(per_rank: List[Dict[str, Any]], run: str, ref: Dict[str, Any], *, check_replicated: bool = True
             ) -> Dict[str, float]:
    for r in per_rank:
        assert r[run]["losses"] == per_rank[0][run]["losses"]  # the global loss, the same on every rank
        assert r[run]["norms"] == per_rank[0][run]["norms"]
    got = merged(per_rank, run, check_replicated=check_replicated)
    assert got.keys() == ref["params"].keys()
    out = {"param": max(_rel(got[k], v) for k, v in ref["params"].items()),
           "loss": max(abs(a - b) / abs(b) for a, b in zip(per_rank[0][run]["losses"], ref["losses"]))}
    if ref["norms"]:
        assert len(per_rank[0][run]["norms"]) == len(ref["norms"])
        out["norm"] = max(abs(a - b) / abs(b) for a, b in zip(per_rank[0][run]["norms"], ref["norms"]))
    return out


def _within(d: Dict[str, float]) -> None:
    assert all(v <= RTOL for v in d.values()), d


def test_layout(four):
    assert [r["layout"]["tp"] for r in four] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["layout"]["dp"] for r in four] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert four[0]["layout"]["sizes"] == (2, 2, 2)  # TP 2, shard group 2, data parallel 2
    assert all(size == 2 for _, size in four[0]["layout"]["units"])  # every unit sharded over DP only


@pytest.mark.parametrize("case", list(CASES) + ["zero3+explicit"])
def test_four_ranks_match_reference(four, reference, case):
    _within(distance(four, case, reference["plain"]))


@pytest.mark.parametrize("case", ["zero3", "no_shard", "gqa"])
def test_two_ranks_match_reference(two, reference, case):
    """``gqa``: grouped-query attention (4 query, 2 key/value heads): each TP rank holds 2 query heads and the
    key/value head they share."""
    _within(distance(two, case, reference["gqa" if case == "gqa" else "plain"]))


def test_clipping_matches_reference(four, two, reference):
    for per_rank, run in ((four, "zero3+double_buffer+clip"), (four, "no_shard+clip"),
                          (two, "zero3+double_buffer+clip")):
        d = distance(per_rank, run, reference["clip"])
        assert "norm" in d
        _within(d)


def test_total_norms_match_reference(four):
    torch.manual_seed(0)
    model = GPT(cfg(1))
    x, y = synthetic_batch(0, GLOBAL_ROWS, cfg(1), torch.device("cpu"))
    loss_fn(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    two_norm = float(torch.nn.utils.get_total_norm(grads, 2.0))
    inf_norm = float(torch.nn.utils.get_total_norm(grads, float("inf")))
    for r in four:
        assert abs(r["norms"]["two"] - two_norm) <= RTOL * two_norm, (r["norms"], two_norm)
        assert abs(r["norms"]["inf"] - inf_norm) <= RTOL * inf_norm, (r["norms"], inf_norm)


def test_double_buffer_addresses_fixed(four):
    for r in four:
        steps = r["zero3+double_buffer"]["addresses"]
        assert all(a == steps[0] for a in steps)


def test_sequence_parallel_grads_summed_over_tp_before_the_dp_reduction(four):
    log = four[0]["collectives"]
    for unit in ("layers.1", "layers.0", "<root>"):
        tp_sum = log.index(f"all-reduce of sequence-parallel gradients of unit {unit} over the tensor-parallel group")
        assert tp_sum < log.index(f"reduce-scatter of gradients of unit {unit}"), log


def test_checkpoint_2x2_loads_at_1x2(four, two, reference):
    keys = four[0]["saved"]["keys"]
    assert "layers.0.attn.qkv.weight@tp0of2" in keys and "layers.0.attn.ln.weight" in keys
    assert four[1]["saved"]["keys"][keys.index("layers.0.attn.qkv.weight@tp0of2")] == "layers.0.attn.qkv.weight@tp1of2"
    for q in range(TP):  # 1x2 rank q is TP rank q, as 2x2 ranks q and 2+q
        saved, loaded = four[q]["saved"], two[q]["after_load"]
        assert saved["params"].keys() == loaded["params"].keys()
        assert all(torch.equal(saved["params"][k], loaded["params"][k]) for k in saved["params"])
        assert saved["optim"].keys() == loaded["optim"].keys()
        for n, st in saved["optim"].items():
            assert all(torch.equal(v, loaded["optim"][n][k]) for k, v in st.items()), n
    cont = reference["continued"]
    _within(distance(two, "continued", {**cont, "losses": cont["losses"][STEPS:]}))


def test_checkpoint_at_another_tp_refused(two):
    for r in two:
        assert r["other_tp"] is not None and "layers.0.attn.qkv.weight" in r["other_tp"], r["other_tp"]
        msg = r["other_tp_dict"]
        assert msg is not None and ("@tp0of2" in msg or "@tp1of2" in msg), msg
        assert "same tensor_parallel_size (1 here)" in msg and "merge_tp_state_dicts" in msg, msg


def test_negative_controls(four, two, reference):
    # Swapping whole slices between the TP ranks relabels heads and MLP columns together: the same function (the
    # losses agree), other parameters; the merged parameters are what the reference check sees.
    for per_rank in (four, two):
        swapped = distance(per_rank, "swapped", reference["plain"])
        assert swapped["param"] > 100 * RTOL, swapped
    # Without the TP sum the layernorms drift apart between TP ranks (merging refuses) and away from the reference.
    with pytest.raises(ValueError, match="differs between TP ranks 0 and 1"):
        merged(four, "no_tp_sum")
    no_sum = distance(four, "no_tp_sum", reference["plain"], check_replicated=False)
    assert no_sum["param"] > 100 * RTOL, no_sum


def test_misuse_refused(four):
    for r in four:
        m = r["refused"]
        assert all(v is not None for v in m.values()), m
        assert m["hsdp"].startswith("NotImplementedError") and "hybrid sharding" in m["hsdp"], m["hsdp"]
        assert m["ep"].startswith("NotImplementedError") and "expert parallelism" in m["ep"], m["ep"]
        assert "tensor_parallel_size=3 does not divide the world size 4" in m["not_dividing"], m["not_dividing"]
        q = r["rank"]
        mine, theirs = [q % 2, q % 2 + 2], [q // 2 * 2, q // 2 * 2 + 1]
        assert (f"the model's tensor_parallel_group has ranks {mine} but the engine's tensor-parallel group has "
                f"{theirs}") in m["group_ranks"], m["group_ranks"]
        assert "tensor_parallel_groups(2)[0]" in m["group_ranks"]
        assert "fully_shard got no tensor parallelism" in m["engine_without_tp"] and \
               "tensor_parallel_size=2" in m["engine_without_tp"], m["engine_without_tp"]
        assert "without process_group=" in m["group_without_dp"], m["group_without_dp"]
        assert "tensor_parallel_size=2 and process_group=" in m["size_and_process_group"]
        assert "tensor_parallel_size=4 but tensor_parallel_group has 2 ranks" in m["size_mismatch"]
        assert "not a grid" in m["not_a_grid"] and "tensor_parallel_groups(tp)" in m["not_a_grid"], m["not_a_grid"]
        assert "parameters ['ln_f.weight'] are replicated over the tensor-parallel group" in m["replicated_differ"], \
            m["replicated_differ"]
        assert "layers.0.attn.qkv.weight" in m["untagged_shards"] and "tensor_model_parallel=True" in \
            m["untagged_shards"], m["untagged_shards"]


# ------------------------------------------------------------------ no process group


@pytest.mark.parametrize("kw,exc,words", [
    (dict(hidden_size=36, num_heads=3), ValueError, ["does not divide num_heads=3", "num_heads / TP"]),
    (dict(num_kv_heads=1), ValueError, ["does not divide num_kv_heads=1", "num_kv_heads / TP"]),
    (dict(ffn_hidden_size=65), ValueError, ["does not divide ffn_hidden_size=65"]),
    (dict(seq_len=15), ValueError, ["does not divide seq_len=15"]),
    (dict(sequence_parallel=False), NotImplementedError, ["sequence_parallel=False", "set sequence_parallel=True"]),
    (dict(moe_every=1), NotImplementedError, ["moe_every=1", "moe_every=0"]),
    (dict(rich_calls=True), NotImplementedError, ["rich_calls=True"]),
    (dict(tensor_parallel_size=0), ValueError, ["tensor_parallel_size=0", "positive integer"]),
])
def test_config_misuse_refused(kw, exc, words):
    base = {**MODEL, "tensor_parallel_size": TP, "sequence_parallel": True, **kw}
    with pytest.raises(exc) as info:
        GPTConfig(**base)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_missing_group_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\) needs the tensor-parallel process group.*"
                                         r"tensor_parallel_groups\(2\)"):
        GPT(cfg(TP))


def test_slices_round_trip():
    torch.manual_seed(0)
    full = GPT(cfg(1)).state_dict()
    for tp in (2, 4):
        parts = [slice_tp_state_dict(full, tensor_parallel_size=tp, tp_rank=q, num_heads=4) for q in range(tp)]
        assert parts[0]["layers.0.attn.qkv.weight"].shape == (96 // tp, 32)
        assert parts[1]["layers.0.attn.proj.weight"].shape == (32, 32 // tp)
        assert parts[1]["layers.1.mlp.fc2.weight"].shape == (32, 64 // tp)
        assert torch.equal(parts[1]["layers.0.attn.ln.weight"], full["layers.0.attn.ln.weight"])
        back = merge_tp_state_dicts(parts, num_heads=4)
        assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    # TP rank 1 of 2 holds heads 2 and 3 of each of q, k and v (head dim 8)
    q1 = slice_tp_state_dict(full, tensor_parallel_size=2, tp_rank=1, num_heads=4)["layers.0.attn.qkv.weight"]
    w = full["layers.0.attn.qkv.weight"]
    assert torch.equal(q1, torch.cat([w[16:32], w[48:64], w[80:96]]))
    # grouped-query attention, 4 query and 2 key/value heads: rank 1 holds query heads 2, 3 and key/value head 1
    torch.manual_seed(0)
    full = GPT(cfg(1, gqa=True)).state_dict()
    w = full["layers.0.attn.qkv.weight"]  # [q 0..3 | k 0..1 | v 0..1] x 8 rows each
    parts = [slice_tp_state_dict(full, tensor_parallel_size=2, tp_rank=q, num_heads=4, num_kv_heads=2) for q in range(2)]
    assert torch.equal(parts[1]["layers.0.attn.qkv.weight"], torch.cat([w[16:32], w[40:48], w[56:64]]))
    back = merge_tp_state_dicts(parts, num_heads=4, num_kv_heads=2)
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_tp_linears_are_made_on_the_default_device():
    # the TP slices' linears are filled by copy, made with skip_init; built inside `with torch.device(...)` (as
    # benchmarks build on the GPU) they must land there, not on the CPU where fully_shard would refuse the mix
    from fsdp_cudagraph.apps.tp import local_linear

    with torch.device("meta"):
        lin = local_linear(4, 8)
    assert lin.weight.device.type == "meta" and lin.bias.device.type == "meta"
    assert local_linear(4, 8).weight.device.type == "cpu"
