"""The capture protocol on 2 Gloo ranks: the CPU backend runs TE's warmup/capture schedule without graphs.

What it shows, on the real engine (``megatron_fsdp``, ZeRO-3 with double buffer) and the reference GPT:

- every FSDP phase of every unit that owns a graphed callable runs exactly once per warmup iteration and
  once for the capture, in TE's order, and never inside the (simulated) capture region;
- no collective or allocation is issued inside a capture region: the engine refuses them there, shown by a
  successful capture plus a negative control that puts an FSDP hook inside the region and gets the refusal;
- hooks are exactly restored after capture (only the replay address check is added), after a failed
  capture, and after ``delete()``; a failed capture leaves parameters, optimizer state and gradients alone;
- training with a protocol capture gives the losses of eager training, bit for bit, before and after
  ``delete()``;
- the address check refuses a replay whose parameter (or gradient buffer) moved;
- selection and precondition errors.

The distributed work runs in two spawned 2-rank jobs (module-scoped fixtures); the tests assert on what the
ranks return.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import fsdp_cudagraph.graphs.partial as capture_mod
from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, hooks_snapshot
from fsdp_cudagraph.apps.model import GPT, GPTConfig, SelfAttention, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard, is_capturing, simulated_capture
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
GLOBAL_BATCH = 8
WARMUP_ITERS = 3  # cuda_graph_num_warmup_iters
CAPTURE_AT = 2  # capture before this step's forward (after two eager steps)
DELETE_AT = 5  # delete() before this step's forward
STEPS = 8
UNITS = ["layers.0", "layers.1", "layers.2", "layers.3"]  # GPTConfig(num_layers=4, moe_every=2): 1 and 3 are MoE

#: scope -> the callables it must select, in forward order
SCOPES: Dict[Tuple[str, ...], List[str]] = {
    (): UNITS,
    ("attn",): [f"{u}.attn" for u in UNITS],
    ("attn", "mlp"): ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.2.attn", "layers.2.mlp", "layers.3.attn"],
    ("attn", "moe_router", "moe_preprocess"): [
        "layers.0.attn", "layers.1.attn", "layers.1.moe.router", "layers.1.moe.preprocess",
        "layers.2.attn", "layers.3.attn", "layers.3.moe.router", "layers.3.moe.preprocess",
    ],
    ("moe_router",): ["layers.1.moe.router", "layers.3.moe.router"],  # only some units own a callable
}
PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward")
CAPTURE_REFUSAL = "while a CUDA graph is being captured"


# ---------------------------------------------------------------------------------------------- rank helpers


class _CaptureBoom(RuntimeError):
    pass


class _RaisingAttention(SelfAttention):
    """SelfAttention that raises inside a capture region when ``raise_in_capture`` is set (eager: unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "raise_in_capture", False) and is_capturing():
            raise _CaptureBoom("boom: forward failed during capture")
        return super().forward(x)


def _build(*, double_buffer: bool = True, persist: Optional[bool] = None, raising_attn: Optional[int] = None):
    persist = double_buffer if persist is None else persist
    torch.manual_seed(0)
    cfg = GPTConfig(moe_every=2)
    gpt = GPT(cfg)
    if raising_attn is not None:
        attn = gpt.layers[raising_attn].attn
        attn.__class__ = _RaisingAttention
        attn.raise_in_capture = True
    model = fully_shard(
        gpt,
        fsdp_unit_modules=[TransformerBlock],
        sharding_strategy="optim_grads_params",
        fsdp_double_buffer=double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=persist,
    )
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    return cfg, model, opt


def _graph_cfg(modules) -> CudaGraphConfig:
    return CudaGraphConfig(
        cuda_graph_impl="local",
        cuda_graph_modules=list(modules),
        use_megatron_fsdp=True,
        fsdp_double_buffer=True,
        fsdp_db_use_persist_buf_on_alloc_fail=True,
        cuda_graph_warmup_steps=CAPTURE_AT,
        cuda_graph_num_warmup_iters=WARMUP_ITERS,
    )


def _forward_loss(model, cfg, step: int, rank: int) -> torch.Tensor:
    x, y = synthetic_batch(step, GLOBAL_BATCH, cfg, torch.device("cpu"))
    per = GLOBAL_BATCH // WORLD
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    return loss_fn(model(x), y)


def _step(model, opt, cfg, step: int, rank: int) -> float:
    loss = _forward_loss(model, cfg, step, rank)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _eager_losses(rank: int, steps: int = STEPS) -> List[float]:
    cfg, model, opt = _build()
    return [_step(model, opt, cfg, s, rank) for s in range(steps)]


def _trace_callables(model, names) -> None:
    """Make each named submodule log its forward and the start of its backward into ``model.trace``.

    The class is swapped (not hooked: capture takes hooks off), so the log shows where each callable ran
    relative to the FSDP phases, and whether it ran inside the capture region.
    """
    for n in names:
        mod = model.module.get_submodule(n)
        base = type(mod)

        def forward(self, *args, _base=base, _n=n, **kwargs):
            out = _base.forward(self, *args, **kwargs)
            if model.trace is not None:
                model.trace.append(("forward", _n, is_capturing()))
                if out.requires_grad:
                    out.register_hook(lambda g, _n=_n: None if model.trace is None else model.trace.append(("backward", _n, is_capturing())))
            return out

        mod.__class__ = type(f"Traced{base.__name__}", (base,), {"forward": forward})


def _watched(model, names) -> Dict[str, torch.nn.Module]:
    """Every unit module and every named submodule (by qualified name inside the unwrapped model)."""
    out = {u.name: u.module for u in model.units}
    for n in names:
        out[n] = model.module.get_submodule(n)
    return out


def _sig(snapshot: Dict[str, List[Tuple[int, Any]]]) -> Dict[str, List[Tuple[int, str, int]]]:
    """A picklable picture of hooks_snapshot: (hook id, hook name, object identity) per entry."""
    return {
        name: [(hid, getattr(obj, "__qualname__", repr(obj)), id(obj)) for hid, obj in entries]
        for name, entries in snapshot.items()
    }


def _snap(mods: Dict[str, torch.nn.Module], keep_alive: list) -> Dict[str, Dict[str, list]]:
    out = {}
    for n, m in mods.items():
        s = hooks_snapshot(m)
        keep_alive.append(s)  # object ids stay unique while the snapshots live
        out[n] = _sig(s)
    return out


def _error(fn: Callable[[], Any]) -> Optional[Tuple[str, str]]:
    """(exception class name, message) if ``fn`` raises, else None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tests assert on type and message
        return type(exc).__name__, str(exc)
    return None


def _clone_state(opt) -> Dict[int, Dict[str, Any]]:
    return copy.deepcopy(opt.state_dict()["state"])


def _same_state(a: Dict[int, Dict[str, Any]], b: Dict[int, Dict[str, Any]]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if a[k].keys() != b[k].keys():
            return False
        for kk, va in a[k].items():
            vb = b[k][kk]
            if isinstance(va, torch.Tensor):
                if not torch.equal(va, vb):
                    return False
            elif va != vb:
                return False
    return True


def _same_params(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- job 1: scopes


def _scopes_job(rank: int, world: int) -> Dict[str, Any]:
    """Eager reference, then per scope: train STEPS steps with a protocol capture and a delete()."""
    results: Dict[str, Any] = {"eager": _eager_losses(rank)}
    keep_alive: list = []
    for scope, expected_callables in SCOPES.items():
        cfg, model, opt = _build()
        _trace_callables(model, expected_callables)
        mods = _watched(model, [n for n in expected_callables if n not in UNITS])
        r: Dict[str, Any] = {"hooks_before": _snap(mods, keep_alive)}
        graphs = PartialCudaGraphs(model, _graph_cfg(scope), backend="protocol")
        losses = []
        for step in range(STEPS):
            if step == CAPTURE_AT:
                model.trace = []
                report = graphs.capture()
                r["capture_trace"] = model.trace
                model.trace = None
                r["callables"] = report.callables
                r["unknown_hooks"] = report.unknown_hooks
                r["hooks_after_capture"] = _snap(mods, keep_alive)
                r["forward_overridden"] = {n: "forward" in mods[n].__dict__ for n in report.callables}
            if step == DELETE_AT:
                r["replays"] = {n: getattr(mods[n].__dict__.get("forward"), "replays", None) for n in r["callables"]}
                graphs.delete()
                r["hooks_after_delete"] = _snap(mods, keep_alive)
                r["forward_after_delete"] = {n: "forward" in mods[n].__dict__ for n in r["callables"]}
            traced = step in (1, CAPTURE_AT + 1, DELETE_AT + 1)  # eager, replay, eager after delete
            if traced:
                model.trace = []
            losses.append(_step(model, opt, cfg, step, rank))
            if traced:
                r[f"trace_step{step}"] = model.trace
                model.trace = None
        r["losses"] = losses
        results[scope] = r
    return results


@pytest.fixture(scope="module")
def scopes() -> List[Dict[str, Any]]:
    return run_gloo(_scopes_job, WORLD)


def _one_pass(callables: List[str]) -> List[Tuple[str, str]]:
    """TE's order for one warmup or capture pass: forwards in forward order, then backwards in reverse.

    A unit unshards before its first callable's forward and reshards after its last; in backward it
    unshards before its last callable's backward and reduces after its first's.
    """
    by_unit: Dict[str, List[str]] = {}
    for n in callables:
        by_unit.setdefault(".".join(n.split(".")[:2]), []).append(n)
    fwd = [e for u, cs in by_unit.items() for e in [("pre_forward", u)] + [("forward", c) for c in cs] + [("post_forward", u)]]
    bwd = [
        e
        for u, cs in reversed(by_unit.items())
        for e in [("pre_backward", u)] + [("backward", c) for c in reversed(cs)] + [("post_backward", u)]
    ]
    return fwd + bwd


@pytest.mark.parametrize("scope", list(SCOPES), ids=lambda s: "+".join(s) or "layers")
def test_each_fsdp_phase_runs_once_per_pass_outside_capture(scopes, scope):
    expected_callables = SCOPES[scope]
    owners = list(dict.fromkeys(".".join(n.split(".")[:2]) for n in expected_callables))
    one_pass = _one_pass(expected_callables)
    for rank, res in enumerate(scopes):
        r = res[scope]
        assert r["callables"] == expected_callables, f"rank {rank}"
        assert r["unknown_hooks"] == [], f"rank {rank}"
        trace = r["capture_trace"]
        fsdp = [e for e in trace if e[0] in PHASES]
        assert fsdp, f"rank {rank}: the capture ran no FSDP phase at all"
        # no FSDP phase ran while capturing
        assert [e for e in fsdp if e[2]] == [], f"rank {rank}: FSDP phases inside the capture region"
        # exactly once per warmup iteration and once for the capture, per owning unit and phase
        for u in owners:
            for ph in PHASES:
                n = sum(1 for p, name, _ in fsdp if (p, name) == (ph, u))
                assert n == WARMUP_ITERS + 1, f"rank {rank}: {ph} of {u} ran {n} times"
        assert {name for _, name, _ in fsdp} == set(owners), f"rank {rank}: phases of units owning no callable"
        # TE's schedule, pass by pass, with the callables' own forwards and backwards in between; only the
        # callables of the last pass ran inside the capture region
        passes = [trace[i : i + len(one_pass)] for i in range(0, len(trace), len(one_pass))]
        assert len(passes) == WARMUP_ITERS + 1 and sum(map(len, passes)) == len(trace)
        for i, p in enumerate(passes):
            assert [(ph, u) for ph, u, _ in p] == one_pass, f"rank {rank}, pass {i}"
            capturing = i == WARMUP_ITERS
            assert [c for ph, _, c in p if ph in ("forward", "backward")] == [capturing] * (2 * len(expected_callables))
            for u in owners:
                pos = [next(j for j, (ph2, u2, _) in enumerate(p) if (ph2, u2) == (ph, u)) for ph in PHASES]
                assert pos == sorted(pos), f"rank {rank}, pass {i}, unit {u}: phases out of order {pos}"


@pytest.mark.parametrize("scope", list(SCOPES), ids=lambda s: "+".join(s) or "layers")
def test_replays_go_through_call_with_hooks_around(scopes, scope):
    for rank, res in enumerate(scopes):
        r = res[scope]
        assert all(r["forward_overridden"].values()), f"rank {rank}: {r['forward_overridden']}"
        # steps CAPTURE_AT .. DELETE_AT-1 each replay every graphed callable once
        assert r["replays"] == {n: DELETE_AT - CAPTURE_AT for n in r["callables"]}, f"rank {rank}"
        assert not any(r["forward_after_delete"].values()), f"rank {rank}: forward override left after delete()"
        # the restored FSDP hooks fire around the replays exactly as in an eager step
        eager = r["trace_step1"]
        assert eager and not any(c for _, _, c in eager)
        assert {(ph, u) for ph, u, _ in eager} >= {(ph, u) for u in UNITS for ph in PHASES}
        assert {(ph, n) for ph, n, _ in eager} >= {(ph, n) for n in r["callables"] for ph in ("forward", "backward")}
        assert r[f"trace_step{CAPTURE_AT + 1}"] == eager, f"rank {rank}: replay step"
        assert r[f"trace_step{DELETE_AT + 1}"] == eager, f"rank {rank}: step after delete()"


@pytest.mark.parametrize("scope", list(SCOPES), ids=lambda s: "+".join(s) or "layers")
def test_hooks_restored_after_capture_and_delete(scopes, scope):
    for rank, res in enumerate(scopes):
        r = res[scope]
        before, after, deleted = r["hooks_before"], r["hooks_after_capture"], r["hooks_after_delete"]
        # the FSDP hooks really are on the unit modules (so the comparisons below compare something)
        for u in UNITS:
            assert len(before[u]["_forward_pre_hooks"]) == 2 and len(before[u]["_forward_hooks"]) == 2
        assert deleted == before, f"rank {rank}: hooks after delete() differ from before"
        for mod, dicts in before.items():
            for name, entries in dicts.items():
                got = after[mod][name]
                if mod in r["callables"] and name == "_forward_pre_hooks":
                    # capture adds exactly one hook, last: the replay address check
                    assert got[: len(entries)] == entries, f"rank {rank}: {mod}.{name}"
                    assert len(got) == len(entries) + 1, f"rank {rank}: {mod}.{name}: {got}"
                    assert "_address_check" in got[-1][1], got[-1]
                else:
                    assert got == entries, f"rank {rank}: {mod}.{name}"


@pytest.mark.parametrize("scope", list(SCOPES), ids=lambda s: "+".join(s) or "layers")
def test_losses_equal_eager_through_capture_and_delete(scopes, scope):
    for rank, res in enumerate(scopes):
        eager = res["eager"]
        assert len(set(eager)) == len(eager), "the reference losses must change every step"
        assert res[scope]["losses"] == eager, f"rank {rank}"
    assert scopes[0]["eager"] != scopes[1]["eager"]  # the ranks saw different data


# ---------------------------------------------------------------------------------------------- job 2: failures


def _extract_leaving_pre_forward(module, **kwargs):
    """extract_hooks, but the engine's pre-forward hook stays on the module instead of in the plan."""
    ex = _REAL_EXTRACT(module, **kwargs)
    for hid, hook in ex.saved["_forward_pre_hooks"].items():
        if getattr(hook, "_megatron_fsdp_role", None) == "pre_forward":
            module._forward_pre_hooks[hid] = hook
            ex.capture_time["forward_pre_hooks"].pop(hid)
    return ex


_REAL_EXTRACT = capture_mod.extract_hooks
_REAL_WRAPPER = capture_mod._args.CallWrapper


class _CallingWrapper(_REAL_WRAPPER):
    """The capture wrapper without its hook check, calling the module through ``__call__`` (hooks and all)."""

    def __init__(self, module, name, sig, fwd) -> None:
        torch.nn.Module.__init__(self)
        self.inner, self.callable_name, self.sig, self.out_sig = module, name, sig, None
        self.eager_forward, self._names, self.training = module.__call__, [], module.training


_REAL_PRECONDITIONS = capture_mod._schedules.check_graph_maker_preconditions


class _FailingReplay(capture_mod._schedules.ProtocolReplay):
    """The protocol's replay object, failing on the third callable (after two forwards were replaced)."""

    made = 0

    def __init__(self, module) -> None:
        _FailingReplay.made += 1
        if _FailingReplay.made == 3:
            raise _CaptureBoom("boom: failed after replacing two forwards")
        super().__init__(module)


def _failures_job(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    keep_alive: list = []
    eager = _eager_losses(rank, 6)
    out["eager"] = eager

    # --- direct: an unshard of a stale unit inside a capture region is refused, and nothing is issued
    cfg, model, opt = _build()
    _step(model, opt, cfg, 0, rank)  # the optimizer step makes every unit stale
    unit = model.units[2]
    with simulated_capture():
        out["direct"] = _error(unit.unshard)
    out["direct_state"] = (unit.pending_ag is None, unit.data_valid)
    unit.unshard()  # control: outside a capture region the same call works
    unit.wait_unshard()
    full = model.full_state_dict()
    out["direct_params_ok"] = all(torch.equal(p.detach(), full[n]) for n, p in zip(unit.layout.names, unit.params))
    out["direct_losses"] = [eager[0]] + [_step(model, opt, cfg, s, rank) for s in range(1, 4)]

    # --- negative control: the engine's pre-forward hook left on the module fires inside the capture region
    cfg, model, opt = _build()
    mods = _watched(model, [])
    before = _snap(mods, keep_alive)
    graphs = PartialCudaGraphs(model, _graph_cfg([]), backend="protocol")
    losses = [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT)]
    model.trace = []
    capture_mod.extract_hooks = _extract_leaving_pre_forward
    try:
        # The graph makers' own precondition (no hook on a passed module) refuses this before any work...
        out["neg_precondition"] = _error(graphs.capture)
        # ...so, to show the engine's refusal, stand in for a graph maker that does not check.
        # (and for a wrapper that calls the module through __call__, so that its hooks run in the region)
        capture_mod._schedules.check_graph_maker_preconditions = lambda order: None
        capture_mod._args.CallWrapper = _CallingWrapper
        out["neg_error"] = _error(graphs.capture)
    finally:
        capture_mod.extract_hooks = _REAL_EXTRACT
        capture_mod._schedules.check_graph_maker_preconditions = _REAL_PRECONDITIONS
        capture_mod._args.CallWrapper = _REAL_WRAPPER
    out["neg_trace"] = model.trace
    model.trace = None
    out["neg_hooks"] = (before, _snap(mods, keep_alive))
    out["neg_captured"] = graphs.captured
    losses += [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT, 6)]
    out["neg_losses"] = losses

    # --- a capture that fails mid-way (a graphed forward raises in the capture region)
    cfg, model, opt = _build(raising_attn=2)
    names = SCOPES[("attn",)]
    mods = _watched(model, names)
    before = _snap(mods, keep_alive)
    graphs = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    losses = [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT)]
    params0, state0 = model.full_state_dict(), _clone_state(opt)
    model.trace = []
    out["fail_error"] = _error(graphs.capture)
    out["fail_trace"] = model.trace
    model.trace = None
    out["fail_hooks"] = (before, _snap(mods, keep_alive))
    out["fail_forward"] = {n: "forward" in m.__dict__ for n, m in mods.items()}
    out["fail_captured"] = graphs.captured
    out["fail_params_same"] = _same_params(params0, model.full_state_dict())
    out["fail_state_same"] = _same_state(state0, _clone_state(opt))
    out["fail_state_nonempty"] = len(state0) == len(model.units) + 1
    out["fail_grads_none"] = [u.main_shard.grad is None for u in model.all_units()]
    losses += [_step(model, opt, cfg, CAPTURE_AT, rank)]  # eager after the failure
    model.module.layers[2].attn.raise_in_capture = False
    out["fail_retry"] = _error(graphs.capture)  # a failed capture can be retried
    out["fail_retry_callables"] = graphs.report.callables if graphs.report else None
    losses += [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT + 1, 6)]
    graphs.delete()
    out["fail_losses"] = losses

    # --- a capture that fails after it replaced some callables' forward
    cfg, model, opt = _build()
    mods = _watched(model, names)
    before = _snap(mods, keep_alive)
    graphs = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    losses = [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT)]
    capture_mod._schedules.ProtocolReplay = _FailingReplay
    try:
        out["late_error"] = _error(graphs.capture)
    finally:
        capture_mod._schedules.ProtocolReplay = _FailingReplay.__bases__[0]
    out["late_made"] = _FailingReplay.made
    out["late_hooks"] = (before, _snap(mods, keep_alive))
    out["late_forward"] = {n: "forward" in m.__dict__ for n, m in mods.items()}
    losses += [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT, 6)]
    out["late_losses"] = losses

    # --- a module with its own instance-level forward: replays run it, delete() gives it back
    cfg, model, opt = _build()
    attn = model.module.layers[0].attn
    own_calls: List[bool] = []

    def own_forward(x, _attn=attn, _cls=type(attn)):
        own_calls.append(is_capturing())
        return _cls.forward(_attn, x)

    attn.forward = own_forward
    unused = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    losses = [_step(model, opt, cfg, 0, rank)]
    unused.delete()  # never captured: must leave the modules alone
    out["own_kept_without_capture"] = attn.__dict__.get("forward") is own_forward
    graphs = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    losses += [_step(model, opt, cfg, 1, rank)]
    n0 = len(own_calls)
    graphs.capture()
    out["own_capture_calls"] = own_calls[n0:]
    out["own_replaced"] = attn.__dict__.get("forward") is not own_forward
    n1 = len(own_calls)
    losses += [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT, 4)]
    out["own_replay_calls"] = (len(own_calls) - n1, attn.__dict__["forward"].replays)
    graphs.delete()
    out["own_restored"] = attn.__dict__.get("forward") is own_forward
    losses += [_step(model, opt, cfg, s, rank) for s in range(4, 6)]
    out["own_losses"] = losses

    # --- the replay address check
    cfg, model, opt = _build()
    graphs = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    losses = [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT)]
    graphs.capture()
    losses += [_step(model, opt, cfg, s, rank) for s in range(CAPTURE_AT, 4)]
    p = model.module.layers[1].attn.qkv.weight
    original = p.data
    old = p.data_ptr()
    p.data = p.data.clone()
    out["addr_param"] = (old, p.data_ptr(), _error(lambda: _forward_loss(model, cfg, 4, rank)))
    p.data = original
    gbuf = model.units[1].grad_buffer
    original_g = gbuf.tensor
    gbuf.tensor = gbuf.tensor.clone()
    out["addr_grad"] = (original_g.data_ptr(), gbuf.tensor.data_ptr(), _error(lambda: _forward_loss(model, cfg, 4, rank)))
    gbuf.tensor = original_g
    losses += [_step(model, opt, cfg, s, rank) for s in range(4, 6)]  # everything back in place: replays again
    out["addr_losses"] = losses
    graphs.delete()

    # --- selection and precondition errors
    cfg, model, opt = _build()
    out["mamba"] = _error(lambda: PartialCudaGraphs(model, _graph_cfg(["mamba"]), backend="protocol"))
    graphs = PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol")
    out["too_early"] = _error(graphs.capture)
    _step(model, opt, cfg, 0, rank)
    out["after_one_step"] = _error(graphs.capture)  # control: one eager step is enough
    graphs.delete()
    for db, persist in ((False, False), (True, False)):
        cfg, model, opt = _build(double_buffer=db, persist=persist)
        out[f"no_db_{db}_{persist}"] = _error(lambda: PartialCudaGraphs(model, _graph_cfg(["attn"]), backend="protocol"))
    # without double buffer the unshard buffer is allocated on demand: refused inside a capture region
    cfg, model, opt = _build(double_buffer=False)
    unit = model.units[0]
    with simulated_capture():
        out["alloc"] = _error(unit.unshard)
    out["alloc_state"] = (unit.param_buffer.kind, unit.param_buffer.allocated, unit.pending_ag is None)
    return out


@pytest.fixture(scope="module")
def failures() -> List[Dict[str, Any]]:
    return run_gloo(_failures_job, WORLD)


def test_unshard_inside_capture_is_refused(failures):
    for rank, out in enumerate(failures):
        kind, msg = out["direct"]
        assert kind == "RuntimeError", msg
        assert CAPTURE_REFUSAL in msg and "all-gather of unit layers.2" in msg and f"[rank {rank}]" in msg, msg
        assert out["direct_state"] == (True, False), "the refused unshard must issue nothing and stay stale"
        assert out["direct_params_ok"], "the unshard after the refusal must gather the current parameters"
        assert out["direct_losses"] == out["eager"][:4]


def test_allocation_inside_capture_is_refused(failures):
    for rank, out in enumerate(failures):
        kind, msg = out["alloc"]
        assert kind == "RuntimeError", msg
        assert CAPTURE_REFUSAL in msg and "allocation of the unshard buffer of unit layers.0" in msg, msg
        assert out["alloc_state"] == ("dynamic", False, True)


def test_negative_control_fsdp_hook_inside_capture_is_refused(failures):
    for rank, out in enumerate(failures):
        kind, msg = out["neg_precondition"]
        assert kind == "RuntimeError" and "still has hooks" in msg and "_forward_pre_hooks" in msg, msg
        kind, msg = out["neg_error"]
        assert kind == "RuntimeError", msg
        assert CAPTURE_REFUSAL in msg and "megatron_fsdp" in msg and "all-gather of unit layers." in msg, msg
        trace = out["neg_trace"]
        # the warmup iterations ran; the pre-forward hook then fired inside the capture region and was refused
        assert sum(1 for ph, u, c in trace if (ph, u, c) == ("post_backward", "layers.0", False)) == WARMUP_ITERS
        assert trace[-1][0] == "pre_forward" and trace[-1][2] is True, trace[-4:]
        before, after = out["neg_hooks"]
        assert after == before, f"rank {rank}: hooks not restored after the refused capture"
        assert out["neg_captured"] is False
        assert out["neg_losses"] == out["eager"], f"rank {rank}"


def test_failed_capture_restores_everything(failures):
    for rank, out in enumerate(failures):
        kind, msg = out["fail_error"]
        assert kind == "_CaptureBoom" and "boom" in msg, out["fail_error"]
        # it failed mid-way: the warmup iterations and part of the capture pass had run
        trace = out["fail_trace"]
        assert sum(1 for ph, u, _ in trace if (ph, u) == ("post_backward", "layers.0")) == WARMUP_ITERS
        assert trace[-1] == ("pre_forward", "layers.2", False), trace[-3:]
        before, after = out["fail_hooks"]
        assert after == before, f"rank {rank}: hooks not restored after the failed capture"
        assert not any(out["fail_forward"].values()), f"rank {rank}: {out['fail_forward']}"
        assert out["fail_captured"] is False
        assert out["fail_state_nonempty"], "the optimizer must have state to compare"
        assert out["fail_params_same"] and out["fail_state_same"]
        assert all(out["fail_grads_none"]), f"rank {rank}: a failed capture left main gradients behind"
        assert out["fail_retry"] is None, out["fail_retry"]
        assert out["fail_retry_callables"] == SCOPES[("attn",)]
        assert out["fail_losses"] == out["eager"], f"rank {rank}"


def test_capture_failing_after_forwards_were_replaced_undoes_them(failures):
    for rank, out in enumerate(failures):
        kind, msg = out["late_error"] or ("no error", "")
        assert kind == "_CaptureBoom" and "two forwards" in msg, out["late_error"]
        assert out["late_made"] == 3
        before, after = out["late_hooks"]
        assert after == before, f"rank {rank}: hooks not restored"
        assert not any(out["late_forward"].values()), f"rank {rank}: forward overrides left: {out['late_forward']}"
        assert out["late_losses"] == out["eager"], f"rank {rank}"


def test_instance_forward_is_captured_replayed_and_given_back(failures):
    for rank, out in enumerate(failures):
        assert out["own_kept_without_capture"], "delete() without a capture dropped the module's own forward"
        # warmup iterations outside, then the capture pass inside the capture region
        assert out["own_capture_calls"] == [False] * WARMUP_ITERS + [True]
        assert out["own_replaced"]
        assert out["own_replay_calls"] == (2, 2), "replays must run the module's own forward, through __call__"
        assert out["own_restored"], "delete() must give the module its own forward back"
        assert out["own_losses"] == out["eager"], f"rank {rank}"


def test_address_check_refuses_moved_parameters_and_gradients(failures):
    for rank, out in enumerate(failures):
        old, new, err = out["addr_param"]
        assert old != new
        kind, msg = err
        assert kind == "RuntimeError", msg
        assert "layers.1.attn" in msg and "qkv.weight" in msg, msg
        assert f"{old:#x}" in msg and f"{new:#x}" in msg, msg
        old, new, err = out["addr_grad"]
        assert old != new
        kind, msg = err
        assert kind == "RuntimeError", msg
        assert "layers.1" in msg and f"{old:#x}" in msg and f"{new:#x}" in msg, msg
        # with the addresses back in place, training replays on and matches eager
        assert out["addr_losses"] == out["eager"], f"rank {rank}"


def test_selection_and_precondition_errors(failures):
    for out in failures:
        kind, msg = out["mamba"]
        assert kind == "ValueError" and "mamba" in msg, msg
        kind, msg = out["too_early"]
        assert kind == "RuntimeError" and "eager" in msg, msg
        assert out["after_one_step"] is None, out["after_one_step"]
        kind, msg = out["no_db_False_False"]
        assert kind == "ValueError", msg
        assert "fsdp_double_buffer" in msg and "fsdp_db_use_persist_buf_on_alloc_fail" in msg, msg
        # [Note: fixed addresses]: with the double buffer every unit sits in a slot (a unit too large for one is
        # refused by fully_shard without the persistent fallback), so nothing moves and nothing is refused.
        assert out["no_db_True_False"] is None, out["no_db_True_False"]
