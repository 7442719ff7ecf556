"""Inference graphs under megatron_fsdp on 2 Gloo ranks, through the CPU protocol backend.

What it shows, on the real engine and the reference GPT (3 layers, one MoE):

- every strategy, layer and block scope: graphed evaluation equals the eager forward of the padded batch, bit
  for bit, also after optimizer steps between evaluations (block graphs re-install the compute parameters
  inside the graph); ranks may pass different batch sizes (block graphs agree on the bucket);
- layer scope: the engine's pre-forward and post-forward of every unit run around each layer's capture and
  replay, never inside; block scope with ZeRO-3: the all-gathers are inside the graph, and a replay that would
  issue other collectives than its capture is refused (negative control);
- evaluation during training, with training graphs (PartialCudaGraphs) captured: training losses, final
  parameters, optimizer state and the training graphs' replay counts equal a run without evaluation, bit for
  bit, for eager, layer and block evaluation; graphed evaluation equals eager evaluation;
- refusals: ZeRO-3 without the double buffer; ranks calling a block graph with different shapes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from fsdp_cudagraph import CudaGraphConfig, InferenceCudaGraphs, PartialCudaGraphs
from fsdp_cudagraph.capture.buckets import Buckets, pad_to
from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import fully_shard
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2
CPU = torch.device("cpu")
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, seq_len=16, moe_every=2)
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
ROWS = 4  # training rows per rank
EVAL_SIZES = {0: [3, 4, 1], 1: [1, 4, 2]}  # per rank: block graphs must agree on the bucket per call
BUCKETS = [2, 4]
CAPTURE_AT, STEPS, EVAL_AFTER = 2, 7, (2, 3, 5)  # training: capture before step 2; evaluate after steps 2, 3, 5
UNITS = ["layers.0", "layers.1", "layers.2"]


class _Repeating(GPT):
    """The reference GPT that runs its first two layers in swapped order when ``swap_first`` (a host decision).

    (It used to run its first layer a second time; megatron_fsdp refuses a unit called twice in one forward
    before any graph sees the call. Skipping a layer would not do either: the prefetch plan of the capture
    still gathers the skipped unit, so the collectives stay the same. A swapped order re-gathers a
    double-buffer slot, which the capture did not.)
    """

    swap_first = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))[None]
        layers = list(self.layers)
        if self.swap_first:
            layers[0], layers[1] = layers[1], layers[0]
        for layer in layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def _build(strategy: str, *, double_buffer: bool = True, cls: type = GPT):
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = fully_shard(cls(cfg), fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                        fsdp_double_buffer=double_buffer, fsdp_db_use_persist_buf_on_alloc_fail=double_buffer)
    return cfg, model, torch.optim.Adam(model.optimizer_parameters(), lr=1e-2)


def _icfg(scope: str) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope=scope, cuda_graph_num_warmup_iters=2,
                           use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)


def _train_step(model, opt, cfg, step: int, rank: int) -> torch.Tensor:
    x, y = synthetic_batch(step, ROWS * WORLD, cfg, CPU)
    x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _eval_tokens(cfg, b: int, step: int, rank: int, seq: Optional[int] = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 100 * rank + 10 * step + b)
    return torch.randint(0, cfg.vocab_size, (b, seq or cfg.seq_len), generator=g)


def _bucket(b: int) -> int:
    return next(s for s in BUCKETS if s >= b)


# ---------------------------------------------------------------------------------------------- the job


def _matrix(rank: int) -> Dict[Any, Any]:
    """Every strategy and scope: graphed evaluation against eager, with optimizer steps in between."""
    out: Dict[Any, Any] = {}
    for strategy in STRATEGIES:
        for scope in ("layer", "block"):
            cfg, model, opt = _build(strategy)
            graphs = InferenceCudaGraphs(model, _icfg(scope), batch_buckets=Buckets(BUCKETS), backend="protocol")
            equal_padded, diff_unpadded = [], 0.0
            for step in range(3):
                model.eval()
                with torch.no_grad():
                    for b, other in zip(EVAL_SIZES[rank], EVAL_SIZES[1 - rank]):
                        x = _eval_tokens(cfg, b, step, rank)
                        graphed = graphs(x)
                        # block graphs pad to the bucket agreed by both ranks: 4 whenever one rank needs 4
                        bucket = _bucket(b) if scope == "layer" else max(_bucket(b), _bucket(other))
                        eager = model(pad_to(x, bucket, 0))[:b]
                        equal_padded.append(torch.equal(graphed, eager))
                        diff_unpadded = max(diff_unpadded, (graphed - model(x)).abs().max().item())
                model.train()
                _train_step(model, opt, cfg, step, rank)
            out[(strategy, scope)] = dict(
                equal_padded=equal_padded, diff_unpadded=diff_unpadded, counters=dict(graphs.counters),
                num_graphs=graphs.num_graphs, collectives=[c.collectives for c in graphs.captures])
            graphs.delete()
    return out


def _traces(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for scope in ("layer", "block"):
        cfg, model, _ = _build("optim_grads_params")
        graphs = InferenceCudaGraphs(model, _icfg(scope), batch_buckets=Buckets(BUCKETS), backend="protocol")
        model.eval()
        with torch.no_grad():
            for name in ("capture", "replay"):
                model.trace = []
                graphs(_eval_tokens(cfg, 3, 0, rank))
                out[(scope, name)] = model.trace
                model.trace = None
    # negative control: a host decision changed after capture (block scope, ZeRO-3) must not replay silently
    cfg, model, _ = _build("optim_grads_params", cls=_Repeating)
    graphs = InferenceCudaGraphs(model, _icfg("block"), batch_buckets=Buckets(BUCKETS), backend="protocol")
    model.eval()
    with torch.no_grad():
        graphs(_eval_tokens(cfg, 4, 0, rank))
        model.module.swap_first = True
        try:
            graphs(_eval_tokens(cfg, 4, 0, rank))
            out["changed_decision"] = None
        except RuntimeError as exc:
            out["changed_decision"] = str(exc)
    return out


def _training(rank: int, eval_scope: Optional[str], eval_after=EVAL_AFTER) -> Dict[str, Any]:
    """Train with a protocol capture of whole-layer training graphs; evaluate after some steps (or never)."""
    cfg, model, opt = _build("optim_grads_params")
    train_cfg = CudaGraphConfig(cuda_graph_impl="local", use_megatron_fsdp=True, fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True, cuda_graph_warmup_steps=CAPTURE_AT,
                                cuda_graph_num_warmup_iters=2)
    training_graphs = PartialCudaGraphs(model, train_cfg, backend="protocol")
    inference = None if eval_scope is None else InferenceCudaGraphs(
        model, _icfg(eval_scope), batch_buckets=Buckets(BUCKETS), backend="protocol")
    losses: List[torch.Tensor] = []
    evals: List[torch.Tensor] = []
    addresses = None
    for step in range(STEPS):
        if step == CAPTURE_AT:
            training_graphs.capture()
            addresses = model.buffer_addresses()
        losses.append(_train_step(model, opt, cfg, step, rank))
        if inference is not None and step in eval_after:
            model.eval()
            with torch.no_grad():
                for b in (3, 4):
                    x = _eval_tokens(cfg, b, step, rank)
                    evals.append(inference(pad_to(x, 4, 0))[:b] if eval_scope == "none" else inference(x))
            model.train()
    replays = {n: model.module.get_submodule(n).forward.replays for n in UNITS}
    state = model.state_dict()
    opt_state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                 for k, s in opt.state_dict()["state"].items()}
    grads_bound = [p.grad is not None for p in model.optimizer_parameters()]
    engine = dict(addresses_kept=model.buffer_addresses() == addresses,
                  states=[u.state.name for u in model.all_units()])
    training_graphs.delete()
    if inference is not None:
        inference.delete()
    return dict(losses=losses, evals=evals, replays=replays, state=state, opt=opt_state, grads_bound=grads_bound,
                engine=engine)


def _refusals(rank: int) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    _, model, _ = _build("optim_grads_params", double_buffer=False)
    try:
        InferenceCudaGraphs(model, _icfg("layer"), batch_buckets=Buckets(BUCKETS), backend="protocol")
        out["no_double_buffer"] = None
    except ValueError as exc:
        out["no_double_buffer"] = str(exc)
    cfg, model, _ = _build("optim_grads_params")
    graphs = InferenceCudaGraphs(model, _icfg("block"), batch_buckets=Buckets(BUCKETS), backend="protocol")
    model.eval()
    with torch.no_grad():
        try:
            graphs(_eval_tokens(cfg, 2, 0, rank, seq=16 if rank == 0 else 8))
            out["shape_disagreement"] = None
        except ValueError as exc:
            out["shape_disagreement"] = str(exc)
    return out


def _job(rank: int, world: int) -> Dict[str, Any]:
    return {
        "matrix": _matrix(rank),
        "traces": _traces(rank),
        "training": {s: _training(rank, s) for s in (None, "none", "layer", "block")},
        "before_capture": _training(rank, "layer", eval_after=(1,) + EVAL_AFTER),
        "refusals": _refusals(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> List[Dict[str, Any]]:
    return run_gloo(_job, WORLD)


# ---------------------------------------------------------------------------------------------- assertions


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scope", ["layer", "block"])
def test_graphed_evaluation_equals_eager_every_strategy(ranks, strategy, scope):
    for rank, r in enumerate(ranks):
        m = r["matrix"][(strategy, scope)]
        assert m["equal_padded"] == [True] * 9, (rank, m["equal_padded"])
        # the unpadded eager forward: same math, other row counts (measured 0.0 on CPU for these shapes)
        assert m["diff_unpadded"] <= 2e-6
        assert m["counters"]["graphed_calls"] == 9 and m["counters"]["eager_calls"] == 0
        # layer: 3 layers x the buckets this rank used; block: one graph per agreed bucket (4 and 2)
        assert m["num_graphs"] == (3 * len({_bucket(b) for b in EVAL_SIZES[rank]}) if scope == "layer" else 2)
        if scope == "layer":
            assert all(c == [] for c in m["collectives"])  # the engine's collectives run outside layer graphs
    block = ranks[0]["matrix"][(strategy, "block")]["collectives"][0]
    if strategy == "no_shard":
        assert block == []  # installs are local copies
    elif strategy == "optim_grads_params":
        for unit in ["<root>"] + UNITS:
            assert any(c.endswith(f"unit {unit}") for c in block), (unit, block)  # all-gathers inside the graph


def test_layer_graphs_run_the_engine_hooks_around_capture_and_replay(ranks):
    for r in ranks:
        for name in ("capture", "replay"):
            trace = r["traces"][("layer", name)]
            assert all(not capturing for _, _, capturing in trace), trace
            assert [(p, u) for p, u, _ in trace] == [(p, u) for u in UNITS for p in ("pre_forward", "post_forward")]


def test_block_graphs_hold_the_engine_work(ranks):
    for r in ranks:
        trace = r["traces"][("block", "replay")]
        assert trace and all(capturing for _, _, capturing in trace)  # the protocol replay runs as the capture did
        assert [(p, u) for p, u, _ in trace] == [(p, u) for u in UNITS for p in ("pre_forward", "post_forward")]


def test_negative_control_a_changed_host_decision_is_refused(ranks):
    for r in ranks:
        msg = r["traces"]["changed_decision"]
        assert msg is not None and "issued other collectives or outputs than its capture" in msg


@pytest.mark.parametrize("scope", ["none", "layer", "block"])
def test_evaluation_during_training_leaves_training_untouched(ranks, scope):
    for r in ranks:
        base, run = r["training"][None], r["training"][scope]
        assert all(torch.equal(a, b) for a, b in zip(base["losses"], run["losses"])) and len(run["losses"]) == STEPS
        assert base["state"].keys() == run["state"].keys()
        assert all(torch.equal(base["state"][k], run["state"][k]) for k in base["state"])
        assert base["opt"].keys() == run["opt"].keys()
        for k in base["opt"]:
            assert all(torch.equal(base["opt"][k][n], run["opt"][k][n]) for n in base["opt"][k])
        assert run["replays"] == base["replays"] and all(v == STEPS - CAPTURE_AT for v in run["replays"].values())
        assert run["grads_bound"] == base["grads_bound"]
        # unit states as without evaluation; every engine buffer (double-buffer slots included) where it was at capture
        assert run["engine"]["states"] == base["engine"]["states"] and run["engine"]["addresses_kept"]
        assert len(run["evals"]) == 2 * len(EVAL_AFTER)
        if scope != "none":  # graphed evaluation equals eager evaluation of the padded batch, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(run["evals"], r["training"]["none"]["evals"]))


def test_evaluation_before_training_capture_leaves_training_graphs_replaying(ranks):
    # PartialCudaGraphs records sample args only from calls with gradients enabled, so an evaluation between
    # the warmup steps and capture() does not become the captured call.
    for r in ranks:
        base, run = r["training"][None], r["before_capture"]
        assert all(torch.equal(a, b) for a, b in zip(base["losses"], run["losses"]))  # bit-exact either way
        assert run["replays"] == base["replays"]


def test_refusals(ranks):
    for rank, r in enumerate(ranks):
        msg = r["refusals"]["no_double_buffer"]
        assert msg is not None and "needs the parameters at fixed addresses" in msg and "fsdp_double_buffer=True" in msg
        msg = r["refusals"]["shape_disagreement"]
        assert msg is not None and msg.startswith(f"[rank {rank}]") and "different shapes" in msg
