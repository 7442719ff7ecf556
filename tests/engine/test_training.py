"""CPU tests of the engine in training as users run it: gradient clipping, frozen parameters (also under
partial graphs on the protocol backend), activation checkpointing, the wrong-optimizer guard, and bf16
mixed precision, each against a single-process reference or against the same run without the feature.

Multi-process tests (marked ``gloo``) share one spawned 2-rank job per topic (see test_engine.py for why).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
from fsdp_cudagraph.apps.model import GPTConfig, loss_fn, synthetic_batch
from megatron_fsdp import MegatronFSDP
from tests.dist_utils import run_gloo
from tests.engine._common import (ATOL, CPU, GLOBAL_BATCH, NUM_STEPS, RTOL, STRATEGIES, build_gpt, global_loss, sgd,
                                  shard)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, cfg: GPTConfig, *, rank: int = 0,
               world: int = 1, before_step: Optional[Callable[[], Any]] = None) -> Tuple[torch.Tensor, Any]:
    """One step on this rank's rows of global batch ``step``; ``before_step`` runs between backward and step."""
    tokens, targets = synthetic_batch(step, GLOBAL_BATCH, cfg, CPU)
    per = GLOBAL_BATCH // world
    loss = loss_fn(model(tokens[rank * per : (rank + 1) * per]), targets[rank * per : (rank + 1) * per])
    loss.backward()
    extra = before_step() if before_step is not None else None
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), extra


def _error(fn: Callable[[], Any]) -> Optional[Tuple[str, str]]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests inspect type and message
        return type(exc).__name__, str(exc)
    return None


def _assert_close_state(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        # Tolerances: see [Note: matching tolerance] in _common.py (fp32, SGD, summation order only).
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


# --- clipping ---------------------------------------------------------------------------------------------------

#: Below every step's gradient norm in this model (about 0.9 at step 0; asserted), so every step clips.
MAX_NORM = 0.25
CLIP_CASES = {
    "optim_grads_params": dict(sharding_strategy="optim_grads_params"),
    "optim_grads+double_buffer": dict(sharding_strategy="optim_grads", fsdp_double_buffer=True),
    "no_shard": dict(sharding_strategy="no_shard"),
}


def _clip_job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, kwargs in CLIP_CASES.items():
        gpt, cfg = build_gpt()
        model = shard(gpt, **kwargs)
        opt = sgd(model.optimizer_parameters())
        losses, norms = [], []
        for step in range(NUM_STEPS):
            local, norm = train_step(model, opt, step, cfg, rank=rank, world=world,
                                     before_step=lambda: model.clip_grad_norm_(MAX_NORM))
            losses.append(global_loss(local, world))
            norms.append(norm.item())
        out[name] = dict(losses=losses, norms=norms, params=model.state_dict())
    # torch's clip over the main shards is refused (sharded strategies), and the inf norm is global too.
    gpt, cfg = build_gpt()
    model = shard(gpt, sharding_strategy="optim_grads_params")
    tokens, targets = synthetic_batch(0, GLOBAL_BATCH, cfg, CPU)
    per = GLOBAL_BATCH // world
    loss_fn(model(tokens[rank * per : (rank + 1) * per]), targets[rank * per : (rank + 1) * per]).backward()
    out["inf_norm"] = model.total_grad_norm(float("inf")).item()
    out["two_norm"] = model.total_grad_norm().item()
    out["torch_clip"] = _error(lambda: torch.nn.utils.clip_grad_norm_(model.optimizer_parameters(), 1.0))
    out["torch_clip_foreach"] = _error(
        lambda: torch.nn.utils.clip_grad_norm_(model.optimizer_parameters(), 1.0, foreach=False))
    out["local_norm_escape"] = model.optimizer_parameters()[0].grad.as_subclass(torch.Tensor).norm().item()
    return out


@functools.lru_cache(maxsize=None)
def clip_runs() -> List[Dict[str, Any]]:
    return run_gloo(_clip_job, 2)


@functools.lru_cache(maxsize=None)
def clip_reference() -> Dict[str, Any]:
    model, cfg = build_gpt()
    opt = sgd(model.parameters())
    losses, norms = [], []
    for step in range(NUM_STEPS):
        loss, norm = train_step(model, opt, step, cfg,
                                before_step=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        losses.append(loss.item())
        norms.append(norm.item())
    first, cfg = build_gpt()
    tokens, targets = synthetic_batch(0, GLOBAL_BATCH, cfg, CPU)
    loss_fn(first(tokens), targets).backward()
    grads = [p.grad for p in first.parameters()]
    inf = max(g.abs().max().item() for g in grads)
    return dict(losses=losses, norms=norms, params={k: v.detach().clone() for k, v in model.state_dict().items()},
                inf_norm=inf, two_norm=torch.nn.utils.get_total_norm(grads).item())


@pytest.mark.gloo
@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clip_grad_norm_matches_single_process_clipping(case):
    ref = clip_reference()
    assert min(ref["norms"]) > 2 * MAX_NORM, ref["norms"]  # every step clips: the comparison is not vacuous
    for rank_result in clip_runs():
        run = rank_result[case]
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        _assert_close_state(run["params"], ref["params"])


@pytest.mark.gloo
def test_clip_norms_are_global_and_torch_clip_on_shards_is_refused():
    ref = clip_reference()
    for rank_result in clip_runs():
        assert rank_result["inf_norm"] == pytest.approx(ref["inf_norm"], rel=1e-6)
        assert rank_result["two_norm"] == pytest.approx(ref["two_norm"], rel=1e-5)
        for key in ("torch_clip", "torch_clip_foreach"):
            kind, msg = rank_result[key]
            assert kind == "RuntimeError", msg
            assert "model.clip_grad_norm_(max_norm)" in msg and "this rank's share" in msg, msg
        assert 0 < rank_result["local_norm_escape"] < ref["two_norm"]  # a shard's own norm, on purpose


# --- frozen parameters ------------------------------------------------------------------------------------------

# A root parameter, parts of two units, and the whole last unit (which then has nothing to step).
FROZEN = ("tok.weight", "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias", "layers.1.moe.experts.w1")
FROZEN_UNIT = "layers.2"
FROZEN_CASES = [(s, False) for s in STRATEGIES] + [("optim_grads_params", True)]


def frozen_gpt(seed: int = 0):
    gpt, cfg = build_gpt(seed=seed)
    for name in FROZEN:
        gpt.get_parameter(name).requires_grad_(False)
    gpt.get_submodule(FROZEN_UNIT).requires_grad_(False)
    return gpt, cfg


def _graph_config(modules: List[str]) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=modules, use_megatron_fsdp=True,
                           fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                           cuda_graph_warmup_steps=2, cuda_graph_num_warmup_iters=2)


def _frozen_job(rank: int, world: int) -> Dict[Any, Any]:
    out: Dict[Any, Any] = {}
    for strategy, double_buffer in FROZEN_CASES:
        gpt, cfg = frozen_gpt()
        model = shard(gpt, sharding_strategy=strategy, fsdp_double_buffer=double_buffer)
        initial = model.state_dict()
        opt = sgd(model.optimizer_parameters())
        losses = [global_loss(train_step(model, opt, s, cfg, rank=rank, world=world)[0], world) for s in range(NUM_STEPS)]
        units = {u.name: u for u in model.all_units()}
        out[(strategy, double_buffer)] = dict(
            losses=losses, params=model.state_dict(), initial=initial,
            num_optimizer_params=len(model.optimizer_parameters()),
            optimizer_numel=sum(p.numel() for p in model.optimizer_parameters()),
            regions={n: (u.grad_numel, u.numel, u.grad_buffer.tensor.numel()) for n, u in units.items()},
        )
    # Partial graphs (CPU protocol backend) over units that hold frozen parameters: bit-exact with eager.
    for modules in ([], ["attn"]):
        runs = []
        for graphed in (False, True):
            gpt, cfg = frozen_gpt()
            model = shard(gpt, sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                          fsdp_db_use_persist_buf_on_alloc_fail=True)
            opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
            graphs = PartialCudaGraphs(model, _graph_config(modules), backend="protocol") if graphed else None
            losses = []
            for s in range(5):
                if graphs is not None and s == 2:
                    graphs.capture()
                losses.append(train_step(model, opt, s, cfg, rank=rank, world=world)[0].item())
            runs.append((losses, model.state_dict(), graphs.report.callables if graphs is not None else None))
            if graphs is not None:
                graphs.delete()
        out[("graphs", tuple(modules))] = runs
    return out


@functools.lru_cache(maxsize=None)
def frozen_runs() -> List[Dict[Any, Any]]:
    return run_gloo(_frozen_job, 2)


@functools.lru_cache(maxsize=None)
def frozen_reference() -> Dict[str, Any]:
    model, cfg = frozen_gpt()
    opt = sgd([p for p in model.parameters() if p.requires_grad])
    losses = [train_step(model, opt, s, cfg)[0].item() for s in range(NUM_STEPS)]
    return dict(losses=losses, params={k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer", FROZEN_CASES)
def test_frozen_parameters_train_like_the_reference(strategy, double_buffer):
    ref = frozen_reference()
    frozen = set(FROZEN) | {n for n in ref["params"] if n.startswith(FROZEN_UNIT + ".")}
    trainable = set(ref["params"]) - frozen
    for rank_result in frozen_runs():
        run = rank_result[(strategy, double_buffer)]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        _assert_close_state(run["params"], ref["params"])
        for name in frozen:
            assert torch.equal(run["params"][name], run["initial"][name]), name  # not stepped at all
        assert any(not torch.equal(run["params"][n], run["initial"][n]) for n in trainable)
        # Not in the optimizer or in gradient buffers: the fully frozen unit has no optimizer shard, and the
        # gradient buffers cover the trainable region only.
        assert run["num_optimizer_params"] == 3  # root, layers.0, layers.1
        grad_numel, numel, grad_buffer_numel = run["regions"][FROZEN_UNIT]
        assert grad_numel == 0 < numel
        for unit in ("layers.0", "layers.1", "<root>"):
            grad_numel, numel, grad_buffer_numel = run["regions"][unit]
            assert 0 < grad_numel < numel
            if not double_buffer:  # a double-buffer slot is sized for the largest unit
                assert grad_buffer_numel == grad_numel
        shards = 1 if strategy == "no_shard" else 2
        trainable_region = sum(grad_numel for grad_numel, _, _ in run["regions"].values())
        assert run["optimizer_numel"] * shards == trainable_region
        assert sum(ref["params"][n].numel() for n in trainable) <= trainable_region


@pytest.mark.gloo
@pytest.mark.parametrize("modules", [[], ["attn"]])
def test_partial_graphs_on_units_with_frozen_parameters(modules):
    for rank_result in frozen_runs():
        (eager_losses, eager_params, _), (graph_losses, graph_params, callables) = rank_result[("graphs", tuple(modules))]
        assert callables and (modules or callables == ["layers.0", "layers.1", "layers.2"])
        assert graph_losses == eager_losses  # bit for bit
        assert all(torch.equal(graph_params[k], eager_params[k]) for k in eager_params)


def test_frozen_flag_changed_after_fully_shard_is_refused(one_rank_group):
    gpt, cfg = frozen_gpt()
    model = shard(gpt)
    gpt.tok.weight.requires_grad_(True)  # unfrozen after sharding: it would get a gradient with nowhere to go
    with pytest.raises(RuntimeError, match=r"parameters \['tok\.weight'\] of unit <root> were frozen"):
        train_step(model, sgd(model.optimizer_parameters()), 0, cfg)
    gpt, cfg = frozen_gpt()
    model = shard(gpt)
    gpt.head.weight.requires_grad_(False)  # frozen after sharding: the optimizer would still move it
    with pytest.raises(RuntimeError, match=r"parameter head\.weight of unit <root> was trainable"):
        train_step(model, sgd(model.optimizer_parameters()), 0, cfg)


# --- the wrong optimizer parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("params", ["model.parameters()", "model.module.parameters()"])
def test_optimizer_over_compute_views_is_refused(one_rank_group, params):
    gpt, cfg = build_gpt()
    model = shard(gpt)
    wrong = torch.optim.Adam(eval(params, {"model": model}), lr=1e-3)  # noqa: S307 - a fixed expression
    with pytest.raises(ValueError, match=r"Adam steps parameter .*compute view of FSDP unit .*"
                                         r"model\.optimizer_parameters\(\)"):
        train_step(model, wrong, 0, cfg)
    right = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    before = model.state_dict()["head.weight"]
    train_step(model, right, 1, cfg)
    assert not torch.equal(model.state_dict()["head.weight"], before)  # the right optimizer steps and trains


# --- activation checkpointing -----------------------------------------------------------------------------------


class _CheckpointedLayers(nn.ModuleList):
    """A ModuleList whose iteration hands out each layer under ``torch.utils.checkpoint``: the model's own
    ``for layer in self.layers: x = layer(x)`` then checkpoints every layer, as a model's forward loop would."""

    use_reentrant = False

    def __iter__(self):
        for layer in super().__iter__():
            yield functools.partial(checkpoint, layer, use_reentrant=self.use_reentrant)


def _checkpointed(variant: str, **kwargs: Any) -> Tuple[MegatronFSDP, GPTConfig]:
    gpt, cfg = build_gpt()
    if variant in ("nonreentrant", "reentrant"):
        layers = _CheckpointedLayers(gpt.layers)
        layers.use_reentrant = variant == "reentrant"
        gpt.layers = layers
    elif variant == "wrapper_before":
        for i in range(len(gpt.layers)):
            gpt.layers[i] = checkpoint_wrapper(gpt.layers[i])
    model = shard(gpt, **kwargs)
    if variant == "wrapper_after":
        for i in range(len(gpt.layers)):
            gpt.layers[i] = checkpoint_wrapper(gpt.layers[i])
    return model, cfg


CKPT_CASES = [("optim_grads_params", False, v) for v in ("nonreentrant", "reentrant", "wrapper_before", "wrapper_after")]
CKPT_CASES += [("optim_grads_params", True, "nonreentrant"), ("optim_grads_params", True, "reentrant"),
               ("optim_grads", False, "nonreentrant"), ("no_shard", False, "reentrant")]


def _ckpt_job(rank: int, world: int) -> Dict[Any, Any]:
    out: Dict[Any, Any] = {}
    for strategy, double_buffer, variant in sorted(set(CKPT_CASES) | {(s, db, "none") for s, db, _ in CKPT_CASES}):
        model, cfg = _checkpointed(variant, sharding_strategy=strategy, fsdp_double_buffer=double_buffer)
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        model.trace = []
        losses = [global_loss(train_step(model, opt, s, cfg, rank=rank, world=world)[0], world) for s in range(4)]
        recomputes = sorted({name.replace("._checkpoint_wrapped_module", "") for phase, name, _ in model.trace
                             if phase == "pre_recompute"})
        out[(strategy, double_buffer, variant)] = dict(
            losses=losses, params=model.state_dict(), recomputes=recomputes,
            uses_recompute=[model.unit_uses_recompute(u) for u in model.units],
        )
    # Partial graphs of checkpointed units are refused at capture (after an eager step showed the recompute,
    # or at once for a checkpoint_wrapper), naming the units.
    for variant in ("nonreentrant", "wrapper_before"):
        model, cfg = _checkpointed(variant, sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                   fsdp_db_use_persist_buf_on_alloc_fail=True)
        graphs = PartialCudaGraphs(model, _graph_config(["attn"]), backend="protocol")
        opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
        train_step(model, opt, 0, cfg, rank=rank, world=world)
        out[("graphs", variant)] = _error(graphs.capture)
        graphs.delete()
    return out


@functools.lru_cache(maxsize=None)
def ckpt_runs() -> List[Dict[Any, Any]]:
    return run_gloo(_ckpt_job, 2)


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer, variant", CKPT_CASES)
def test_checkpointed_units_match_plain_units(strategy, double_buffer, variant):
    plain_keys = set(build_gpt()[0].state_dict())
    for rank_result in ckpt_runs():
        run, base = rank_result[(strategy, double_buffer, variant)], rank_result[(strategy, double_buffer, "none")]
        assert run["recomputes"] == ["layers.0", "layers.1", "layers.2"]  # the recompute really ran
        assert base["recomputes"] == []
        assert run["uses_recompute"] == [True] * 3 and base["uses_recompute"] == [False] * 3
        assert run["losses"] == base["losses"]  # bit for bit: the recompute is the same computation
        assert set(run["params"]) == plain_keys  # checkpoint_wrapper's segment is not in the keys
        assert all(torch.equal(run["params"][k], base["params"][k]) for k in plain_keys)


@pytest.mark.gloo
@pytest.mark.parametrize("variant", ["nonreentrant", "wrapper_before"])
def test_partial_graphs_of_checkpointed_units_are_refused(variant):
    for rank_result in ckpt_runs():
        kind, msg = rank_result[("graphs", variant)]
        assert kind == "NotImplementedError", msg
        assert "activation checkpointing" in msg and "layers.0" in msg, msg


# --- bf16 mixed precision ---------------------------------------------------------------------------------------

# [Note: bf16 tolerance]
# The reference emulates the engine's mixed precision in one process: fp32 master weights, a bf16 copy for
# forward and backward, bf16 gradients cast to fp32, SGD on the master. What differs is where bf16 rounds:
# the reference rounds each gradient of the whole batch once; the engine rounds each rank's half-batch
# gradient and adds the halves in fp32. Measured (2 Gloo ranks, 10 SGD steps, lr 0.1, momentum 0.9; torch
# 2.13 CPU): max |engine - reference| over all final parameters 2.04e-3, the same for every strategy and
# buffer mode; losses within 6.5e-4. BF16_ATOL = 6e-3 is 2.9x the parameter difference and
# BF16_LOSS_ATOL = 2e-3 3.1x the loss difference. An engine that does not train (lr=0: final parameters equal
# initial ones) is 0.071 away from the reference's final parameters, 12x BF16_ATOL, and every unit's own
# parameters move by 0.018 to 0.071 (asserted below, > BF16_ATOL each), so an engine that drops any one
# unit's update fails too.
BF16_ATOL = 6e-3
BF16_LOSS_ATOL = 2e-3
BF16_CASES = [(s, False) for s in STRATEGIES] + [("optim_grads_params", True)]


def _bf16_job(rank: int, world: int) -> Dict[Any, Any]:
    out: Dict[Any, Any] = {}
    for strategy, double_buffer in BF16_CASES:
        gpt, cfg = build_gpt()
        model = shard(gpt, sharding_strategy=strategy, fsdp_double_buffer=double_buffer, compute_dtype=torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in gpt.parameters())
        opt = sgd(model.optimizer_parameters())
        losses = [global_loss(train_step(model, opt, s, cfg, rank=rank, world=world)[0], world) for s in range(NUM_STEPS)]
        out[(strategy, double_buffer)] = dict(losses=losses, params=model.state_dict())
    return out


@functools.lru_cache(maxsize=None)
def bf16_runs() -> List[Dict[Any, Any]]:
    return run_gloo(_bf16_job, 2)


@functools.lru_cache(maxsize=None)
def bf16_reference() -> Dict[str, Any]:
    master, cfg = build_gpt()
    initial = {k: v.detach().clone() for k, v in master.state_dict().items()}
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = sgd(master.parameters())
    losses = []
    for step in range(NUM_STEPS):
        with torch.no_grad():
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pc.copy_(pm)
        tokens, targets = synthetic_batch(step, GLOBAL_BATCH, cfg, CPU)
        loss = loss_fn(compute(tokens), targets)
        loss.backward()
        for pc, pm in zip(compute.parameters(), master.parameters()):
            pm.grad, pc.grad = pc.grad.float(), None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, params={k: v.detach().clone() for k, v in master.state_dict().items()}, initial=initial)


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer", BF16_CASES)
def test_bf16_training_matches_mixed_precision_reference(strategy, double_buffer):
    ref = bf16_reference()
    # The guard of [Note: bf16 tolerance]: a run that leaves all parameters (or one unit's) where they
    # started would fail the comparison below.
    assert _max_diff(ref["initial"], ref["params"]) > 10 * BF16_ATOL
    for unit in ("layers.0.", "layers.1.", "layers.2.", ""):
        keys = [k for k in ref["params"] if k.startswith(unit) and (unit or not k.startswith("layers."))]
        assert _max_diff({k: ref["initial"][k] for k in keys}, {k: ref["params"][k] for k in keys}) > BF16_ATOL, unit
    for rank_result in bf16_runs():
        run = rank_result[(strategy, double_buffer)]
        diff = _max_diff(run["params"], ref["params"])
        assert math.isfinite(diff) and diff <= BF16_ATOL, f"max |engine - reference| = {diff:.2e}"
        losses = torch.tensor(run["losses"])
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=0, atol=BF16_LOSS_ATOL)


@pytest.mark.gloo
def test_zero3_casts_on_gather_to_the_same_bits_as_zero2():
    """ZeRO-3 keeps no bf16 copy of its shards: it casts the fp32 shard into its slice of the gather buffer and
    gathers in place ([Note: cast on gather], _unit.py). ZeRO-2 (``optim_grads``) all-gathers the same cast
    shards out of place, and both reduce-scatter the same gradients, so every loss and final parameter must be
    the same bits, with on-demand buffers and with the double buffer; a gather that read a stale or half-cast
    slice would not be."""
    for rank_result in bf16_runs():
        zero2 = rank_result[("optim_grads", False)]
        for double_buffer in (False, True):
            zero3 = rank_result[("optim_grads_params", double_buffer)]
            assert zero3["losses"] == zero2["losses"], double_buffer
            assert zero3["params"].keys() == zero2["params"].keys()
            for k, v in zero2["params"].items():
                assert torch.equal(zero3["params"][k], v), (double_buffer, k)


def test_gradient_fold_zeroes_exactly_what_no_gradient_covers():
    """[Note: the gradient fold] copies each present gradient into its view and zeroes the rest; the rest is
    the alignment gaps, the tail padding and the views of absent gradients, merged where they touch."""
    from megatron_fsdp._flat import ALIGN_NUMEL, FlatLayout
    from megatron_fsdp._reduce import _gaps

    params = [nn.Parameter(torch.zeros(n)) for n in (10, ALIGN_NUMEL, 3)]
    layout = FlatLayout(["a", "b", "c"], params, world_size=2)
    a, b, c = layout.offsets
    assert (a, b, c) == (0, ALIGN_NUMEL, 2 * ALIGN_NUMEL) and layout.total_numel == 4 * ALIGN_NUMEL
    assert _gaps(layout, [False, False, False]) == [(10, ALIGN_NUMEL), (c + 3, layout.total_numel)]
    assert _gaps(layout, [False, True, False]) == [(10, 2 * ALIGN_NUMEL), (c + 3, layout.total_numel)]
    assert _gaps(layout, [True, False, True]) == [(0, ALIGN_NUMEL), (c, layout.total_numel)]
    covered = torch.zeros(layout.total_numel, dtype=torch.bool)
    for absent in ([False] * 3, [True, False, False], [False, False, True]):
        covered.zero_()
        for (off, n), gone in zip(zip(layout.offsets, layout.numels), absent):
            if not gone:
                covered[off:off + n] = True
        for lo, hi in _gaps(layout, absent):
            assert not covered[lo:hi].any()
            covered[lo:hi] = True
        assert covered.all(), absent
