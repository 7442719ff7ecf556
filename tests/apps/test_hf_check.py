"""The alignment checker (``fsdp_cudagraph.check``) on 2 Gloo ranks with the protocol backend.

It must say EQUAL for a model that trains bit-identically, and for a deliberately perturbed callable
(``perturb=``: its graphed output scaled by 1.01 after capture, graphed run only) it must report the
mismatch from the capture step on and name exactly that callable, whichever scope. It reports hooks kept
but not run at capture, and calls that ran eagerly because they differed from capture. Models: the
reference GPT (no extra dependency) and, when transformers is installed, HF Llama. The command line runs
once as a user would, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch

from fsdp_cudagraph.check import ModelSpec, check_alignment
from fsdp_cudagraph.apps.hf_models import HAS_TRANSFORMERS, TRANSFORMERS_REASON
from tests.apps._models import gpt_factory
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, CAPTURE = 5, 2
def gpt_with_user_hook(device: torch.device) -> ModelSpec:
    spec = gpt_factory(device)
    spec.model.layers[1].register_forward_hook(lambda module, args, output: None)
    return spec


def hf_changing_constant(device: torch.device) -> ModelSpec:
    """HF Llama whose step-3 batch passes is_causal=False (a changed constant: those calls run eagerly)."""
    from fsdp_cudagraph.apps import hf_models

    spec = hf_models.llama(device)
    base = spec.batch
    spec.batch = lambda step: dict(base(step), is_causal=step != 3)
    return spec


def _job(rank: int, world: int) -> Dict[str, Any]:
    kw = dict(steps=STEPS, capture_step=CAPTURE, num_warmup_iters=2)
    out = {
        "equal": check_alignment(gpt_factory, **kw).to_dict(),
        "perturb_layer": check_alignment(gpt_factory, perturb="layers.2", **kw).to_dict(),
        "perturb_attn": check_alignment(gpt_factory, cuda_graph_modules=["attn", "mlp"], perturb="layers.1.attn",
                                        **kw).to_dict(),
        "user_hook": check_alignment(gpt_with_user_hook, **kw).to_dict(),
    }
    if HAS_TRANSFORMERS:
        from fsdp_cudagraph.apps import hf_models

        out["hf_mlp_perturb"] = check_alignment(hf_models.llama, cuda_graph_module_patterns=["model.layers.*.mlp"],
                                                perturb="model.layers.0.mlp", **kw).to_dict()
        out["hf_constant"] = check_alignment(hf_changing_constant, **kw).to_dict()
    return out


@pytest.fixture(scope="module")
def checks() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2)


def test_checker_says_equal_for_an_aligned_model(checks):
    for res in checks:
        r = res["equal"]
        assert r["equal"] and r["params_equal"] and r["first_mismatch_step"] is None
        assert [s["equal"] for s in r["steps"]] == [True] * STEPS
        assert r["callables"] == ["layers.0", "layers.1", "layers.2", "layers.3"] and r["backend"] == "protocol"
        assert r["engine"] == "megatron_fsdp" and "fp32 main parameters" in r["precision"], r["precision"]
        assert r["culprit"] is None and r["divergence"] is None and r["unknown_hooks"] == []
        assert r["calls"] == {n: {"replays": STEPS - CAPTURE, "eager_calls": 0, "last_change": None} for n in r["callables"]}
        assert r["attention_backends"] == {}


@pytest.mark.parametrize("case,name", [("perturb_layer", "layers.2"), ("perturb_attn", "layers.1.attn")])
def test_checker_names_the_perturbed_callable(checks, case, name):
    for rank, res in enumerate(checks):
        r = res[case]
        assert not r["equal"] and not r["params_equal"]
        assert [s["equal"] for s in r["steps"]] == [True] * CAPTURE + [False] * (STEPS - CAPTURE)
        assert r["first_mismatch_step"] == CAPTURE
        assert r["culprit"] == name, r["divergence"]
        d = r["divergence"]
        assert d["step"] == CAPTURE and d["record"][:2] == ["output", name] and d["rank"] == 0, d
        assert f"the output of {name} differs" in d["explanation"]


def test_checker_reports_hooks_kept_but_not_run_at_capture(checks):
    for res in checks:
        r = res["user_hook"]
        assert r["equal"], r["steps"]
        assert len(r["unknown_hooks"]) == 1 and r["unknown_hooks"][0].startswith("layers.1._forward_hooks["), r["unknown_hooks"]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason=TRANSFORMERS_REASON or "ok")
def test_checker_on_hf_llama_perturbed_mlp_and_changed_constant(checks):
    for res in checks:
        r = res["hf_mlp_perturb"]
        assert not r["equal"] and r["culprit"] == "model.layers.0.mlp" and r["first_mismatch_step"] == CAPTURE
        r = res["hf_constant"]
        assert r["equal"], r["steps"]  # the changed call ran eagerly: still bit-identical
        for n in ("model.layers.0", "model.layers.1"):
            c = r["calls"][n]
            assert (c["replays"], c["eager_calls"]) == (STEPS - CAPTURE - 1, 1), c
            assert c["last_change"] == "`is_causal` was True (bool) at capture, now False (bool)"


def test_checker_command_line_negative_control(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "fsdp_cudagraph.check", "--model", "tests.apps._models:gpt_factory", "--device",
           "cpu", "--steps", "4", "--capture-step", "2", "--modules", "mlp", "--perturb", "layers.0.mlp",
           "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "negative control: CAUGHT (perturbed layers.0.mlp, reported layers.0.mlp)" in proc.stdout
    assert "first graphed callable to differ: layers.0.mlp" in proc.stdout
    assert "engine megatron_fsdp, backend protocol" in proc.stdout  # the default engine
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["culprit"] == "layers.0.mlp" and rec["world_size"] == 1
