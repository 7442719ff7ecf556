"""FP8 training settings (``capture/fp8.py``): names, recipes, refusals, and their way into TE's graph maker.

No TE and no GPU here. Where a test needs TE to see the wiring, it stands in for the one piece it needs, and
says so: ``transformer_engine.common.recipe`` (recipe classes that record their arguments), TE's ``autocast``
(a context manager that records its arguments) and ``make_graphed_callables`` (TE's warmup/capture schedule
without graphs, ``schedules.run_te_schedule``, recording its keyword arguments and installing a forward that,
as TE's does, requires ``is_first_microbatch=<bool>`` at each replay when ``cache_quantized_params=True``).
What TE computes in FP8 is proven on GPUs (``tests/gpu/test_fp8.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import types
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import fsdp_cudagraph.graphs.partial as partial_mod
from fsdp_cudagraph import CudaGraphConfig, FP8Recipe, PartialCudaGraphs, add_cuda_graph_args, config_from_args
from fsdp_cudagraph.apps.model import GPTConfig
from fsdp_cudagraph.capture import fp8 as fp8_mod
from fsdp_cudagraph.capture import schedules
from tests.dist_utils import run_gloo

TE = "transformer_engine"


# ---------------------------------------------------------------------------------------------- names and config
def test_recipe_names_parse_case_insensitively_and_unknown_ones_are_named():
    assert fp8_mod.parse_fp8_recipe(None) is None
    assert fp8_mod.parse_fp8_recipe(" Delayed ") == "delayed"
    with pytest.raises(ValueError, match="'mxfp8'.*delayed, current, block"):
        fp8_mod.parse_fp8_recipe("mxfp8")
    with pytest.raises(TypeError, match="fp8_recipe must be None or a str"):
        fp8_mod.parse_fp8_recipe(8)


@pytest.mark.parametrize("kw", [dict(cuda_graph_impl=TE, fp8_recipe="delayed"),
                                dict(cuda_graph_impl=TE, fp8_recipe="block", fp8_cache_quantized_params=True),
                                dict(cuda_graph_impl="full_iteration", fp8_recipe="current"),
                                dict(cuda_graph_impl="full_iteration", fp8_recipe="block"),
                                dict(fp8_recipe="delayed", fp8_cache_quantized_params=True),  # eager
                                dict(cuda_graph_impl=TE, fp8_recipe="delayed", fp8_dot_product_attention=True),
                                dict(fp8_recipe="current", fp8_dot_product_attention=True)])  # eager
def test_config_accepts_what_te_can_capture(kw):
    cfg = CudaGraphConfig(**kw)
    assert cfg.fp8_recipe == kw["fp8_recipe"]


@pytest.mark.parametrize("kw, words", [
    (dict(cuda_graph_impl="local", fp8_recipe="current"), ["fp8_recipe='current' with cuda_graph_impl='local'",
                                                          "cuda_graph_impl='transformer_engine'"]),
    (dict(cuda_graph_impl="full_iteration", fp8_recipe="delayed"), ["'delayed' with cuda_graph_impl='full_iteration'",
                                                                  "'current' or 'block'"]),
    (dict(cuda_graph_impl="full_iteration", fp8_recipe="current", fp8_cache_quantized_params=True),
     ["fp8_cache_quantized_params=True with cuda_graph_impl='full_iteration'"]),
    (dict(cuda_graph_impl=TE, fp8_recipe="delayed", inference_cuda_graph_scope="block"),
     ["inference_cuda_graph_scope='block' is not supported", "drop inference_cuda_graph_scope"]),
    (dict(cuda_graph_impl=TE, fp8_cache_quantized_params=True), ["without fp8_recipe would be ignored"]),
    (dict(fp8_dot_product_attention=True), ["fp8_dot_product_attention=True without fp8_recipe would be ignored"]),
    (dict(cuda_graph_impl=TE, fp8_recipe="block", fp8_dot_product_attention=True),
     ["fp8_recipe='block' with fp8_dot_product_attention=True", "no FP8 attention for block scaling", "'delayed'"]),
    (dict(cuda_graph_impl=TE, fp8_recipe="current", fp8_dot_product_attention=True),
     ["fp8_recipe='current' with FP8 attention under per-layer graphs", "only for a DelayedScaling recipe",
      "fp8_recipe='delayed'"]),
    (dict(cuda_graph_impl="full_iteration", fp8_recipe="current", fp8_dot_product_attention=True),
     ["fp8_dot_product_attention=True with cuda_graph_impl='full_iteration'", "delayed-scaling state",
      "cuda_graph_impl='transformer_engine'"]),
])
def test_config_refuses_with_value_rule_and_fix(kw, words):
    with pytest.raises(ValueError) as err:
        CudaGraphConfig(**kw)
    for w in words:
        assert w in str(err.value)


def test_config_from_the_command_line():
    p = argparse.ArgumentParser()
    add_cuda_graph_args(p)
    args = p.parse_args(["--cuda-graph-impl", TE, "--fp8-recipe", "Delayed", "--fp8-cache-quantized-params",
                         "--fp8-dot-product-attention"])
    cfg = config_from_args(args)
    assert (cfg.fp8_recipe, cfg.fp8_cache_quantized_params, cfg.fp8_dot_product_attention) == ("delayed", True, True)
    assert not config_from_args(p.parse_args(["--fp8-recipe", "delayed"])).fp8_dot_product_attention
    assert config_from_args(p.parse_args([])).fp8_recipe is None
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8-recipe", "e4m3"])


def test_a_run_spec_carries_fp8_attention_to_the_recipe_and_the_graph_config():
    from fsdp_cudagraph.apps.train import RunSpec, fp8_recipe, graph_config

    model = GPTConfig(fp8="delayed", use_te=True, hidden_size=64, seq_len=32)
    spec = RunSpec(model=model, fp8_dot_product_attention=True, backend="te")
    assert fp8_recipe(spec).dot_product_attention and graph_config(spec).fp8_dot_product_attention
    assert not fp8_recipe(RunSpec(model=model)).dot_product_attention
    with pytest.raises(ValueError, match="fp8_dot_product_attention=True needs GPTConfig\\(fp8=...\\)"):
        fp8_recipe(RunSpec(model=GPTConfig(), fp8_dot_product_attention=True))


def test_gpt_config_refuses_fp8_without_te_layers_or_fp8_shapes():
    assert GPTConfig(fp8="block", use_te=True, hidden_size=64, seq_len=32).fp8 == "block"
    with pytest.raises(ValueError, match="use_te=False.*set use_te=True"):
        GPTConfig(fp8="delayed")
    with pytest.raises(ValueError, match="hidden_size=72, seq_len=100.*multiple of 16"):
        GPTConfig(fp8="delayed", use_te=True, hidden_size=72, num_heads=4, seq_len=100, ffn_hidden_size=256)
    with pytest.raises(ValueError, match="te_grouped"):
        GPTConfig(fp8="current", use_te=True, moe_every=1, moe_experts="te_grouped")


# ---------------------------------------------------------------------------------------------- device and shapes
@pytest.mark.parametrize("name, cap, cuda, words", [
    ("block", (8, 9), "12.9", ["compute capability 9.0", "is 8.9", "'current' or 'delayed'"]),
    ("block", (9, 0), "12.8", ["CUDA 12.9", "runs CUDA 12.8"]),
    ("delayed", (8, 0), "13.0", ["compute capability 8.9", "is 8.0", "bf16"]),
    ("current", (7, 5), "12.4", ["compute capability 8.9"]),
])
def test_device_refusals(name, cap, cuda, words):
    with pytest.raises(RuntimeError) as err:
        fp8_mod.check_fp8_device(name, cap, cuda)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("name, cap, cuda", [("block", (9, 0), "13.0"), ("block", (10, 0), "12.9"),
                                             ("delayed", (8, 9), "12.1"), ("current", (9, 0), "12.4")])
def test_device_accepts(name, cap, cuda):
    fp8_mod.check_fp8_device(name, cap, cuda)


def test_without_a_gpu_fp8_is_refused_at_runtime():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        fp8_mod.check_fp8_runtime("current")


@pytest.mark.parametrize("name, cap, cudnn, det, env, words", [
    ("block", (9, 0), (9, 19, 0), False, "", ["no FP8 attention for block scaling", "'delayed'"]),
    ("delayed", (8, 9), (9, 19, 0), False, "", ["compute capability 9.0", "is 8.9"]),
    ("current", (9, 0), (9, 19, 0), False, "", ["current-scaling FP8 attention on compute capability 10.0",
                                                 "is 9.0", "NVTE_DPA_FP8_RECIPE=DelayedScaling"]),
    ("delayed", (9, 0), (9, 14, 0), True, "", ["cuDNN 9.19 or newer", "runs cuDNN 9.14.0", "CUDNN_PATH=",
                                                "LD_LIBRARY_PATH=$CUDNN_PATH/lib",
                                                "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1"]),
    ("current", (10, 0), (9, 18, 1), True, "", ["cuDNN 9.19 or newer", "9.18.1"]),
])
def test_fp8_attention_refusals_name_the_rule_and_the_fix(name, cap, cudnn, det, env, words):
    """[Note: FP8 attention]: TE 2.20's kernel rules, checked before the first forward."""
    problems = fp8_mod.fp8_attention_problems(name, cap, cudnn, deterministic=det, dpa_recipe=env)
    assert len(problems) == 1
    for w in words:
        assert w in problems[0]


@pytest.mark.parametrize("name, cap, cudnn, det, env", [
    ("delayed", (9, 0), (9, 19, 0), True, ""),
    ("delayed", (9, 0), (9, 14, 0), False, ""),  # non-deterministic kernels: any cuDNN TE takes
    ("current", (9, 0), (9, 19, 0), True, "DelayedScaling"),  # attention scaled by delayed scaling on Hopper
    ("current", (10, 0), (9, 19, 0), True, ""),
])
def test_fp8_attention_accepted_where_te_runs_it(name, cap, cudnn, det, env):
    assert fp8_mod.fp8_attention_problems(name, cap, cudnn, deterministic=det, dpa_recipe=env) == []


def test_fp8_attention_determinism_follows_te(monkeypatch):
    """TE picks deterministic attention kernels when NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch's deterministic
    mode is on (its own test): the cuDNN rule applies then only."""
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not fp8_mod.attention_deterministic()
        monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        assert fp8_mod.attention_deterministic()
        monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert fp8_mod.attention_deterministic()
    finally:
        torch.use_deterministic_algorithms(was)


def test_te_gemm_shape_rule():
    assert fp8_mod.fp8_shape_problem("w", (768, 256)) is None
    assert fp8_mod.fp8_shape_problem("x", (2, 128, 256)) is None
    assert "last (100) a multiple of 16" in fp8_mod.fp8_shape_problem("w", (64, 100))
    assert "(10) to be a multiple of 8" in fp8_mod.fp8_shape_problem("x", (2, 5, 64))


# ---------------------------------------------------------------------------------------------- stand-ins for TE
class _Recorded:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw


def _recipes() -> Any:
    """Stand-in for ``transformer_engine.common.recipe``: classes that record their arguments."""
    fmt = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    return types.SimpleNamespace(Format=fmt, DelayedScaling=type("DelayedScaling", (_Recorded,), {}),
                                 Float8CurrentScaling=type("Float8CurrentScaling", (_Recorded,), {}),
                                 Float8BlockScaling=type("Float8BlockScaling", (_Recorded,), {}))


class _StubTE:
    """Stand-in for ``transformer_engine.pytorch``: ``autocast`` and ``make_graphed_callables`` recorded."""

    def __init__(self) -> None:
        self.regions: List[Dict[str, Any]] = []
        self.graph_calls: List[Dict[str, Any]] = []
        self.replays: List[Any] = []
        self.depth = 0

    @contextlib.contextmanager
    def autocast(self, **kw: Any):
        self.regions.append(kw)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def make_graphed_callables(self, modules, sample_args, *, num_warmup_iters=3, capture_time_hooks=None, **kw):
        self.graph_calls.append(kw)
        schedules.run_te_schedule(modules, sample_args, capture_time_hooks, num_warmup_iters=num_warmup_iters,
                                  region=contextlib.nullcontext)
        cache = kw.get("cache_quantized_params", False)
        for m in modules:
            fwd = m.forward

            def replay(*args: Any, _fwd=fwd, **user_kwargs: Any) -> Any:  # TE's functionalized() rule
                if cache and not isinstance(user_kwargs.get("is_first_microbatch"), bool):
                    raise ValueError("`is_first_microbatch` boolean kwarg must be provided for FP8 weight caching.")
                self.replays.append(user_kwargs.get("is_first_microbatch"))
                return _fwd(*args)

            m.forward = replay
        return modules


@pytest.fixture
def stub_te(monkeypatch):
    te = _StubTE()
    monkeypatch.setattr(fp8_mod, "_recipe_classes", _recipes)
    monkeypatch.setattr(fp8_mod, "_te", types.SimpleNamespace(require_te=lambda what: te, HAS_TE=False))
    monkeypatch.setattr(fp8_mod, "te_autocast_active", lambda: te.depth > 0)
    monkeypatch.setattr(partial_mod, "require_te", lambda what: te)
    monkeypatch.setattr(CudaGraphConfig, "check_runtime", lambda self: None)
    monkeypatch.setattr(FP8Recipe, "check_runtime", lambda self: None)
    return te


def test_recipes_are_built_as_megatron_builds_them(stub_te):
    d, c, b = (FP8Recipe(n).recipe for n in ("delayed", "current", "block"))
    assert type(d).__name__ == "DelayedScaling" and d.kw == {"fp8_format": "HYBRID"}
    assert type(c).__name__ == "Float8CurrentScaling" and c.kw == {"fp8_format": "HYBRID"}
    assert type(b).__name__ == "Float8BlockScaling" and b.kw == {}  # TE's default: E4M3, 1x128 / 128x128 blocks


def test_fp8_attention_sets_te_fp8_dpa_in_the_one_recipe(stub_te):
    d, c = (FP8Recipe(n, dot_product_attention=True) for n in ("delayed", "current"))
    assert d.recipe.kw == {"fp8_format": "HYBRID", "fp8_dpa": True} and type(d.recipe).__name__ == "DelayedScaling"
    assert c.recipe.kw == {"fp8_format": "HYBRID", "fp8_dpa": True}
    assert "dot_product_attention=True" in repr(d) and "dot_product_attention" not in repr(FP8Recipe("delayed"))
    with d.autocast():
        pass
    assert stub_te.regions[-1]["recipe"] is d.recipe and d.graph_maker_kwargs()["recipe"] is d.recipe
    with pytest.raises(ValueError, match="no FP8 attention for block scaling"):
        FP8Recipe("block", dot_product_attention=True)
    with pytest.raises(ValueError, match="no FP8 attention for block scaling"):
        fp8_mod.build_te_recipe("block", dot_product_attention=True)
    with pytest.raises(TypeError, match="dot_product_attention must be a bool"):
        FP8Recipe("delayed", dot_product_attention="yes")


def test_fp8_attention_is_checked_at_the_first_region_and_current_is_refused_under_graphs(stub_te, monkeypatch):
    """An eager run reaches TE's attention through the first ``autocast()``: the machine's rules are checked there,
    once a recipe; per-layer graphs refuse FP8 attention under current scaling (TE restores the warmup's
    delayed-scaling state only for a DelayedScaling recipe, [Note: FP8 attention])."""
    checked: List[str] = []
    monkeypatch.setattr(FP8Recipe, "check_runtime", lambda self: checked.append(repr(self)))
    attention, plain = FP8Recipe("delayed", dot_product_attention=True), FP8Recipe("delayed")
    for _ in range(3):
        with attention.autocast():
            pass
        with plain.autocast():
            pass
    assert checked == [repr(attention)]
    with pytest.raises(NotImplementedError, match="fp8_recipe='current' with FP8 attention under per-layer graphs"):
        _graphs(FP8Recipe("current", dot_product_attention=True))


def test_one_recipe_object_for_every_region_and_the_graph_maker(stub_te):
    group = object()
    fp8 = FP8Recipe("delayed", amax_reduction_group=group)
    with fp8.autocast():
        assert fp8_mod.is_first_microbatch() is None  # no caching: TE modules get no is_first_microbatch
    with fp8.autocast(first_microbatch=True):
        pass
    assert stub_te.regions[0] == {"enabled": True, "recipe": fp8.recipe, "amax_reduction_group": group}
    assert stub_te.regions[0]["recipe"] is stub_te.regions[1]["recipe"]
    assert fp8.graph_maker_kwargs() == {"enabled": True, "recipe": fp8.recipe, "amax_reduction_group": group,
                                        "cache_quantized_params": False}  # TE 2.20's names (fp8_* are deprecated)
    assert fp8.replay_kwargs() == {}


def test_weight_caching_needs_the_micro_batch_flag(stub_te):
    fp8 = FP8Recipe("current", cache_quantized_params=True)
    with pytest.raises(ValueError, match="first_microbatch=\\(i == 0\\)"):
        with fp8.autocast():
            pass
    for first in (True, False):
        with fp8.autocast(first_microbatch=first):
            assert fp8_mod.is_first_microbatch() is first
            assert fp8.replay_kwargs() == {"is_first_microbatch": first}
    assert fp8_mod.is_first_microbatch() is None
    with pytest.raises(RuntimeError, match="replayed outside fp8.autocast"):
        fp8.replay_kwargs()


def test_the_llama_units_hand_the_micro_batch_flag_to_te_blocks_only(stub_te):
    """``LlamaLayer`` passes ``is_first_microbatch`` to a TE block inside a caching region (TE quantizes the weights
    on the step's first micro-batch), nothing outside one or without caching, and never to the torch block."""
    from fsdp_cudagraph.apps.llama import LlamaConfig, LlamaLayer, _RopeTable

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=32,
                      seq_len=4, layers_impl="torch")
    torch_layer, te_layer = LlamaLayer(cfg, 1, _RopeTable(cfg)), LlamaLayer(cfg, 1, _RopeTable(cfg))
    calls: List[Dict[str, Any]] = []

    class Block(nn.Module):  # records what a TE TransformerLayer would be called with
        def forward(self, x, rotary_pos_emb, **kwargs):
            calls.append(kwargs)
            return x

    te_layer.te, te_layer.block = True, Block()
    x = torch.randn(4, 1, 16)
    cached, plain = FP8Recipe("current", cache_quantized_params=True), FP8Recipe("current")
    te_layer(x)
    with plain.autocast():
        te_layer(x)
    for first in (True, False):
        with cached.autocast(first_microbatch=first):
            assert fp8_mod.te_call_kwargs() == {"is_first_microbatch": first}
            te_layer(x)
            torch_layer(x)  # LlamaTorchLayer takes no such argument: it is not given one
    assert calls == [{}, {}, {"is_first_microbatch": True}, {"is_first_microbatch": False}]
    assert fp8_mod.te_call_kwargs() == {}


# ---------------------------------------------------------------------------------------------- through PartialCudaGraphs
class FakeWorkspace:
    """A TE quantized-weight workspace (``get_data_tensors()``: rowwise and columnwise data)."""

    def __init__(self, n: int) -> None:
        self.data, self.transpose = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)

    def get_data_tensors(self):
        return self.data, self.transpose


class TELikeLinear(nn.Linear):
    """A linear layer with TE's FP8 attributes: ``fp8_meta`` and, once it ran, a cached quantized weight."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.fp8_meta: Dict[str, Any] = {}
        self._fp8_workspaces: Dict[str, Any] = {}
        self.calls: List[Any] = []

    def forward(self, x: torch.Tensor, is_first_microbatch: Any = None) -> torch.Tensor:
        self.calls.append(is_first_microbatch)
        self.fp8 = fp8_mod.te_autocast_active()  # as TE sets it at every forward
        self._fp8_workspaces.setdefault("weight", FakeWorkspace(self.weight.numel()))
        return super().forward(x)


class Block(nn.Module):
    cuda_graph_module = "mlp"

    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.fc = TELikeLinear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = fp8_mod.is_first_microbatch()
        return torch.relu(self.fc(x, **({} if first is None else {"is_first_microbatch": first})))


def _graphs(fp8: Any, n: int = 32, **cfg: Any):
    torch.manual_seed(0)
    model = nn.Sequential(Block(n), Block(n))
    config = CudaGraphConfig(cuda_graph_impl=TE, cuda_graph_modules=["mlp"], **cfg)
    return model, PartialCudaGraphs(model, config, fp8=fp8)


def _step(model: nn.Module, fp8: FP8Recipe, n: int = 32, micro: int = 2) -> None:
    for i in range(micro):
        with fp8.autocast(first_microbatch=i == 0):
            out = model(torch.randn(8, n))
        out.sum().backward()


def test_te_graph_maker_gets_the_recipe_group_and_caching_and_replays_get_the_flag(stub_te):
    group = object()
    fp8 = FP8Recipe("delayed", amax_reduction_group=group, cache_quantized_params=True)
    model, graphs = _graphs(fp8)
    assert graphs.fp8 is fp8
    _step(model, fp8)
    graphs.capture()
    (kw,) = stub_te.graph_calls
    assert kw["enabled"] is True and kw["recipe"] is fp8.recipe and kw["amax_reduction_group"] is group
    assert kw["cache_quantized_params"] is True
    _step(model, fp8)
    assert stub_te.replays == [True, True, False, False]  # per callable, per micro-batch, as the region says
    with pytest.raises(RuntimeError, match="replayed outside fp8.autocast"):
        model(torch.randn(8, 32))
    graphs.delete()


def test_config_recipe_builds_the_object_and_a_disagreeing_one_is_refused(stub_te):
    _, graphs = _graphs(None, fp8_recipe="current")
    assert isinstance(graphs.fp8, FP8Recipe) and graphs.fp8.name == "current"
    graphs.delete()
    with pytest.raises(ValueError, match="disagrees with config.fp8_recipe='current'"):
        _graphs(FP8Recipe("delayed"), fp8_recipe="current")
    with pytest.raises(ValueError, match="fp8_dot_product_attention=True; give the same recipe"):
        _graphs(FP8Recipe("delayed"), fp8_recipe="delayed", fp8_dot_product_attention=True)
    _, graphs = _graphs(None, fp8_recipe="delayed", fp8_dot_product_attention=True)
    assert graphs.fp8.dot_product_attention and graphs.fp8.recipe.kw["fp8_dpa"] is True
    graphs.delete()
    with pytest.raises(TypeError, match="fp8 must be an FP8Recipe"):
        _graphs("delayed")


@pytest.mark.parametrize("backend", ["torch", "protocol"])
def test_fp8_with_another_graph_maker_is_refused(backend):
    model = nn.Sequential(Block(), Block())
    config = CudaGraphConfig(cuda_graph_impl=TE, cuda_graph_modules=["mlp"])
    with pytest.raises(NotImplementedError, match=f"backend='{backend}' is not supported.*backend='te'"):
        PartialCudaGraphs(model, config, backend=backend, fp8=FP8Recipe("current"))


def test_capture_inside_an_autocast_region_is_refused(stub_te):
    fp8 = FP8Recipe("current")
    model, graphs = _graphs(fp8)
    _step(model, fp8)
    with fp8.autocast():
        with pytest.raises(RuntimeError, match="outside `with fp8.autocast\\(\\):`"):
            graphs.capture()
    graphs.delete()


def test_shapes_te_fp8_gemms_refuse_are_named_at_capture(stub_te):
    fp8 = FP8Recipe("current")
    model, graphs = _graphs(fp8, n=20)
    _step(model, fp8, n=20)
    with pytest.raises(ValueError, match="0.fc.weight has shape \\[20, 20\\].*multiples of 16"):
        graphs.capture()
    graphs.delete()


def test_a_cached_fp8_weight_dropped_after_capture_is_caught_before_replay(stub_te):
    fp8 = FP8Recipe("delayed", cache_quantized_params=True)
    model, graphs = _graphs(fp8)
    _step(model, fp8)
    graphs.capture()
    _step(model, fp8)  # replays
    model[1].fc._fp8_workspaces.clear()  # what TE does on a recipe change
    with pytest.raises(RuntimeError, match="quantized weight fc._fp8_workspaces\\['weight'\\]\\[0\\].*FP8 weight cache"):
        _step(model, fp8)
    graphs.delete()


def test_te_weight_flag_no_capture_without_caching_while_caching_graphs_live(stub_te):
    caching = FP8Recipe("delayed", cache_quantized_params=True)
    model, graphs = _graphs(caching)
    _step(model, caching)
    graphs.capture()
    plain = FP8Recipe("delayed")
    model2, graphs2 = _graphs(plain)
    _step(model2, plain)
    with pytest.raises(NotImplementedError, match="one process-wide weight-update flag"):
        graphs2.capture()
    graphs.delete()
    graphs2.delete()
    model3, graphs3 = _graphs(plain)
    _step(model3, plain)
    graphs3.capture()  # the caching graphs are gone
    graphs3.delete()


# ---------------------------------------------------------------------------------------------- TE's module state
class _DelayedRecipe:
    def delayed(self) -> bool:
        return True


class _CurrentRecipe:
    def delayed(self) -> bool:
        return False


class TELikeModule(nn.Module):
    """TE's FP8 state as ``TransformerEngineBaseModule`` keeps it: ``fp8``, ``fp8_meta`` with the recipe and, for
    delayed scaling, a recipe state holding ``scale`` and ``amax_history``; ``reset_fp8_meta_tensors``."""

    def __init__(self, recipe: Any) -> None:
        super().__init__()
        self.fp8 = True
        state = types.SimpleNamespace(scale=torch.full((3,), 7.0), amax_history=torch.full((4, 3), 2.0))
        self.fp8_meta = {"recipe": recipe, "scaling_fwd": state if isinstance(recipe, _DelayedRecipe) else object()}

    def reset_fp8_meta_tensors(self) -> None:
        st = self.fp8_meta["scaling_fwd"]
        st.scale.copy_(torch.ones_like(st.scale))
        st.amax_history.copy_(torch.zeros_like(st.amax_history))


def test_delayed_scaling_modules_are_found_for_the_whole_step_refusal():
    model = nn.ModuleDict({"a": TELikeModule(_DelayedRecipe()), "b": TELikeModule(_CurrentRecipe())})
    assert fp8_mod.delayed_scaling_modules(model) == ["a"]
    model["a"].fp8 = False  # its last forward ran without FP8
    assert fp8_mod.delayed_scaling_modules(model) == []


def test_reset_scaling_state_resets_delayed_scaling_in_place():
    model = nn.ModuleDict({"a": TELikeModule(_DelayedRecipe()), "b": TELikeModule(_CurrentRecipe())})
    st = model["a"].fp8_meta["scaling_fwd"]
    ptr = st.scale.data_ptr()
    assert fp8_mod.reset_scaling_state(model) == ["a"]
    assert torch.equal(st.scale, torch.ones(3)) and not st.amax_history.any() and st.scale.data_ptr() == ptr


def test_quantized_weight_probe_sees_replaced_and_dropped_workspaces():
    m = TELikeLinear(16, 16)
    assert fp8_mod.quantized_weight_probe(m) is None  # nothing cached yet
    m(torch.randn(8, 16))
    probe, names = fp8_mod.quantized_weight_probe(m)
    assert names == ("TELikeLinear._fp8_workspaces['weight'][0]", "TELikeLinear._fp8_workspaces['weight'][1]")
    before = probe()
    assert probe() == before and all(before)
    m._fp8_workspaces["weight"] = FakeWorkspace(256)
    assert probe() != before
    m._fp8_workspaces.clear()
    assert probe() == (0, 0)


def test_length_buckets_refuse_fp8():
    from fsdp_cudagraph import LengthBucketGraphs

    with pytest.raises(NotImplementedError, match="length-bucketed graphs is not supported"):
        LengthBucketGraphs(nn.Sequential(Block()), CudaGraphConfig(cuda_graph_impl=TE, cuda_graph_modules=["mlp"],
                                                                   fp8_recipe="current"),
                           buckets=[8, 16], length_args={"x": 0}, backend="protocol")


def test_final_states_compare_te_extra_state_by_content():
    """TE's extra state is pickled bytes, and pickled tensors carry storage keys made from addresses: two equal
    scaling states need not be equal bytes, so the alignment apps compare what they hold."""
    import pickle

    from fsdp_cudagraph.apps.train import states_equal

    def te_state(history: torch.Tensor) -> torch.Tensor:
        payload = pickle.dumps({"amax_history_fwd": history, "extra_fp8_variables": {"num_gemms": 1}})
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    w = torch.ones(2)
    a = {"w": w, "m._extra_state": te_state(torch.arange(4.0))}
    b = {"w": w.clone(), "m._extra_state": te_state(torch.arange(4.0) + 0)}  # equal values, another storage
    assert states_equal(a, b)
    assert not states_equal(a, {"w": w, "m._extra_state": te_state(torch.arange(4.0) + 1)})
    empty = torch.empty(0, dtype=torch.uint8)  # a stateless recipe's (current, block) or a bf16 TE module's
    assert states_equal({"m._extra_state": empty}, {"m._extra_state": empty.clone()})


def test_eager_fp8_steps_with_graphs_built_without_a_recipe_are_refused_at_capture(stub_te):
    # the replays would compute in bf16 what the eager steps computed in FP8: refused, naming the modules and the fix
    model, graphs = _graphs(None)
    _step(model, FP8Recipe("current"))
    with pytest.raises(ValueError, match=r"TE modules \['0.fc', '1.fc'\] ran their last forward in FP8.*"
                                         r"fp8=FP8Recipe\(name\)"):
        graphs.capture()
    graphs.delete()


def test_graphs_with_a_recipe_after_eager_steps_without_fp8_are_refused_at_capture(stub_te):
    fp8 = FP8Recipe("current")
    model, graphs = _graphs(fp8)
    for _ in range(2):
        model(torch.randn(8, 32)).sum().backward()  # no fp8.autocast(): the eager steps ran bf16
    with pytest.raises(ValueError, match=r"no TE module of the graphed callables ran FP8.*\['0.fc', '1.fc'\]"):
        graphs.capture()
    graphs.delete()


def _fsdp2_with_fp8(rank: int, world: int) -> str:
    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    model = nn.Sequential(Block(), Block())
    shard_fsdp2(model, list(model), device=torch.device("cpu"))
    try:
        PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl=TE, cuda_graph_modules=["mlp"], fp8_recipe="current",
                                                 use_megatron_fsdp=False))
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_fp8_under_an_engine_it_has_not_run_with_is_refused():
    (msg,) = run_gloo(_fsdp2_with_fp8, 1)
    assert "under torch FSDP2 is not supported yet" in msg and "megatron_fsdp" in msg, msg


def test_two_cudnns_in_one_process_are_named_with_the_fix(monkeypatch):
    """[Note: two cuDNNs in one process]: torch's mismatch error becomes one line with the library-path fix; other
    errors and an accepted cuDNN say nothing."""
    from fsdp_cudagraph.capture import te as te_mod

    def mismatch():
        raise RuntimeError("cuDNN version incompatibility: PyTorch was compiled  against (9, 19, 0) but found runtime "
                           "version (9, 14, 0). PyTorch already comes bundled with cuDNN.")

    monkeypatch.setattr(torch.backends.cudnn, "version", mismatch)
    said = te_mod.cudnn_mismatch()
    assert said.startswith("cuDNN version incompatibility: PyTorch was compiled  against (9, 19, 0) but found runtime "
                           "version (9, 14, 0): this process holds parts of two cuDNNs")
    assert "CUDNN_PATH=" in said and "LD_LIBRARY_PATH=$CUDNN_PATH/lib" in said and "nvidia.cudnn" in said
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert te_mod.cudnn_mismatch() is None

    def other():
        raise RuntimeError("cuDNN version 91100 is not compatible with devices with SM < 7.5")

    monkeypatch.setattr(torch.backends.cudnn, "version", other)
    assert te_mod.cudnn_mismatch() is None


def test_te_running_another_cudnn_than_torch_is_named_with_the_fix(monkeypatch):
    """[Note: two cuDNNs in one process], the second way: torch reports its own cuDNN while TE runs another (its
    attention then ran unfused); the same version, or no TE, says nothing."""
    from fsdp_cudagraph.capture import te as te_mod

    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    said = te_mod.cudnn_mismatch(te_cudnn=(9, 14, 0))
    assert said.startswith("TE runs cuDNN 9.14.0 and torch cuDNN 9.19.0: this process holds two cuDNNs"), said
    assert "unfused attention" in said and said.endswith(te_mod.CUDNN_FIX)
    assert te_mod.cudnn_mismatch(te_cudnn=(9, 19, 0)) is None
    assert te_mod.cudnn_mismatch(te_cudnn=(9, 19, 0, 1)) is None  # only major, minor and patch are compared
    monkeypatch.setattr(te_mod, "HAS_TE", False)
    assert te_mod.te_cudnn_version() is None and te_mod.cudnn_mismatch() is None
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)  # a torch without cuDNN
    assert te_mod.cudnn_mismatch(te_cudnn=(9, 14, 0)) is None
