"""CPU tests of the megatron_fsdp engine: Gloo training against a single-process reference, double-buffer
address stability, checkpoint round trips, recovery from a failed step, and input validation.

Multi-process tests (marked ``gloo``) run several configurations inside one spawned job, because starting
the ranks costs more than training the tiny model; the job's results are cached per module so that
parametrized tests share a job.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megatron_fsdp._collectives as collectives
from fsdp_cudagraph.apps.model import GPT, Experts, GPTConfig, Router, SelfAttention, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import MegatronFSDP, fully_shard
from tests.dist_utils import run_gloo
from tests.engine._common import (ATOL, CPU, GLOBAL_BATCH, NUM_STEPS, RTOL, STRATEGIES, adam, assert_tensors_equal, build_gpt,
                                  fsdp_step, local_step, optimizer_state_tensors, sgd, shard)

# --- 1. and 6.: training matches a single-process reference; prefetch changes nothing ---------------------------

# name -> (fully_shard keyword arguments, micro-batches per step)
MATCH_CASES: Dict[str, Tuple[Dict[str, Any], int]] = {
    **{s: (dict(sharding_strategy=s), 1) for s in STRATEGIES},
    "optim_grads_params+double_buffer": (
        dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True), 1),
    "optim_grads_params+accumulate2": (dict(sharding_strategy="optim_grads_params"), 2),
    "optim_grads+double_buffer+accumulate2": (
        dict(sharding_strategy="optim_grads", fsdp_double_buffer=True), 2),
    # Nested units (each attention block is a unit inside its layer's unit): with double buffering the inner
    # unit's prefetch of the next layer must not overwrite the slot the enclosing layer still computes in.
    "optim_grads_params+double_buffer+nested_units": (
        dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
             fsdp_unit_modules=[TransformerBlock, SelfAttention]), 1),
}
PREFETCH_CASES: Dict[str, Tuple[Dict[str, Any], int]] = {
    f"{name}+no_prefetch": ({**MATCH_CASES[name][0], "prefetch": False}, MATCH_CASES[name][1])
    for name in ("optim_grads_params", "optim_grads_params+double_buffer", "optim_grads")
}


def _train_cases(rank: int, world: int, cases: Dict[str, Tuple[Dict[str, Any], int]]) -> Dict[str, Any]:
    out = {}
    for name, (kwargs, num_micro) in cases.items():
        gpt, cfg = build_gpt()
        model = shard(gpt, **kwargs)
        optimizer = sgd(model.optimizer_parameters())
        losses = [fsdp_step(model, optimizer, step, cfg, rank, world, num_micro) for step in range(NUM_STEPS)]
        out[name] = (losses, model.full_state_dict())
    return out


@functools.lru_cache(maxsize=None)
def matching_runs(world: int) -> Dict[str, Any]:
    """One Gloo job per world size; every rank's results (losses and full state dict per case)."""
    cases = {**MATCH_CASES, **(PREFETCH_CASES if world == 2 else {})}
    return run_gloo(_train_cases, world, cases)


@functools.lru_cache(maxsize=None)
def reference_run(num_micro: int) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """The unsharded model trained in this process: losses, final and initial parameters."""
    model, cfg = build_gpt()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = sgd(model.parameters())
    losses = [local_step(model, optimizer, step, cfg, num_micro=num_micro).item() for step in range(NUM_STEPS)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, initial


def test_reference_training_moves_parameters():
    """Guards the comparisons below against being vacuous: the reference really trains."""
    losses, final, initial = reference_run(1)
    assert losses[-1] < losses[0] - 0.05
    assert max((final[k] - initial[k]).abs().max().item() for k in final) > 1e-2


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(MATCH_CASES))
def test_training_matches_single_process_reference(world, case):
    ranks = matching_runs(world)
    ref_losses, ref_params, _ = reference_run(MATCH_CASES[case][1])
    losses, params = ranks[0][case]
    # Tolerances: see [Note: matching tolerance].
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    # full_state_dict gathers the same parameters on every rank.
    for r in range(1, world):
        assert ranks[r][case][0] == losses
        assert_tensors_equal(ranks[r][case][1], params)


@pytest.mark.gloo
@pytest.mark.parametrize("case", list(PREFETCH_CASES))
def test_prefetch_off_gives_identical_training(case):
    ranks = matching_runs(2)
    with_prefetch = case.removesuffix("+no_prefetch")
    assert ranks[0][case][0] == ranks[0][with_prefetch][0]
    assert_tensors_equal(ranks[0][case][1], ranks[0][with_prefetch][1])


# --- 2. double buffer: fixed addresses, two slots by parity, persistent fallback ----------------------------------

NUM_ADDRESS_ITERS = 5


def _capture_addresses(model: MegatronFSDP, cfg: GPTConfig, rank: int, world: int) -> List[Dict[str, Any]]:
    """Train NUM_ADDRESS_ITERS steps recording, per iteration and unit, where its unsharded data lives.

    Forward: parameter pointers and unshard-buffer pointer seen by a pre-hook that runs after FSDP's
    pre-forward (registered after ``fully_shard``). Backward: parameter pointers seen by a tensor hook on
    the unit's output, registered after FSDP's pre-backward hook. After backward: the gradient buffer.
    Collectives: the buffers that the all-gathers write and the reduce-scatters/all-reduces read.
    """
    iters: List[Dict[str, Any]] = []
    current: Dict[str, Any] = {}

    def on_forward(unit):
        def hook(module, args):
            current[("forward", unit.name)] = (unit.param_addresses(), unit.buffer_addresses()["param"])
        return hook

    def on_output(unit):
        def record_backward(grad):
            current[("backward", unit.name)] = (unit.param_addresses(), unit.buffer_addresses()["param"])

        def hook(module, args, output):
            if output.requires_grad:
                output.register_hook(record_backward)
        return hook

    for unit in model.units:
        unit.module.register_forward_pre_hook(on_forward(unit))
        unit.module.register_forward_hook(on_output(unit))

    originals = collectives.all_gather, collectives.reduce_scatter, collectives.all_reduce

    def all_gather(output, shard_, group, what):
        current.setdefault(("all_gather", what), set()).add(output.data_ptr())
        return originals[0](output, shard_, group, what)

    def reduce_scatter(output, full, group, what, **kw):
        current.setdefault(("reduce", what), set()).add(full.data_ptr())
        return originals[1](output, full, group, what, **kw)

    def all_reduce(tensor, group, what, **kw):
        current.setdefault(("reduce", what), set()).add(tensor.data_ptr())
        return originals[2](tensor, group, what, **kw)

    optimizer = sgd(model.optimizer_parameters())
    collectives.all_gather, collectives.reduce_scatter, collectives.all_reduce = all_gather, reduce_scatter, all_reduce
    try:
        for step in range(NUM_ADDRESS_ITERS):
            current = {}
            tokens, targets = synthetic_batch(step, GLOBAL_BATCH, cfg, CPU)
            per_rank = GLOBAL_BATCH // world
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            loss_fn(model(tokens[rows]), targets[rows]).backward()
            for unit in model.units:
                current[("grad", unit.name)] = unit.buffer_addresses()["grad"]
            optimizer.step()
            optimizer.zero_grad()
            iters.append(current)
    finally:
        collectives.all_gather, collectives.reduce_scatter, collectives.all_reduce = originals
    return iters


def _unit_plan(model: MegatronFSDP) -> List[Dict[str, Any]]:
    return [dict(name=u.name, numel=u.numel, is_moe=hasattr(u.module, "moe"), param_kind=u.param_buffer.kind,
                 param_slot=u.param_buffer.slot, grad_kind=u.grad_buffer.kind, grad_slot=u.grad_buffer.slot)
            for u in model.units]


def _double_buffer_job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, strategy, num_layers, fit_dense_only in [
        ("zero3", "optim_grads_params", 3, False),
        ("zero2", "optim_grads", 3, False),
        # Four layers: two dense units share the slots, two MoE units do not fit them.
        ("zero3_persistent", "optim_grads_params", 4, True),
    ]:
        gpt, cfg = build_gpt(num_layers=num_layers)
        slot_numel = None
        if fit_dense_only:
            probe = shard(build_gpt(num_layers=num_layers)[0], sharding_strategy=strategy)
            slot_numel = max(u.numel for u in probe.units if not hasattr(u.module, "moe"))
        model = shard(gpt, sharding_strategy=strategy, fsdp_double_buffer=True,
                      fsdp_db_use_persist_buf_on_alloc_fail=True, fsdp_double_buffer_numel=slot_numel)
        out[name] = dict(plan=_unit_plan(model), iters=_capture_addresses(model, cfg, rank, world),
                         slot_numel=model.slot_numel)
    return out


@functools.lru_cache(maxsize=None)
def double_buffer_runs() -> List[Dict[str, Any]]:
    return run_gloo(_double_buffer_job, 2)


def _assert_same_every_iteration(iters: List[Dict[str, Any]]) -> None:
    first = iters[0]
    for i, rec in enumerate(iters[1:], start=1):
        assert rec.keys() == first.keys(), f"iteration {i} recorded {sorted(rec.keys() ^ first.keys())} differently"
        moved = {k: (first[k], rec[k]) for k in first if rec[k] != first[k]}
        assert not moved, f"iteration {i}: addresses moved: {moved}"


@pytest.mark.gloo
@pytest.mark.parametrize("rank", [0, 1])
def test_double_buffer_zero3_addresses_fixed_and_slots_alternate(rank):
    run = double_buffer_runs()[rank]["zero3"]
    plan, iters = run["plan"], run["iters"]
    assert [u["param_slot"] for u in plan] == [0, 1, 0] and [u["grad_slot"] for u in plan] == [0, 0, 0]
    assert {u["param_kind"] for u in plan} == {u["grad_kind"] for u in plan} == {"slot"}
    _assert_same_every_iteration(iters)
    rec = iters[0]
    for u in plan:
        name = u["name"]
        for phase in ("forward", "backward"):
            param_ptrs, buffer_ptr = rec[(phase, name)]
            assert buffer_ptr is not None and param_ptrs[0] == buffer_ptr  # the first parameter starts the buffer
        assert rec[("all_gather", f"unit {name}")] == {rec[("forward", name)][1]}
        assert rec[("reduce", f"gradients of unit {name}")] == {rec[("grad", name)]}
    # Units of one parity share an unshard slot; the two slots are different memory. Every unit's gradients
    # go through the one gradient slot ([Note: one gradient slot]).
    fwd = {u["name"]: rec[("forward", u["name"])][1] for u in plan}
    grad = {u["name"]: rec[("grad", u["name"])] for u in plan}
    assert fwd["layers.0"] == fwd["layers.2"] != fwd["layers.1"]
    assert grad["layers.0"] == grad["layers.2"] == grad["layers.1"]


@pytest.mark.gloo
def test_double_buffer_zero2_gradient_slots_fixed():
    for rank_result in double_buffer_runs():
        run = rank_result["zero2"]
        plan, iters = run["plan"], run["iters"]
        # ZeRO-2 keeps compute parameters resident; only the gradient buffers use the slots.
        assert [u["param_kind"] for u in plan] == ["persistent"] * 3
        assert [u["grad_slot"] for u in plan] == [0, 0, 0]
        # Parameters start installed, so the first all-gathers (of updated parameters) come in iteration 1;
        # everything iteration 0 records is recorded identically later.
        assert not any(kind == "all_gather" for kind, _ in iters[0])
        assert {k: iters[1][k] for k in iters[0]} == iters[0]
        _assert_same_every_iteration(iters[1:])
        rec = iters[1]
        for u in plan:
            assert rec[("all_gather", f"unit {u['name']}")] == {rec[("forward", u["name"])][1]}
        assert rec[("grad", "layers.0")] == rec[("grad", "layers.2")] == rec[("grad", "layers.1")]
        for u in plan:
            assert rec[("reduce", f"gradients of unit {u['name']}")] == {rec[("grad", u["name"])]}


@pytest.mark.gloo
def test_double_buffer_units_too_large_get_persistent_buffers():
    for rank_result in double_buffer_runs():
        run = rank_result["zero3_persistent"]
        plan, iters = run["plan"], run["iters"]
        assert [u["is_moe"] for u in plan] == [False, True, False, True]
        assert all(u["numel"] > run["slot_numel"] for u in plan if u["is_moe"])
        assert [(u["param_kind"], u["param_slot"]) for u in plan] == [
            ("slot", 0), ("persistent", None), ("slot", 1), ("persistent", None)]
        assert [u["grad_kind"] for u in plan] == ["slot", "persistent", "slot", "persistent"]
        _assert_same_every_iteration(iters)
        rec = iters[0]
        ptrs = [rec[("forward", u["name"])][1] for u in plan]
        assert len(set(ptrs)) == 4  # two slots plus one buffer of its own per MoE unit
        for u in plan:
            assert rec[("all_gather", f"unit {u['name']}")] == {rec[("forward", u["name"])][1]}
            assert rec[("reduce", f"gradients of unit {u['name']}")] == {rec[("grad", u["name"])]}


# --- 3. save, load, continue --------------------------------------------------------------------------------------

SAVE_AFTER, TOTAL_STEPS = 3, 6
CHECKPOINT_CASES = [(s, "sharded", False) for s in STRATEGIES] + [
    ("optim_grads_params", "sharded", True),
    ("optim_grads_params", "full", False),
    ("optim", "full", False),
]


def _checkpoint_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    out = {}
    for strategy, kind, double_buffer in CHECKPOINT_CASES:
        kwargs = dict(sharding_strategy=strategy, fsdp_double_buffer=double_buffer)
        tag = f"{strategy}-{kind}-{double_buffer}"
        model_path = os.path.join(directory, f"{tag}-model-rank{rank}.pt")
        optim_path = os.path.join(directory, f"{tag}-optim-rank{rank}.pt")
        # Uninterrupted run, saving after SAVE_AFTER steps (torch.save serialises the state at that moment).
        gpt, cfg = build_gpt()
        model = shard(gpt, **kwargs)
        optimizer = adam(model.optimizer_parameters())
        uninterrupted = []
        for step in range(TOTAL_STEPS):
            if step == SAVE_AFTER:
                torch.save(model.sharded_state_dict() if kind == "sharded" else model.full_state_dict(), model_path)
                torch.save(optimizer.state_dict(), optim_path)
            uninterrupted.append(fsdp_step(model, optimizer, step, cfg, rank, world))
        final = model.full_state_dict()
        # A fresh model with different initial values, restored from the files.
        fresh = shard(build_gpt(seed=1)[0], **kwargs)
        fresh_optimizer = adam(fresh.optimizer_parameters())
        state = torch.load(model_path, weights_only=False)
        (fresh.load_sharded_state_dict if kind == "sharded" else fresh.load_full_state_dict)(state)
        fresh_optimizer.load_state_dict(torch.load(optim_path, weights_only=False))
        resumed = [fsdp_step(fresh, fresh_optimizer, step, cfg, rank, world) for step in range(SAVE_AFTER, TOTAL_STEPS)]
        out[tag] = dict(uninterrupted=uninterrupted, resumed=resumed, final=final,
                        resumed_final=fresh.full_state_dict())
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    return run_gloo(_checkpoint_job, 2, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, kind, double_buffer", CHECKPOINT_CASES)
def test_save_load_continue_matches_uninterrupted(checkpoint_runs, strategy, kind, double_buffer):
    for rank_result in checkpoint_runs:
        run = rank_result[f"{strategy}-{kind}-{double_buffer}"]
        assert len(run["resumed"]) == TOTAL_STEPS - SAVE_AFTER
        assert run["resumed"] == run["uninterrupted"][SAVE_AFTER:]  # bit for bit
        assert_tensors_equal(run["resumed_final"], run["final"])


# --- 5. a step that raises leaves the state untouched ------------------------------------------------------------

FAIL_STEP, FAILURE_STEPS = 2, 6


class InjectedFailure(RuntimeError):
    pass


def _arm_failure(gpt: GPT, where: str) -> Dict[str, bool]:
    """Make the next step raise once: in forward (inside layer 1), in backward (at layer 0's output), or in
    backward before any unit's backward (at the input of the root's LM head, once the head has its gradient).
    """
    armed = {"on": False}

    def fire():
        if armed["on"]:
            armed["on"] = False
            raise InjectedFailure(f"injected failure in {where}")

    if where == "forward":
        # Inside the unit, so the unit is left mid-forward with its parameters unsharded and the next unit
        # prefetched.
        gpt.layers[1].attn.register_forward_pre_hook(lambda module, args: fire())
    elif where == "root_backward":
        # Autograd accumulates head.weight's gradient before it runs the hooks of the head's input, so the
        # root holds a compute-parameter gradient of the failed step while every unit is still FORWARD_DONE.
        def on_final_norm(module, args, output):
            output.register_hook(lambda grad: fire())
        gpt.ln_f.register_forward_hook(on_final_norm)
    else:
        # Registered after fully_shard, so it runs after FSDP's pre-backward hook on the same tensor: layers 2
        # and 1 have reduced their gradients by then and layer 0 is unsharding.
        def on_output(module, args, output):
            if output.requires_grad:
                output.register_hook(lambda grad: fire())
        gpt.layers[0].register_forward_hook(on_output)
    return armed


def _failure_job(rank: int, world: int, cases: List[Tuple[str, bool, str]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for strategy, double_buffer, where in cases:
        kwargs = dict(sharding_strategy=strategy, fsdp_double_buffer=double_buffer)
        gpt, cfg = build_gpt()
        model = shard(gpt, **kwargs)
        optimizer = adam(model.optimizer_parameters())
        armed = _arm_failure(gpt, where) if where != "skip" else None
        losses, record = {}, {}
        for step in range(FAILURE_STEPS):
            if step == FAIL_STEP:
                if armed is None:
                    continue  # the run that simply skips this step
                params_before, optim_before = model.full_state_dict(), optimizer_state_tensors(optimizer)
                armed["on"] = True
                try:
                    local_step(model, optimizer, step, cfg, rank=rank, world=world)
                except InjectedFailure as exc:
                    record["raised"] = str(exc)
                record.update(params_before=params_before, optim_before=optim_before,
                              params_after=model.full_state_dict(), optim_after=optimizer_state_tensors(optimizer))
                optimizer.zero_grad()
                continue
            losses[step] = fsdp_step(model, optimizer, step, cfg, rank, world)
        out[(strategy, double_buffer, where)] = dict(losses=losses, **record)
    return out


FAILURE_CASES = [("optim_grads_params", db, where) for db in (False, True) for where in ("forward", "backward")] + [
    ("no_shard", False, "backward"),
    ("optim_grads_params", False, "root_backward"),
    ("no_shard", False, "root_backward"),
]


@functools.lru_cache(maxsize=None)
def failure_runs() -> List[Dict[str, Any]]:
    skips = sorted({(s, db, "skip") for s, db, _ in FAILURE_CASES})
    return run_gloo(_failure_job, 2, FAILURE_CASES + skips)


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer, where", FAILURE_CASES)
def test_failed_step_leaves_state_untouched_and_training_continues(strategy, double_buffer, where):
    for rank_result in failure_runs():
        run = rank_result[(strategy, double_buffer, where)]
        skipped = rank_result[(strategy, double_buffer, "skip")]
        assert run.get("raised") == f"injected failure in {where}"
        assert run["optim_before"], "the optimizer has state by the failing step"
        assert_tensors_equal(run["params_after"], run["params_before"])
        assert_tensors_equal(run["optim_after"], run["optim_before"])
        assert FAIL_STEP not in run["losses"] and len(run["losses"]) == FAILURE_STEPS - 1
        assert run["losses"] == skipped["losses"]  # bit for bit, the steps after the failure included


# --- 4. bad input, clear errors (one process, a one-rank group) --------------------------------------------------


def test_fully_shard_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match=r"initialised process group.*init_process_group"):
        shard(build_gpt()[0])


def test_unit_class_matching_no_module(one_rank_group):
    with pytest.raises(ValueError) as err:
        fully_shard(build_gpt()[0], fsdp_unit_modules=[nn.GRU, "TransfomerBlock"])
    message = str(err.value)
    assert "['GRU', 'TransfomerBlock']" in message  # the classes asked for
    assert "'TransformerBlock'" in message and "'Linear'" in message  # the classes present


def test_parameter_shared_between_units(one_rank_group):
    gpt, _ = build_gpt()
    gpt.layers[2].attn.qkv.weight = gpt.layers[0].attn.qkv.weight
    with pytest.raises(ValueError, match=r"parameter layers\.2\.attn\.qkv\.weight is shared with unit layers\.0;"):
        shard(gpt)


def test_parameter_shared_between_unit_and_root(one_rank_group):
    gpt, _ = build_gpt()
    gpt.ln_f.weight = gpt.layers[0].attn.ln.weight  # the root's final norm reuses a layer's norm weight
    with pytest.raises(ValueError, match=r"parameter ln_f\.weight is shared with unit layers\.0, outside"):
        shard(gpt)


def test_parameter_tied_inside_one_unit_is_allowed(one_rank_group):
    gpt, _ = build_gpt()
    gpt.layers[0].mlp.ln.weight = gpt.layers[0].attn.ln.weight
    model = shard(gpt)
    assert model.units[0].layout.names.count("layers.0.attn.ln.weight") == 1
    assert "layers.0.mlp.ln.weight" not in model.units[0].layout.names


def test_integer_compute_dtype(one_rank_group):
    with pytest.raises(ValueError, match=r"compute_dtype=torch\.int32 is not a floating-point dtype"):
        shard(build_gpt()[0], compute_dtype=torch.int32)


@pytest.mark.parametrize("owner, name, unit", [("layers.1.attn", "layers.1.attn.counter", "layers.1"),
                                               ("", "counter", "<root>")])
def test_non_float_parameter(one_rank_group, owner, name, unit):
    gpt, _ = build_gpt()
    gpt.get_submodule(owner).counter = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=rf"parameter {name} of unit {unit} has dtype torch\.int64"):
        shard(gpt)


def test_persist_flag_needs_double_buffer(one_rank_group):
    with pytest.raises(ValueError, match=r"fsdp_db_use_persist_buf_on_alloc_fail=True needs fsdp_double_buffer=True"):
        shard(build_gpt()[0], fsdp_db_use_persist_buf_on_alloc_fail=True)


def test_unit_too_large_for_double_buffer_without_persist_flag(one_rank_group):
    dense_numel = max(u.numel for u in shard(build_gpt()[0]).units if not hasattr(u.module, "moe"))
    with pytest.raises(ValueError) as err:
        shard(build_gpt()[0], fsdp_double_buffer=True, fsdp_double_buffer_numel=dense_numel)
    message = str(err.value)
    assert message.startswith("unit layers.1 needs")  # the MoE unit
    assert f"fsdp_double_buffer_numel={dense_numel}" in message
    assert "fsdp_db_use_persist_buf_on_alloc_fail=True" in message  # the fix


def test_unknown_sharding_strategy(one_rank_group):
    with pytest.raises(ValueError, match=r"sharding_strategy='zero3' is not one of: no_shard, optim, optim_grads, "
                                         r"optim_grads_params"):
        shard(build_gpt()[0], sharding_strategy="zero3")


def test_nested_unit_sharing_its_parents_slot_is_refused(one_rank_group):
    # Plan order layers.0 (slot 0), layers.1 (slot 1), layers.1.moe.router (slot 0), layers.1.moe.experts
    # (slot 1), layers.2 (slot 0): the experts unit would overwrite the slot its enclosing layer still computes
    # in. Silent corruption becomes a clear error.
    gpt, cfg = build_gpt()
    model = shard(gpt, sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                  fsdp_unit_modules=[TransformerBlock, Router, Experts])
    assert [(u.name, u.param_buffer.slot) for u in model.units] == [
        ("layers.0", 0), ("layers.1", 1), ("layers.1.moe.router", 0), ("layers.1.moe.experts", 1), ("layers.2", 0)]
    tokens, _ = synthetic_batch(0, 2, cfg, CPU)
    with pytest.raises(RuntimeError, match=r"unit layers\.1\.moe\.experts needs double-buffer slot 1, but unit "
                                           r"layers\.1 still computes in it \(FORWARD\).*turn fsdp_double_buffer off"):
        model(tokens)
