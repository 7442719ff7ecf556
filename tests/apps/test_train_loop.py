"""The training loop behind the demo, the alignment suite and the benchmarks, on CPU (Gloo, protocol backend).

What the GPU record relies on, checked where CI can run it: eager and graphed runs of ``run_training`` give
``torch.equal`` losses, final parameters and user-hook values; a perturbed token is reported; gradient
accumulation and a late ``PartialCudaGraphs`` (the stream-hazard control's schedule) train the same.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Dict

import pytest
import torch

from fsdp_cudagraph.apps.model import GPTConfig
from fsdp_cudagraph.apps.train import RunSpec, run_training
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo


def _job(rank: int, world: int) -> Dict[str, Any]:
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=12, moe_every=2)
    base = RunSpec(model=cfg, steps=5, capture_step=2, backend="protocol", compute_dtype=torch.float32,
                   user_hooks=True, attention_as_graphed=["attn"])
    out: Dict[str, Any] = {}
    eager = run_training(base, torch.device("cpu"))
    runs = {
        "attn": RunSpec(**{**base.__dict__, "cuda_graph_modules": ["attn"], "attention_as_graphed": None}),
        "perturbed": RunSpec(**{**base.__dict__, "cuda_graph_modules": ["attn"], "attention_as_graphed": None,
                                "perturb_step": 3}),
        "late_build": RunSpec(**{**base.__dict__, "cuda_graph_modules": ["attn"], "attention_as_graphed": None,
                                 "build_graphs_step": 1}),
    }
    for name, spec in runs.items():
        r = run_training(spec, torch.device("cpu"))
        out[name] = {
            "losses": [torch.equal(a, b) for a, b in zip(eager.losses, r.losses)],
            "params": all(torch.equal(eager.final_state[k], r.final_state[k]) for k in eager.final_state),
            "hooks": {k: len(v) == len(r.hook_values[k]) and torch.equal(torch.stack(v), torch.stack(r.hook_values[k]))
                      for k, v in eager.hook_values.items()},
            "num_hook_values": sum(len(v) for v in r.hook_values.values()),
            "captured": r.capture.callables if r.capture else None,
        }
    accum = RunSpec(**{**base.__dict__, "grad_accum": 2, "user_hooks": False})
    a = run_training(accum, torch.device("cpu"))
    b = run_training(RunSpec(**{**accum.__dict__, "cuda_graph_modules": [], "attention_as_graphed": None}),
                     torch.device("cpu"))
    out["accum"] = [torch.equal(x, y) for x, y in zip(a.losses, b.losses)]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_gloo(_job, 2)


def test_graphed_run_equals_eager_with_user_hooks(ranks):
    for r in ranks:
        run = r["attn"]
        assert all(run["losses"]) and len(run["losses"]) == 5 and run["params"]
        assert run["hooks"] and all(run["hooks"].values())
        # a forward and a full backward hook per graphed module per step, replays included
        assert run["num_hook_values"] == 2 * 2 * 5 and run["captured"] == ["layers.0.attn", "layers.1.attn"]


def test_a_perturbed_token_is_reported_from_its_step(ranks):
    for r in ranks:
        assert r["perturbed"]["losses"] == [True, True, True, False, False] and not r["perturbed"]["params"]


def test_graphs_built_late_and_accumulation_train_the_same(ranks):
    for r in ranks:
        assert all(r["late_build"]["losses"]) and r["late_build"]["params"]
        assert all(r["accum"]) and len(r["accum"]) == 5


def test_exit_process_keeps_the_status_and_flushes_output():
    """The entry points leave through exit_process: status and piped output survive."""
    code = ("import sys; from fsdp_cudagraph.apps.train import exit_process; print('stdout line', end=''); "
            "sys.stderr.write('stderr line'); exit_process(3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "stdout line" and proc.stderr.endswith("stderr line"), (proc.stdout, proc.stderr)


def test_make_adam_names_and_refusal():
    from fsdp_cudagraph.apps.train import make_adam

    p = [torch.nn.Parameter(torch.zeros(4))]
    assert make_adam(p, "adam_fused", lr=1e-3).defaults["fused"] is True
    assert make_adam(p, "adam", lr=1e-3).defaults["fused"] is None
    with pytest.raises(ValueError, match="'sgd' is not one of"):
        make_adam(p, "sgd", lr=1e-3)
