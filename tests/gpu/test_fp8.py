"""GPU tests of FP8 training with TransformerEngine under the engine, eager against graphed, bit for bit.

They run the entry points a user runs and check their verdicts (docs/fp8.md):

- ``python -m fsdp_cudagraph.apps.align --backends te --rows FP8`` (torchrun for 2 GPUs): per-layer graphs
  (``attn mlp`` and whole layers) with delayed, current and block scaling (block where the GPU runs it),
  delayed scaling with two micro-batches and with TE's own layer, cached quantized weights, attention in FP8
  (delayed scaling, where TE runs it: the test below says why not where it does not); every loss and
  final parameter ``torch.equal`` to the eager run under the same ``FP8Recipe.autocast()``; controls: the
  delayed-scaling state reset after capture is reported as a mismatch, a cached FP8 weight dropped after
  capture is caught before the replay.
- ``python -m fsdp_cudagraph.apps.full_iteration_align --fp8-only --models te``: whole-step graphs with
  current and block scaling; delayed scaling refused with its reason.
- ``tests/gpu/scripts/fp8_gather.py``: TE's primary FP8 weights gathered as FP8 bytes by the engine, every loss and
  main parameter ``torch.equal`` to the same layers with bf16 weights that TE quantizes in forward, and graphed
  (per-layer and whole-step) equal to eager; fused and unfused weight gradients. With ``--engine nvidia`` (one GPU
  green at ``907f506``): NVIDIA Megatron-FSDP gathering the same FP8 weights, per-layer graphs ``torch.equal`` to eager;
  controls: a transpose moved after capture refused before the replay, ``keep_fp8_transpose_cache=False`` refused.
  With ``--engine ours-kept``: ``fully_shard(keep_compute_shard=True)`` (the bf16 cast of the shards kept across
  gathers) against casting at every gather, eager and graphed, every loss and main parameter ``torch.equal``.

Skipped without CUDA or without TE, with the reason.
"""

import os

import pytest
import torch

from fsdp_cudagraph.apps.align import fp8_attention_refusal, matrix
from fsdp_cudagraph.apps.full_iteration_align import STRATEGIES, plan_rows
from fsdp_cudagraph.capture.te import HAS_TE, TE_REASON
from tests.gpu_utils import NO_GPU, launcher, run_json

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU), pytest.mark.te,
              pytest.mark.skipif(not HAS_TE, reason=TE_REASON or "TE present")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
PARTIAL_CONTROLS = {"FP8 scaling state not restored", "FP8 quantized weight moved"}


def _partial(tmp_path, nproc: int) -> dict:
    return run_json(launcher(nproc, ["-m", "fsdp_cudagraph.apps.align"]) + ["--backends", "te", "--rows", "FP8"],
                    tmp_path / f"fp8-align-{nproc}.json", name=f"fp8-align-{nproc}gpu.json", tail=6000)


def _check_partial(res: dict, world: int) -> None:
    planned = [r["what"] for r in matrix("te", quick=False) if "FP8" in r["what"]]
    assert res["world_size"] == world
    assert [r["what"] for r in res["rows"]] == planned
    bad = [(r["what"], r["scope"], r.get("error") or r["first_mismatch_step"]) for r in res["rows"] if not r["equal"]]
    assert not bad, bad
    assert {c["control"] for c in res["controls"]} == PARTIAL_CONTROLS
    assert all(c["caught"] for c in res["controls"]), res["controls"]
    assert res["all_ok"]


@pytest.mark.gpu
def test_fp8_attention_rows_are_planned_where_te_runs_them():
    """The FP8 attention rows run inside the per-layer FP8 runs above; where this machine's GPU or the cuDNN TE loaded
    cannot run them deterministically, they are left out and this test is skipped with the library's refusal."""
    why = fp8_attention_refusal()
    if why is not None:
        pytest.skip(why)
    rows = [r for r in matrix("te", quick=False) if r.get("fp8_attention")]
    assert [(r["scope"], r["grad_accum"]) for r in rows] == [(["attn", "mlp"], 1), ([], 2)]


def _whole_step(tmp_path, nproc: int) -> dict:
    return run_json(launcher(nproc, ["-m", "fsdp_cudagraph.apps.full_iteration_align"])
                    + ["--fp8-only", "--models", "te"], tmp_path / f"fp8-fi-{nproc}.json",
                    name=f"fp8-full-iteration-{nproc}gpu.json", tail=6000)


def _check_whole_step(res: dict, world: int) -> None:
    planned = [sp.model.fp8 for sp in plan_rows(["te"], STRATEGIES, steps=res["steps"],
                                                capture_step=res["capture_step"], optimizer="adam_fused")
               if sp.model.fp8 is not None]
    assert res["world_size"] == world and [r["fp8"] for r in res["rows"]] == planned and planned
    bad = [(r["fp8"], r["graph_optimizer"], r.get("error") or r["first_mismatch_step"]) for r in res["rows"]
           if not r["equal"]]
    assert not bad, bad
    assert all(r["counters"]["train_replays"] == res["steps"] - res["capture_step"] for r in res["rows"])
    assert [c["control"] for c in res["controls"]] == ["FP8 delayed scaling in a whole-step graph"]
    assert all(c["caught"] for c in res["controls"]), res["controls"]
    assert res["all_ok"]


@pytest.mark.gpu
def test_fp8_per_layer_graphs_bit_exact_1gpu(tmp_path):
    _check_partial(_partial(tmp_path, 1), 1)


@pytest.mark.gpu
def test_fp8_whole_step_graphs_bit_exact_1gpu(tmp_path):
    _check_whole_step(_whole_step(tmp_path, 1), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
@TWO_GPUS
def test_fp8_per_layer_graphs_bit_exact_2gpu(tmp_path):
    """Delayed scaling reduces its amaxes over both ranks (the default group) outside the graphs."""
    _check_partial(_partial(tmp_path, 2), 2)


@pytest.mark.gpu
@pytest.mark.multigpu
@TWO_GPUS
def test_fp8_whole_step_graphs_bit_exact_2gpu(tmp_path):
    _check_whole_step(_whole_step(tmp_path, 2), 2)


def _fp8_gather(tmp_path, nproc: int, engine: str = "ours") -> dict:
    """tests/gpu/scripts/fp8_gather.py under ``engine`` (``--engine``; the file names carry a non-default one)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "fp8_gather.py")
    tag = "" if engine == "ours" else f"-{engine}"
    return run_json(launcher(nproc, [script]) + ["--engine", engine], tmp_path / f"fp8-gather{tag}-{nproc}.json",
                    name=f"fp8-gather{tag}-{nproc}gpu.json", tail=6000)


def _check_gather(res: dict, world: int) -> None:
    assert res["world_size"] == world and res["ok"], res
    # one byte a weight element (and a small staging area): at most 0.55x the bf16 gather's bytes
    assert res["gather_bytes_ratio"] <= 0.55, res["gather_bytes_ratio"]


@pytest.mark.gpu
def test_fp8_gathered_weights_bit_exact_1gpu(tmp_path):
    _check_gather(_fp8_gather(tmp_path, 1), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
@TWO_GPUS
def test_fp8_gathered_weights_bit_exact_2gpu(tmp_path):
    """The weights' scales come from the amax all-reduced over both ranks' shards."""
    _check_gather(_fp8_gather(tmp_path, 2), 2)


def _check_kept(res: dict, world: int) -> None:
    assert res["world_size"] == world and res["ok"], res
    assert [r["row"] for r in res["rows"][0]] == ["cast", "kept", "kept + per-layer graphs", "kept + whole-step graph"]
    assert all(r.get("placed") and r["equal"] for r in res["rows"][0][1:]), res["rows"][0]


@pytest.mark.gpu
def test_kept_compute_shard_bit_exact_1gpu(tmp_path):
    """``fully_shard(keep_compute_shard=True)`` under TE layers in FP8 (current scaling): the same bits as casting at
    every gather, and graphed (per-layer, whole-step) equal to eager; at one GPU every unit keeps its cast in an
    unshard buffer of its own."""
    _check_kept(_fp8_gather(tmp_path, 1, engine="ours-kept"), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
@TWO_GPUS
def test_kept_compute_shard_bit_exact_2gpu(tmp_path):
    """At 2 GPUs the layers keep a bf16 copy of their shards and gather from it."""
    _check_kept(_fp8_gather(tmp_path, 2, engine="ours-kept"), 2)


def _nvidia_fp8_gather(tmp_path, nproc: int) -> dict:
    from fsdp_cudagraph.engines.nvidia.build import NVIDIA_PIP, _nvidia_unavailable

    why = _nvidia_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"{why}; {NVIDIA_PIP}")
    return _fp8_gather(tmp_path, nproc, engine="nvidia")


def _check_nvidia_gather(res: dict, world: int) -> None:
    assert res["world_size"] == world and res["ok"], res
    names = [r["row"] for r in res["rows"][0]]
    assert names == ["nvidia gather", "nvidia gather + per-layer graphs", "nvidia control: transpose moved",
                     "nvidia control: keep_fp8_transpose_cache=False"], names


@pytest.mark.gpu
def test_nvidia_fp8_gathered_weights_graphed_bit_exact_1gpu(tmp_path):
    _check_nvidia_gather(_nvidia_fp8_gather(tmp_path, 1), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
@TWO_GPUS
def test_nvidia_fp8_gathered_weights_graphed_bit_exact_2gpu(tmp_path):
    _check_nvidia_gather(_nvidia_fp8_gather(tmp_path, 2), 2)
