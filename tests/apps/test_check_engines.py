"""The alignment checker under each FSDP engine (``check_alignment(engine=...)``, ``--engine``).

CPU (2 Gloo ranks, protocol backend, the tiny reference GPT of ``tests/apps/_models.py``): under PyTorch
FSDP2 the checker says EQUAL for the aligned model and, for a perturbed callable, reports the mismatch from
the capture step on naming exactly that callable; its gradient records are each rank's shard of FSDP2's
DTensor gradients; ``optim_grads`` maps to ``reshard_after_forward=False`` and a strategy FSDP2 cannot
express is refused. The command line runs once with ``--engine fsdp2``. ``engine="nvidia"`` without a GPU
(or without megatron-core) and an unknown engine are refused before the factory is called.

GPU (marked ``gpu``, skipped without CUDA, and for ``nvidia`` without megatron-core, with the reason): the
command line with ``--engine nvidia`` and ``--engine fsdp2`` on a dense reference GPT must say EQUAL.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from fsdp_cudagraph.check import ModelSpec, check_alignment
from fsdp_cudagraph.engines.nvidia.build import NVIDIA_PIP
from fsdp_cudagraph.engines.registry import registered_builders

ENGINES = registered_builders()
from tests.dist_utils import run_gloo
from tests.gpu_utils import NO_GPU, ROOT, gpu_env, keep, run_entry
from tests.apps._models import gpt_factory

STEPS, CAPTURE = 5, 2


def _recorded_fsdp2_grads() -> Dict[str, Any]:
    """One FSDP2 step through the checker's engine builder and recorder: {name: (recorded shape, local shape,
    full shape)} of every main_grad record."""
    from fsdp_cudagraph.checker.divergence import StepRecorder

    torch.manual_seed(0)
    spec = gpt_factory(torch.device("cpu"))
    run = ENGINES["fsdp2"].build(spec.model, unit_modules=spec.unit_modules, make_optimizer=spec.make_optimizer,
                                 device=torch.device("cpu"), sharding_strategy="optim_grads_params",
                                 compute_dtype=None)
    recorder = StepRecorder([])
    recorder.start()
    spec.loss(run.model, spec.batch(0)).backward()
    recorder.grads(run.named_parameters())
    params = dict(run.named_parameters())
    return {key[1]: (meta[0], tuple(params[key[1]].grad.to_local().shape), tuple(params[key[1]].shape))
            for key, (meta, _) in recorder.stop() if key[0] == "main_grad"}


def _job(rank: int, world: int) -> Dict[str, Any]:
    kw = dict(steps=STEPS, capture_step=CAPTURE, num_warmup_iters=2, engine="fsdp2")
    out: Dict[str, Any] = {
        "equal": check_alignment(gpt_factory, **kw).to_dict(),
        "perturb": check_alignment(gpt_factory, cuda_graph_modules=["attn", "mlp"], perturb="layers.2.mlp",
                                   **kw).to_dict(),
        "optim_grads": check_alignment(gpt_factory, sharding_strategy="optim_grads", **kw).to_dict(),
        "slots": check_alignment(gpt_factory, engine_options={"storage": "slots"}, **kw).to_dict(),
        "mp": check_alignment(gpt_factory, engine_options={"mixed_precision": "bf16"}, **kw).to_dict(),
        "slots_mp": check_alignment(gpt_factory, engine_options={"storage": "slots", "mixed_precision": "bf16"},
                                    **kw).to_dict(),
        "slots_perturb": check_alignment(gpt_factory, engine_options={"storage": "slots"},
                                         perturb="layers.1", **kw).to_dict(),
        "grads": _recorded_fsdp2_grads(),
        "names": [n for n, _ in gpt_factory(torch.device("cpu")).model.named_parameters()],
    }
    try:
        check_alignment(gpt_factory, sharding_strategy="optim", **kw)
        out["bad_strategy"] = None
    except ValueError as exc:
        out["bad_strategy"] = str(exc)
    return out


@pytest.fixture(scope="module")
def checks() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


@pytest.mark.gloo
def test_fsdp2_checker_says_equal(checks):
    for res in checks:
        r = res["equal"]
        assert r["engine"] == "fsdp2" and "keep_unsharded_storage" in r["precision"], (r["engine"], r["precision"])
        assert r["equal"] and r["params_equal"] and r["first_mismatch_step"] is None
        assert [s["equal"] for s in r["steps"]] == [True] * STEPS
        assert r["callables"] == ["layers.0", "layers.1", "layers.2", "layers.3"] and r["world_size"] == 2
        assert r["calls"] == {n: {"replays": STEPS - CAPTURE, "eager_calls": 0, "last_change": None}
                              for n in r["callables"]}
        assert r["culprit"] is None and r["divergence"] is None and r["unknown_hooks"] == []
        r = res["optim_grads"]
        assert r["equal"] and "reshard_after_forward=False" in r["precision"], r["steps"]


@pytest.mark.gloo
def test_fsdp2_checker_with_slots_and_mixed_precision_says_equal(checks):
    """The checker's FSDP2 options: the double buffer (use_unsharded_slots), FSDP2's MixedPrecisionPolicy with fp32
    shards, and both; each EQUAL, and the policy really applied (its losses differ from the fp32 run's)."""
    for res in checks:
        for key, words in (("slots", ["use_unsharded_slots"]), ("mp", ["MixedPrecisionPolicy", "torch.float32"]),
                           ("slots_mp", ["use_unsharded_slots", "MixedPrecisionPolicy"])):
            r = res[key]
            assert all(w in r["precision"] for w in words), (key, r["precision"])
            assert r["equal"] and r["params_equal"] and [s["equal"] for s in r["steps"]] == [True] * STEPS, (key, r)
            assert all(c["replays"] == STEPS - CAPTURE for c in r["calls"].values()), (key, r["calls"])
        assert res["mp"]["steps"] != res["equal"]["steps"]  # bf16 compute: not the fp32 run's numbers
        r = res["slots_perturb"]
        assert not r["equal"] and r["culprit"] == "layers.1", (r["culprit"], r["divergence"])


def test_engine_options_are_checked_before_any_work():
    """An option another engine owns, an unknown storage, mixed precision with a cast, slots on one rank."""
    cases = [
        (dict(engine="megatron_fsdp", engine_options={"storage": "slots"}),
         ["engine_options ['storage'] are not options of engine='megatron_fsdp'", "it takes ['keep_compute_shard']"]),
        (dict(engine="fsdp2", engine_options={"offload": True}),
         ["['offload']", "it takes ['storage', 'mixed_precision', 'expert_parallel_size']"]),
    ]
    for kw, words in cases:
        with pytest.raises(ValueError) as info:
            check_alignment(_must_not_build, device=torch.device("cpu"), **kw)
        assert all(w in str(info.value) for w in words), str(info.value)
    from tests.apps._models import gpt_factory as factory

    build = ENGINES["fsdp2"].build
    common = dict(unit_modules=factory(torch.device("cpu")).unit_modules, make_optimizer=None,
                  device=torch.device("cpu"), sharding_strategy="optim_grads_params")
    with pytest.raises(ValueError, match=r"storage='disk' is not one of \('keep', 'slots'\)"):
        build(factory(torch.device("cpu")).model, compute_dtype=None, options={"storage": "disk"}, **common)
    with pytest.raises(ValueError, match=r"mixed_precision='bf16' keeps fp32 sharded parameters .* "
                                         r"compute_dtype=torch.bfloat16 would cast"):
        build(factory(torch.device("cpu")).model, compute_dtype=torch.bfloat16,
              options={"mixed_precision": "bf16"}, **common)


@pytest.mark.gloo
def test_fsdp2_checker_names_the_perturbed_callable(checks):
    for res in checks:
        r = res["perturb"]
        assert r["engine"] == "fsdp2" and not r["equal"] and not r["params_equal"]
        assert [s["equal"] for s in r["steps"]] == [True] * CAPTURE + [False] * (STEPS - CAPTURE)
        assert r["culprit"] == "layers.2.mlp", r["divergence"]
        d = r["divergence"]
        assert d["step"] == CAPTURE and d["record"][:2] == ["output", "layers.2.mlp"] and d["rank"] == 0, d
        assert "layers.2.attn" in r["callables"] and r["calls"]["layers.2.attn"]["replays"] == STEPS - CAPTURE


@pytest.mark.gloo
def test_fsdp2_gradient_records_are_this_ranks_shards(checks):
    for res in checks:
        grads = res["grads"]
        assert sorted(grads) == sorted(res["names"])  # every parameter's reduced gradient is recorded
        assert all(rec == local for rec, local, _ in grads.values()), grads
        assert any(local != full for _, local, full in grads.values()), grads  # sharded, not the full tensor


@pytest.mark.gloo
def test_fsdp2_refuses_a_strategy_it_cannot_express(checks):
    msg = checks[0]["bad_strategy"]
    assert msg is not None and "sharding_strategy='optim'" in msg and "optim_grads_params" in msg, msg


@pytest.mark.gloo
def test_checker_command_line_with_fsdp2(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "fsdp_cudagraph.check", "--engine", "fsdp2", "--device", "cpu", "--model",
           "tests.apps._models:gpt_factory", "--steps", "4", "--capture-step", "2", "--json", str(out)]
    proc = run_entry(cmd, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine fsdp2, backend protocol" in proc.stdout and "verdict: EQUAL" in proc.stdout, proc.stdout
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["engine"] == "fsdp2" and rec["world_size"] == 1 and len(rec["steps"]) == 4
    # The FSDP2 options on the command line: slots need 2+ ranks (refused on this one), and they belong to fsdp2.
    proc = run_entry(cmd[:-2] + ["--fsdp2-storage", "slots"], env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode != 0 and "storage='slots' needs 2+ ranks (world size 1)" in proc.stderr, proc.stderr[-2000:]
    bad = [a if a != "fsdp2" else "megatron_fsdp" for a in cmd[:-2]] + ["--fsdp2-mp", "bf16"]
    proc = run_entry(bad, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 2 and "are options of --engine fsdp2, not --engine megatron_fsdp" in proc.stderr
    proc = run_entry(cmd[:-2] + ["--nvidia-wrapper", "mcore"], env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 2 and "--nvidia-wrapper is an option of --engine nvidia, not --engine fsdp2" in proc.stderr
    proc = run_entry(cmd[:-2] + ["--keep-compute-shard"], env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 2 and "--keep-compute-shard is an option of --engine megatron_fsdp" in proc.stderr
    # our engine with the shards' bf16 copy kept: graphed equal to eager; with fp32 compute there is nothing to keep
    ours = [a if a != "fsdp2" else "megatron_fsdp" for a in cmd[:-2]] + ["--keep-compute-shard"]
    proc = run_entry(ours + ["--dtype", "bf16"], env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0 and "verdict: EQUAL" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_entry(ours, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode != 0 and "there is nothing to keep" in proc.stderr, proc.stderr[-2000:]


def _must_not_build(device: torch.device) -> ModelSpec:
    raise AssertionError("the factory was called: the engine must be refused before any work")


#: Why engine="nvidia" cannot run on this machine's GPU (None: it can).
NVIDIA_UNAVAILABLE = ENGINES["nvidia"].unavailable(torch.device("cuda"))


def test_nvidia_engine_without_a_gpu_is_refused_before_any_work():
    with pytest.raises((ImportError, RuntimeError)) as info:
        check_alignment(_must_not_build, engine="nvidia", device=torch.device("cpu"))
    msg = str(info.value)
    assert "engine='nvidia' cannot run here" in msg and "needs a GPU (device cpu" in msg, msg
    assert NVIDIA_PIP in msg and "--device cuda" in msg, msg
    try:
        import megatron.core.distributed.fsdp.src.megatron_fsdp  # noqa: F401
    except Exception:  # noqa: BLE001 - as the engine probes it
        assert info.type is ImportError and "megatron-core is not importable" in msg, msg
    else:
        assert info.type is RuntimeError and "not importable" not in msg, msg


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError) as info:
        check_alignment(_must_not_build, engine="fsdp3", device=torch.device("cpu"))
    msg = str(info.value)
    assert "engine='fsdp3'" in msg and "['fsdp2', 'megatron_fsdp', 'nvidia']" in msg, msg


# ---------------------------------------------------------------------------------------------- GPU

GPU_CFG = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=100)


def dense_gpt_factory(device: torch.device) -> ModelSpec:
    """The reference GPT without MoE (every unit one size, as NVIDIA's double buffer wants), seq 100."""

    def batch(step: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = synthetic_batch(step, 2 * world, GPU_CFG, device)
        return x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]

    return ModelSpec(model=GPT(GPU_CFG).to(device), unit_modules=[TransformerBlock], batch=batch,
                     loss=lambda model, b: loss_fn(model(b[0]), b[1]))


def _gpu_check(tmp_path, engine: str) -> Dict[str, Any]:
    out = tmp_path / f"check-{engine}.json"
    cmd = [sys.executable, "-m", "fsdp_cudagraph.check", "--engine", engine, "--model",
           "tests.apps.test_check_engines:dense_gpt_factory", "--json", str(out)]
    proc = run_entry(cmd, env=gpu_env(), timeout=600)
    keep(str(out), f"check-{engine}-1gpu.json")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["equal"] and rec["engine"] == engine and rec["backend"] in ("te", "torch"), rec
    assert all(s["equal"] for s in rec["steps"]) and rec["params_equal"] and len(rec["callables"]) == 4
    return rec


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_checker_fsdp2_1gpu(tmp_path):
    rec = _gpu_check(tmp_path, "fsdp2")
    assert "torch.bfloat16" in rec["precision"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.skipif(NVIDIA_UNAVAILABLE is not None, reason=f"{NVIDIA_UNAVAILABLE}; {NVIDIA_PIP}")
def test_checker_nvidia_1gpu(tmp_path):
    rec = _gpu_check(tmp_path, "nvidia")
    assert "fp32 main parameters" in rec["precision"]
