"""GPU tests of full-iteration graphs: bit-exact against eager on 1 and 2 GPUs, with the negative controls.

They run the entry point a user runs (``python -m fsdp_cudagraph.apps.full_iteration_align``; torchrun for 2
GPUs) and check its verdicts: every row ``torch.equal`` (losses of every micro-batch of every step, final
parameters, evaluation outputs) and every control caught. Skipped without CUDA; the TE rows are skipped
inside the script without TE (the JSON lists them under ``skipped``).
"""


import pytest
import torch

from tests.gpu_utils import NO_GPU, launcher, run_json

from fsdp_cudagraph.apps.full_iteration_align import STRATEGIES, plan_rows
from fsdp_cudagraph.capture.te import HAS_TE

# The full matrix takes about 80 s on one H100: it is opt-in (`pytest -m matrix`); `pytest -m gpu` runs the
# TE and torch rows of one strategy each ([Note: the quick and the full matrix] in test_alignment.py).
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
CONTROLS = {".item() in the step", "host sync only under capture", "CPU tensor in the step",
            "ZeRO-3 without double buffer", "strict shape change", "one token perturbed at step 4"} | (
    {"FP8 delayed scaling in a whole-step graph"} if HAS_TE else set())


def _run(tmp_path, nproc: int, extra=()) -> dict:
    return run_json(launcher(nproc, ["-m", "fsdp_cudagraph.apps.full_iteration_align", *extra]),
                    tmp_path / f"fi-align-{nproc}gpu.json")


MODELS = ["torch", "te"] if HAS_TE else ["torch"]  # the app's default --models, TE's only where TE imports


def _key(row: dict) -> tuple:
    return (row["model"], row["moe_experts"], row.get("fp8"), row["strategy"], row["grad_accum"],
            row["graph_optimizer"], row["max_norm"], row["activation_checkpointing"], row["delete_step"])


def _planned(steps: int = 20, capture_step: int = 3) -> list:
    """The rows the app plans for its default command line (its own list: a count restated here would rot)."""
    return [_key({"model": "te" if sp.model.use_te else "torch", "moe_experts": sp.model.moe_experts,
                  "fp8": sp.model.fp8, "strategy": sp.sharding_strategy, "grad_accum": sp.grad_accum, "graph_optimizer": sp.graph_optimizer,
                  "max_norm": sp.max_norm, "activation_checkpointing": sp.activation_checkpointing,
                  "delete_step": sp.delete_step})
            for sp in plan_rows(MODELS, STRATEGIES, steps=steps, capture_step=capture_step, optimizer="adam_fused")]


def _check(res: dict, world: int) -> None:
    assert res["world_size"] == world and res["all_ok"]
    rows = res["rows"]
    assert [_key(r) for r in rows] == _planned(res["steps"], res["capture_step"])
    assert sum(r["reduce_dtype"] == "torch.bfloat16" for r in rows) == len(MODELS)
    bad = [(r["model"], r["strategy"], r["grad_accum"], r["first_mismatch_step"]) for r in rows if not r["equal"]]
    assert not bad, bad
    # the graphed runs really replayed: capture at step 3 of 20, 17 replays (minus fallbacks and deletes)
    assert all("error" not in r for r in rows), [r["error"] for r in rows if "error" in r]
    plain = [r for r in rows if not r["short_steps"] and r["delete_step"] is None]
    clipped = [r for r in rows if r["max_norm"] is not None]
    assert len(clipped) == 1 and clipped[0]["norms_equal"]
    assert any(n > clipped[0]["max_norm"] for n in clipped[0]["norms"])
    assert all(r["counters"]["train_replays"] == 17 for r in plain), [r["counters"] for r in plain]
    assert all(r["counters"]["optimizer_replays"] == 17 for r in plain if r["graph_optimizer"])
    assert {c["control"] for c in res["controls"]} == CONTROLS
    assert all(c["caught"] for c in res["controls"]), res["controls"]


@pytest.mark.gpu
def test_full_iteration_rows_1gpu(tmp_path):
    """Quick form: the no_shard rows (the last to go bit-exact) of both models, both optimizers, accum 1 and 2."""
    res = _run(tmp_path, 1, ["--no-controls", "--only", "te:no_shard", "torch:no_shard"])
    rows = res["rows"]
    assert res["all_ok"] and [_key(r) for r in rows] == [k for k in _planned() if k[3] == "no_shard"], rows
    bad = [(r["model"], r["strategy"], r["grad_accum"], r["first_mismatch_step"]) for r in rows if not r["equal"]]
    assert not bad, bad


@pytest.mark.matrix
def test_full_iteration_bit_exact_1gpu(tmp_path):
    _check(_run(tmp_path, 1), 1)


@pytest.mark.gpu
@pytest.mark.matrix
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
def test_full_iteration_bit_exact_2gpu(tmp_path):
    _check(_run(tmp_path, 2), 2)
