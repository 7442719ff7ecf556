"""The full-iteration alignment's own training loop (``full_iteration_align.run_full``/``run_row``) on Gloo.

The GPU record runs this loop; here it runs on the CPU protocol backend, so a broken loop (a wrong call, a
comparison that cannot fail) shows up on every CI run, before a GPU run is spent on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import pytest
import torch

from fsdp_cudagraph.apps.full_iteration_align import FullRunSpec, run_row
from fsdp_cudagraph.apps.model import GPTConfig

from tests.dist_utils import run_gloo

WORLD = 2
CFG = GPTConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, seq_len=16, moe_every=2, num_experts=4,
                moe_top_k=2)
STEPS, CAPTURE, RECORDED = 6, 2, 4


def _job(rank: int, world: int) -> Dict[str, Any]:
    cpu = torch.device("cpu")
    base = FullRunSpec(model=CFG, steps=STEPS, capture_step=CAPTURE, record_grad_steps=RECORDED)
    return {
        # the GPU record's failing shape: one micro-batch, no_shard, the eager optimizer
        "no_shard_1": run_row(dataclasses.replace(base, sharding_strategy="no_shard"), cpu),
        "zero3_2_opt_graph": run_row(dataclasses.replace(base, grad_accum=2, graph_optimizer=True,
                                                         eval_steps=(1, 3, 4, 5), short_steps=(4,)), cpu),
        "graphed_first": run_row(dataclasses.replace(base, sharding_strategy="no_shard"), cpu, graphed_first=True),
        "perturbed": run_row(base, cpu, perturb_step=3),
        # gradients reduced in bf16 into fp32 main gradients, micro-batches, the optimizer in the graph
        "zero3_bf16_reduce": run_row(dataclasses.replace(base, grad_accum=2, graph_optimizer=True,
                                                         reduce_dtype=torch.bfloat16), cpu),
    }


@pytest.fixture(scope="module")
def rows() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["no_shard_1", "zero3_2_opt_graph", "graphed_first", "zero3_bf16_reduce"])
def test_rows_are_bit_exact_with_gradients_compared(rows, name):
    for rank, r in enumerate(rows):
        row = r[name]
        assert row["equal"], (rank, name, row)
        assert row["losses_equal_per_step"] == [True] * STEPS
        assert row["grads_equal_per_step"] == [True] * RECORDED, "the first steps' gradients must be compared"
        assert row["first_mismatch_step"] is None and row["first_grad_mismatch_step"] is None
        c = row["counters"]
        fallbacks = int(name == "zero3_2_opt_graph")  # its short step after capture ran eagerly
        assert (c["train_eager_steps"], c["train_replays"], c["train_fallbacks"]) == (
            CAPTURE, STEPS - CAPTURE - fallbacks, fallbacks), c


@pytest.mark.gloo
def test_evaluations_and_fallbacks_are_compared(rows):
    row = rows[0]["zero3_2_opt_graph"]
    c = row["counters"]
    assert row["evals_equal"] and (c["eval_eager_steps"], c["eval_replays"]) == (2, 2), c
    assert c["optimizer_replays"] >= 1, c


@pytest.mark.gloo
def test_a_perturbed_token_is_caught_at_its_step_in_losses_and_gradients(rows):
    for r in rows:
        row = r["perturbed"]
        assert not row["equal"]
        assert row["first_mismatch_step"] == 3 and row["first_grad_mismatch_step"] == 3, row
        assert row["grads_equal_per_step"][:3] == [True] * 3
