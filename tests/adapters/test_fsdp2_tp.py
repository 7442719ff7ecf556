"""PyTorch FSDP2 composed with DTensor tensor parallelism (torchtitan's composition) under the FSDP2 adapter with
per-layer graphs: Gloo, 4 ranks as 2 (dp) x 2 (tp) and 2 ranks as 1 x 2, protocol backend.

The model is a tiny GPT of this file with separate q, k and v projections (torchtitan's layout): its attention
reshapes to ``[b, s, -1, head_dim]``, so it runs on the local heads of a TP rank unchanged. Each block is
``parallelize_module``'d over ``mesh['tp']`` of a 2-D ``(dp, tp)`` DeviceMesh (``ColwiseParallel`` for q, k, v and
``fc1``, ``RowwiseParallel`` for ``proj`` and ``fc2``; no sequence parallelism), then ``shard_fsdp2(model, layers,
mesh=mesh['dp'])``, ``keep_unsharded_storage``, Adam, clipping with the FSDP2 ``clip_grad_norm_``. The TP ranks of a
data-parallel rank take the same rows. Must hold on every rank:

- graphed (``attn mlp`` and whole layers, captured at step 1) equals eager TP, ``torch.equal`` on every loss,
  clipping norm and (``full_tensor()``) parameter; every callable replayed every step after capture;
- eager TP equals the 1-D reference (the same model without TP, FSDP2 over all ranks, the same global batch) within
  ``RTOL`` on losses, norms and parameters; a TP shard perturbed on one rank before training fails that check;
- torch's ``clip_grad_norm_`` raises on the two meshes (``dp`` and ``(dp, tp)``); ours gives the 1-D norm;
- refused at build: no mesh, the whole 2-D mesh, a mesh of another root, expert parallelism with TP, unsharded
  slots; and the reference GPT's fused ``[q | k | v]`` projection under ``ColwiseParallel`` does not split by heads
  (its forward raises on the local width).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

STEPS = 3
CAPTURE_AT = 1
BATCH = 4  # global rows per step
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 32, 16, 2, 2, 8
MAX_NORM = 0.5  # below the measured norms (0.79 to 0.91): clipping scales every step
#: Eager TP against the 1-D reference, relative to each tensor's largest magnitude. Measured (torch 2.13 CPU,
#: fp32, 3 steps): parameters 5.7e-7 (2x2) and 6.7e-7 (1x2), losses 0 (2x2) and 6.9e-8 (1x2), norms 1.3e-7 and
#: 7.5e-8; adding 1e-3 to one TP rank's shard of a q projection before training moves the parameters by 3.7e-3
#: (the negative control, 370 times the bound).
RTOL = 1e-5


class Attention(nn.Module):
    cuda_graph_module = "attn"

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.ln = nn.LayerNorm(HIDDEN)
        # no biases on q, k, v (torchtitan's): k's bias has a gradient of zero in exact arithmetic (softmax ignores a
        # shift shared by every key), so its computed gradient is rounding noise that Adam scales to lr-sized steps,
        # different for every summation order, and no tolerance could compare it
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln(x)
        # -1: the heads this rank holds (all of them without TP, HEADS / TP under ColwiseParallel)
        q, k, v = (m(y).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return x + self.proj(o)


class MLP(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))[None]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def _tp_plan() -> Dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def _parallelized(mesh2d, device: str = "cpu") -> TinyGPT:
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = TinyGPT().to(device)
    for layer in model.layers:
        parallelize_module(layer, mesh2d["tp"], _tp_plan())
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(rank: int, world: int, tp: int, *, scope: Optional[List[str]] = None, perturb: bool = False,
           device: str = "cpu") -> Dict[str, Any]:
    """tp > 1: the 2-D run (tp ranks per data-parallel rank); tp == 1: the 1-D reference over all ranks. ``device``
    "cuda" (tests/gpu/scripts/fsdp2_tp_graphs.py): NCCL meshes and the torch backend."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, keep_unsharded_storage
    from fsdp_cudagraph.engines.fsdp2 import clip_grad_norm_, fsdp2_mesh, shard_fsdp2

    if tp > 1:
        mesh2d = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        model, dp_mesh = _parallelized(mesh2d, device), mesh2d["dp"]
    else:
        torch.manual_seed(0)
        model, dp_mesh = TinyGPT().to(device), fsdp2_mesh(device)
    shard_fsdp2(model, list(model.layers), mesh=dp_mesh)
    keep_unsharded_storage(model)
    if perturb and rank == 1:  # negative control: one TP rank's shard of layer 0's q projection
        with torch.no_grad():
            model.layers[0].attn.q.weight.to_local().add_(1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graphs = None
    if scope is not None:
        graphs = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=scope,
                                                          cuda_graph_warmup_steps=CAPTURE_AT),
                                   backend="protocol" if device == "cpu" else "torch")
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    rows = BATCH // dp
    out: Dict[str, Any] = {"losses": [], "norms": []}
    for step in range(STEPS):
        if graphs is not None and step == CAPTURE_AT:
            out["callables"] = graphs.capture().callables
        x, y = (t.to(device) for t in _batch(step))
        loss = F.cross_entropy(model(x[dp_rank * rows:(dp_rank + 1) * rows]).flatten(0, 1),
                               y[dp_rank * rows:(dp_rank + 1) * rows].flatten())
        loss.backward()
        if step == 0 and tp > 1:
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                out["torch_clip"] = None
            except RuntimeError as exc:  # raised at the stack of norms, before any gradient is scaled
                out["torch_clip"] = str(exc)
        out["norms"].append(clip_grad_norm_(model, MAX_NORM).detach().cpu())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a data-parallel rank holds its loss: the world mean is the global one
        out["losses"].append((mean / world).cpu())
    if graphs is not None:
        out["replays"] = {n: model.get_submodule(n).__dict__["forward"].replays for n in out["callables"]}
        graphs.delete()
    out["params"] = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    if tp > 1:
        out["placements"] = {n: [type(pl).__name__ for pl in p.placements] for n, p in model.named_parameters()}
    return out


def _refusals(rank: int, world: int, tp: int) -> Dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fsdp_cudagraph import use_unsharded_slots
    from fsdp_cudagraph.apps.model import GPT, GPTConfig
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_mesh, shard_fsdp2

    mesh2d = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = _parallelized(mesh2d)
    out: Dict[str, str] = {}
    attempts = {"no_mesh": dict(), "mesh_2d": dict(mesh=mesh2d), "other_root": dict(mesh=fsdp2_mesh("cpu")),
                "ep": dict(mesh=mesh2d["dp"], expert_parallel_size=2)}
    for key, kwargs in attempts.items():
        try:
            shard_fsdp2(model, list(model.layers), **kwargs)
            out[key] = "accepted"
        except (ValueError, NotImplementedError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    shard_fsdp2(model, list(model.layers), mesh=mesh2d["dp"])
    try:
        use_unsharded_slots(model)
        out["slots"] = "accepted"
    except NotImplementedError as exc:
        out["slots"] = str(exc)
    # the reference GPT's fused [q heads | k heads | v heads] rows: ColwiseParallel gives rank 0 the first half of
    # the rows (q heads and part of k), not whole heads of each; its forward reshapes with the global head count
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, seq_len=SEQ)
    gpt = GPT(cfg)
    parallelize_module(gpt.layers[0], mesh2d["tp"], {"attn.qkv": ColwiseParallel()})
    try:
        gpt(_batch(0)[0])
        out["fused_qkv"] = "ran"
    except RuntimeError as exc:
        out["fused_qkv"] = str(exc)
    return out


def _job(rank: int, world: int, tp: int) -> Dict[str, Any]:
    res = {"reference": _train(rank, world, 1), "eager": _train(rank, world, tp),
           "attn_mlp": _train(rank, world, tp, scope=["attn", "mlp"]), "layers": _train(rank, world, tp, scope=[])}
    if world == 2:  # one each, to keep the file fast: the negative control at 1x2, the refusals at 2x2 (slots need dp > 1)
        res["perturbed"] = _train(rank, world, tp, perturb=True)
    else:
        res["refusals"] = _refusals(rank, world, tp)
    return res


@pytest.fixture(scope="module")
def runs_2x2() -> List[Dict[str, Any]]:
    return run_gloo(_job, 4, 2)


@pytest.fixture(scope="module")
def runs_1x2() -> List[Dict[str, Any]]:
    return run_gloo(_job, 2, 2)


@pytest.fixture(params=["runs_2x2", "runs_1x2"], ids=["2x2", "1x2"])
def runs(request) -> List[Dict[str, Any]]:
    return request.getfixturevalue(request.param)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("scope", ["attn_mlp", "layers"])
def test_graphed_fsdp2_tp_equals_eager(runs, scope):
    for res in runs:
        eager, run = res["eager"], res[scope]
        assert all(torch.equal(a, b) for a, b in zip(run["losses"], eager["losses"])), (run["losses"], eager["losses"])
        assert all(torch.equal(a, b) for a, b in zip(run["norms"], eager["norms"])), (run["norms"], eager["norms"])
        assert all(torch.equal(run["params"][k], eager["params"][k]) for k in eager["params"])
        expected = {f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn", "mlp")} if scope == "attn_mlp" \
            else {f"layers.{i}" for i in range(LAYERS)}
        assert set(run["replays"]) == expected, run["replays"]
        assert all(n == STEPS - CAPTURE_AT for n in run["replays"].values()), run["replays"]


def test_fsdp2_tp_matches_the_1d_reference(runs):
    for res in runs:
        ref, tp = res["reference"], res["eager"]
        worst = max(_rel(tp["params"][k], ref["params"][k]) for k in ref["params"])
        assert worst <= RTOL, worst
        assert all(_rel(a, b) <= RTOL for a, b in zip(tp["losses"], ref["losses"])), (tp["losses"], ref["losses"])
        assert all(_rel(a, b) <= RTOL for a, b in zip(tp["norms"], ref["norms"])), (tp["norms"], ref["norms"])
        assert all(float(n) > MAX_NORM for n in ref["norms"])  # the clipping acted on every step
        # the TP slices are DTensors on the 2-D mesh, sharded over dp and tp; the rest over dp alone
        assert res["eager"]["placements"]["layers.0.attn.proj.weight"] == ["Shard", "Shard"]
        assert res["eager"]["placements"]["tok.weight"] == ["Shard"]


def test_perturbed_tp_shard_fails_the_check(runs_1x2):
    for res in runs_1x2:
        ref, bad = res["reference"], res["perturbed"]
        worst = max(_rel(bad["params"][k], ref["params"][k]) for k in ref["params"])
        assert worst > 100 * RTOL, worst


def test_torch_clip_grad_norm_refuses_the_two_meshes(runs):
    for res in runs:
        msg = res["eager"]["torch_clip"]
        assert msg is not None and "mesh" in msg, msg


def test_refusals(runs_2x2):
    for res in runs_2x2:
        ref = res["refusals"]
        assert ref["no_mesh"].startswith("ValueError") and "mesh=mesh['dp']" in ref["no_mesh"], ref["no_mesh"]
        assert ref["mesh_2d"].startswith("NotImplementedError") and "2-D mesh" in ref["mesh_2d"], ref["mesh_2d"]
        assert ref["other_root"].startswith("ValueError") and "same root mesh" in ref["other_root"], ref["other_root"]
        assert ref["ep"].startswith("NotImplementedError") and "use one of the two" in ref["ep"], ref["ep"]
        assert "DTensor (tensor-parallel)" in ref["slots"] and "keep_unsharded_storage" in ref["slots"], ref["slots"]
        assert "invalid" in ref["fused_qkv"], ref["fused_qkv"]
