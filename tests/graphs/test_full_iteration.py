"""Full-iteration graphs on CPU: the engine's capture-guard modes, the host-sync checks, and the whole-step
schedule on 2 Gloo ranks through the protocol backend.

What a CPU can show (CUDA graphs themselves need a GPU: tests/gpu/test_full_iteration.py):

- the capture guard: refuses collectives and allocations inside a (simulated) capture by default; in
  ``ALLOW_COLLECTIVES`` mode lets collectives through but still refuses on-demand allocations; restores the
  previous mode on exit and on error; is visible from other threads (autograd's);
- the host-sync check names ``.item()``, Python branches on tensors, boolean masks, and (on a device) CPU
  tensors and host<->device copies, with the user's line; CUDA's and torch's capture errors are translated;
- the schedule: training through ``FullIterationCudaGraph`` (protocol backend: capture and every replay
  run the step under the capture guard and must issue the capture's collectives) gives losses and final
  parameters ``torch.equal`` to the plain eager engine, for every strategy, with gradient accumulation,
  with and without the optimizer graph; the ranks capture the same collectives; an eager fallback step
  issues the same collectives as a replay;
- static inputs: a changed shape falls back to eager (one warning) and stays bit-exact, or raises in strict
  mode; inputs that require grad and malformed micro-batch lists are refused;
- evaluation graphs, ``step()`` under ``no_grad``, ``delete()``, a failed capture, the optimizer checks.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph, HostSyncError
from fsdp_cudagraph.capture.capture_safety import SYNC_DEBUG_MARK, CaptureSafetyCheck, translate_capture_error
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import CaptureGuardMode, capture_guard, fully_shard, is_capturing, simulated_capture
from megatron_fsdp._common import capture_guard_mode, check_not_capturing
from tests.dist_utils import run_gloo
from tests.engine._common import eager_losses

CPU = torch.device("cpu")
WORLD = 2
MICRO = 2  # micro-batches per step (gradient accumulation)
ROWS = 2  # rows per rank and micro-batch
STEPS = 7
WARMUP = 2  # cuda_graph_warmup_steps: steps 0-1 eager, capture at step 2, replays after
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=3, seq_len=16, moe_every=2)


# ---------------------------------------------------------------------------------------------- capture guard


def test_guard_refuses_collectives_and_allocations_by_default():
    assert capture_guard_mode() is CaptureGuardMode.REFUSE
    check_not_capturing("all-gather of unit x", collective=True)  # not capturing: allowed
    with simulated_capture():
        for kwargs in ({"collective": True}, {}):
            with pytest.raises(RuntimeError, match="was requested while a CUDA graph is being captured.*mode refuse"):
                check_not_capturing("all-gather of unit x", **kwargs)


def test_guard_allow_collectives_still_refuses_allocations():
    log: List[str] = []
    with capture_guard(CaptureGuardMode.ALLOW_COLLECTIVES, collective_log=log):
        assert capture_guard_mode() is CaptureGuardMode.ALLOW_COLLECTIVES
        with simulated_capture():
            check_not_capturing("all-gather of unit layers.0", collective=True)
            with pytest.raises(RuntimeError, match="allocation of the unshard buffer.*fsdp_double_buffer=True"):
                check_not_capturing("allocation of the unshard buffer of unit layers.0")
        check_not_capturing("reduce-scatter of gradients of unit layers.0", collective=True)  # outside capture
    assert log == ["all-gather of unit layers.0", "reduce-scatter of gradients of unit layers.0"]
    assert capture_guard_mode() is CaptureGuardMode.REFUSE
    with simulated_capture(), pytest.raises(RuntimeError, match="mode refuse"):
        check_not_capturing("all-gather of unit layers.0", collective=True)
    check_not_capturing("all-gather after the block", collective=True)
    assert log[-1] == "reduce-scatter of gradients of unit layers.0"  # the log was detached on exit


def test_guard_mode_restored_on_error_and_nesting():
    with pytest.raises(KeyError):
        with capture_guard(CaptureGuardMode.ALLOW_COLLECTIVES):
            with capture_guard(CaptureGuardMode.REFUSE):
                assert capture_guard_mode() is CaptureGuardMode.REFUSE
            assert capture_guard_mode() is CaptureGuardMode.ALLOW_COLLECTIVES
            raise KeyError("boom")
    assert capture_guard_mode() is CaptureGuardMode.REFUSE
    with pytest.raises(TypeError, match="CaptureGuardMode"):
        with capture_guard("allow_collectives"):  # type: ignore[arg-type]
            pass


def test_guard_mode_is_process_wide():
    # autograd runs the engine's backward hooks on its own device threads: they must see the mode
    seen: List[Any] = []
    with capture_guard(CaptureGuardMode.ALLOW_COLLECTIVES):
        t = threading.Thread(target=lambda: seen.append(capture_guard_mode()))
        t.start()
        t.join()
    assert seen == [CaptureGuardMode.ALLOW_COLLECTIVES]


# ---------------------------------------------------------------------------------------------- host-sync check


def _check(device: torch.device = CPU) -> CaptureSafetyCheck:
    return CaptureSafetyCheck(device, "the training step")


def test_host_sync_check_names_item_and_the_line():
    x = torch.ones(3)
    with pytest.raises(HostSyncError) as info:
        with _check():
            x.sum().item()  # the offending line
    err = info.value
    assert "aten._local_scalar_dense" in str(err) and "Tensor.item()" in str(err)
    assert "test_full_iteration.py" in err.location and "x.sum().item()  # the offending line" in err.location
    assert "cannot be captured in a CUDA graph" in str(err) and "torch.where" in str(err)


@pytest.mark.parametrize("case", ["branch", "mask", "nonzero", "unique", "equal", "repeat_interleave"])
def test_host_sync_check_refuses_data_dependent_ops(case):
    x = torch.arange(6.0)
    ops = {
        "branch": lambda: bool(x.sum() > 3),
        "mask": lambda: x[x > 2],
        "nonzero": lambda: torch.nonzero(x),
        "unique": lambda: torch.unique(x),
        "equal": lambda: torch.equal(x, x),
        "repeat_interleave": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1, 1])),
    }
    with pytest.raises(HostSyncError, match="cannot be captured"):
        with _check():
            ops[case]()


def test_host_sync_check_passes_device_side_code_unchanged():
    x = torch.arange(6.0)
    with _check():
        a = torch.where(x > 2, x, torch.zeros_like(x))
        b = x[torch.tensor([0, 2])]
        c = x.repeat_interleave(2)
        d = x * torch.tensor(2.0)  # a CPU scalar is fine when the step itself runs on CPU
    assert torch.equal(a, torch.tensor([0.0, 0, 0, 3, 4, 5])) and torch.equal(b, torch.tensor([0.0, 2]))
    assert c.numel() == 12 and torch.equal(d, 2 * x)


def test_host_sync_check_leaves_compiled_functions_compiled():
    """[Note: dispatch modes and torch.compile]: one check must not make Dynamo give a compiled function up."""
    runs: List[str] = []

    def backend(gm, example_inputs):
        def compiled(*args):
            runs.append("compiled")
            return gm.forward(*args)
        return compiled

    @torch.compile(backend=backend)
    def bias_gelu(x, b):
        return torch.nn.functional.gelu(x + b)

    x, b = torch.randn(4, 8), torch.randn(8)
    expected = torch.nn.functional.gelu(x + b)
    assert torch.equal(bias_gelu(x, b), expected) and runs == ["compiled"]
    with _check():
        checked = bias_gelu(x, b)  # runs as its Python under the check
    assert torch.equal(checked, expected) and runs == ["compiled"]
    for _ in range(2):
        bias_gelu(x, b)
    assert runs == ["compiled"] * 3  # compiled again after the check (without force_eager: never again)

    @torch.compile(backend=backend)
    def reads_on_host(x):
        return x * x.sum().item()

    with pytest.raises(HostSyncError, match="_local_scalar_dense"):  # the check sees inside compiled functions
        with _check():
            reads_on_host(x)


def test_host_sync_check_on_a_device_refuses_cpu_tensors_and_copies():
    # "meta" stands in for the CUDA device: the rules only look at device types
    dev = torch.device("meta")
    x = torch.ones(3, device=dev)
    with pytest.raises(HostSyncError, match="mixes a CPU tensor with device tensors"):
        with _check(dev):
            x * torch.tensor([2.0, 2.0, 2.0])
    with pytest.raises(HostSyncError, match="copies a CPU tensor to the device"):
        with _check(dev):
            torch.ones(3).to(dev)
    with pytest.raises(HostSyncError, match="copies a device tensor to the host"):
        with _check(dev):
            x.to("cpu")
    with _check(dev):  # integer CPU metadata (attention kernels' RNG seeds) is not user data
        torch.ops.aten.add.Tensor(x, torch.tensor(1))


def _raise_sync_error() -> None:
    raise RuntimeError(f"CUDA error: {SYNC_DEBUG_MARK}")  # what torch's sync debug mode raises


def test_translate_capture_errors():
    try:
        _raise_sync_error()
    except RuntimeError as exc:
        out = translate_capture_error(exc, phase="the training step")
    assert isinstance(out, HostSyncError) and "_raise_sync_error" in out.location
    # a failed capture raises again when it ends: the original error is found through the chain
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        out = translate_capture_error(exc, phase="the training step")
    assert isinstance(out, RuntimeError) and "CUDA refused an operation" in str(out)
    assert "operation not permitted when stream is capturing" in str(out)
    rng = RuntimeError("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture. If you need this call "
                       "to be captured, please file an issue.")
    out = translate_capture_error(rng, phase="the training step")
    assert isinstance(out, RuntimeError) and "preserve_rng_state=False" in str(out)
    assert translate_capture_error(ValueError("unrelated"), phase="x") is None


# ---------------------------------------------------------------------------------------------- Gloo job


def _build(strategy: str = "optim_grads_params", *, double_buffer: bool = True, lr: float = 1e-3,
           checkpointing: bool = False):
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    gpt = GPT(cfg)
    if checkpointing:  # activation checkpointing: each unit's forward runs again inside its backward
        for i in range(len(gpt.layers)):
            gpt.layers[i] = checkpoint_wrapper(gpt.layers[i], preserve_rng_state=False)
    model = fully_shard(gpt, fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=double_buffer, fsdp_db_use_persist_buf_on_alloc_fail=double_buffer)
    return cfg, model, torch.optim.Adam(model.optimizer_parameters(), lr=lr)


def _micro_batches(cfg: GPTConfig, step: int, rank: int, seq: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for m in range(MICRO):
        x, y = synthetic_batch(step * MICRO + m, ROWS * WORLD, cfg, CPU)
        x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        out.append((x[:, :seq], y[:, :seq]) if seq else (x, y))
    return out


def _forward_step(model, x, y):
    return loss_fn(model(x), y) / MICRO


def _config(**kw) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=WARMUP, **kw)


def _eager_run(strategy: str, rank: int, *, seq_at: Dict[int, int] = {}, eval_at=(), steps: int = STEPS,
               max_norm=None, checkpointing: bool = False):
    """The plain engine loop: the reference every graphed run must equal bit for bit."""
    cfg, model, opt = _build(strategy, checkpointing=checkpointing)
    losses, evals, norms = [], [], []
    for step in range(steps):
        if step in eval_at:
            with torch.no_grad():
                evals.append(tuple(_forward_step(model, x, y) for x, y in _micro_batches(cfg, 100, rank)))
        losses.append(eager_losses(_forward_step, model, _micro_batches(cfg, step, rank, seq_at.get(step, 0))))
        if max_norm is not None:
            norms.append(model.clip_grad_norm_(max_norm))
        opt.step()
        opt.zero_grad()
    return losses, evals, model.full_state_dict(), norms


def _graphed_run(strategy: str, rank: int, *, graph_optimizer: bool, seq_at: Dict[int, int] = {}, eval_at=(),
                 delete_at: int = -1, steps: int = STEPS, max_norm=None, checkpointing: bool = False) -> Dict[str, Any]:
    cfg, model, opt = _build(strategy, checkpointing=checkpointing)
    g = FullIterationCudaGraph(model, _forward_step, _config(), graph_optimizer=graph_optimizer)
    losses, evals, warned, fallback_logs, norms = [], [], [], [], []
    for step in range(steps):
        if step == delete_at:
            g.delete()
        if step in eval_at:
            evals.append(g.evaluate(_micro_batches(cfg, 100, rank)))
        batches = _micro_batches(cfg, step, rank, seq_at.get(step, 0))
        if g.deleted:  # after delete(): the model trains eagerly, as without graphs
            losses.append(eager_losses(_forward_step, model, batches))
            opt.step()
        else:
            log: List[str] = []
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                with capture_guard(CaptureGuardMode.REFUSE, collective_log=log):  # records eager collectives
                    losses.append(g.step(batches))
            warned += [str(x.message) for x in w]
            if step in seq_at:
                fallback_logs.append(log)
            norm = g.optimizer_step(opt, max_norm=max_norm)
            if norm is not None:
                norms.append(norm)
        opt.zero_grad()
    report = g.reports.get("train")
    return {"losses": losses, "evals": evals, "state": model.full_state_dict(), "counters": g.counters,
            "collectives": report.collectives if report else None, "warned": warned, "fallback_logs": fallback_logs,
            "units_with_grads": report.units_with_grads if report else None, "norms": norms,
            "recomputed": sorted(u.name for u in model.units if u.recomputed)}


def _error(fn) -> Tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests assert on type and message
        return type(exc).__name__, str(exc)
    return ("", "no error")


def _errors_job(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    cfg, model, opt = _build("optim_grads_params", double_buffer=False)
    out["no_double_buffer"] = _error(lambda: FullIterationCudaGraph(model, _forward_step, _config()))
    cfg, model, opt = _build()
    out["wrong_impl"] = _error(lambda: FullIterationCudaGraph(model, _forward_step, CudaGraphConfig()))
    out["not_fsdp"] = _error(lambda: FullIterationCudaGraph(model.module, _forward_step, _config()))

    # strict: a changed shape after capture raises, and the graph keeps working for the captured shape
    g = FullIterationCudaGraph(model, _forward_step, _config(cuda_graph_strict_signature=True))
    for step in range(WARMUP + 1):
        g.step(_micro_batches(cfg, step, rank))
        opt.step()
        opt.zero_grad()
    out["strict"] = _error(lambda: g.step(_micro_batches(cfg, 9, rank, seq=8)))
    out["strict_then_ok"] = _error(lambda: g.step(_micro_batches(cfg, 9, rank)))
    x, y = _micro_batches(cfg, 0, rank)[0]
    out["requires_grad_input"] = _error(lambda: g.step([(x.float().requires_grad_(), y)]))
    out["not_a_list"] = _error(lambda: g.step((x, y)[0]))
    with torch.no_grad():
        out["step_no_grad"] = _error(lambda: g.step(_micro_batches(cfg, 0, rank)))
    # the optimizer graph refuses what it would silently get wrong
    cfg, model2, opt2 = _build()
    go = FullIterationCudaGraph(model2, _forward_step, _config(), graph_optimizer=True)
    for step in range(WARMUP + 1):
        go.step(_micro_batches(cfg, step, rank))
        go.optimizer_step(opt2)
        opt2.zero_grad()
    go.step(_micro_batches(cfg, 5, rank))
    opt2.zero_grad(set_to_none=True)
    out["opt_after_zero_grad"] = _error(lambda: go.optimizer_step(opt2))
    go.step(_micro_batches(cfg, 6, rank))
    opt2.param_groups[0]["lr"] = 5e-4
    out["opt_lr_changed"] = _error(lambda: go.optimizer_step(opt2))
    out["opt_other_optimizer"] = _error(lambda: go.optimizer_step(opt))
    opt2.param_groups[0]["lr"] = 1e-3
    out["opt_max_norm_changed"] = _error(lambda: go.optimizer_step(opt2, max_norm=1.0))
    go.delete()
    out["after_delete"] = _error(lambda: go.step(_micro_batches(cfg, 7, rank)))

    # .item() in the step is refused by name, at the last warmup step (the one right before capture)
    cfg, model, opt = _build()

    def item_step(model, x, y):
        loss = loss_fn(model(x), y)
        if loss.item() > 100:  # a data-dependent Python branch
            loss = loss * 0
        return loss

    gi = FullIterationCudaGraph(model, item_step, _config())
    for step in range(WARMUP - 1):
        gi.step(_micro_batches(cfg, step, rank))  # the earlier warmup steps run unchecked, as eager steps
        opt.step()
        opt.zero_grad()
    out["item"] = _error(lambda: gi.step(_micro_batches(cfg, WARMUP - 1, rank)))

    # a host read that only happens while capturing: refused at capture; the graph is then unusable and the
    # model keeps training eagerly, correctly
    cfg, model, opt = _build()

    def sneaky_step(model, x, y):
        loss = loss_fn(model(x), y)
        if is_capturing():
            loss.item()
        return loss

    gs = FullIterationCudaGraph(model, sneaky_step, _config())
    for step in range(WARMUP):
        gs.step(_micro_batches(cfg, step, rank))
        opt.step()
        opt.zero_grad()
    out["capture_sync"] = _error(lambda: gs.step(_micro_batches(cfg, WARMUP, rank)))
    out["after_failed_capture"] = _error(lambda: gs.step(_micro_batches(cfg, WARMUP, rank)))
    x, y = _micro_batches(cfg, WARMUP, rank)[0]
    out["eager_after_failed_capture"] = _error(lambda: loss_fn(model(x), y).backward())
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    res: Dict[str, Any] = {"eager": {}, "graphed": {}}
    for strategy in STRATEGIES:
        res["eager"][strategy] = _eager_run(strategy, rank)
        res["graphed"][strategy] = _graphed_run(strategy, rank, graph_optimizer=strategy in ("optim", "optim_grads_params"))
    # a shorter sequence at step 4 (after capture): an eager fallback in the middle of replays
    res["eager"]["shape"] = _eager_run("optim_grads_params", rank, seq_at={4: 8})
    res["graphed"]["shape"] = _graphed_run("optim_grads_params", rank, graph_optimizer=True, seq_at={4: 8})
    # evaluation graphs between training steps (warmup 2: eager at 1 and 2, captured at 3, replayed at 5, 6)
    evals = (1, 2, 3, 5, 6)
    res["eager"]["eval"] = _eager_run("optim_grads", rank, eval_at=evals)
    res["graphed"]["eval"] = _graphed_run("optim_grads", rank, graph_optimizer=False, eval_at=evals)
    # sync-free clipping (model.clip_grad_norm_) inside the optimizer graph, its norm returned every step
    res["eager"]["clip"] = _eager_run("optim_grads_params", rank, max_norm=0.05)
    res["graphed"]["clip"] = _graphed_run("optim_grads_params", rank, graph_optimizer=True, max_norm=0.05)
    # activation checkpointing: the recomputed forwards (and their gathers) inside the captured backward
    res["eager"]["ckpt"] = _eager_run("optim_grads_params", rank, checkpointing=True)
    res["graphed"]["ckpt"] = _graphed_run("optim_grads_params", rank, graph_optimizer=False, checkpointing=True)
    # delete() after two replays: the model continues eagerly
    res["graphed"]["delete"] = _graphed_run("optim_grads_params", rank, graph_optimizer=True, delete_at=5)
    res["errors"] = _errors_job(rank)
    return res


@pytest.fixture(scope="module")
def ranks() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


def _assert_same_training(eager, graphed, what: str) -> None:
    losses, _, state, _ = eager
    assert len(graphed["losses"]) == len(losses)
    bad = [i for i, (a, b) in enumerate(zip(losses, graphed["losses"])) if not torch.equal(a, b)]
    assert not bad, f"{what}: losses differ at steps {bad}"
    assert state.keys() == graphed["state"].keys()
    assert all(torch.equal(state[k], graphed["state"][k]) for k in state), f"{what}: final parameters differ"


@pytest.mark.gloo
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_iteration_schedule_is_bit_exact_with_eager(ranks, strategy):
    for rank, r in enumerate(ranks):
        g = r["graphed"][strategy]
        _assert_same_training(r["eager"][strategy], g, f"rank {rank}, {strategy}")
        c = g["counters"]
        assert (c["train_eager_steps"], c["train_replays"], c["train_fallbacks"]) == (WARMUP, STEPS - WARMUP, 0), c
        if strategy in ("optim", "optim_grads_params"):
            assert c["optimizer_replays"] == STEPS - WARMUP, c
        # every unit (and the root) was reduced by the captured step, in every micro-batch
        assert g["units_with_grads"] == sorted(["<root>", "layers.0", "layers.1", "layers.2"])
        kinds = {d.split(" of ")[0] for d in g["collectives"]}
        expected = {"all-reduce"} if strategy == "no_shard" else {"all-gather", "reduce-scatter"}
        assert kinds == expected, kinds
        n_reduce = sum(d.startswith(("reduce-scatter", "all-reduce")) for d in g["collectives"])
        assert n_reduce == MICRO * 4, n_reduce  # 3 layers + root, per micro-batch
    # every rank captured the same collectives, in the same order
    assert ranks[0]["graphed"][strategy]["collectives"] == ranks[1]["graphed"][strategy]["collectives"]


@pytest.mark.gloo
def test_shape_change_falls_back_to_eager_once_and_stays_exact(ranks):
    for rank, r in enumerate(ranks):
        g = r["graphed"]["shape"]
        _assert_same_training(r["eager"]["shape"], g, f"rank {rank}, shape change")
        c = g["counters"]
        assert (c["train_eager_steps"], c["train_fallbacks"], c["train_replays"]) == (WARMUP, 1, STEPS - WARMUP - 1)
        assert len(g["warned"]) == 1 and "micro_batches[0][0]" in g["warned"][0] and "(2, 8)" in g["warned"][0]
        # the eager fallback issued the collectives a replay issues (same units, same order)
        assert g["fallback_logs"] == [g["collectives"]]


@pytest.mark.gloo
def test_evaluation_graph_matches_eager_evaluation(ranks):
    for rank, r in enumerate(ranks):
        g = r["graphed"]["eval"]
        _assert_same_training(r["eager"]["eval"], g, f"rank {rank}, with evaluation")
        eager_evals = r["eager"]["eval"][1]
        assert len(g["evals"]) == len(eager_evals) == 5
        for i, (a, b) in enumerate(zip(eager_evals, g["evals"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}, evaluation {i}"
        c = g["counters"]
        assert (c["eval_eager_steps"], c["eval_replays"]) == (2, 3), c


@pytest.mark.gloo
def test_clipping_inside_the_optimizer_graph(ranks):
    for rank, r in enumerate(ranks):
        g = r["graphed"]["clip"]
        _assert_same_training(r["eager"]["clip"], g, f"rank {rank}, clipping")
        eager_norms = r["eager"]["clip"][3]
        assert len(g["norms"]) == len(eager_norms) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(eager_norms, g["norms"])), f"rank {rank}: norms differ"
        assert all(float(n) > 0.05 for n in eager_norms), "max_norm must actually clip, or the test shows nothing"
        assert g["counters"]["optimizer_replays"] == STEPS - WARMUP


@pytest.mark.gloo
def test_activation_checkpointing_inside_the_graph(ranks):
    for rank, r in enumerate(ranks):
        g = r["graphed"]["ckpt"]
        _assert_same_training(r["eager"]["ckpt"], g, f"rank {rank}, activation checkpointing")
        assert g["counters"]["train_replays"] == STEPS - WARMUP
        # the units really recomputed their forward inside backward (the engine's flag from the last step)
        assert g["recomputed"] == [f"layers.{i}._checkpoint_wrapped_module" for i in range(3)], g["recomputed"]
        assert not r["graphed"]["optim_grads_params"]["recomputed"]


@pytest.mark.gloo
def test_delete_leaves_the_model_eager_and_correct(ranks):
    for rank, r in enumerate(ranks):
        g = r["graphed"]["delete"]
        _assert_same_training(r["eager"]["optim_grads_params"], g, f"rank {rank}, delete at step 5")
        assert g["counters"]["train_replays"] == 5 - WARMUP


@pytest.mark.gloo
def test_refusals_and_errors(ranks):
    for rank, r in enumerate(ranks):
        e = r["errors"]
        assert e["no_double_buffer"][0] == "ValueError" and "fixed address" in e["no_double_buffer"][1]
        assert "fsdp_double_buffer=True" in e["no_double_buffer"][1] and "unshard buffer of unit" in e["no_double_buffer"][1]
        assert e["wrong_impl"][0] == "ValueError" and "cuda_graph_impl='none'" in e["wrong_impl"][1]
        # the engine's inner module is refused at build, naming the object to pass
        assert e["not_fsdp"][0] == "ValueError" and "pass the object fully_shard returned" in e["not_fsdp"][1]
        kind, msg = e["strict"]
        assert kind == "ValueError" and "captured for other inputs" in msg and "micro_batches[0][0]" in msg
        assert "never replays on stale buffers" in msg and f"[rank {rank}]" in msg
        assert e["strict_then_ok"] == ("", "no error")
        assert e["requires_grad_input"][0] == "ValueError" and "requires grad" in e["requires_grad_input"][1]
        assert e["not_a_list"][0] == "TypeError" and "list or tuple of micro-batches" in e["not_a_list"][1]
        assert e["step_no_grad"][0] == "RuntimeError" and "evaluate()" in e["step_no_grad"][1]
        assert e["opt_after_zero_grad"][0] == "RuntimeError" and "unbound" in e["opt_after_zero_grad"][1]
        assert e["opt_lr_changed"][0] == "RuntimeError" and "lr changed from 0.001 to 0.0005" in e["opt_lr_changed"][1]
        assert e["opt_other_optimizer"][0] == "ValueError"
        assert e["opt_max_norm_changed"][0] == "RuntimeError" and "max_norm=None" in e["opt_max_norm_changed"][1]
        assert e["after_delete"][0] == "RuntimeError" and "after delete()" in e["after_delete"][1]
        kind, msg = e["item"]
        assert kind == "HostSyncError" and "aten._local_scalar_dense" in msg
        assert "if loss.item() > 100:" in msg and "test_full_iteration.py" in msg
        kind, msg = e["capture_sync"]
        assert kind == "HostSyncError" and "loss.item()" in msg and "sneaky_step" in msg
        assert e["after_failed_capture"][0] == "RuntimeError" and "failed earlier" in e["after_failed_capture"][1]
        assert e["eager_after_failed_capture"] == ("", "no error")
