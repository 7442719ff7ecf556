"""The README's usage block, read from README.md and run on CPU with the one change the README names.

On 2 Gloo ranks: the block runs with ``my_gpt`` (the reference GPT, whose attention and MLP classes carry
``cuda_graph_module`` tags), ``MyTransformerLayer``, ``device``, ``loader`` and ``loss_fn`` supplied, and
with ``PartialCudaGraphs(model, config)`` changed to ``PartialCudaGraphs(model, config, backend="protocol")``,
the line of the README's CPU block (its second ```python block under '## Usage', which must show it). Must hold: the block as written (no change) is refused when ``PartialCudaGraphs``
is built, before any training step, and the error names the change; with the change, its losses equal the
same loop without graphs (``torch.equal``) at every step, and are finite.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = [pytest.mark.gloo,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the block; GPUs run "
                                 "examples/readme_loop.py (tests/gpu/test_alignment.py)")]

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
AS_WRITTEN = "graphs = PartialCudaGraphs(model, config)"
ON_CPU = 'graphs = PartialCudaGraphs(model, config, backend="protocol")'
STEPS = 6


def usage_blocks() -> List[str]:
    """The ```python blocks of the README's '## Usage' section: the GPU block first, then the CPU change."""
    text = open(README, encoding="utf-8").read()
    section = text.split("\n## Usage", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def usage_block() -> str:
    """The first ```python block under the README's '## Usage' heading."""
    blocks = usage_blocks()
    assert blocks, "README's Usage section has no ```python block"
    return blocks[0]


def _names(rank: int, world: int, losses: List[torch.Tensor]) -> Dict[str, Any]:
    from fsdp_cudagraph.apps.model import GPT, GPTConfig, loss_fn, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, seq_len=16)
    my_gpt = GPT(cfg)
    loader = []
    for step in range(STEPS):
        x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
        loader.append((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))

    def recorded_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        losses.append(loss.detach().clone())
        return loss

    return {"my_gpt": my_gpt, "MyTransformerLayer": my_gpt.unit_class, "device": torch.device("cpu"),
            "loader": loader, "loss_fn": recorded_loss}


def _job(rank: int, world: int) -> Dict[str, Any]:
    block = usage_block()
    assert AS_WRITTEN in block, f"the README's block no longer builds graphs with {AS_WRITTEN!r}"
    out: Dict[str, Any] = {}
    # 1. as written: refused at construction, before any step ran
    losses: List[torch.Tensor] = []
    try:
        exec(compile(block, "README.md (Usage)", "exec"), _names(rank, world, losses))
        out["as_written"] = None
    except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
        out["as_written"] = (type(exc).__name__, str(exc), len(losses))
    # 2. with the README's one change for CPU
    losses = []
    exec(compile(block.replace(AS_WRITTEN, ON_CPU), "README.md (Usage, CPU)", "exec"), _names(rank, world, losses))
    out["graphed"] = losses
    # 3. the same loop without graphs: the block minus its graph lines
    eager_block = "\n".join(line for line in block.replace(AS_WRITTEN, "graphs = None").splitlines()
                            if "graphs.capture()" not in line and "graphs.delete()" not in line
                            and "if step == config.cuda_graph_warmup_steps" not in line)
    losses = []
    exec(compile(eager_block, "README.md (Usage, eager)", "exec"), _names(rank, world, losses))
    out["eager"] = losses
    return out


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


def test_readme_shows_the_cpu_change():
    blocks = usage_blocks()
    assert len(blocks) >= 2 and ON_CPU in blocks[1], (
        f"the README's CPU block (second ```python block under '## Usage') must show {ON_CPU!r}, the change "
        "this test runs")


def test_block_as_written_is_refused_on_cpu_naming_the_change(runs):
    for res in runs:
        assert res["as_written"] is not None, "the block built GPU graphs on a CPU machine"
        kind, msg, steps_run = res["as_written"]
        assert steps_run == 0, f"refused only after {steps_run} steps; the machine check belongs in the constructor"
        assert kind == "RuntimeError" and "backend='protocol'" in msg and "torch.cuda.is_available()" in msg, msg


def test_block_with_the_cpu_change_trains_like_eager(runs):
    for res in runs:
        graphed, eager = res["graphed"], res["eager"]
        assert len(graphed) == len(eager) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(graphed, eager)), (graphed, eager)
        assert all(bool(torch.isfinite(loss)) for loss in graphed), graphed
