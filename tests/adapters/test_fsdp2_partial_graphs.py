"""PartialCudaGraphs on a model sharded by PyTorch FSDP2, as a user writes it: 2 Gloo ranks, protocol backend.

The reference GPT (its layers are the FSDP2 units; attention and MLP carry ``cuda_graph_module`` tags) under
``torch.distributed.fsdp.fully_shard`` with ``keep_unsharded_storage`` (ZeRO-3 whose unsharded parameters
stay at one address; see docs/engines.md), trained eagerly and with graphs captured at step 2 (whole layers,
and attn+mlp), fp32, Adam. Must hold on every rank (``torch.equal``): every step's loss and every final
parameter equal to the eager FSDP2 run; the capture replays through the restored FSDP2 hooks; FSDP2 without
kept storage is refused when PartialCudaGraphs is built, naming the setting and ``keep_unsharded_storage``; a parameter moved
after capture is refused before the replay.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
STEPS = 6
CAPTURE_AT = 2


def _build(keep: bool = True):
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard

    from fsdp_cudagraph.apps.model import GPT, GPTConfig
    from fsdp_cudagraph import keep_unsharded_storage

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, seq_len=16)
    model = GPT(cfg)
    for layer in model.layers:
        fsdp2_shard(layer)
    fsdp2_shard(model)
    if keep:
        keep_unsharded_storage(model)
    return model, cfg


def _train(rank: int, world: int, scope: Optional[List[str]], *, move_param: bool = False,
           skip_prepare: bool = False) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    model, cfg = _build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graphs = None
    if scope is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scope,
                                                          cuda_graph_warmup_steps=CAPTURE_AT), backend="protocol")
    out: Dict[str, Any] = {"losses": [], "error": None}
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT and skip_prepare:
            # negative control: the adapter does not register the unsharded parameters before capture, so the
            # graph maker's parameters (the sharded DTensors) are not the ones the forward reads
            graphs.engine.prepare_capture = lambda units: None
            try:
                graphs.capture()
            except RuntimeError as exc:
                out["capture_error"] = str(exc)
        elif graphs is not None and step == CAPTURE_AT:
            out["callables"] = graphs.capture().callables
            if move_param:  # negative control: an unsharded parameter that no longer sits where capture saw it
                from fsdp_cudagraph.engines import adapter_for

                _, unsharded = adapter_for(model).replay_tensors(model.layers[0])[0]
                unsharded.data = unsharded.data.clone()
        x, y = synthetic_batch(step, 2 * world, cfg, torch.device("cpu"))
        try:
            loss = loss_fn(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        except RuntimeError as exc:
            out["error"] = str(exc)
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().clone())
    if graphs is not None and graphs.captured:
        out["replays"] = {n: model.get_submodule(n).__dict__["forward"].replays for n in out["callables"]}
        graphs.delete()
    if out["error"] is None:  # a refused replay leaves FSDP2 mid-forward (unsharded): nothing to compare then
        out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    res = {"eager": _train(rank, world, None), "layers": _train(rank, world, []),
           "attn_mlp": _train(rank, world, ["attn", "mlp"]), "moved": _train(rank, world, [], move_param=True),
           "unprepared": _train(rank, world, [], skip_prepare=True)}
    model, _ = _build(keep=False)
    try:
        PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=[]), backend="protocol")
        res["unsafe"] = None
    except (ValueError, NotImplementedError) as exc:
        res["unsafe"] = str(exc)
    return res


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


@pytest.mark.parametrize("scope", ["layers", "attn_mlp"])
def test_graphed_fsdp2_training_equals_eager(runs, scope):
    for res in runs:
        eager, run = res["eager"], res[scope]
        assert run["error"] is None, run["error"]
        assert len(run["losses"]) == len(eager["losses"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"])), (run["losses"], eager["losses"])
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])
        assert run["replays"] and all(n == STEPS - CAPTURE_AT for n in run["replays"].values()), run["replays"]


def test_capture_with_the_sharded_parameters_registered_is_refused(runs):
    """Contract item 6: TE's graph maker takes module.parameters() before the unshard hook runs. Without the
    adapter's prepare_capture they are FSDP2's sharded DTensors and a replay's gradients would reach nothing
    FSDP2 reduces (trained silently wrong on an H200 before the fix); the capture is refused, and the failed
    capture leaves the eager run exactly as if it had not been tried."""
    for res in runs:
        run, eager = res["unprepared"], res["eager"]
        msg = run.get("capture_error")
        assert msg is not None and "prepare_capture" in msg and "layers.0" in msg, run
        assert run["error"] is None and all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"]))
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])


def test_fsdp2_without_kept_storage_is_refused_when_built(runs):
    for res in runs:
        msg = res["unsafe"]
        assert msg is not None and "keep_unsharded_storage" in msg, msg


def test_moved_parameter_is_refused_before_replay(runs):
    for res in runs:
        run = res["moved"]
        assert run["error"] is not None and "captured at" in run["error"], run
        assert len(run["losses"]) == CAPTURE_AT


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real thing (benchmarks/tools/gpu_record.sh)")
def test_engines_align_script_cpu_smoke(tmp_path):
    """benchmarks/engines_align.py (the GPU record of both engines) runs its rows on CPU and finds them equal."""
    import json
    import subprocess
    import sys

    from tests.dist_utils import _free_port
    from tests.gpu_utils import ROOT

    out = tmp_path / "ea.json"
    proc = subprocess.run([sys.executable, "benchmarks/engines_align.py", "--cpu-smoke", "--steps", "6", "--skip", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(__import__("os").environ, PYTHONPATH=ROOT, MASTER_PORT=str(_free_port())))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    ran = [r for r in rows if "skipped" not in r]
    assert {r["engine"] for r in ran} == {"fsdp2", "fsdp2_mp", "megatron_fsdp"}
    assert all(r["equal"] and r["moved_caught"] and r["unsafe_refused"] for r in ran), ran
    skipped = {r["engine"]: r["skipped"] for r in rows if "skipped" in r}
    assert all("needs 2+ ranks (world size 1)" in skipped[e] for e in ("fsdp2_slots", "fsdp2_slots_mp")), skipped


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real thing (benchmarks/tools/gpu_record.sh)")
def test_engines_align_script_fsdp2_slots_on_two_ranks(tmp_path):
    """The same script on 2 Gloo ranks for FSDP2 with the double buffer and mixed precision: equal, and the
    slot control (a captured unit asked to move to the other slot) refused."""
    import json
    import subprocess
    import sys

    from tests.dist_utils import _free_port
    from tests.gpu_utils import ROOT

    out = tmp_path / "ea2.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(_free_port()), "benchmarks/engines_align.py", "--cpu-smoke", "--steps", "6", "--skip",
                           "2", "--engines", "fsdp2_slots_mp", "--backends", "torch", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(__import__("os").environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine"] == "fsdp2_slots_mp" and row["equal"] and row["moved_caught"] and row["unsafe_refused"], row
    assert row["slot_caught"] and "was captured reading its unsharded parameters in slot" in row["slot_error"], row
    assert row["engine_info"]["storage"] == "use_unsharded_slots" and "bfloat16" in row["engine_info"]["policy"]
