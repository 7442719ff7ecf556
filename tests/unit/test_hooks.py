"""The two-phase hook extractor (``fsdp_cudagraph.hooks``) on plain modules, without a process group.

A module carries a mix of user hooks (every registration flavour torch has) and fake FSDP hooks (functions
with the engine's sentinel and role attributes). Extraction must leave the module bare, route exactly the
FSDP hooks into TE's ``capture_time_hooks`` form, report the rest, and restoration must give back the very
same hook objects, ids, order and flags, also when hooks were registered in between.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from torch import nn

from fsdp_cudagraph import extract_hooks, hooks_snapshot, restore_hooks
from fsdp_cudagraph.hooks import HOOK_KEYS, POST_SENTINEL, PRE_SENTINEL
from megatron_fsdp._unit_hooks import make_unit_hooks

DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def test_sentinel_names_are_the_design_contract():
    # The engine and the extractor meet on these names (DESIGN.md); a rename on one side breaks capture.
    assert PRE_SENTINEL == "_cuda_graph_backward_pre_handler"
    assert POST_SENTINEL == "_cuda_graph_backward_handler"
    assert HOOK_KEYS == ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class Hooked:
    """A Linear with user hooks of every kind interleaved with fake FSDP hooks; ``log`` records calls."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.m = nn.Linear(4, 4)
        self.log: list = []
        log = self.log

        # -- user hooks
        def user_pre(mod, args):
            log.append("user_pre")

        def user_pre_kw(mod, args, kwargs):
            log.append("user_pre_kw")

        def user_post_always(mod, args, out):
            log.append("user_post_always")

        def user_post_kw(mod, args, kwargs, out):
            log.append("user_post_kw")

        def user_full_bwd(mod, gin, gout):
            log.append("user_full_bwd")

        def user_bwd_pre(mod, gout):
            log.append("user_bwd_pre")

        # -- fake FSDP hooks, shaped like megatron_fsdp._unit.make_unit_hooks
        def inner_pre_backward(*a):
            log.append(("inner_pre_backward", a))
            return "not None"  # the TE-form adapter must still return None

        def inner_post_backward(*a):
            log.append(("inner_post_backward", a))
            return "not None"

        def fsdp_pre_forward(mod, args):
            log.append(("fsdp_pre_forward", mod, args))

        def fsdp_register_post_backward(mod, args, kwargs):
            log.append("fsdp_register_post_backward")

        def fsdp_post_forward(mod, args, out):
            log.append(("fsdp_post_forward", mod, args, out))

        def fsdp_register_pre_backward(mod, args, out):
            log.append("fsdp_register_pre_backward")

        def misplaced_pre_forward(mod, args, out):
            # A pre_forward role in the forward-hook dict is not the engine's: it must not be run at capture.
            log.append("misplaced_pre_forward")

        fsdp_pre_forward._megatron_fsdp_role = "pre_forward"
        fsdp_register_post_backward._megatron_fsdp_role = "register_post_backward"
        fsdp_register_post_backward._cuda_graph_backward_handler = inner_post_backward
        fsdp_post_forward._megatron_fsdp_role = "post_forward"
        fsdp_register_pre_backward._megatron_fsdp_role = "register_pre_backward"
        fsdp_register_pre_backward._cuda_graph_backward_pre_handler = inner_pre_backward
        misplaced_pre_forward._megatron_fsdp_role = "pre_forward"

        m = self.m
        self.fn = {k: v for k, v in locals().items() if callable(v) and not isinstance(v, nn.Module)}
        self.handles = {
            "user_pre": m.register_forward_pre_hook(user_pre),
            "fsdp_pre_forward": m.register_forward_pre_hook(fsdp_pre_forward),
            "fsdp_register_post_backward": m.register_forward_pre_hook(fsdp_register_post_backward, with_kwargs=True),
            "user_pre_kw": m.register_forward_pre_hook(user_pre_kw, with_kwargs=True),
            "fsdp_post_forward": m.register_forward_hook(fsdp_post_forward),
            "user_post_always": m.register_forward_hook(user_post_always, always_call=True),
            "fsdp_register_pre_backward": m.register_forward_hook(fsdp_register_pre_backward),
            "user_post_kw": m.register_forward_hook(user_post_kw, with_kwargs=True),
            "misplaced_pre_forward": m.register_forward_hook(misplaced_pre_forward),
            "user_full_bwd": m.register_full_backward_hook(user_full_bwd),
            "user_bwd_pre": m.register_full_backward_pre_hook(user_bwd_pre),
        }
        self.hid = {k: h.id for k, h in self.handles.items()}

    def run(self) -> list:
        """Forward and backward once; return (and clear) the log of hook calls."""
        self.log.clear()
        x = torch.randn(2, 4, requires_grad=True)
        self.m(x).sum().backward()
        out = [e if isinstance(e, str) else e[0] for e in self.log]
        self.log.clear()
        return out


@pytest.fixture
def hooked() -> Hooked:
    return Hooked()


def test_fixture_has_every_flavour(hooked):
    # Guard the fixture itself: every dict and flag dict is populated, and every hook fires eagerly.
    m = hooked.m
    assert all(len(getattr(m, n)) > 0 for n in DICTS + FLAGS)
    assert [len(getattr(m, n)) for n in DICTS] == [4, 5, 1, 1]
    fired = hooked.run()
    assert fired == [
        "user_pre", "fsdp_pre_forward", "fsdp_register_post_backward", "user_pre_kw",
        "fsdp_post_forward", "user_post_always", "fsdp_register_pre_backward", "user_post_kw",
        "misplaced_pre_forward", "user_bwd_pre", "user_full_bwd",
    ]


def test_extract_leaves_module_bare(hooked):
    m = hooked.m
    extract_hooks(m)
    for name in DICTS + FLAGS:
        assert len(getattr(m, name)) == 0, name
    assert hooks_snapshot(m) == {n: [] for n in DICTS + FLAGS}
    # torch.cuda.make_graphed_callables' precondition (torch/cuda/graphs.py)
    assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    # ... and the module really runs hook-free
    assert hooked.run() == []


def test_saved_copy_is_exact_and_detached(hooked):
    m = hooked.m
    before = hooks_snapshot(m)
    live = {n: getattr(m, n) for n in DICTS + FLAGS}
    ex = extract_hooks(m)
    assert ex.module is m
    assert set(ex.saved) == set(DICTS + FLAGS)
    for name in DICTS + FLAGS:
        assert list(ex.saved[name].items()) == before[name], name
        assert ex.saved[name] is not live[name], f"{name}: the restore copy must not be the live dict"
        assert getattr(m, name) is live[name], f"{name}: extraction must clear the live dict, not replace it"
    # the flags really were captured (with_kwargs / always_called ids)
    h = hooked.hid
    assert set(ex.saved["_forward_pre_hooks_with_kwargs"]) == {h["fsdp_register_post_backward"], h["user_pre_kw"]}
    assert set(ex.saved["_forward_hooks_with_kwargs"]) == {h["user_post_kw"]}
    assert set(ex.saved["_forward_hooks_always_called"]) == {h["user_post_always"]}


def test_capture_time_plan_routes_fsdp_hooks_in_te_form(hooked):
    m, h, fn = hooked.m, hooked.hid, hooked.fn
    ex = extract_hooks(m)
    plan = ex.capture_time
    assert tuple(plan) == HOOK_KEYS
    assert {k: list(v) for k, v in plan.items()} == {
        "forward_pre_hooks": [h["fsdp_pre_forward"]],
        "forward_hooks": [h["fsdp_post_forward"]],
        "backward_pre_hooks": [h["fsdp_register_pre_backward"]],
        "backward_hooks": [h["fsdp_register_post_backward"]],
    }
    # The backward keys hold the inner handlers (never the registering wrappers).
    assert plan["backward_pre_hooks"][h["fsdp_register_pre_backward"]].__wrapped__ is fn["inner_pre_backward"]
    assert plan["backward_hooks"][h["fsdp_register_post_backward"]].__wrapped__ is fn["inner_post_backward"]
    # TE form: one positional argument (the module), returns None.
    for key in HOOK_KEYS:
        for f in plan[key].values():
            assert len(inspect.signature(f, follow_wrapped=False).parameters) == 1, key
    log = hooked.log
    log.clear()
    assert plan["backward_pre_hooks"][h["fsdp_register_pre_backward"]](m) is None
    assert plan["backward_hooks"][h["fsdp_register_post_backward"]](m) is None
    assert plan["forward_pre_hooks"][h["fsdp_pre_forward"]](m) is None
    assert plan["forward_hooks"][h["fsdp_post_forward"]](m) is None
    assert len(log) == 4
    assert log[0] == ("inner_pre_backward", (m,))
    assert log[1] == ("inner_post_backward", (m,))
    assert log[2][0] == "fsdp_pre_forward" and log[2][1] is m and log[2][2] == ()
    assert log[3][0] == "fsdp_post_forward" and log[3][1] is m and log[3][2] == () and log[3][3] is None
    # Running the plan must not re-register anything on the module.
    assert all(len(getattr(m, n)) == 0 for n in DICTS + FLAGS)


def test_unknown_and_withheld_are_reported_not_planned(hooked):
    m, h, fn = hooked.m, hooked.hid, hooked.fn
    ex = extract_hooks(m)
    unknown = [(d, hid, hook) for d, hid, hook in ex.unknown]
    assert unknown == [
        ("_forward_pre_hooks", h["user_pre"], fn["user_pre"]),
        ("_forward_pre_hooks", h["user_pre_kw"], fn["user_pre_kw"]),
        ("_forward_hooks", h["user_post_always"], fn["user_post_always"]),
        ("_forward_hooks", h["user_post_kw"], fn["user_post_kw"]),
        ("_forward_hooks", h["misplaced_pre_forward"], fn["misplaced_pre_forward"]),
        ("_backward_pre_hooks", h["user_bwd_pre"], fn["user_bwd_pre"]),
        ("_backward_hooks", h["user_full_bwd"], fn["user_full_bwd"]),
    ]
    assert ex.withheld == [
        ("_forward_pre_hooks", h["fsdp_register_post_backward"], fn["fsdp_register_post_backward"]),
        ("_forward_hooks", h["fsdp_register_pre_backward"], fn["fsdp_register_pre_backward"]),
    ]
    planned = {f.__wrapped__ for v in ex.capture_time.values() for f in v.values()}
    assert planned == {fn["fsdp_pre_forward"], fn["fsdp_post_forward"], fn["inner_pre_backward"], fn["inner_post_backward"]}
    assert not planned & {hook for _, _, hook in ex.unknown + ex.withheld}


def test_restore_is_exact(hooked):
    m = hooked.m
    reference = hooked.run()
    before = hooks_snapshot(m)
    live = {n: getattr(m, n) for n in DICTS + FLAGS}
    ex = extract_hooks(m)
    restore_hooks(ex)
    assert hooks_snapshot(m) == before
    for name in DICTS + FLAGS:
        assert getattr(m, name) is live[name], f"{name}: restore must refill the module's own dict"
        assert list(getattr(m, name)) == [hid for hid, _ in before[name]], name
    assert hooked.run() == reference
    # Same dicts: the user's original handles still work and also drop the flag entries.
    hooked.handles["user_pre_kw"].remove()
    hooked.handles["user_post_always"].remove()
    hooked.handles["user_full_bwd"].remove()
    assert hooked.hid["user_pre_kw"] not in m._forward_pre_hooks_with_kwargs
    assert hooked.hid["user_post_always"] not in m._forward_hooks_always_called
    assert [e for e in reference if e not in ("user_pre_kw", "user_post_always", "user_full_bwd")] == hooked.run()


def test_restore_twice_round_trip(hooked):
    m = hooked.m
    before = hooks_snapshot(m)
    for _ in range(2):
        ex = extract_hooks(m)
        assert hooks_snapshot(m) == {n: [] for n in DICTS + FLAGS}
        restore_hooks(ex)
        assert hooks_snapshot(m) == before


def test_restore_keeps_hooks_registered_in_between_after_the_restored_ones(hooked):
    m = hooked.m
    before = hooks_snapshot(m)
    ex = extract_hooks(m)
    log = hooked.log

    def late_pre(mod, args, kwargs):
        log.append("late_pre")

    def late_post(mod, args, out):
        log.append("late_post")

    def late_bwd(mod, gin, gout):
        log.append("late_bwd")

    late = {
        "pre": m.register_forward_pre_hook(late_pre, with_kwargs=True),
        "post": m.register_forward_hook(late_post, always_call=True),
        "bwd": m.register_full_backward_hook(late_bwd),
    }
    restore_hooks(ex)
    after = hooks_snapshot(m)
    expected = {k: list(v) for k, v in before.items()}
    expected["_forward_pre_hooks"].append((late["pre"].id, late_pre))
    expected["_forward_pre_hooks_with_kwargs"].append((late["pre"].id, True))
    expected["_forward_hooks"].append((late["post"].id, late_post))
    expected["_forward_hooks_always_called"].append((late["post"].id, True))
    expected["_backward_hooks"].append((late["bwd"].id, late_bwd))
    assert after == expected
    fired = hooked.run()
    assert fired.index("late_pre") == fired.index("user_pre_kw") + 1  # last of the forward-pre hooks
    assert fired.index("late_post") == fired.index("misplaced_pre_forward") + 1
    assert fired[-1] == "late_bwd"
    for handle in late.values():
        handle.remove()
    assert hooks_snapshot(m) == before


def test_module_without_hooks():
    m = nn.Linear(2, 2)
    ex = extract_hooks(m)
    assert ex.capture_time == {k: {} for k in HOOK_KEYS}
    assert ex.unknown == [] and ex.withheld == []
    restore_hooks(ex)
    assert hooks_snapshot(m) == {n: [] for n in DICTS + FLAGS}


def test_real_engine_hooks_are_routed_to_the_unit_phases():
    """The engine's own hooks (make_unit_hooks, on a stand-in unit) meet the extractor's sentinels."""
    calls: list = []
    unit = types.SimpleNamespace(**{
        phase: (lambda phase: lambda *a: calls.append((phase, a)))(phase)
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward")
    })
    pre, reg_post_bwd, post, reg_pre_bwd = make_unit_hooks(unit)
    m = nn.Linear(3, 3)
    # registered the way MegatronFSDP._register_hooks does
    hids = [
        m.register_forward_pre_hook(pre).id,
        m.register_forward_pre_hook(reg_post_bwd, with_kwargs=True).id,
        m.register_forward_hook(post).id,
        m.register_forward_hook(reg_pre_bwd).id,
    ]
    before = hooks_snapshot(m)
    ex = extract_hooks(m)
    assert ex.unknown == []
    assert ex.withheld == [("_forward_pre_hooks", hids[1], reg_post_bwd), ("_forward_hooks", hids[3], reg_pre_bwd)]
    assert {k: list(v) for k, v in ex.capture_time.items()} == {
        "forward_pre_hooks": [hids[0]],
        "forward_hooks": [hids[2]],
        "backward_pre_hooks": [hids[3]],
        "backward_hooks": [hids[1]],
    }
    for key in HOOK_KEYS:  # TE's order within a step
        for f in ex.capture_time[key].values():
            assert f(m) is None
    assert [c[0] for c in calls] == ["pre_forward", "post_forward", "pre_backward", "post_backward"]
    assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    restore_hooks(ex)
    assert hooks_snapshot(m) == before
