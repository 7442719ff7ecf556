"""``fully_shard(keep_compute_shard=True)``: ZeRO-3 casts each unit's fp32 shards to the compute dtype once per
change of the shards and gathers from that copy ([Note: cast on gather] in ``megatron_fsdp/_unit.py``).

Must hold, on Gloo (bf16 compute, two micro-batches a step, clipping, Adam):

- 1 and 2 ranks (and at 2, expert parallelism and HSDP 2 x 1): every loss and the final state ``torch.equal`` to the
  same run casting at every gather; the main shards are cast once a step (one cast per unit region and step), where
  the default casts at every gather; a unit whose shard group has one rank keeps the cast in an unshard buffer of
  its own (no copy, no slot), the others keep a copy and gather into their slot;
- a checkpoint loaded mid-run (the shards change outside the optimizer), frozen parameters (a region of their own),
  per-layer graphs (protocol backend) and a full-iteration graph (protocol backend, graphed optimizer step and
  eager one): the same bits as casting at every gather;
- a gather inside a (simulated) capture does not use the copy: the captured work must not depend on a host
  decision about freshness;
- refused where there is nothing to keep (strategies that keep unsharded compute parameters, fp32 compute).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import pytest
import torch

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo
from tests.engine._common import accumulated_step, protocol_layer_graphs

pytestmark = pytest.mark.gloo

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=3, seq_len=16, moe_every=0)
MOE = dict(moe_every=1, num_experts=4, moe_top_k=2, ffn_hidden_size=48, moe_experts="split")
STEPS = 4
MICRO = 2


@contextlib.contextmanager
def _shard_casts(model: Any) -> Iterator[Dict[str, int]]:
    """Count the copies whose source is one of ``model``'s main or frozen shards and whose destination has another
    dtype: the fp32 -> compute-dtype casts of the gathers."""
    shards = {u.main_shard.data_ptr(): "main" for u in model.all_units()}
    shards.update({u.frozen_shard.data_ptr(): "frozen" for u in model.all_units() if u.frozen_shard.numel()})
    counts = {"main": 0, "frozen": 0}
    original = torch.Tensor.copy_

    def counting(dst: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and dst.dtype != src.dtype and src.data_ptr() in shards:
            counts[shards[src.data_ptr()]] += 1
        return original(dst, src, *args, **kwargs)

    torch.Tensor.copy_ = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]


def _train(rank: int, world: int, keep: bool, *, frozen: bool = False, reload: bool = False,
           graphed: bool = False, ep: int = 1, hsdp: bool = False) -> Dict[str, Any]:
    import torch.distributed as dist

    import megatron_fsdp

    extra: Dict[str, Any] = {}
    if hsdp:  # 2 x 1: replicas across the two ranks, shard groups of one
        pair, singles = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(world)]
        extra = dict(replicate_group=pair, shard_group=singles[rank])
    torch.manual_seed(0)
    if ep > 1:  # expert parallelism: each expert bucket gathers over its own (expert-data-parallel) group
        cfg = GPTConfig(**{**MODEL, **MOE}, expert_parallel_size=ep)
        gpt = GPT(cfg, expert_parallel_group=megatron_fsdp.expert_parallel_groups(ep)[0])
        extra = dict(expert_parallel_size=ep)
    else:
        cfg = GPTConfig(**MODEL)
        gpt = GPT(cfg)
    if frozen:  # one block's norms frozen: a frozen region beside the main one
        for p in gpt.layers[1].attn.ln.parameters():
            p.requires_grad_(False)
    model = fully_shard(gpt, fsdp_unit_modules=[TransformerBlock], compute_dtype=torch.bfloat16,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True, keep_compute_shard=keep,
                        **extra)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
    graphs = None
    if graphed:
        graphs = protocol_layer_graphs(model)
    losses: List[torch.Tensor] = []
    saved = None
    with _shard_casts(model) as casts:
        for step in range(STEPS + (2 if reload else 0)):
            if graphs is not None and step == 1:
                graphs.capture()
            if reload and step == 2:
                saved = model.state_dict()
            if reload and step == STEPS:
                model.load_state_dict(saved)  # the shards change outside the optimizer
            x, y = synthetic_batch(step, MICRO * 2 * world, cfg, torch.device("cpu"))
            losses.append(accumulated_step(model, opt, x, y, rank, MICRO))
    if graphs is not None:
        graphs.delete()
    units = list(model.all_units())
    regions = {"main": len(units), "frozen": sum(1 for u in units if u.frozen_shard.numel())}
    return {"losses": losses, "state": model.state_dict(), "casts": dict(casts), "regions": regions,
            "steps": STEPS + (2 if reload else 0), "units": sorted(u.name for u in units),
            "with copy": sorted(u.name for u in units if u._kept),
            "own buffer": sorted(u.name for u in units if u.param_buffer.kind == "persistent")}


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    bad = [f"loss {i}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if not torch.equal(x, y)]
    return bad + [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]


def _pairs(rank: int, world: int) -> Dict[str, Any]:
    out = {"plain": {keep: _train(rank, world, keep) for keep in (False, True)}}
    if world == 1:
        out["frozen, reloaded"] = {keep: _train(rank, world, keep, frozen=True, reload=True) for keep in (False, True)}
        out["per-layer graphs"] = {keep: _train(rank, world, keep, graphed=True) for keep in (False, True)}
    else:
        out["expert parallel 2"] = {keep: _train(rank, world, keep, ep=2) for keep in (False, True)}
        out["HSDP 2 x 1"] = {keep: _train(rank, world, keep, hsdp=True) for keep in (False, True)}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_kept_copy_trains_the_same_bits_and_casts_once_a_step(world):
    for rank, runs in enumerate(run_gloo(_pairs, world)):
        for case, pair in runs.items():
            cast, kept = pair[False], pair[True]
            # where the copy lives: a unit whose shard group has one rank (one rank, HSDP 2 x 1's shard groups, the
            # expert buckets at EP = world) keeps its cast in a buffer of its own, no copy and no slot; the root has
            # its own buffer anyway; the other units keep a copy and gather into their slot
            assert cast["own buffer"] == ["<root>"] and cast["with copy"] == [], (case, cast)
            one_rank = [u for u in kept["units"] if world == 1 or case.startswith("HSDP") or u.endswith("[experts]")]
            assert kept["own buffer"] == sorted(set(one_rank) | {"<root>"}), (case, kept["own buffer"])
            assert kept["with copy"] == [u for u in kept["units"] if u not in kept["own buffer"]], (case, kept)
            assert _same(cast, kept) == [], (world, rank, case, _same(cast, kept))
            steps = kept["steps"]
            # one cast per region and step (a load marks the shards changed: the step after it casts once, as any);
            # capturing per-layer graphs gathers the layers once more and leaves the shards marked changed
            once = {r: n * steps for r, n in kept["regions"].items()}
            if case == "per-layer graphs":
                assert once["main"] < kept["casts"]["main"] <= once["main"] + kept["regions"]["main"], kept["casts"]
            else:
                assert kept["casts"] == once, (case, kept["casts"])
            # the default casts at every gather (each micro-batch's forward at least)
            assert cast["casts"]["main"] > kept["casts"]["main"], (case, cast["casts"], kept["casts"])


# --------------------------------------------------------------------------- full-iteration graph (protocol)


def _full_iteration(rank: int, world: int) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph
    from tests.engine._common import eager_losses

    def forward_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(x), y) / MICRO

    def run(keep: bool, graphed: bool, graph_optimizer: bool) -> Dict[str, Any]:
        torch.manual_seed(0)
        cfg = GPTConfig(**MODEL)
        model = fully_shard(GPT(cfg), fsdp_unit_modules=[TransformerBlock], compute_dtype=torch.bfloat16,
                            fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                            keep_compute_shard=keep)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
        g = FullIterationCudaGraph(model, forward_step, CudaGraphConfig(
            cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=2), graph_optimizer=graph_optimizer) \
            if graphed else None
        losses = []
        for step in range(6):
            x, y = synthetic_batch(step, MICRO * 2 * world, cfg, torch.device("cpu"))
            batches = [(x[(rank * MICRO + m) * 2:(rank * MICRO + m) * 2 + 2],
                        y[(rank * MICRO + m) * 2:(rank * MICRO + m) * 2 + 2]) for m in range(MICRO)]
            if g is None:
                losses.append(eager_losses(forward_step, model, batches))
                opt.step()
            else:
                losses.append(g.step(batches))
                g.optimizer_step(opt)
            opt.zero_grad()
        if g is not None:
            g.delete()
        return {"losses": losses, "state": model.full_state_dict()}

    ref = run(False, False, False)
    return {f"graph_optimizer={go}": (ref, run(True, True, go)) for go in (True, False)}


@pytest.mark.parametrize("world", [1, 2])
def test_kept_copy_under_a_full_iteration_graph(world):
    """At 2 ranks the layers gather from their copies; at one, every unit holds its cast in a buffer of its own."""
    for rank, runs in enumerate(run_gloo(_full_iteration, world)):
        for case, (ref, kept) in runs.items():
            assert _same(ref, kept) == [], (rank, case, _same(ref, kept))


def _inside_capture(rank: int, world: int) -> Dict[str, Any]:
    """A gather under a (simulated) capture casts from the shard itself and leaves the kept copy alone."""
    from megatron_fsdp import CaptureGuardMode, capture_guard, simulated_capture

    torch.manual_seed(0)
    model = fully_shard(GPT(GPTConfig(**MODEL)), fsdp_unit_modules=[TransformerBlock], compute_dtype=torch.bfloat16,
                        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True, keep_compute_shard=True)
    unit = model.units[0]
    out = torch.empty(unit.param_buffer.tensor[: unit.grad_numel].shape, dtype=torch.bfloat16)
    with capture_guard(CaptureGuardMode.ALLOW_COLLECTIVES), simulated_capture():
        unit._gather(out, unit.main_shard.detach(), "a captured gather", "main").wait()
    captured = {"allocated": "main" in unit._kept, "fresh": unit._kept_fresh["main"]}
    eager = torch.empty_like(out)
    unit._gather(eager, unit.main_shard.detach(), "an eager gather", "main").wait()
    return {"captured": captured, "equal": torch.equal(out, eager), "kept after eager": "main" in unit._kept}


def test_a_captured_gather_casts_from_the_shard():
    for res in run_gloo(_inside_capture, 2):
        assert res["captured"] == {"allocated": False, "fresh": False}, res
        assert res["kept after eager"] and res["equal"], res


def _refusals(rank: int, world: int) -> Dict[str, str]:
    from tests.dist_utils import outcome

    def build(**kw: Any) -> None:
        fully_shard(GPT(GPTConfig(**MODEL)), fsdp_unit_modules=[TransformerBlock], keep_compute_shard=True, **kw)

    return {"optim_grads": outcome(lambda: build(sharding_strategy="optim_grads", compute_dtype=torch.bfloat16),
                                   ValueError),
            "fp32": outcome(lambda: build(compute_dtype=torch.float32), ValueError)}


def test_nothing_to_keep_is_refused_with_the_fix():
    res = run_gloo(_refusals, 1)[0]
    assert "keep_compute_shard=True" in res["optim_grads"] and "'optim_grads'" in res["optim_grads"], res
    assert "compute_dtype=torch.float32" in res["fp32"] and "drop keep_compute_shard" in res["fp32"], res
