"""megatron-core's GPTModel with tensor parallelism on 4 Gloo ranks as 2 (dp) x 2 (tp): tests/adapters/test_mcore_tp.py's
job and checks (its docstring says what must hold) where the data-parallel groups have two ranks (strided
``{0, 2}``, ``{1, 3}``), so the engine reduces over DP as well as summing the norms' gradients over TP, and the DP
ranks train different micro-batches. Here: the groups, graphed (``attn_mlp``) against eager ``torch.equal``, and
the agreement with TP=1 within ``RTOL`` ([Note: mcore TP tolerance]); the scope ``layer``, the negative controls
and the refusals run on 1 x 2 only (the same code paths). Its own file: four spawned ranks take about 40 s on two
shared cores.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from fsdp_cudagraph.apps import mcore_gpt
from tests.adapters.test_mcore_tp import check_agreement, check_equal, check_layout, job
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.skipif(not mcore_gpt.HAS_MCORE, reason=mcore_gpt.MCORE_REASON)


@pytest.fixture(scope="module")
def four() -> List[Dict[str, Any]]:
    return run_gloo(job, 4)


@pytest.mark.gloo
def test_megatron_core_groups_are_the_engines_layout(four: List[Dict[str, Any]]) -> None:
    check_layout(four)


@pytest.mark.gloo
def test_attn_mlp_graphs_bit_exact(four: List[Dict[str, Any]]) -> None:
    check_equal(four, "attn_mlp")


@pytest.mark.gloo
def test_agrees_with_tp1(four: List[Dict[str, Any]]) -> None:
    check_agreement(four)
