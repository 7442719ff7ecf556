"""CPU tests of the CUDA graph configuration: parsing, deprecated spellings, validation, runtime checks."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest
import torch

import fsdp_cudagraph.capture.te as te_probe
from fsdp_cudagraph.config import (
    CudaGraphConfig,
    CudaGraphImpl,
    CudaGraphModule,
    InferenceCudaGraphScope,
    add_cuda_graph_args,
    config_from_args,
    migrate_deprecated_options,
    parse_cuda_graph_impl,
    parse_cuda_graph_module,
    parse_cuda_graph_modules,
    parse_inference_cuda_graph_scope,
)

Impl, Mod, Inf = CudaGraphImpl, CudaGraphModule, InferenceCudaGraphScope
FSDP_OK = dict(use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cuda_graph_args(parser)
    return parser


def from_argv(argv: list, **overrides) -> CudaGraphConfig:
    return config_from_args(make_parser().parse_args(argv), **overrides)


def assert_typed(cfg: CudaGraphConfig) -> None:
    assert isinstance(cfg.cuda_graph_impl, CudaGraphImpl)
    assert isinstance(cfg.inference_cuda_graph_scope, InferenceCudaGraphScope)
    assert isinstance(cfg.cuda_graph_modules, list)
    assert all(isinstance(m, CudaGraphModule) for m in cfg.cuda_graph_modules)
    assert cfg.enable_cuda_graph is None and cfg.external_cuda_graph is None and cfg.cuda_graph_scope is None


# --- defaults, parsing ------------------------------------------------------------------------------------------


def test_defaults_are_typed_and_disabled():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = CudaGraphConfig()
    assert_typed(cfg)
    assert cfg.cuda_graph_impl is Impl.NONE and cfg.inference_cuda_graph_scope is Inf.NONE
    assert (cfg.cuda_graph_warmup_steps, cfg.cuda_graph_num_warmup_iters) == (3, 3)
    assert not cfg.enabled and cfg.backend is None


@pytest.mark.parametrize("impl, enabled, backend, inference", [
    ("local", True, "torch", Inf.LAYER),
    ("transformer_engine", True, "te", Inf.NONE),
    ("full_iteration", False, None, Inf.NONE),
    ("none", False, None, Inf.NONE),
])
def test_properties_and_inference_resolution(impl, enabled, backend, inference):
    cfg = CudaGraphConfig(cuda_graph_impl=impl)
    assert (cfg.enabled, cfg.backend, cfg.inference_cuda_graph_scope) == (enabled, backend, inference)


@pytest.mark.parametrize("parse, text, expected", [
    (parse_cuda_graph_impl, "LOCAL", Impl.LOCAL),
    (parse_cuda_graph_impl, " Transformer-Engine ", Impl.TRANSFORMER_ENGINE),
    (parse_cuda_graph_impl, Impl.FULL_ITERATION, Impl.FULL_ITERATION),
    (parse_cuda_graph_module, "MoE-Router", Mod.MOE_ROUTER),
    (parse_inference_cuda_graph_scope, "Block", Inf.BLOCK),
])
def test_parse_case_insensitive(parse, text, expected):
    assert parse(text) is expected


def test_parse_modules_dedupes_in_order_and_accepts_one_name():
    assert parse_cuda_graph_modules(["MLP", "attn", Mod.MLP]) == [Mod.MLP, Mod.ATTN]
    assert parse_cuda_graph_modules("attn") == [Mod.ATTN]
    assert parse_cuda_graph_modules(None) == []
    cfg = CudaGraphConfig(cuda_graph_impl="LOCAL", cuda_graph_modules=["Attn", "MLP"],
                          inference_cuda_graph_scope="BLOCK")
    assert cfg.cuda_graph_modules == [Mod.ATTN, Mod.MLP] and cfg.inference_cuda_graph_scope is Inf.BLOCK


@pytest.mark.parametrize("parse, bad, valid", [
    (parse_cuda_graph_impl, "te", "none, local, transformer_engine, full_iteration"),
    (parse_cuda_graph_module, "attention", "attn, mlp, moe, moe_router, moe_preprocess, mamba"),
    (parse_inference_cuda_graph_scope, "layers", "none, layer, block"),
])
def test_parse_unknown_lists_valid_values(parse, bad, valid):
    with pytest.raises(ValueError, match=f"'{bad}'.*{valid}"):
        parse(bad)


def test_parse_wrong_type():
    with pytest.raises(TypeError, match="cuda_graph_impl.*int 3"):
        parse_cuda_graph_impl(3)
    with pytest.raises(ValueError, match="unknown cuda_graph_impl 'TE'"):
        CudaGraphConfig(cuda_graph_impl="TE")


def test_argparse_reports_parse_helper_message(capsys):
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-modules", "attn", "bogus"])
    assert "unknown cuda_graph_modules entry 'bogus'" in capsys.readouterr().err


def test_argparse_new_flags_and_fsdp_from_args():
    args = make_parser().parse_args(["--cuda-graph-impl", "transformer-engine", "--cuda-graph-modules", "attn", "MLP",
                                     "--cuda-graph-warmup-steps", "5", "--cuda-graph-num-warmup-iters", "2"])
    args.use_megatron_fsdp = args.fsdp_double_buffer = args.fsdp_db_use_persist_buf_on_alloc_fail = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_args(args, cuda_graph_warmup_steps=7)
    assert_typed(cfg)
    assert cfg.cuda_graph_impl is Impl.TRANSFORMER_ENGINE and cfg.cuda_graph_modules == [Mod.ATTN, Mod.MLP]
    assert (cfg.cuda_graph_warmup_steps, cfg.cuda_graph_num_warmup_iters) == (7, 2)  # overrides win
    assert cfg.use_megatron_fsdp and cfg.fsdp_double_buffer and cfg.fsdp_db_use_persist_buf_on_alloc_fail


def test_add_args_to_existing_group_and_unknown_override():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("mine")
    assert add_cuda_graph_args(group) is group
    args = parser.parse_args(["--cuda-graph-module-patterns", "layers.*.attn"])
    cfg = config_from_args(args, cuda_graph_impl="local")
    assert cfg.cuda_graph_module_patterns == ["layers.*.attn"]
    with pytest.raises(TypeError, match="cuda_graph_iml"):
        config_from_args(parser.parse_args([]), cuda_graph_iml="local")


# --- migration table, dataclass and argparse paths -------------------------------------------------------------

MIGRATIONS = [
    # (dataclass kwargs, argv, impl, modules, inference)
    (dict(enable_cuda_graph=True), ["--enable-cuda-graph"], Impl.LOCAL, [], Inf.LAYER),
    (dict(external_cuda_graph=True), ["--external-cuda-graph"], Impl.TRANSFORMER_ENGINE, [], Inf.NONE),
    (dict(cuda_graph_scope="full_iteration"), ["--cuda-graph-scope", "full_iteration"], Impl.FULL_ITERATION, [],
     Inf.NONE),
    (dict(cuda_graph_scope=["full_iteration_inference"]), ["--cuda-graph-scope", "full_iteration_inference"],
     Impl.LOCAL, [], Inf.BLOCK),
    (dict(cuda_graph_scope=["attn", "mlp"], cuda_graph_impl="local"),
     ["--cuda-graph-scope", "attn", "mlp", "--cuda-graph-impl", "local"], Impl.LOCAL, [Mod.ATTN, Mod.MLP], Inf.LAYER),
    # agreeing combinations: accepted, still warned
    (dict(enable_cuda_graph=True, cuda_graph_impl="local"), ["--enable-cuda-graph", "--cuda-graph-impl", "local"],
     Impl.LOCAL, [], Inf.LAYER),
    (dict(enable_cuda_graph=True, cuda_graph_scope="full_iteration_inference", inference_cuda_graph_scope="block"),
     ["--enable-cuda-graph", "--cuda-graph-scope", "full_iteration_inference", "--inference-cuda-graph-scope", "block"],
     Impl.LOCAL, [], Inf.BLOCK),
    (dict(cuda_graph_scope=["mlp", "attn"], cuda_graph_modules=["attn", "mlp"], external_cuda_graph=True),
     ["--cuda-graph-scope", "mlp", "attn", "--cuda-graph-modules", "attn", "mlp", "--external-cuda-graph"],
     Impl.TRANSFORMER_ENGINE, [Mod.ATTN, Mod.MLP], Inf.NONE),
    # upstream spelled full-iteration graphs as the local impl plus scope full_iteration
    (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
     ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"], Impl.FULL_ITERATION, [], Inf.NONE),
]


@pytest.mark.parametrize("kwargs, argv, impl, modules, inference", MIGRATIONS)
@pytest.mark.parametrize("path", ["dataclass", "argparse"])
def test_migration(path, kwargs, argv, impl, modules, inference):
    with pytest.warns(DeprecationWarning, match="deprecated") as record:
        cfg = CudaGraphConfig(**kwargs) if path == "dataclass" else from_argv(argv)
    assert_typed(cfg)
    assert cfg.cuda_graph_impl is impl and cfg.cuda_graph_modules == modules
    assert cfg.inference_cuda_graph_scope is inference
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert all(w.filename == __file__ for w in deprecations), [w.filename for w in deprecations]


def test_migrated_config_holds_one_truth():
    with pytest.warns(DeprecationWarning):
        cfg = CudaGraphConfig(enable_cuda_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated fields were reset: no second warning, same result
        assert dataclasses.replace(cfg) == cfg


def test_enable_false_warns_and_changes_nothing():
    with pytest.warns(DeprecationWarning, match="enable_cuda_graph"):
        cfg = CudaGraphConfig(enable_cuda_graph=False, cuda_graph_impl="transformer_engine")
    assert cfg.cuda_graph_impl is Impl.TRANSFORMER_ENGINE


def test_cuda_graph_scope_name_is_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="CudaGraphScope.*CudaGraphModule") as record:
        from fsdp_cudagraph.config import CudaGraphScope
    assert CudaGraphScope is CudaGraphModule and record[0].filename == __file__
    import fsdp_cudagraph.config as config

    with pytest.raises(AttributeError, match="NoSuchName"):
        config.NoSuchName


def test_migrate_function_is_shared_and_typed():
    with pytest.warns(DeprecationWarning):
        out = migrate_deprecated_options(cuda_graph_scope="full_iteration_inference")
    assert out.cuda_graph_impl is Impl.LOCAL and out.inference_cuda_graph_scope is Inf.BLOCK


# --- conflicts between deprecated and new inputs: both names in the message -----------------------------------

CONFLICTS = [
    (dict(enable_cuda_graph=True, cuda_graph_impl="transformer_engine"),
     ["--enable-cuda-graph", "--cuda-graph-impl", "transformer_engine"], ["enable_cuda_graph", "cuda_graph_impl"]),
    (dict(enable_cuda_graph=True, cuda_graph_impl="none"), ["--enable-cuda-graph", "--cuda-graph-impl", "none"],
     ["enable_cuda_graph", "cuda_graph_impl='none'"]),
    (dict(external_cuda_graph=True, cuda_graph_impl="local"), ["--external-cuda-graph", "--cuda-graph-impl", "local"],
     ["external_cuda_graph", "cuda_graph_impl='local'"]),
    (dict(enable_cuda_graph=True, external_cuda_graph=True), ["--enable-cuda-graph", "--external-cuda-graph"],
     ["enable_cuda_graph", "external_cuda_graph"]),
    (dict(cuda_graph_scope="full_iteration", cuda_graph_impl="transformer_engine"),
     ["--cuda-graph-scope", "full_iteration", "--cuda-graph-impl", "transformer_engine"],
     ["cuda_graph_scope", "cuda_graph_impl='transformer_engine'"]),
    (dict(cuda_graph_scope="full_iteration_inference", external_cuda_graph=True),
     ["--cuda-graph-scope", "full_iteration_inference", "--external-cuda-graph"],
     ["cuda_graph_scope", "external_cuda_graph"]),
    (dict(cuda_graph_scope="full_iteration_inference", cuda_graph_impl="full_iteration"),
     ["--cuda-graph-scope", "full_iteration_inference", "--cuda-graph-impl", "full_iteration"],
     ["cuda_graph_scope", "cuda_graph_impl='full_iteration'"]),
    (dict(cuda_graph_scope="full_iteration_inference", inference_cuda_graph_scope="layer", cuda_graph_impl="local"),
     ["--cuda-graph-scope", "full_iteration_inference", "--inference-cuda-graph-scope", "layer"],
     ["cuda_graph_scope", "inference_cuda_graph_scope='layer'"]),
    (dict(cuda_graph_scope=["attn"], cuda_graph_modules=["mlp"], cuda_graph_impl="local"),
     ["--cuda-graph-scope", "attn", "--cuda-graph-modules", "mlp", "--cuda-graph-impl", "local"],
     ["cuda_graph_scope", "cuda_graph_modules"]),
    (dict(cuda_graph_scope=["full_iteration", "attn"]), ["--cuda-graph-scope", "full_iteration", "attn"],
     ["cuda_graph_scope", "full_iteration", "attn"]),
    (dict(cuda_graph_scope=["full_iteration", "full_iteration_inference"]),
     ["--cuda-graph-scope", "full_iteration", "full_iteration_inference"], ["cuda_graph_scope", "full_iteration"]),
]


@pytest.mark.parametrize("kwargs, argv, names", CONFLICTS)
@pytest.mark.parametrize("path", ["dataclass", "argparse"])
def test_conflict_names_both_inputs(path, kwargs, argv, names):
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as info:
        CudaGraphConfig(**kwargs) if path == "dataclass" else from_argv(argv)
    for name in names:
        assert name in str(info.value)


def test_unknown_cuda_graph_scope_entry_lists_legacy_values():
    with pytest.raises(ValueError, match="'whole'.*full_iteration_inference"):
        CudaGraphConfig(cuda_graph_scope="whole")


# --- validation rules ------------------------------------------------------------------------------------------

REJECTIONS = [
    (dict(cuda_graph_impl="local", use_megatron_fsdp=True),
     ["use_megatron_fsdp", "fsdp_double_buffer=False and fsdp_db_use_persist_buf_on_alloc_fail=False"]),
    (dict(cuda_graph_impl="transformer_engine", **{**FSDP_OK, "fsdp_db_use_persist_buf_on_alloc_fail": False}),
     ["use_megatron_fsdp", "but fsdp_db_use_persist_buf_on_alloc_fail=False",
      "--fsdp-db-use-persist-buf-on-alloc-fail"]),
    (dict(fsdp_db_use_persist_buf_on_alloc_fail=True),
     ["fsdp_db_use_persist_buf_on_alloc_fail=True requires fsdp_double_buffer"]),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_preprocess"]), ["'moe_preprocess' requires 'moe_router'"]),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe", "moe_router"]), ["'moe'", "'moe_router'"]),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe", "moe_preprocess"]), ["'moe'", "drop 'moe_preprocess'"]),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=["attn"]),
     ["cuda_graph_modules=['attn']", "cuda_graph_impl='full_iteration'"]),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_module_patterns=["*.attn"]),
     ["cuda_graph_module_patterns", "cuda_graph_impl='full_iteration'"]),
    (dict(cuda_graph_modules=["attn"]), ["cuda_graph_modules=['attn']", "cuda_graph_impl='none'"]),
    (dict(cuda_graph_impl="none", cuda_graph_module_patterns=["MLP"]),
     ["cuda_graph_module_patterns=['MLP']", "cuda_graph_impl='none'"]),
    (dict(inference_cuda_graph_scope="layer"), ["inference_cuda_graph_scope='layer'", "cuda_graph_impl='none'"]),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn"], cuda_graph_module_patterns=["*.mlp"]),
     ["cuda_graph_modules", "cuda_graph_module_patterns", "exclusive"]),
    (dict(cuda_graph_warmup_steps=0), ["cuda_graph_warmup_steps=0", ">= 1"]),
    (dict(cuda_graph_num_warmup_iters=0), ["cuda_graph_num_warmup_iters=0", ">= 1"]),
]


@pytest.mark.parametrize("kwargs, names", REJECTIONS)
def test_rejection_names_inputs(kwargs, names):
    with pytest.raises(ValueError) as info:
        CudaGraphConfig(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_all_violations_reported_together():
    with pytest.raises(ValueError) as info:
        CudaGraphConfig(cuda_graph_warmup_steps=0, cuda_graph_modules=["attn"],
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    assert str(info.value).count("\n  - ") == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(cuda_graph_warmup_steps=2.0), "cuda_graph_warmup_steps must be an int"),
    (dict(cuda_graph_num_warmup_iters=True), "cuda_graph_num_warmup_iters must be an int"),
    (dict(use_megatron_fsdp="yes"), "use_megatron_fsdp must be a bool"),
    (dict(cuda_graph_impl="local", cuda_graph_module_patterns=[""]), "non-empty strings"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=5), "cuda_graph_modules must be a list"),
])
def test_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        CudaGraphConfig(**kwargs)


def test_accepted_combinations():
    cfg = CudaGraphConfig(cuda_graph_impl="transformer_engine",
                          cuda_graph_modules=["moe_router", "moe_preprocess", "attn"], **FSDP_OK)
    assert cfg.cuda_graph_modules == [Mod.MOE_ROUTER, Mod.MOE_PREPROCESS, Mod.ATTN]
    assert CudaGraphConfig(cuda_graph_impl="local", cuda_graph_modules=["moe", "attn", "mamba"]).enabled
    assert CudaGraphConfig(use_megatron_fsdp=True).cuda_graph_impl is Impl.NONE  # eager FSDP needs no buffers
    assert CudaGraphConfig(cuda_graph_impl="full_iteration", use_megatron_fsdp=True)  # refused at runtime instead


# --- runtime checks --------------------------------------------------------------------------------------------


def test_check_runtime_none_passes_anywhere():
    CudaGraphConfig().check_runtime()


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_check_runtime_without_cuda(impl, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=f"cuda_graph_impl='{impl}' needs a CUDA GPU"):
        CudaGraphConfig(cuda_graph_impl=impl).check_runtime()


def test_check_runtime_te_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te_probe, "HAS_TE", False)
    monkeypatch.setattr(te_probe, "TE_REASON", "TransformerEngine is not importable (test)")
    with pytest.raises(ImportError, match=r"TransformerEngine is not importable \(test\).*fsdp-cudagraph\[te\]"):
        CudaGraphConfig(cuda_graph_impl="transformer_engine").check_runtime()
    CudaGraphConfig(cuda_graph_impl="local").check_runtime()  # the local impl does not need TE


def test_check_runtime_te_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te_probe, "HAS_TE", True)
    CudaGraphConfig(cuda_graph_impl="transformer_engine").check_runtime()


def test_check_runtime_full_iteration(monkeypatch):
    # implemented by FullIterationCudaGraph: needs a GPU like the other impls, and no TE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="cuda_graph_impl='full_iteration' needs a CUDA GPU"):
        CudaGraphConfig(cuda_graph_impl="full_iteration").check_runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te_probe, "HAS_TE", False)
    CudaGraphConfig(cuda_graph_impl="full_iteration").check_runtime()
