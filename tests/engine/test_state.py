"""CPU tests of the engine's state: the nn.Module state-dict API, reads of parameters outside forward, and
torch.distributed.checkpoint (DCP) across world sizes, strategies and into the plain model.

Reads that crashed the process before (a parameter view on freed storage segfaults) run inside the spawned
Gloo ranks: a crash there fails the test through ``run_gloo`` instead of killing pytest.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_fsdp import MegatronFSDP
from tests.dist_utils import run_gloo
from tests.engine._common import STRATEGIES, adam, build_gpt, fsdp_step, full_optimizer_state, sgd, shard

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

STATE_CASES = [(s, db) for s in STRATEGIES for db in (False, True)]


def _reads_outside_forward(gpt: torch.nn.Module) -> Dict[str, str]:
    """Read every module parameter between steps; what each holds: 'nan' (placeholder) or 'finite'."""
    out = {}
    for name, p in gpt.named_parameters():
        v = p.detach().clone()  # a view on freed storage would crash here
        assert tuple(v.shape) == tuple(p.shape)
        out[name] = "nan" if bool(torch.isnan(v).all()) else ("finite" if bool(torch.isfinite(v).all()) else "mixed")
    return out


def _error(fn) -> Any:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)
    return None


def _state_job(rank: int, world: int, directory: str) -> Dict[Any, Any]:
    out: Dict[Any, Any] = {}
    for strategy, double_buffer in STATE_CASES:
        kwargs = dict(sharding_strategy=strategy, fsdp_double_buffer=double_buffer)
        gpt, cfg = build_gpt()
        model = shard(gpt, **kwargs)
        opt = sgd(model.optimizer_parameters())
        for step in range(2):
            fsdp_step(model, opt, step, cfg, rank, world)
        rec: Dict[str, Any] = {}
        rec["reads"] = _reads_outside_forward(gpt)
        sd = model.state_dict()
        rec["sd"] = sd
        # Inside forward the parameters are the current values (compute dtype fp32 here: exactly).
        seen = {}
        hook = gpt.layers[1].attn.register_forward_pre_hook(
            lambda m, a: seen.__setitem__("qkv", m.qkv.weight.detach().clone()))
        with torch.no_grad():
            model(torch.zeros(2, cfg.seq_len, dtype=torch.long))
        hook.remove()
        rec["in_forward_equal"] = torch.equal(seen["qkv"], sd["layers.1.attn.qkv.weight"])
        rec["reads_after_eval"] = _reads_outside_forward(gpt)
        rec["root_after_eval_current"] = torch.equal(gpt.head.weight.detach(), sd["head.weight"])
        path = os.path.join(directory, f"{strategy}-{double_buffer}-rank{rank}.pt")
        torch.save(sd, path)
        loaded = torch.load(path)  # weights_only: plain tensors
        rec["module_state_dict"] = _error(gpt.state_dict)
        layer0 = {k[len("layers.0."):]: v for k, v in sd.items() if k.startswith("layers.0.")}
        rec["submodule_load"] = _error(lambda: gpt.layers[0].load_state_dict(layer0))
        rec["strict_missing"] = _error(lambda: model.load_state_dict({k: v for k, v in loaded.items() if k != "head.weight"}))
        fresh = shard(build_gpt(seed=1)[0], **kwargs)
        rec["fresh_differs"] = not torch.equal(fresh.state_dict()["head.weight"], sd["head.weight"])
        partial = fresh.load_state_dict({"head.weight": loaded["head.weight"]}, strict=False)
        rec["partial"] = (sorted(partial.missing_keys)[:1], list(partial.unexpected_keys), len(partial.missing_keys))
        res = fresh.load_state_dict(loaded)
        rec["incompatible"] = (list(res.missing_keys), list(res.unexpected_keys))
        rec["round_trip"] = fresh.state_dict()
        # The loaded model computes what the original computes (fresh optimizers on both: no momentum carried).
        rec["next_losses"] = [fsdp_step(m, sgd(m.optimizer_parameters()), 2, cfg, rank, world) for m in (model, fresh)]
        # summon_full_params: module parameters are the full fp32 values inside, writable with writeback.
        now = model.state_dict()
        with model.summon_full_params():
            inner = gpt.state_dict()  # the module-level state dict is allowed inside
            rec["summon_forward"] = _error(lambda: model(torch.zeros(2, cfg.seq_len, dtype=torch.long)))
        rec["summon_equal"] = inner.keys() == now.keys() and all(torch.equal(inner[k], now[k]) for k in now)
        with model.summon_full_params(writeback=True), torch.no_grad():
            gpt.head.weight.fill_(0.5)
        rec["writeback"] = torch.equal(model.state_dict()["head.weight"], torch.full_like(now["head.weight"], 0.5))
        rec["reads_after_summon"] = _reads_outside_forward(gpt)
        rec["loss_after_summon"] = fsdp_step(model, sgd(model.optimizer_parameters()), 3, cfg, rank, world)
        out[(strategy, double_buffer)] = rec
    return out


@functools.lru_cache(maxsize=None)
def state_runs(directory: str) -> List[Dict[Any, Any]]:
    return run_gloo(_state_job, 2, directory)


@pytest.fixture(scope="module")
def state_results(tmp_path_factory):
    return state_runs(str(tmp_path_factory.mktemp("state")))


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer", STATE_CASES)
def test_state_dict_round_trip(state_results, strategy, double_buffer):
    plain_keys = set(build_gpt()[0].state_dict())
    for rank_result in state_results:
        rec = rank_result[(strategy, double_buffer)]
        sd = rec["sd"]
        assert set(sd) == plain_keys  # the unwrapped model's keys: loadable into the plain model
        build_gpt()[0].load_state_dict(sd)
        assert all(v.dtype == torch.float32 for v in sd.values())
        assert rec["in_forward_equal"], "inside forward a parameter must hold its current value"
        assert rec["fresh_differs"]
        assert rec["partial"] == (["layers.0.attn.ln.bias"], [], len(plain_keys) - 1)
        assert rec["incompatible"] == ([], [])
        assert rec["round_trip"].keys() == sd.keys()
        assert all(torch.equal(rec["round_trip"][k], sd[k]) for k in sd)
        loss_model, loss_fresh = rec["next_losses"]
        assert loss_model == loss_fresh  # bit for bit
        kind, msg = rec["strict_missing"]
        assert kind == "RuntimeError" and "head.weight" in msg, msg


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer", STATE_CASES)
def test_summon_full_params(state_results, strategy, double_buffer):
    dynamic = strategy == "optim_grads_params" and not double_buffer
    for rank_result in state_results:
        rec = rank_result[(strategy, double_buffer)]
        assert rec["summon_equal"]
        kind, msg = rec["summon_forward"]
        assert kind == "RuntimeError" and "summon_full_params" in msg, msg
        assert rec["writeback"]  # gathered from both ranks' shards: each rank wrote its own slice
        # Afterwards the parameters are the compute buffers again, and training goes on.
        assert set(rec["reads_after_summon"].values()) == ({"nan"} if dynamic else {"finite"})
        assert math.isfinite(rec["loss_after_summon"])


@pytest.mark.gloo
@pytest.mark.parametrize("strategy, double_buffer", STATE_CASES)
def test_parameter_reads_outside_forward_are_safe(state_results, strategy, double_buffer):
    """No segfault (the ranks survived), and what a read gives is documented: NaN placeholders for on-demand
    ZeRO-3 buffers (so a value read there cannot pass for a real one), memory-backed views otherwise."""
    dynamic = strategy == "optim_grads_params" and not double_buffer
    for rank_result in state_results:
        rec = rank_result[(strategy, double_buffer)]
        assert set(rec["reads"].values()) == ({"nan"} if dynamic else {"finite"}), rec["reads"]
        # After a forward without backward (evaluation), the root stays gathered: its values are current.
        root = {n for n in rec["reads_after_eval"] if not n.startswith("layers.")}
        for n, what in rec["reads_after_eval"].items():
            assert what == ("nan" if dynamic and n not in root else "finite"), (n, what)
        assert rec["root_after_eval_current"]
        for key in ("module_state_dict", "submodule_load"):
            kind, msg = rec[key]
            assert kind == "RuntimeError", msg
            assert "MegatronFSDP wrapper" in msg, msg


# --- DCP ------------------------------------------------------------------------------------------------------------

SAVE_AT, TOTAL = 3, 5
FROZEN = ("pos.weight", "layers.0.attn.proj.bias")  # a root parameter and a unit parameter: the frozen regions too


def _frozen_gpt(seed: int):
    gpt, cfg = build_gpt(seed=seed)
    for name in FROZEN:
        gpt.get_parameter(name).requires_grad_(False)
    return gpt, cfg


def _restore(model: MegatronFSDP, optimizer: torch.optim.Optimizer, directory: str) -> None:
    msd, osd = model.sharded_state_dict(), model.optimizer_state_dict(optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
    model.load_sharded_state_dict(msd)
    model.load_optimizer_state_dict(optimizer, osd)


def _dcp_save_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    gpt, cfg = _frozen_gpt(0)
    model = shard(gpt, sharding_strategy="optim_grads_params")
    opt = adam(model.optimizer_parameters())
    initial = model.state_dict()
    for step in range(SAVE_AT):
        fsdp_step(model, opt, step, cfg, rank, world)
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=directory)
    saved = dict(params=model.state_dict(), optim=full_optimizer_state(model, opt), initial=initial)
    uninterrupted = [fsdp_step(model, opt, step, cfg, rank, world) for step in range(SAVE_AT, TOTAL)]
    final = model.state_dict()
    # Resume at the same world size: a fresh model with other initial values and a fresh optimizer.
    fresh = shard(_frozen_gpt(1)[0], sharding_strategy="optim_grads_params")
    fresh_opt = adam(fresh.optimizer_parameters())
    _restore(fresh, fresh_opt, directory)
    loaded = dict(params=fresh.state_dict(), optim=full_optimizer_state(fresh, fresh_opt))
    resumed = [fsdp_step(fresh, fresh_opt, step, cfg, rank, world) for step in range(SAVE_AT, TOTAL)]
    return dict(saved=saved, loaded=loaded, uninterrupted=uninterrupted, resumed=resumed, final=final,
                resumed_final=fresh.state_dict())


def _dcp_load_job(rank: int, world: int, directory: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    fresh = shard(_frozen_gpt(1)[0], **kwargs)
    opt = adam(fresh.optimizer_parameters())
    _restore(fresh, opt, directory)
    return dict(params=fresh.state_dict(), optim=full_optimizer_state(fresh, opt))


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dcp"))
    return directory, run_gloo(_dcp_save_job, 2, directory)


def _assert_same(actual: Dict[str, Any], expected: Dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        if isinstance(expected[k], dict):
            _assert_same(actual[k], expected[k])
        else:
            assert torch.equal(actual[k], expected[k]), k


@pytest.mark.gloo
def test_dcp_resume_same_world_size_matches_uninterrupted(dcp_checkpoint):
    _, ranks = dcp_checkpoint
    for run in ranks:
        saved, loaded = run["saved"], run["loaded"]
        assert any(not torch.equal(saved["params"][k], saved["initial"][k]) for k in saved["params"])  # it trained
        for name in FROZEN:
            assert torch.equal(saved["params"][name], saved["initial"][name])
            assert name not in saved["optim"]
        _assert_same(loaded["params"], saved["params"])
        _assert_same(loaded["optim"], saved["optim"])
        assert run["resumed"] == run["uninterrupted"]  # bit for bit
        _assert_same(run["resumed_final"], run["final"])


@pytest.mark.gloo
@pytest.mark.parametrize("world, kwargs", [
    (1, dict(sharding_strategy="optim_grads_params")),
    (4, dict(sharding_strategy="optim_grads", fsdp_double_buffer=True)),
])
def test_dcp_loads_at_another_world_size(dcp_checkpoint, world, kwargs):
    directory, saved_ranks = dcp_checkpoint
    saved = saved_ranks[0]["saved"]
    assert "exp_avg" in saved["optim"]["head.weight"] and saved["optim"]["head.weight"]["step"].item() == SAVE_AT
    for rank_result in run_gloo(_dcp_load_job, world, directory, kwargs):
        _assert_same(rank_result["params"], saved["params"])
        _assert_same(rank_result["optim"], saved["optim"])


@pytest.mark.gloo
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # a plain load, in this process
def test_dcp_loads_into_the_plain_model(dcp_checkpoint):
    """The checkpoint's metadata alone (no megatron_fsdp code on the load side) rebuilds full tensors."""
    directory, saved_ranks = dcp_checkpoint
    saved = saved_ranks[0]["saved"]
    plain, _ = _frozen_gpt(1)
    model_sd = plain.state_dict()
    optim_sd = {"state": {n: {k: torch.zeros_like(v) for k, v in state.items()} for n, state in saved["optim"].items()}}
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    _assert_same(model_sd, saved["params"])
    _assert_same(plain.state_dict(), saved["params"])  # loaded in place into the module
    _assert_same(optim_sd["state"], saved["optim"])


class _ScaledLayer(torch.nn.Module):
    """A layer with a 0-dim parameter (a learnable temperature): it lives on one rank, whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.temp = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.temp


class _ScaledModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaledLayer() for _ in range(2))
        self.scale = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def _scalar_dcp_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = shard(_ScaledModel(), fsdp_unit_modules=[_ScaledLayer])
    opt = adam(model.optimizer_parameters())
    for step in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=directory)
    torch.manual_seed(1)
    fresh = shard(_ScaledModel(), fsdp_unit_modules=[_ScaledLayer])
    fresh_opt = adam(fresh.optimizer_parameters())
    _restore(fresh, fresh_opt, directory)
    return dict(saved=model.state_dict(), loaded=fresh.state_dict(), saved_optim=full_optimizer_state(model, opt),
                loaded_optim=full_optimizer_state(fresh, fresh_opt))


@pytest.mark.gloo
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_zero_dim_parameters(tmp_path):
    for run in run_gloo(_scalar_dcp_job, 2, str(tmp_path)):
        assert {k for k, v in run["saved"].items() if v.dim() == 0} == {"layers.0.temp", "layers.1.temp", "scale"}
        _assert_same(run["loaded"], run["saved"])
        _assert_same(run["loaded_optim"], run["saved_optim"])
    plain = _ScaledModel()
    target = plain.state_dict()
    dcp.load({"model": target}, checkpoint_id=str(tmp_path))
    _assert_same(target, run["saved"])


def _dcp_resave_job(rank: int, world: int, source: str, target: str) -> Dict[str, Any]:
    """Load the checkpoint at this world size and save it again from here."""
    fresh = shard(_frozen_gpt(1)[0], sharding_strategy="optim_grads_params")
    opt = adam(fresh.optimizer_parameters())
    _restore(fresh, opt, source)
    dcp.save({"model": fresh.sharded_state_dict(), "optim": fresh.optimizer_state_dict(opt)}, checkpoint_id=target)
    return {}


def _dcp_resume_job(rank: int, world: int, directory: str) -> Dict[str, Any]:
    fresh = shard(_frozen_gpt(1)[0], sharding_strategy="optim_grads_params")
    opt = adam(fresh.optimizer_parameters())
    _restore(fresh, opt, directory)
    cfg = _frozen_gpt(1)[1]
    resumed = [fsdp_step(fresh, opt, step, cfg, rank, world) for step in range(SAVE_AT, TOTAL)]
    return dict(resumed=resumed, final=fresh.state_dict())


@pytest.mark.gloo
@pytest.mark.parametrize("middle", [1, 4])
def test_dcp_through_another_world_size_resumes_bit_exact(dcp_checkpoint, tmp_path, middle):
    """Saved at 2 ranks, loaded and saved again at 1 or 4, loaded back at 2: training continues bit for bit."""
    directory, saved_ranks = dcp_checkpoint
    resaved = str(tmp_path / f"via{middle}")
    run_gloo(_dcp_resave_job, middle, directory, resaved)
    for saved, run in zip(saved_ranks, run_gloo(_dcp_resume_job, 2, resaved)):
        assert run["resumed"] == saved["uninterrupted"]  # bit for bit
        _assert_same(run["final"], saved["final"])
