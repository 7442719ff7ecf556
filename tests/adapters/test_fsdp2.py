"""The FSDP2 engine adapter (fsdp_cudagraph.engines.fsdp2) driven in TE's capture schedule on 2 Gloo ranks.

The schedule is the protocol backend's (``capture.schedules.run_te_schedule``): per warmup iteration and in the capture pass,
all forwards in order then all backwards in reverse, every capture-time hook outside the (simulated) capture
region, the module's own hooks taken off during capture and put back after. The tests speak to the engine only
through ``fsdp_cudagraph.engines`` (``adapter_for`` and the contract), so they stay valid when PartialCudaGraphs
does too. One spawned job runs every check; the tests read its report.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.capture import schedules
from fsdp_cudagraph.engines import HOOK_DICTS, HOOK_KEYS, adapter_for
from fsdp_cudagraph.engines.plain import PlainModule
from fsdp_cudagraph.engines.fsdp2 import adapter as fsdp2_adapter
from fsdp_cudagraph.engines.fsdp2 import storage as fsdp2_storage
from fsdp_cudagraph import keep_unsharded_storage, release_unsharded_storage
from fsdp_cudagraph.hooks import extract_hooks, hooks_snapshot, restore_hooks
from tests.dist_utils import run_gloo

WORLD = 2
NUM_STEPS = 5
SCHEDULE_AT = 2
NUM_WARMUP = 2
HIDDEN = 8
ROWS = 4  # per rank



class Net(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(num_layers))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(*, reshard_after_forward: bool = True, reshard_after_backward: bool = True, keep: bool = False,
          **kwargs: Any) -> Net:
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fsdp2_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fsdp2_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if not reshard_after_backward:
        model.set_reshard_after_backward(False)
    if keep:
        assert keep_unsharded_storage(model) == 2 * len(model.layers) + 2
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(WORLD * ROWS, HIDDEN, generator=g)[rank * ROWS:(rank + 1) * ROWS]


class Recorder:
    """Counts the capture-time hook calls and the collectives, and where each collective ran."""

    def __init__(self) -> None:
        self.calls: Dict[tuple, int] = collections.Counter()
        self.in_capture = False
        self.collectives_outside = 0
        self.collectives_inside = 0


def drive_schedule(adapter, layers: List[nn.Module], rec: Recorder, *, fail_capture_forward: bool = False) -> None:
    """TE's capture schedule as the protocol backend runs it (``capture.schedules.run_te_schedule``), on
    ``layers`` (each one callable), their hooks taken off by phase 1 and planned by the adapter (phase 2)."""
    extracted = []
    try:
        for layer in layers:
            extracted.append(extract_hooks(layer, hook_plan=adapter.hook_plan))
            assert not extracted[-1].unknown, extracted[-1].unknown
        plans = [{k: {hid: counted(fn, rec, (i, k), layer) for hid, fn in ex.capture_time[k].items()} for k in HOOK_KEYS}
                 for i, (ex, layer) in enumerate(zip(extracted, layers))]
        g = torch.Generator().manual_seed(7)
        sample = [torch.randn(ROWS, HIDDEN, generator=g).requires_grad_() for _ in layers]
        callables: List[Any] = list(layers)
        if fail_capture_forward:
            callables[1] = failing_in_capture(layers[1], rec)
        # As TE's graph maker: autograd.backward into .grad of the static input and the parameters the layer
        # holds at its backward (FSDP2 swaps them in at its pre-backward), cleared and restored.
        schedules.run_te_schedule(callables, [(x,) for x in sample], plans, num_warmup_iters=NUM_WARMUP,
                                  region=lambda: region(adapter, rec),
                                  grad_inputs=lambda i: [p for p in layers[i].parameters() if p.requires_grad])
    finally:
        for ex in extracted:
            restore_hooks(ex)
        adapter.reset()


def counted(fn, rec: Recorder, key: tuple, layer: nn.Module):
    def run_counted(_given: Any) -> None:  # on the layer, whatever callable the schedule passes
        rec.calls[key] += 1
        return fn(layer)
    return run_counted


def failing_in_capture(layer: nn.Module, rec: Recorder):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if rec.in_capture:
            raise ValueError("captured forward failed")
        return layer(x)
    return forward


@contextlib.contextmanager
def region(adapter, rec: Recorder):
    rec.in_capture = True
    try:
        with adapter.simulated_capture():
            yield
    finally:
        rec.in_capture = False


@contextlib.contextmanager
def count_collectives(rec: Recorder):
    """Count every torch.distributed collective FSDP2 may call, split by inside/outside the capture region."""
    names = [n for n in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                         "reduce_scatter_single", "all_reduce") if hasattr(dist, n)]
    orig = {n: getattr(dist, n) for n in names}

    def wrap(fn):
        def counting(*a, **k):
            if rec.in_capture:
                rec.collectives_inside += 1
            else:
                rec.collectives_outside += 1
            return fn(*a, **k)
        return counting
    for n in names:
        setattr(dist, n, wrap(orig[n]))
    try:
        yield
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)


def train(rank: int, *, schedule: bool, rec: Optional[Recorder] = None, **settings: Any) -> Dict[str, Any]:
    model = build(**settings)
    if schedule and settings.get("keep"):
        model(batch(0, rank)).sum().backward()  # lazy init before the check, as the graph layer captures after eager steps
        model.zero_grad()
        adapter_for(model).check_partial_graphs()
        model = build(**settings)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adapter = adapter_for(model)
    losses = []
    for step in range(NUM_STEPS):
        if schedule and step == SCHEDULE_AT:
            layers = list(model.layers)
            assert adapter.unit_modules() == layers
            before = [hooks_snapshot(m) for m in layers]
            with count_collectives(rec):
                drive_schedule(adapter, layers, rec)
            assert [hooks_snapshot(m) for m in layers] == before
            opt.zero_grad()  # warmup and capture gradients are not the step's (the graph layer discards them too)
        loss = model(batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": [p.full_tensor() for p in model.parameters()]}


def job(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    report: Dict[str, Any] = {}
    for label, settings in {"zero3": {}, "zero2": {"reshard_after_forward": False},
                            "zero3_kept": {"keep": True}}.items():
        rec = Recorder()
        ref = train(rank, schedule=False, **{k: v for k, v in settings.items() if k != "keep"})
        got = train(rank, schedule=True, rec=rec, **settings)
        report[label] = {
            "losses_equal": all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"])),
            "params_equal": all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"])),
            "calls": dict(rec.calls), "inside": rec.collectives_inside, "outside": rec.collectives_outside,
        }

    # (c) a collective forced inside the region raises, and the functions are restored after.
    model = build()
    adapter = adapter_for(model)
    model(batch(0, rank)).sum().backward()
    before = dist.all_reduce
    try:
        with adapter.simulated_capture():
            dist.all_reduce(torch.ones(1))
        report["forced"] = None
    except RuntimeError as exc:
        report["forced"] = str(exc)
    report["restored_collective"] = dist.all_reduce is before

    # (d) hooks restored exactly when the captured forward raises, and FSDP2 still trains after.
    layers = list(model.layers)
    before_hooks = [hooks_snapshot(m) for m in layers]
    try:
        drive_schedule(adapter, layers, Recorder(), fail_capture_forward=True)
        report["failed_capture"] = None
    except ValueError as exc:
        report["failed_capture"] = str(exc)
    report["hooks_restored_after_failure"] = [hooks_snapshot(m) for m in layers] == before_hooks
    report["same_hook_objects"] = all(
        a[d][j][1] is b[d][j][1] for a, b in zip(before_hooks, [hooks_snapshot(m) for m in layers])
        for d in HOOK_DICTS for j in range(len(a[d])))
    loss = model(batch(1, rank)).sum()
    loss.backward()
    report["trains_after_failure"] = bool(torch.isfinite(loss.detach()))

    # (e) settings: what is refused and what is accepted.
    refused = {}
    for label, settings in {"zero3": {}, "reshard_after_backward": {"reshard_after_forward": False},
                            "bf16": {"reshard_after_forward": False, "reshard_after_backward": False,
                                     "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
                            "ok": {"reshard_after_forward": False, "reshard_after_backward": False},
                            "zero3_kept": {"keep": True}}.items():
        m = build(**settings)
        m(batch(0, rank)).sum().backward()  # lazy init, as before a capture
        try:
            adapter_for(m).check_partial_graphs()
            refused[label] = None
        except NotImplementedError as exc:
            refused[label] = str(exc)
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard
    torch.manual_seed(0)
    m = Net()
    fsdp2_shard([m.layers[0], m.layers[1]], reshard_after_forward=False)
    fsdp2_shard(m, reshard_after_forward=False)
    keep_unsharded_storage(m)
    m(batch(0, rank)).sum().backward()
    try:
        adapter_for(m).check_partial_graphs()
        refused["grouped"] = None
    except NotImplementedError as exc:
        refused["grouped"] = str(exc)
    report["refused"] = refused

    # (f) a parameter that moves is visible through replay_tensors (ZeRO-3 frees it at reshard).
    model = build()
    adapter = adapter_for(model)
    model(batch(0, rank)).sum().backward()
    layer = model.layers[0]
    state = layer._get_fsdp_state()
    group = fsdp2_storage.param_groups(state)[0]
    group.unshard()
    group.wait_for_unshard()
    named = adapter.replay_tensors(layer)
    report["replay_names"] = [n for n, _ in named]
    report["replay_is_module_param"] = [t is layer[0].weight or t is layer[0].bias for _, t in named]
    ptrs = [t.untyped_storage().data_ptr() for _, t in named]
    sizes_before = [t.untyped_storage().size() for _, t in named]
    group.reshard()
    report["moved"] = [t.untyped_storage().size() == 0 or t.untyped_storage().data_ptr() != p
                       for (_, t), p in zip(named, ptrs)]
    report["sizes_before"] = sizes_before
    # ... and one that no longer moves once its storage is kept.
    model = build(keep=True)
    adapter = adapter_for(model)
    model(batch(0, rank)).sum().backward()
    layer = model.layers[0]
    group = fsdp2_storage.param_groups(layer._get_fsdp_state())[0]
    group.unshard()
    group.wait_for_unshard()
    kept = adapter.replay_tensors(layer)
    ptrs = [t.data_ptr() for _, t in kept]
    group.reshard()
    sharded = layer[0].weight is not kept[0][1] and kept[0][1].untyped_storage().size() > 0
    group.unshard()
    group.wait_for_unshard()
    report["kept_stable"] = sharded and [t.data_ptr() for _, t in adapter.replay_tensors(layer)] == ptrs
    report["kept_is_module_param"] = layer[0].weight is kept[0][1]
    group.reshard()
    release_unsharded_storage(model)
    report["released"] = kept[0][1].untyped_storage().size() == 0
    # A torch whose FSDP2 lacks a name the adapter drives is refused when the adapter is built.
    saved_names = fsdp2_adapter._GROUP_NAMES
    fsdp2_adapter._GROUP_NAMES = saved_names + ("_no_such_fsdp2_name",)
    try:
        fsdp2_adapter.FSDP2Engine(model)  # built anew: adapter_for hands back the adapter held above (one per model)
        report["missing_name"] = None
    except NotImplementedError as exc:
        report["missing_name"] = str(exc)
    finally:
        fsdp2_adapter._GROUP_NAMES = saved_names
    report["unit_of_linear"] = adapter.unit_of(layer[0]) is layer
    report["unit_of_head"] = adapter.unit_of(model.head) is model
    return report


@pytest.fixture(scope="module")
def reports() -> List[Dict[str, Any]]:
    return run_gloo(job, WORLD)


pytestmark = pytest.mark.gloo


@pytest.mark.parametrize("label", ["zero3", "zero2", "zero3_kept"])
def test_schedule_at_step_2_is_bit_exact(reports, label):
    for r in reports:
        assert r[label]["losses_equal"] and r[label]["params_equal"], r[label]


@pytest.mark.parametrize("label", ["zero3", "zero2", "zero3_kept"])
def test_each_hook_runs_once_per_pass(reports, label):
    expected = {(i, k): NUM_WARMUP + 1 for i in range(3) for k in HOOK_KEYS}
    for r in reports:
        assert r[label]["calls"] == expected


@pytest.mark.parametrize("label", ["zero3", "zero2", "zero3_kept"])
def test_no_collective_inside_capture(reports, label):
    for r in reports:
        assert r[label]["inside"] == 0
        assert r[label]["outside"] > 0  # the hooks did all-gather outside, so the counter was live


def test_forced_collective_raises(reports):
    for rank, r in enumerate(reports):
        assert r["forced"] is not None and "torch.distributed.all_reduce" in r["forced"]
        assert f"[rank {rank}]" in r["forced"]
        assert r["restored_collective"]


def test_hooks_restored_when_capture_fails(reports):
    for r in reports:
        assert r["failed_capture"] == "captured forward failed"
        assert r["hooks_restored_after_failure"] and r["same_hook_objects"]
        assert r["trains_after_failure"]


def test_unsafe_settings_refused(reports):
    for r in reports:
        refused = r["refused"]
        assert "reshard_after_forward=True" in refused["zero3"] and "keep_unsharded_storage(model)" in refused["zero3"]
        # not advised: without a reshard after backward FSDP2 skips the all-gather after the optimizer step
        assert "set_reshard_after_backward(False)" not in refused["zero3"]
        assert "reshard_after_backward=True" in refused["reshard_after_backward"]
        # FSDP2's casts run in its hooks, which wrap a replay as they wrap the eager call (FSDP2's mixed precision;
        # bit-exact in tests/adapters/test_fsdp2_mixed_precision.py)
        assert refused["bf16"] is None, refused["bf16"]
        assert "fully_shard([...])" in refused["grouped"] and "layers.0" in refused["grouped"]
        assert refused["ok"] is None and refused["zero3_kept"] is None


def test_replay_tensors_show_a_moved_parameter(reports):
    for r in reports:
        assert r["replay_names"] == ["0.weight", "0.bias"]
        assert all(r["replay_is_module_param"])
        assert all(s > 0 for s in r["sizes_before"])
        assert all(r["moved"])
        assert r["unit_of_linear"] and r["unit_of_head"]


def test_kept_storage_does_not_move(reports):
    for r in reports:
        assert r["kept_stable"] and r["kept_is_module_param"] and r["released"]


def test_missing_fsdp2_internal_is_refused(reports):
    for r in reports:
        assert "FSDPParamGroup._no_such_fsdp2_name" in r["missing_name"] and "torch 2.11 to 2.13" in r["missing_name"]


def test_recognizes_only_fsdp2_roots():
    assert isinstance(adapter_for(nn.Linear(2, 2)), PlainModule)
