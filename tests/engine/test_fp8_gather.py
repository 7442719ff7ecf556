"""FP8 weights gathered as FP8 bytes ([Note: FP8 parameter all-gather], ``megatron_fsdp/_fp8.py``), on Gloo.

TE's FP8 tensors need CUDA, so these run the engine's path with the CPU stand-in of ``tests/engine/_fp8_net.py``
(torch's float8_e4m3fn, TE's current-scaling rule); the GPU suite runs it with TE (``tests/gpu/scripts/fp8_gather.py``).

- Training with FP8 weights gathered as bytes is ``torch.equal`` (every loss, every main parameter, Adam) to the
  same engine training plain weights that each layer quantizes in forward, on 1, 2 and 4 ranks: the scale of a
  weight sharded over ranks is that of the whole weight.
- After an unshard every weight's bytes are the quantization of its whole bf16-rounded main value, its transpose
  is written, and its bytes and transpose sit in the unit's double-buffer slot.
- The unit's all-gathers move one byte per weight element (plus a staging area for the other parameters): at a
  Llama-3-8B layer on 4 ranks, at most 0.55x the bf16 bytes of the same unit.
- A unit's gathers send the bytes of its last quantization while the main shard is unchanged: the backward's (a
  recomputed forward's too) and every later micro-batch's; the first forward after an optimizer step (fused Adam's,
  which moves no version counter, included) quantizes again; training is the same. Controls: bytes marked stale at
  every backward gather train the same; bytes never marked stale are caught. Under a whole-step graph with a graphed
  optimizer and two micro-batches (protocol backend) the units are quantized in every step's first micro-batch only,
  and training is ``torch.equal`` to eager.
- Controls: each rank scaling by the amax of its own piece (no all-reduce) is caught by the first comparison.
- Refused, naming the fix: ZeRO-1/2, no double buffer, frozen FP8 weights, summon_full_params.
- Per-layer graphs over FP8 units train like eager, and the replay check covers each FP8 weight's bytes, transpose
  and scale: a scale tensor replaced after capture is named before the replay.
- A DCP checkpoint of FP8 units (the fp32 main shards and Adam's state) saved on 2 ranks resumes on 2 ranks with
  every later loss ``torch.equal`` to the uninterrupted run's (the next unshard quantizes the loaded values), and on
  1 rank within the engine's summation-order tolerance.
- TE's own path (``_TEOps.quantize``) against a stand-in of the TE calls it makes: the whole weight's scale on every
  rank, each piece cast row-wise only into its output, E4M3's range found across TE's two dtype enums.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from megatron_fsdp import _collectives, _fp8, fully_shard
from megatron_fsdp._unit import FSDPUnit
from tests.dist_utils import run_gloo
from tests.engine._common import RTOL, eager_losses
from tests.engine import _fp8_net
from tests.engine._fp8_net import Block, Net, StandInOps

pytestmark = pytest.mark.gloo

DB = dict(fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)


def _train(rank: int, world: int, quantized: bool, ops: StandInOps, blocks: int = 2,
           recompute: bool = False, micro: int = 1, fused: bool = False) -> Dict[str, Any]:
    torch.manual_seed(0)
    net = Net(quantized, blocks=blocks, recompute=recompute)
    model = fully_shard(net, fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params", **DB)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2, fused=fused)
    losses: List[torch.Tensor] = []
    for step in range(4):
        for i in range(micro):  # gradient accumulation: the optimizer steps after the last micro-batch
            g = torch.Generator().manual_seed(step * micro + i)
            x, y = torch.randn(4 * world, 5, 6, generator=g), torch.randn(4 * world, 5, 3, generator=g)
            loss = nn.functional.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]) / micro
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": model.full_state_dict(), "quantize_calls": ops.quantize_calls}


def _job(rank: int, world: int) -> Dict[str, Any]:
    ops = StandInOps()
    remove = _fp8.register_ops(ops)
    try:
        out = {"gathered": _train(rank, world, True, ops), "reference": _train(rank, world, False, ops)}
        control = StandInOps(reduce_amax=False)
        remove()
        remove = _fp8.register_ops(control)
        out["control"] = _train(rank, world, True, control)
        return out
    finally:
        remove()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_gathered_weights_train_like_weights_quantized_in_forward(world):
    for rank, res in enumerate(run_gloo(_job, world)):
        got, ref = res["gathered"], res["reference"]
        assert got["quantize_calls"] > 0
        assert all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"])), (rank, got["losses"], ref["losses"])
        for k, v in ref["state"].items():
            assert torch.equal(v, got["state"][k]), f"rank {rank}: {k} differs"
        if world > 1:  # one rank's piece is the whole weight: the control is the same there
            ctl = res["control"]["state"]
            assert any(not torch.equal(v, ctl[k]) for k, v in ref["state"].items()), "the no-all-reduce control passed"


#: mode -> (micro-batches a step, fused Adam), the runs of :func:`_kept_bytes_job`
KEPT_MODES = {"kept": (1, False), "stale": (1, False), "recompute": (1, False), "accumulate": (3, False),
              "fused": (3, True), "never stale": (3, True)}


def _kept_bytes_job(rank: int, world: int) -> Dict[str, Any]:
    """Four FP8 units in two double-buffer slots, so the backward gathers again: each gather's kind (forward or
    backward, from the engine's state at the unshard) and whether it quantized, with the kept bytes used as they
    are, under activation checkpointing (the recomputed forward gathers in backward), with 3 micro-batches a step
    (Adam, and fused Adam, which moves no version counter) and, as controls, the bytes marked stale before every
    backward gather, and never marked stale after their first quantization (the engine's signal ignored)."""
    out: Dict[str, Any] = {}
    real_unshard, real_install = FSDPUnit.unshard, FSDPUnit._install_if_stale
    real_gather, real_quantize, real_recompute = _fp8.Fp8Plan.gather, _fp8.Fp8Plan._quantize, FSDPUnit._pre_recompute
    for mode, (micro, fused) in KEPT_MODES.items():
        events: List[str] = []
        kind = ["forward"]

        def unshard(unit, *a, **k):
            kind[0] = "backward" if unit.engine.in_backward else "forward"
            return real_unshard(unit, *a, **k)

        def install(unit, *a, **k):
            kept = unit.fp8 is not None and unit.fp8.fresh
            real_install(unit, *a, **k)
            if mode == "never stale" and kept:
                unit.fp8.fresh = True

        def gather(plan, *a, **k):
            if kind[0] == "backward" and mode == "stale":
                plan.fresh = False
            events.append(kind[0])
            return real_gather(plan, *a, **k)

        def quantize(plan, *a, **k):
            events.append("quantize")
            return real_quantize(plan, *a, **k)

        def recompute(unit, *a, **k):
            events.append("recompute")
            return real_recompute(unit, *a, **k)

        ops = StandInOps()
        remove = _fp8.register_ops(ops)
        FSDPUnit.unshard, FSDPUnit._install_if_stale = unshard, install
        _fp8.Fp8Plan.gather, _fp8.Fp8Plan._quantize, FSDPUnit._pre_recompute = gather, quantize, recompute
        try:
            out[mode] = _train(rank, world, True, ops, blocks=4, recompute=mode == "recompute", micro=micro,
                               fused=fused)
        finally:
            FSDPUnit.unshard, FSDPUnit._install_if_stale = real_unshard, real_install
            _fp8.Fp8Plan.gather, _fp8.Fp8Plan._quantize, FSDPUnit._pre_recompute = (real_gather, real_quantize,
                                                                                  real_recompute)
            remove()
        out[mode]["events"] = events
    for micro, fused in sorted(set(KEPT_MODES.values())):
        ops = StandInOps()
        remove = _fp8.register_ops(ops)
        try:
            out[f"reference {micro} {fused}"] = _train(rank, world, False, ops, blocks=4, micro=micro, fused=fused)
        finally:
            remove()
    return out


def _quantized_in(events: List[str]) -> List[str]:
    """The kind of gather (forward or backward) each quantization happened in."""
    return [events[i - 1] for i, e in enumerate(events) if e == "quantize"]


def test_the_gathers_send_the_bytes_quantized_once_a_step():
    """[Note: one quantization a step]: the backward's gathers (recomputations' included) and every later
    micro-batch's quantize nothing, the first forward after each optimizer step does (fused Adam's included), and
    training is ``torch.equal`` to weights quantized in every forward; the control that marks the bytes stale at
    every backward gather quantizes there and trains the same, the control that never marks them stale trains on
    the first step's weights and is caught."""
    units, steps = 4, 4
    for rank, res in enumerate(run_gloo(_kept_bytes_job, 2)):
        ev = res["kept"]["events"]
        assert ev.count("backward") >= steps, ev  # at least one unit gathered again in each backward
        assert _quantized_in(ev) == ["forward"] * ev.count("forward") == ["forward"] * units * steps, ev
        stale = res["stale"]["events"]
        assert stale.count("quantize") == stale.count("forward") + stale.count("backward"), stale
        rec = res["recompute"]["events"]
        assert _quantized_in(rec) == ["forward"] * rec.count("forward"), rec
        assert rec.count("recompute") >= units * steps and rec.count("backward") >= steps, rec  # every block
        for mode in ("accumulate", "fused"):
            acc = res[mode]["events"]
            # later micro-batches gather again (the units whose slots the backward reused)
            assert acc.count("forward") > units * steps, (mode, acc)
            assert _quantized_in(acc) == ["forward"] * units * steps, (mode, acc)  # once a unit a step
            quantized = [i for i, e in enumerate(acc) if e == "quantize"]
            assert quantized[units - 1] < acc.index("backward"), (mode, acc)  # the first micro-batch's forward
        assert res["never stale"]["events"].count("quantize") == units, res["never stale"]["events"]
        for mode, (micro, fused) in KEPT_MODES.items():
            got, ref = res[mode], res[f"reference {micro} {fused}"]
            same = (all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"]))
                    and all(torch.equal(v, got["state"][k]) for k, v in ref["state"].items()))
            assert same == (mode != "never stale"), (rank, mode, got["losses"], ref["losses"])


def _bytes_job(rank: int, world: int) -> Dict[str, Any]:
    remove = _fp8.register_ops(StandInOps())
    gathered: List[Any] = []
    original = _collectives.all_gather

    def counting(out, shard, group, what):
        gathered.append((out.dtype, out.numel() * out.element_size(), what))
        return original(out, shard, group, what)

    try:
        torch.manual_seed(0)
        net = Net(True)
        model = fully_shard(net, fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params", **DB)
        _collectives.all_gather = counting
        model(torch.randn(4, 5, 6)).sum().backward()
        _collectives.all_gather = original
        unit = model.units[0]
        state = model.full_state_dict()
        checks = []
        for name in ("fc1", "fc2"):
            w = getattr(net.blocks[0], name).weight
            want, want_inv = _fp8_net.quantize(state[f"blocks.0.{name}.weight"])
            slot = unit.param_buffer.tensor.untyped_storage()
            inside = [slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + slot.nbytes() for t in (w._data, w._transpose)]
            checks.append((torch.equal(w._data, want), torch.equal(w._scale_inv, want_inv.reshape(1)),
                           torch.equal(w._transpose, w._data.t()), all(inside)))
        return {"gathered": gathered, "checks": checks, "plane_bytes": unit.layout.total_numel,
                "wire": unit.fp8.wire_bytes(), "unit": unit.name}
    finally:
        _collectives.all_gather = original
        remove()


def test_an_fp8_unit_gathers_bytes_scaled_for_the_whole_weight():
    for res in run_gloo(_bytes_job, 2):
        assert all(all(c) for c in res["checks"]), res["checks"]
        mine = [(dt, n) for dt, n, what in res["gathered"] if res["unit"] in what]
        # one unshard (the slot still holds the unit at its backward): the FP8 plane, one byte a layout element,
        # and the staging area of the norms and biases in the compute dtype (fp32 here)
        assert mine == [(torch.uint8, res["plane_bytes"]), (torch.float32, res["wire"] - res["plane_bytes"])], mine


def test_at_a_llama_8b_layer_the_fp8_gather_moves_half_the_bf16_bytes():
    """The plan's bytes at the shapes of one Llama-3-8B layer (TE's TransformerLayer: fused QKV, gate+up, norms),
    4 ranks, bf16 compute: the staging area of the norms is noise beside the FP8 plane."""
    from megatron_fsdp._flat import FlatLayout

    h, f, kv = 4096, 14336, 1024
    shapes = {"ln1": (h,), "qkv": (h + 2 * kv, h), "proj": (h, h), "ln2": (h,), "fc1": (2 * f, h), "fc2": (h, f)}
    params = [torch.empty(s, device="meta") for s in shapes.values()]
    ops = StandInOps()
    remove = _fp8.register_ops(ops)
    try:
        quantized = [p if p.dim() == 1 else _fp8_net.Fp8Param.__new__(_fp8_net.Fp8Param, torch.zeros(1)) for p in params]
        # the plan reads only which parameters are FP8; give the FP8 ones the stand-in type
        layout = FlatLayout(list(shapes), params, 4)
        plan = _fp8.Fp8Plan.build(ops, layout, quantized, world=4, rank=0, itemsize=2)
    finally:
        remove()
    assert plan.fp8 == [1, 2, 4, 5] and plan.other == [0, 3]
    bf16 = layout.total_numel * 2
    assert plan.wire_bytes() <= 0.55 * bf16, (plan.wire_bytes(), bf16)
    assert plan.wire_bytes() - layout.total_numel == 4 * plan.stage_numel * 2


def _refusal_job(rank: int, world: int, case: str) -> str:
    remove = _fp8.register_ops(StandInOps())
    try:
        torch.manual_seed(0)
        net = Net(True, frozen_fp8=case == "frozen")
        if case == "frozen_plain":  # a frozen bias in a unit with FP8 weights
            net.blocks[0].fc1.bias.requires_grad_(False)
        kw = dict(DB)
        strategy = "optim_grads_params"
        if case == "zero2":
            strategy = "optim_grads"
        if case == "no_double_buffer":
            kw = {}
        if case == "dtype":  # fp32 FP8 weights in a bf16 engine: TE would refuse the forward, less clearly
            kw["compute_dtype"] = torch.bfloat16
        try:
            model = fully_shard(net, fsdp_unit_modules=[Block], sharding_strategy=strategy, **kw)
            if case == "summon":
                with model.summon_full_params():
                    pass
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "no error"
    finally:
        remove()


@pytest.mark.parametrize("case,words", [
    ("zero2", ["sharding_strategy='optim_grads' with", "use sharding_strategy='optim_grads_params'"]),
    ("no_double_buffer", ["fsdp_double_buffer=False", "fsdp_double_buffer=True"]),
    ("frozen", ["frozen FP8 weights", "blocks.0.fc1.weight"]),
    ("frozen_plain", ["FP8 weights and frozen parameters", "fc1.bias", "freeze them in another unit"]),
    ("summon", ["summon_full_params", "state_dict"]),
    ("dtype", ["blocks.0.fc1.weight", "built in torch.float32", "computes in torch.bfloat16",
               "params_dtype=torch.bfloat16"]),
])
def test_fp8_weights_where_the_gather_does_not_run_are_refused(case, words):
    msg = run_gloo(_refusal_job, 1, case)[0]
    assert all(w in msg for w in words), msg


def _graphs_job(rank: int, world: int) -> Dict[str, Any]:
    """Per-layer graphs (protocol backend) over FP8 units: the replay check names an FP8 weight whose scale tensor
    was replaced after capture, and graphed training equals eager until then."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    remove = _fp8.register_ops(StandInOps())
    out: Dict[str, Any] = {}
    try:
        for graphed in (False, True):
            torch.manual_seed(0)
            net = Net(True)
            model = fully_shard(net, fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params", **DB)
            opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)
            graphs = None
            if graphed:
                graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[],
                                                                  cuda_graph_warmup_steps=1), backend="protocol")
            losses = []
            for step in range(3):
                if graphs is not None and step == 1:
                    graphs.capture()
                g = torch.Generator().manual_seed(step)
                x = torch.randn(4 * world, 5, 6, generator=g)[4 * rank:4 * rank + 4]
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            out["graphed" if graphed else "eager"] = losses
            if graphs is not None:
                names = [n for c in graphs.callables for n, _ in graphs.engine.replay_tensors(c.module)]
                out["replay_names"] = names
                w = net.blocks[1].fc1.weight
                w._scale_inv = w._scale_inv.clone()  # a new tensor where the graph read the old one
                try:
                    model(torch.randn(4, 5, 6))
                    out["moved"] = "no error"
                except RuntimeError as exc:
                    out["moved"] = str(exc)
                graphs.delete()
        return out
    finally:
        remove()


def test_the_replay_check_covers_an_fp8_weights_bytes_transpose_and_scale():
    for res in run_gloo(_graphs_job, 2):
        assert all(torch.equal(a, b) for a, b in zip(res["graphed"], res["eager"])), (res["graphed"], res["eager"])
        assert {"fc1.weight (FP8 bytes)", "fc1.weight (transpose)", "fc1.weight (scale_inv)"} <= set(res["replay_names"])
        assert "would replay with parameter fc1.weight (scale_inv)" in res["moved"], res["moved"]


def _whole_step_job(rank: int, world: int) -> Dict[str, Any]:
    """Two micro-batches a step over FP8 units, eagerly and under a whole-step graph with a graphed optimizer
    (protocol backend: every replay runs the captured schedule eagerly, after the same checks): the losses, the
    final state, the quantizations of each step and the micro-batch (0 or 1) each one happened in."""
    from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph

    out: Dict[str, Any] = {}
    real_quantize = _fp8.Fp8Plan._quantize
    for graphed in (False, True):
        counts: List[int] = []
        in_micro: List[int] = []
        calls = [0]

        def quantize(plan, *a, **k):
            counts[-1] += 1
            in_micro.append((calls[0] - 1) % 2)
            return real_quantize(plan, *a, **k)

        def forward_step(m, x, y):
            calls[0] += 1  # every run of a step's body calls it once a micro-batch, in order
            return nn.functional.mse_loss(m(x), y) / 2

        remove = _fp8.register_ops(StandInOps())
        _fp8.Fp8Plan._quantize = quantize
        try:
            model, opt = _fp8_model(0)
            g = (FullIterationCudaGraph(model, forward_step, CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                                              cuda_graph_warmup_steps=2),
                                        graph_optimizer=True, backend="protocol") if graphed else None)
            losses = []
            for step in range(5):
                counts.append(0)
                micro = [_batch(2 * step + i, rank, world, 4 // world) for i in range(2)]
                if g is not None:
                    losses.append(g.step(micro))
                    g.optimizer_step(opt)
                else:
                    losses.append(eager_losses(forward_step, model, micro))
                    opt.step()
                opt.zero_grad()
            out["graphed" if graphed else "eager"] = {"losses": losses, "state": model.full_state_dict(),
                                                       "quantized": counts, "in_micro": in_micro}
        finally:
            _fp8.Fp8Plan._quantize = real_quantize
            remove()
    return out


def test_a_whole_step_graph_over_fp8_units_quantizes_on_the_first_micro_batch():
    """[Note: one quantization a step] under a whole-step graph with a graphed optimizer and two micro-batches: the
    FP8 units are quantized in the first micro-batch of every run of a step (the static step starts with every unit
    stale; the graphed optimizer marks them stale after each replay), never in the second, once a unit a replayed
    step, and training is ``torch.equal`` to eager. (The warm-up step that checks for host syncs, and the capture
    step, run the step's body twice: each run quantizes.)"""
    fp8_units = 2  # the Net's two blocks (its root holds plain parameters)
    for res in run_gloo(_whole_step_job, 2):
        eager, graphed = res["eager"], res["graphed"]
        assert all(torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])), (eager, graphed)
        assert all(torch.equal(v, graphed["state"][k]) for k, v in eager["state"].items())
        assert eager["quantized"] == [fp8_units] * 5, eager["quantized"]
        assert graphed["quantized"][3:] == [fp8_units] * 2, graphed["quantized"]  # the replays
        assert all(c % fp8_units == 0 for c in graphed["quantized"]), graphed["quantized"]
        assert set(eager["in_micro"]) == set(graphed["in_micro"]) == {0}, (eager["in_micro"], graphed["in_micro"])


def _batch(step: int, rank: int, world: int, per: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _fp8_model(seed: int):
    torch.manual_seed(seed)
    model = fully_shard(Net(True), fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params", **DB)
    return model, torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)


def _step(model: Any, opt: Any, step: int, rank: int, world: int) -> torch.Tensor:
    """One step on this rank's share of a global batch of 4 (whole on one rank, halves on two): the same global
    gradient at any world size, so a resume at another size continues the same run."""
    x, y = _batch(step, rank, world, 4 // world)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total / world


def _save_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    remove = _fp8.register_ops(StandInOps())
    try:
        model, opt = _fp8_model(0)
        for step in range(2):
            _step(model, opt, step, rank, world)
        dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=directory)
        return {"after": [_step(model, opt, step, rank, world) for step in range(2, 4)]}
    finally:
        remove()


def _resume_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    remove = _fp8.register_ops(StandInOps())
    try:
        model, opt = _fp8_model(1)  # other initial values: everything must come from the checkpoint
        msd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
        model.load_sharded_state_dict(msd)
        model.load_optimizer_state_dict(opt, osd)
        return {"after": [_step(model, opt, step, rank, world) for step in range(2, 4)]}
    finally:
        remove()


def test_a_dcp_checkpoint_of_fp8_units_resumes_bit_for_bit_at_any_world_size(tmp_path):
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_gloo(_save_job, 2, directory)[0]["after"]
    for res in run_gloo(_resume_job, 2, directory):
        assert all(torch.equal(a, b) for a, b in zip(res["after"], uninterrupted)), (res["after"], uninterrupted)
    # On one rank the gradient of a step is summed in another order than two ranks' reduce-scatter sums it: a few
    # fp32 ulp ([Note: matching tolerance] in tests/engine/_common.py; measured 8.1e-8 relative on the second loss)
    for res in run_gloo(_resume_job, 1, directory):
        assert torch.equal(res["after"][0], uninterrupted[0])
        assert torch.allclose(torch.stack(res["after"]), torch.stack(uninterrupted), rtol=RTOL, atol=0), res["after"]



# ------------------------------------------------------------------ TE's path, against a stand-in of TE's API


def _fake_te(casts: List[Dict[str, Any]]) -> None:
    """A stand-in of the few TE calls ``_TEOps.quantize`` makes (TE needs CUDA), installed in ``sys.modules``: its
    amax, scale and cast do what TE's current scaling does on the CPU, and each quantizer records its usages. Its
    two DType enums are distinct classes with equal integers, as TE's Python enum and its extension's are."""
    import sys
    import types

    class ExtDType:  # the extension's enum: equal to nothing but itself, converts to int
        def __init__(self, v: int) -> None:
            self.v = v

        def __int__(self) -> int:
            return self.v

    tex = types.ModuleType("transformer_engine_torch")
    tex.DType = types.SimpleNamespace(kFloat8E4M3=ExtDType(7), kFloat8E5M2=ExtDType(8))
    tex.compute_amax = lambda x, amax: amax.copy_(x.float().abs().max().reshape(1))

    def scale_and_inv(noop: torch.Tensor, lists: List[List[torch.Tensor]], max_fp8: float, pow2: bool,
                      eps: float) -> None:
        for amax, scale, inv in zip(*lists):
            scale.copy_(max_fp8 / torch.clamp(amax, min=1e-12))
            inv.copy_(1.0 / scale)

    tex.multi_tensor_compute_scale_and_scale_inv = scale_and_inv
    applier = types.ModuleType("transformer_engine.pytorch.optimizers.multi_tensor_apply")
    applier.multi_tensor_applier = lambda op, noop, lists, *args: op(noop, lists, *args)

    class Float8Quantizer:
        def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: Any, *, rowwise: bool = True,
                     columnwise: bool = True) -> None:
            self.scale = scale
            casts.append({"rowwise": rowwise, "columnwise": columnwise})

        def create_tensor_from_data(self, data: torch.Tensor, fake_dtype: Any = torch.float32) -> Any:
            return types.SimpleNamespace(data=data, dtype=fake_dtype)

        def update_quantized(self, src: torch.Tensor, dst: Any) -> Any:
            dst.data.copy_((src.float() * self.scale).to(torch.float8_e4m3fn).view(torch.uint8))
            return dst

    f8 = types.ModuleType("transformer_engine.pytorch.tensor.float8_tensor")
    f8.Float8Quantizer = Float8Quantizer
    sys.modules.update({"transformer_engine_torch": tex, applier.__name__: applier, f8.__name__: f8})


class _PyDType(enum.IntEnum):  # TE's Python enum: the quantizer's ``dtype``
    kFloat8E4M3 = 7


class _Weight:
    """What ``_TEOps.quantize`` reads of a TE FP8 weight: its quantizer's settings, dtype, device and scale_inv."""

    def __init__(self) -> None:
        self.dtype, self.device = torch.bfloat16, torch.device("cpu")
        self._fp8_dtype = _PyDType.kFloat8E4M3
        self._scale_inv = torch.full((1,), -1.0)
        self.cleared = 0

    amax_epsilon = 0.0

    def _get_quantizer(self) -> Any:
        import types

        return types.SimpleNamespace(dtype=_PyDType.kFloat8E4M3, force_pow_2_scales=False,
                                     amax_epsilon=self.amax_epsilon)

    def clear_high_precision_init_val(self) -> None:
        self.cleared += 1


def _te_quantize_job(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    casts: List[Dict[str, Any]] = []
    _fake_te(casts)
    g = torch.Generator().manual_seed(3)
    whole = [torch.randn(40, generator=g) * (i + 1) for i in range(3)]  # three weights, each split over 2 ranks
    weights = [_Weight() for _ in whole]
    # weight 0 halved, weight 1 all on rank 0 (no piece on rank 1), weight 2 halved
    pieces = [whole[0][rank * 20:(rank + 1) * 20], whole[1] if rank == 0 else None, whole[2][rank * 20:(rank + 1) * 20]]
    outs = [None if p is None else torch.zeros(p.numel(), dtype=torch.uint8) for p in pieces]
    offsets = [rank * 20, 0 if rank == 0 else None, rank * 20]
    ops = object.__new__(_fp8._TEOps)  # its __init__ imports TE's tensor classes; quantize needs only the calls above
    ops.quantize(weights, pieces, offsets, outs, dist.group.WORLD)
    return {"scale_inv": [w._scale_inv.clone() for w in weights], "outs": outs, "pieces": pieces, "casts": casts,
            "cleared": [w.cleared for w in weights], "whole": whole}


def test_te_quantize_casts_row_wise_with_the_whole_weights_scale():
    """``_TEOps.quantize`` against a stand-in of TE's calls ([Note: a row-wise cast of the shard pieces]): every rank
    sets each weight's scale from the amax of the whole bf16-rounded weight (a weight with no piece on a rank
    included), writes each piece's bytes cast with that scale into its output, with row-wise-only quantizers, and
    picks E4M3's range from a quantizer dtype of another enum class than the extension's."""
    per_rank = run_gloo(_te_quantize_job, 2)
    whole = per_rank[0]["whole"]
    for r in per_rank:
        assert r["casts"] and all(c == {"rowwise": True, "columnwise": False} for c in r["casts"]), r["casts"]
        assert len(r["casts"]) == sum(p is not None for p in r["pieces"])
        assert r["cleared"] == [1, 1, 1]
        for w, inv in zip(whole, r["scale_inv"]):
            amax = w.to(torch.bfloat16).float().abs().max()
            assert torch.equal(inv, (1.0 / (448.0 / amax)).reshape(1)), (inv, amax)
        for piece, out, inv in zip(r["pieces"], r["outs"], r["scale_inv"]):
            if piece is not None:
                want = (piece.to(torch.bfloat16).float() * (1.0 / inv)).to(torch.float8_e4m3fn).view(torch.uint8)
                assert torch.equal(out, want)


def test_te_weights_with_different_scale_rules_in_one_unit_are_refused():
    """One all-reduce of amaxes and one scale rule a unit: TE weights whose quantizers differ are named at set-up
    (``fully_shard`` collects ``unit_problem``), not at the first unshard."""
    ops = object.__new__(_fp8._TEOps)
    same, other = _Weight(), _Weight()
    assert ops.unit_problem([same, other]) is None
    other.amax_epsilon = 1e-6
    assert "amax_epsilon" in ops.unit_problem([same, other])

