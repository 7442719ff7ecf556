"""Inference graphs on CPU, single process: the protocol backend runs the capture/replay schedule without graphs.

What it shows on the reference GPT (unwrapped; the engine runs in tests/graphs/test_inference_dist.py):

- bucket choice: the smallest bucket that holds the batch, one graph set per bucket, padded static inputs;
- padding and unpadding: outputs come back with the real rows, bit-equal to eager on the padded call (and within
  a measured tolerance of the unpadded one: kernels picked for other row counts may round differently); what
  the padded rows hold never reaches the real rows; sequence buckets for a causal model (checked against the positional
  embedding) and the precision note they carry;
- the fallback: beyond the largest bucket (one warning per size, or a ValueError in strict mode) and beyond
  ``max_graph_sets``;
- the config rules: ``layer`` is the default with ``cuda_graph_impl='local'``; refusals name their inputs;
- greedy generation with the static KV cache: tokens equal to a decode without cache, for every scope, with
  padding and with the eager fallback;
- refusals: gradients on, training mode, outputs without the batch, a moved parameter, after ``delete()``;
- the benchmark's logic, run on CPU (``bench_inference.py --cpu-smoke``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

import pytest
import torch
from torch import nn

from fsdp_cudagraph import CudaGraphConfig, GraphLimitWarning, InferenceCudaGraphs, InferenceCudaGraphScope
from fsdp_cudagraph.capture.buckets import BucketOverflowWarning, Buckets
from fsdp_cudagraph.apps.generate import GreedyGenerator, greedy_reference
from fsdp_cudagraph.apps.model import GPT, GPTConfig
from tests.gpu_utils import run_entry

VOCAB, SEQ = 64, 16
BUCKETS = [2, 4]


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, seq_len=SEQ, **kw)
    return GPT(cfg).eval()


def _cfg(scope: str = "layer", **kw) -> CudaGraphConfig:
    return CudaGraphConfig(cuda_graph_impl="local", inference_cuda_graph_scope=scope, cuda_graph_num_warmup_iters=2, **kw)


def _tokens(b: int, s: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- buckets, padding


@pytest.mark.parametrize("scope", ["layer", "block"])
@pytest.mark.parametrize("moe", [0, 2])
def test_bucket_choice_padding_and_unpadding(scope, moe):
    model = _gpt(moe_every=moe)
    graphs = InferenceCudaGraphs(model, _cfg(scope), batch_buckets=Buckets(BUCKETS))
    per_bucket = 3 if scope == "layer" else 1  # graphs per padded shape: one per layer, or one for the model
    with torch.no_grad():
        for i, (b, bucket) in enumerate([(3, 4), (4, 4), (1, 2), (2, 2), (3, 4)]):
            x = _tokens(b, seed=i)
            out = graphs(x)
            padded = torch.cat([x, torch.zeros(bucket - b, SEQ, dtype=torch.long)])
            # the graphs compute the padded call, bit for bit, and cut the real rows out of it
            assert out.shape == (b, SEQ, VOCAB) and torch.equal(out, model(padded)[:b])
            # The unpadded forward: the same math; a kernel picked for another row count may round differently
            # (measured 0.0 here, up to 6e-7 for the 1-token decode shapes below, fp32 CPU), hence atol 2e-6.
            torch.testing.assert_close(out, model(x), rtol=0, atol=2e-6)
    assert sorted({c.shape[:6] for c in graphs.captures}) == [f"(2, {SEQ}", f"(4, {SEQ}"]  # tokens or hidden states
    assert graphs.num_graphs == 2 * per_bucket  # buckets 4 and 2, each captured once
    assert graphs.counters["graphed_calls"] == 5 and graphs.counters["eager_calls"] == 0
    assert graphs.counters["replays"] == 5 * per_bucket
    graphs.delete()
    assert graphs.num_graphs == 0 and graphs.deleted


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_padded_rows_never_reach_real_rows(scope):
    model = _gpt(moe_every=2)
    x = _tokens(3)
    outs = []
    with torch.no_grad():
        for pad in (0, VOCAB - 1):
            graphs = InferenceCudaGraphs(model, _cfg(scope), batch_buckets=Buckets([8]), pad_value=pad)
            outs.append(graphs(x))
            graphs.delete()
        # the padded input itself, eagerly: the graphs compute exactly this and cut it back
        padded = torch.cat([x, torch.full((5, SEQ), VOCAB - 1)])
        eager_padded = model(padded)[:3]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], eager_padded)


def test_fallback_beyond_largest_bucket_warns_once_per_size():
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg("block"), batch_buckets=Buckets(BUCKETS))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [graphs(_tokens(b)) for b in (5, 5, 6)]
        refs = [model(_tokens(b)) for b in (5, 5, 6)]
    overflow = [w for w in caught if issubclass(w.category, BucketOverflowWarning)]
    assert len(overflow) == 2 and "size 5 exceeds the largest bucket 4" in str(overflow[0].message)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))
    assert graphs.counters["eager_calls"] == 3 and graphs.num_graphs == 0
    strict = InferenceCudaGraphs(model, _cfg("block", cuda_graph_strict_signature=True), batch_buckets=Buckets(BUCKETS))
    with torch.no_grad(), pytest.raises(ValueError, match="size 5 exceeds the largest bucket 4.*refused in strict mode"):
        strict(_tokens(5))


def test_graph_limit_runs_new_shapes_eagerly():
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg("layer"), batch_buckets=Buckets(BUCKETS), max_graph_sets=1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = graphs(_tokens(4, 8))  # first shape: graphed
        b = graphs(_tokens(4, 12))  # a second sequence length (no seq_buckets): over the limit, eager
        c = graphs(_tokens(3, 8))  # the first shape again (padded): replayed
        assert torch.equal(b, model(_tokens(4, 12))) and torch.equal(c, model(_tokens(3, 8)))
    assert [issubclass(w.category, GraphLimitWarning) for w in caught].count(True) == 1
    assert graphs.counters == {"graphed_calls": 2, "eager_calls": 1, "captures": 3, "replays": 6}
    assert a.shape == (4, 8, VOCAB)


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_sequence_buckets_pad_at_the_end(scope):
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg(scope), batch_buckets=Buckets(BUCKETS), seq_buckets=Buckets([8, SEQ]))
    with torch.no_grad():
        x = _tokens(3, 5)
        out = graphs(x)
        padded = torch.zeros(4, 8, dtype=torch.long)
        padded[:3, :5] = x
        assert out.shape == (3, 5, VOCAB) and torch.equal(out, model(padded)[:3, :5])
        # Against the unpadded forward: equal in exact arithmetic; attention over 8 instead of 5 keys sums in
        # another order, measured max |diff| 3.6e-7 (fp32, CPU; see docs/graph-kinds.md), hence 1e-6.
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
        assert graphs(_tokens(4, 7)).shape == (4, 7, VOCAB) and graphs.counters["captures"] == (3 if scope == "layer" else 1)


def test_sequence_buckets_refusals():
    model = _gpt()
    with pytest.raises(ValueError, match=r"seq_buckets=\[8, 32\].*positional embedding has 16 positions"):
        InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets(BUCKETS), seq_buckets=Buckets([8, 32]))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)

        def forward(self, x):
            return self.layer(x)

    with pytest.raises(ValueError, match="seq_buckets=.*causal=None.*only in a causal model.*pass causal=True"):
        InferenceCudaGraphs(Encoder().eval(), _cfg("block"), batch_buckets=Buckets(BUCKETS), seq_buckets=Buckets([8]))
    InferenceCudaGraphs(Encoder().eval(), _cfg("block"), batch_buckets=Buckets(BUCKETS), seq_buckets=Buckets([8]),
                        causal=True)  # declared causal: accepted


# ---------------------------------------------------------------------------------------------- config rules


def test_config_layer_is_the_default_with_local():
    cfg = CudaGraphConfig(cuda_graph_impl="local")
    assert cfg.inference_cuda_graph_scope is InferenceCudaGraphScope.LAYER
    model = _gpt()
    graphs = InferenceCudaGraphs(model, cfg, batch_buckets=Buckets([4]))
    with torch.no_grad():
        graphs(_tokens(4))
    assert graphs.scope is InferenceCudaGraphScope.LAYER and [c.name for c in graphs.captures] == [
        "layers.0", "layers.1", "layers.2"]
    # impl none: scope none, and the object is the model
    eager = InferenceCudaGraphs(model, CudaGraphConfig(), batch_buckets=Buckets([4]))
    with torch.no_grad():
        assert torch.equal(eager(_tokens(3)), model(_tokens(3))) and eager.num_graphs == 0
    assert CudaGraphConfig(cuda_graph_impl="transformer_engine").inference_cuda_graph_scope is InferenceCudaGraphScope.NONE


@pytest.mark.parametrize("kwargs, names", [
    (dict(inference_cuda_graph_scope="layer"), ["inference_cuda_graph_scope='layer'", "cuda_graph_impl='none'"]),
    (dict(cuda_graph_impl="none", inference_cuda_graph_scope="block"),
     ["inference_cuda_graph_scope='block'", "cuda_graph_impl='none'"]),
    (dict(cuda_graph_scope="full_iteration_inference", inference_cuda_graph_scope="layer"),
     ["cuda_graph_scope", "inference_cuda_graph_scope='layer'"]),
])
def test_config_refusals_name_both_inputs(kwargs, names):
    with pytest.raises(ValueError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        CudaGraphConfig(**kwargs)
    assert all(n in str(info.value) for n in names), str(info.value)


def test_construction_refusals():
    model = _gpt()
    with pytest.raises(ValueError, match="backend='torch' needs a model on a CUDA device"):
        InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets([4]), backend="torch")
    with pytest.raises(ValueError, match="'cuda' is now spelled 'torch'"):
        InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets([4]), backend="cuda")
    with pytest.raises(ValueError, match="unwrapped Sequential: name the layer classes with layer_modules"):
        InferenceCudaGraphs(nn.Sequential(nn.Linear(4, 4)), _cfg(), batch_buckets=Buckets([4]))
    with pytest.raises(ValueError, match="match no submodule"):
        InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets([4]), layer_modules=["Missing"])
    with pytest.raises(TypeError, match="must be fsdp_cudagraph.capture.buckets.Buckets"):
        InferenceCudaGraphs(model, _cfg(), batch_buckets=[4])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- refusals at calls


class _LossModel(nn.Module):
    """Returns a scalar: padded rows would be inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).sum()


class _Twice(nn.Module):
    """Calls its one layer twice per forward (a shared layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(self.layer(x)) + x


def test_call_refusals():
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets([4]))
    with pytest.raises(RuntimeError, match="forward only: call it under torch.no_grad"):
        graphs(_tokens(4))
    model.train()
    with torch.no_grad(), pytest.raises(RuntimeError, match="model in eval mode"):
        graphs(_tokens(4))
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError, match="disagree on the batch size"):
        graphs(_tokens(4), _tokens(3))
    loss_graphs = InferenceCudaGraphs(_LossModel().eval(), _cfg("block"), batch_buckets=Buckets([4]))
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"output tensor 0 .* shape \(\).*padded batch 4"):
        loss_graphs(torch.ones(3, 4))
    graphs.delete()
    with torch.no_grad(), pytest.raises(RuntimeError, match="after delete"):
        graphs(_tokens(4))


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_moved_parameter_is_refused_at_replay(scope):
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg(scope), batch_buckets=Buckets([4]))
    with torch.no_grad():
        graphs(_tokens(4))
        model.layers[1].mlp.fc1.weight.data = model.layers[1].mlp.fc1.weight.data.clone()
        with pytest.raises(RuntimeError, match="would replay with parameter .* captured at"):
            graphs(_tokens(4))


def test_layer_called_twice_runs_second_call_eagerly(caplog):
    torch.manual_seed(0)
    model = _Twice().eval()
    graphs = InferenceCudaGraphs(model, _cfg(), batch_buckets=Buckets([4]), layer_modules=[nn.Linear])
    x = torch.randn(3, 4)
    with torch.no_grad():
        outs = [graphs(x) for _ in range(2)]
        assert all(torch.equal(o, model(x)) for o in outs)
    assert graphs.num_graphs == 1 and "ran more than once in one forward" in caplog.text


def test_inference_mode_and_outputs_survive_the_next_call():
    model = _gpt()
    graphs = InferenceCudaGraphs(model, _cfg("block"), batch_buckets=Buckets([4]))
    with torch.inference_mode():
        first = graphs(_tokens(4, seed=1))
        keep = first.clone()
        graphs(_tokens(4, seed=2))  # replays the same graph: the returned tensor is a copy, not the static output
    assert torch.equal(first, keep) and torch.equal(first, model(_tokens(4, seed=1)).detach())


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("model_kw", [{}, {"moe_every": 2}, {"rich_calls": True}])
def test_greedy_tokens_with_static_cache_equal_no_cache_decode(model_kw):
    model = _gpt(**model_kw)
    prompts = _tokens(3, 5, seed=7)
    ref_tokens, ref_logits = greedy_reference(model, prompts, 10, return_logits=True)
    logits = {}
    for scope in ("none", "layer", "block"):
        gen = GreedyGenerator(model, _cfg(scope), max_batch=4, max_len=SEQ)
        tokens, logits[scope] = gen.generate(prompts, 10, return_logits=True)
        assert torch.equal(tokens, ref_tokens), scope
        assert torch.equal(gen.generate(prompts, 10), ref_tokens)  # a second request reuses the graphs and the cache
        if scope != "none":
            assert gen.graphs.num_graphs == (3 if scope == "layer" else 1)  # one bucket (4): the 3 rows are padded
            assert gen.graphs.counters["graphed_calls"] == 18
        gen.delete()
    # Layer and block graphs compute the same padded decode steps: bit-equal logits.
    assert torch.equal(logits["layer"], logits["block"])
    # Eager steps of the unpadded batch (scope none), and the no-cache forward (the cache attends over masked keys,
    # summed in another order): the same math, rounded differently (measured max |diff| 6e-7, fp32 CPU), hence 2e-6.
    torch.testing.assert_close(logits["block"], logits["none"], rtol=0, atol=2e-6)
    torch.testing.assert_close(logits["block"], ref_logits, rtol=0, atol=2e-6)


def test_greedy_logits_at_an_exact_bucket_equal_eager_decode_steps():
    model = _gpt(moe_every=2)
    prompts = _tokens(4, 3, seed=11)  # 4 rows: bucket 4, nothing padded
    logits = {}
    for scope in ("none", "layer", "block"):
        gen = GreedyGenerator(model, _cfg(scope), max_batch=4, max_len=SEQ)
        logits[scope] = gen.generate(prompts, 8, return_logits=True)[1]
    assert torch.equal(logits["layer"], logits["none"]) and torch.equal(logits["block"], logits["none"])


def test_generation_beyond_the_largest_bucket_decodes_eagerly():
    model = _gpt()
    prompts = _tokens(3, 4, seed=3)
    gen = GreedyGenerator(model, _cfg("block"), max_batch=4, max_len=SEQ, batch_buckets=Buckets([1, 2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = gen.generate(prompts, 6)
        single = gen.generate(prompts[:1], 6)  # fits bucket 1: graphed
    assert torch.equal(tokens, greedy_reference(model, prompts, 6))
    assert torch.equal(single, greedy_reference(model, prompts[:1], 6))
    assert sum(issubclass(w.category, BucketOverflowWarning) for w in caught) == 1
    assert gen.graphs.counters["eager_calls"] == 5 and gen.graphs.counters["graphed_calls"] == 5


def test_generation_refusals():
    model = _gpt()
    with pytest.raises(ValueError, match="max_len=32.*positional"):
        GreedyGenerator(model, _cfg(), max_batch=4, max_len=32)
    with pytest.raises(ValueError, match=r"batch_buckets=\[8\] pad decode steps beyond max_batch=4"):
        GreedyGenerator(model, _cfg(), max_batch=4, max_len=8, batch_buckets=Buckets([8]))
    gen = GreedyGenerator(model, _cfg(), max_batch=4, max_len=8)
    with pytest.raises(ValueError, match="prompt_len \\+ max_new_tokens - 1 <= max_len=8"):
        gen.generate(_tokens(2, 5), 5)
    model.train()
    with pytest.raises(RuntimeError, match="eval mode"):
        gen.generate(_tokens(2, 5), 2)
    model.eval()
    gen.delete()
    with pytest.raises(RuntimeError, match="after delete"):
        gen.generate(_tokens(2, 5), 2)


def test_benchmark_cpu_smoke(tmp_path):
    """The benchmark's logic (sections, checks, JSON) on CPU: Gloo, protocol backends, a tiny model."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "inference-smoke.json"
    proc = run_entry([sys.executable, os.path.join(root, "benchmarks", "bench_inference.py"), "--cpu-smoke", "--out",
                      str(out)], env=dict(os.environ, PYTHONPATH=root, MASTER_PORT=str(port)), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    checks = [c for s in ("eval", "decode", "training") for c in res[s]["checks"]]
    assert res["all_ok"] and sum(c["ok"] is True for c in checks) == 13 and not any(c["ok"] is False for c in checks)
    assert res["config"]["cpu_smoke"] and res["world_size"] == 1
