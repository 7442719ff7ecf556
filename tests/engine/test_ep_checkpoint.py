"""Checkpoints of stacked local experts under megatron_fsdp's expert parallelism, on Gloo.

The reference GPT (``fsdp_cudagraph/apps/model.py``, 2 layers, every layer a dropless MoE of 4 ``split`` experts,
top-2) holds ``experts.w1 [E/EP, h, f]`` and ``experts.w2 [E/EP, f, h]``: one name on every EP rank, different
experts, declared with ``stacked_expert_dims = {"w1": 0, "w2": 0}`` ([Note: expert parallelism] in
megatron_fsdp/_expert.py, Checkpoints). Two spawned jobs (module fixtures): 4 ranks, then 2 ranks. What must hold:

- layout: ``state_dict()`` at EP=2 (4 ranks) has the EP=1 GPT's keys and shapes, and at initialisation (the EP=k
  model's experts are the EP=1 model's slices) its values, ``torch.equal``;
- the DTensors of ``sharded_state_dict()`` and ``optimizer_state_dict()``: the local shards of the 4 ranks tile the
  global tensor exactly once (offsets as DCP computes them) and equal its slices, parameters and ``exp_avg``;
- DCP: a checkpoint saved at 4 ranks EP=2 after training loads at 4 ranks EP=2 (a model of another seed), at 4 ranks
  EP=4, at 4 ranks EP=2 with strided EP groups (EP rank 1 on global rank 2: experts follow the EP rank, not the
  global rank), at 2 ranks EP=2 and at 2 ranks EP=1: parameters and optimizer state (global values gathered with
  the engine's full-state-dict path) ``torch.equal`` to the saved ones; and a 2-rank EP=1 checkpoint loads at 2
  ranks EP=2;
- resume: STEPS steps, save, MORE steps (uninterrupted) against a fresh model loaded from that checkpoint for MORE
  steps: losses and final parameters ``torch.equal``, at 4 ranks EP=2 and at 2 ranks EP=2;
- full state dicts: the EP=1 model's loads into the EP=2 model and the EP=2 model's into the EP=1 model, each then
  giving back the same dict (``torch.equal``); ``load_sharded_state_dict`` takes the global plain tensors too;
- a module whose stacked dims are neither 0 nor even (``w_a [E/EP, 3, 5]`` dim 0, ``w_b [4, E/EP, 3]`` dim 1, E=6:
  3 local experts over 2 EDP ranks) tiles exactly too and loads EP=2 <-> EP=1 through DCP;
- negative controls: a checkpoint written with the EP coordinates swapped loads into a correct model with the
  experts of the two EP ranks exchanged (dense parameters unchanged) and its continued losses differ from the
  uninterrupted run's; a per-EP-rank state dict (``[E/EP, ...]``) is refused by ``load_state_dict`` with the
  global shape; the GPT without the declaration has its state dicts refused, the message naming
  ``stacked_expert_dims``; declarations naming no parameter, an out-of-range dim, a non-expert parameter, or
  differing between ranks are refused at ``fully_shard``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from fsdp_cudagraph.apps.model import GPT, GPTConfig
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

STEPS, MORE = 2, 2
ROWS = 2  # sequences per rank per step
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16, moe_every=1, num_experts=4,
             moe_top_k=2, ffn_hidden_size=48)
STACKED = [f"layers.{i}.moe.experts.{w}" for i in range(2) for w in ("w1", "w2")]


def _cfg(ep: int) -> GPTConfig:
    return GPTConfig(moe_experts="split", expert_parallel_size=ep, **MODEL)


def _groups(ep: int, strided: bool = False) -> Any:
    """``(ep_group, edp_group)``: the engine's layout, or EP groups strided by 2 (4 ranks, EP=2: {0,2}, {1,3})."""
    import torch.distributed as dist

    import megatron_fsdp

    if not strided:
        return megatron_fsdp.expert_parallel_groups(ep)
    out: List[Any] = [None, None]
    for i, layout in enumerate(([[0, 2], [1, 3]], [[0, 1], [2, 3]])):
        for members in layout:  # every rank creates every group
            g = dist.new_group(members)
            if dist.get_rank() in members:
                out[i] = g
    return tuple(out)


def _gpt(ep: int, *, seed: int = 0, strided: bool = False, strategy: str = "optim_grads_params",
         marked: bool = True) -> Tuple[Any, torch.optim.Optimizer]:
    from megatron_fsdp import fully_shard

    from fsdp_cudagraph.apps.model import Experts, TransformerBlock

    how: Dict[str, Any] = {}
    group = None
    if ep > 1:
        group, edp = _groups(ep, strided)
        how = dict(expert_parallel_group=group, expert_data_parallel_group=edp)
    torch.manual_seed(seed)
    model = GPT(_cfg(ep), expert_parallel_group=group)
    if not marked:
        for m in model.modules():
            if isinstance(m, Experts):
                del m.stacked_expert_dims
    db = strategy == "optim_grads_params"  # with the fixed addresses CUDA graphs need
    sharded = fully_shard(model, fsdp_unit_modules=[TransformerBlock], sharding_strategy=strategy,
                          fsdp_double_buffer=db, fsdp_db_use_persist_buf_on_alloc_fail=db, **how)
    return sharded, torch.optim.Adam(sharded.optimizer_parameters(), lr=1e-3, eps=1e-3)


def _steps(rank: int, world: int, model: Any, opt: torch.optim.Optimizer, steps: range) -> List[float]:
    import torch.distributed as dist

    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    losses = []
    for step in steps:
        x, y = synthetic_batch(step, ROWS * world, _cfg(1), torch.device("cpu"))
        sl = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = loss_fn(model(x[sl]), y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _global(model: Any, opt: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Parameters (``state_dict()``) and optimizer state as global tensors, through the full-state-dict path (the
    regions gathered over each bucket's group, stacked experts over the EP group): not through DTensors."""
    from megatron_fsdp._state_dict import gather_region

    topo = model.expert_topology
    optim: Dict[str, Dict[str, torch.Tensor]] = {}
    for u in model.all_units() if opt is not None else []:
        for k, v in opt.state[u.main_shard].items():
            if v.dim() == 0:
                views = [v] * len(u.layout.names)
            else:
                views = u.layout.views(gather_region(model, u.layout, v, u))
                if u.is_expert and topo is not None:
                    views = topo.gather_stacked(u.layout.names, views)
            for n, t in zip(u.layout.names, views):
                optim.setdefault(n, {})[k] = t.clone()
    return {"params": model.state_dict(), "optim": optim}


def _tiles(model: Any, opt: Optional[torch.optim.Optimizer], names: List[str]) -> Dict[str, Any]:
    """Each stacked DTensor's (global offset, local shard), as DCP sees them: parameters and ``exp_avg``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sd = model.sharded_state_dict()
    osd = model.optimizer_state_dict(opt) if opt is not None else {"state": {}}
    out = {}
    for n in names:
        for what, dt in (("param", sd[n]), ("exp_avg", osd["state"].get(n, {}).get("exp_avg"))):
            if dt is None:
                continue
            shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
            assert tuple(shape) == tuple(dt.to_local().shape), (n, shape, dt.to_local().shape)
            out[f"{n}/{what}"] = (tuple(offset), dt.to_local().clone(), [repr(p) for p in dt.placements])
    return out


def _save(model: Any, opt: torch.optim.Optimizer, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.sharded_state_dict(), "optim": model.optimizer_state_dict(opt)}, checkpoint_id=ckpt)


def _load(model: Any, opt: torch.optim.Optimizer, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    sd, osd = model.sharded_state_dict(), model.optimizer_state_dict(opt)
    dcp.load({"model": sd, "optim": osd}, checkpoint_id=ckpt)
    model.load_sharded_state_dict(sd)
    model.load_optimizer_state_dict(opt, osd)


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


# ------------------------------------------------------------------ a module stacked along dims 0 and 1


class _OddExperts(nn.Module):
    """Six experts: ``w_a [E/EP, 3, 5]`` stacked along dim 0, ``w_b [4, E/EP, 3]`` along dim 1 (the EP=1 values
    sliced, as the GPT's experts are)."""

    is_expert = True

    def __init__(self, ep_size: int, ep_rank: int, decl: Optional[Dict[str, int]] = None) -> None:
        super().__init__()
        n = 6 // ep_size
        local = slice(ep_rank * n, (ep_rank + 1) * n)
        self.w_a = nn.Parameter(torch.randn(6, 3, 5)[local].clone())
        self.w_b = nn.Parameter(torch.randn(4, 6, 3)[:, local].clone())
        self.stacked_expert_dims = {"w_a": 0, "w_b": 1} if decl is None else decl


class _OddLayer(nn.Module):
    def __init__(self, ep_size: int, ep_rank: int, decl: Optional[Dict[str, int]] = None) -> None:
        super().__init__()
        self.dense = nn.Linear(3, 3)
        self.moe = _OddExperts(ep_size, ep_rank, decl)


def _odd(ep: int, seed: int = 0, decl: Optional[Dict[str, int]] = None, **kw: Any) -> Any:
    import torch.distributed as dist

    from megatron_fsdp import fully_shard

    how: Dict[str, Any] = {}
    q = 0
    if ep > 1:
        group, edp = _groups(ep)
        how = dict(expert_parallel_group=group, expert_data_parallel_group=edp)
        q = dist.get_rank(group)
    torch.manual_seed(seed)
    model = nn.Sequential(*[_OddLayer(ep, q, decl) for _ in range(2)])
    return fully_shard(model, fsdp_unit_modules=[_OddLayer], **how, **kw)


ODD = [f"{i}.moe.{w}" for i in range(2) for w in ("w_a", "w_b")]


def _odd_checks(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from megatron_fsdp import fully_shard

    res: Dict[str, Any] = {"ep1_initial": _odd(1).state_dict()}
    model = _odd(2)
    res["ep2_initial"] = model.state_dict()
    res["tiles"] = _tiles(model, None, ODD)
    with torch.no_grad():  # other values than any model built from a seed
        model.load_state_dict({k: v + 1 for k, v in res["ep2_initial"].items()})
    res["saved"] = model.state_dict()
    dcp.save({"model": model.sharded_state_dict()}, checkpoint_id=ckpt + "/ep2")
    for name, ep in (("ep1", 1), ("ep2", 2)):  # EP=2 -> EP=1 and EP=2 -> EP=2 (another seed)
        other = _odd(ep, seed=3)
        sd = other.sharded_state_dict()
        dcp.load({"model": sd}, checkpoint_id=ckpt + "/ep2")
        other.load_sharded_state_dict(sd)
        res[f"{name}_loaded"] = other.state_dict()
    # EP=1 -> EP=2
    ep1 = _odd(1, seed=4)
    res["ep1_saved"] = ep1.state_dict()
    dcp.save({"model": ep1.sharded_state_dict()}, checkpoint_id=ckpt + "/ep1")
    other = _odd(2, seed=3)
    sd = other.sharded_state_dict()
    dcp.load({"model": sd}, checkpoint_id=ckpt + "/ep1")
    other.load_sharded_state_dict(sd)
    res["ep1_to_ep2"] = other.state_dict()
    # misuse of the declaration, refused at fully_shard on every rank
    res["typo"] = _outcome(lambda: _odd(2, decl={"w_c": 0}))
    res["bad_dim"] = _outcome(lambda: _odd(2, decl={"w_a": 3}))
    res["ranks_differ"] = _outcome(lambda: _odd(2, decl={"w_a": 0, "w_b": 1} if rank != 1 else {"w_a": 0, "w_b": -2}))
    res["ranks_differ_dims"] = _outcome(lambda: _odd(2, decl={"w_a": 0} if rank != 3 else {"w_a": 0, "w_b": 1}))
    not_expert = nn.Sequential(_OddLayer(1, 0), _OddLayer(1, 0))
    not_expert[0].dense.stacked_expert_dims = {"weight": 0}
    res["not_expert"] = _outcome(lambda: fully_shard(not_expert, fsdp_unit_modules=[_OddLayer],
                                                      expert_parallel_size=2))
    return res


# ------------------------------------------------------------------ the jobs


def _four(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from fsdp_cudagraph.apps.model import slice_expert_state_dict

    res: Dict[str, Any] = {}
    model, opt = _gpt(2)
    res["initial"] = model.state_dict()
    res["losses"] = _steps(rank, world, model, opt, range(STEPS))
    _save(model, opt, ckpt + "/a")
    res["saved"] = _global(model, opt)
    res["tiles"] = _tiles(model, opt, STACKED)
    res["uninterrupted"] = _steps(rank, world, model, opt, range(STEPS, STEPS + MORE))
    res["uninterrupted_params"] = model.state_dict()

    model, opt = _gpt(2, seed=7)  # other values: the load must replace them
    _load(model, opt, ckpt + "/a")
    res["ep2_loaded"] = _global(model, opt)
    res["resumed"] = _steps(rank, world, model, opt, range(STEPS, STEPS + MORE))
    res["resumed_params"] = model.state_dict()

    for name, kw in (("ep4", dict(ep=4, strategy="optim")), ("strided", dict(ep=2, strided=True))):
        model, opt = _gpt(seed=7, **kw)
        _load(model, opt, ckpt + "/a")
        res[f"{name}_loaded"] = _global(model, opt)

    # Negative controls. A checkpoint written with the EP coordinates of the mesh swapped (EP rank q's experts
    # saved where EP rank 1-q's belong), loaded into a correct model, then trained on.
    model, opt = _gpt(2, seed=7)
    _load(model, opt, ckpt + "/a")
    topo = model.expert_topology
    topo.grid = topo.grid[::-1]
    model.__dict__.pop("_dcp_meshes", None)
    _save(model, opt, ckpt + "/swapped")
    model, opt = _gpt(2, seed=7)
    _load(model, opt, ckpt + "/swapped")
    res["swapped_loaded"] = model.state_dict()
    res["swapped_continued"] = _steps(rank, world, model, opt, range(STEPS, STEPS + MORE))
    # an EP rank's own slice of the state dict instead of the global one
    q = dist.get_rank(model.expert_parallel_group)
    local = slice_expert_state_dict(res["saved"]["params"], expert_parallel_size=2, ep_rank=q)
    res["local_state_dict"] = _outcome(lambda: model.load_state_dict(local))
    # the GPT without the declaration
    unmarked, _ = _gpt(2, marked=False)
    res["unmarked_state_dict"] = _outcome(unmarked.state_dict)
    res["unmarked_sharded_state_dict"] = _outcome(unmarked.sharded_state_dict)

    res["odd"] = _odd_checks(rank, world, ckpt + "/odd")
    return res


def _two(rank: int, world: int, ckpt: str) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    for name, ep, strategy in (("ep2", 2, "optim_grads_params"), ("ep1", 1, "optim")):
        model, opt = _gpt(ep, seed=7, strategy=strategy)
        _load(model, opt, ckpt + "/a")
        res[f"{name}_loaded"] = _global(model, opt)
    # full state dicts across EP: the EP=2 model (as loaded) into EP=1 and back
    ep1, _ = _gpt(1, seed=5)
    ep1.load_state_dict(res["ep2_loaded"]["params"])
    res["ep2_into_ep1"] = ep1.state_dict()
    fresh1, _ = _gpt(1, seed=6)
    ep2, _ = _gpt(2, seed=5)
    ep2.load_state_dict(fresh1.state_dict())
    res["ep1_sd"], res["ep1_into_ep2"] = fresh1.state_dict(), ep2.state_dict()
    ep2.load_sharded_state_dict(dict(res["ep2_loaded"]["params"]))  # plain global tensors are accepted too
    res["plain_into_sharded"] = ep2.state_dict()
    # resume at 2 ranks EP=2
    model, opt = _gpt(2)
    _steps(rank, world, model, opt, range(STEPS))
    _save(model, opt, ckpt + "/b")
    res["uninterrupted"] = _steps(rank, world, model, opt, range(STEPS, STEPS + MORE))
    res["uninterrupted_params"] = model.state_dict()
    model, opt = _gpt(2, seed=7)
    _load(model, opt, ckpt + "/b")
    res["resumed"] = _steps(rank, world, model, opt, range(STEPS, STEPS + MORE))
    res["resumed_params"] = model.state_dict()
    # DCP from EP=1 (2 ranks, trained) into EP=2
    model, opt = _gpt(1)
    _steps(rank, world, model, opt, range(STEPS))
    _save(model, opt, ckpt + "/c")
    res["ep1_saved"] = _global(model, opt)
    model, opt = _gpt(2, seed=7)
    _load(model, opt, ckpt + "/c")
    res["ep1_to_ep2"] = _global(model, opt)
    return res


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep_stacked_ckpt"))


@pytest.fixture(scope="module")
def four(ckpt_dir):
    return run_gloo(_four, 4, ckpt_dir)


@pytest.fixture(scope="module")
def two(ckpt_dir, four):
    return run_gloo(_two, 2, ckpt_dir)


# ------------------------------------------------------------------ checks


def _equal_dicts(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _equal_global(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    assert _equal_dicts(got["params"], want["params"])
    assert got["optim"].keys() == want["optim"].keys()
    for n, st in want["optim"].items():
        assert got["optim"][n].keys() == st.keys(), n
        for k, v in st.items():
            assert torch.equal(got["optim"][n][k], v), (n, k)


def _saved(four: List[Dict[str, Any]]) -> Dict[str, Any]:
    for r in four[1:]:  # every rank holds the same global values
        _equal_global(r["saved"], four[0]["saved"])
    return four[0]["saved"]


def test_state_dict_has_the_ep1_layout_and_values(four):
    torch.manual_seed(0)
    ep1 = GPT(_cfg(1)).state_dict()
    assert ep1["layers.0.moe.experts.w1"].shape == (4, 32, 48)
    for r in four:
        assert _equal_dicts(r["initial"], ep1)
    saved = _saved(four)["params"]
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in ep1.items()}


def _check_tiles(per_rank: List[Dict[str, Any]], want: Dict[str, torch.Tensor], key: Callable[[str], str]) -> None:
    for name in per_rank[0]:
        full = want[key(name)]
        cover = torch.zeros(full.shape, dtype=torch.int64)
        built = torch.zeros_like(full)
        for r in per_rank:
            offset, local, placements = r[name]
            index = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
            cover[index] += 1
            built[index] = local
        assert bool((cover == 1).all()), (name, cover.flatten().tolist())
        assert torch.equal(built, full), name


def test_sharded_state_dict_tiles_the_global_tensors(four):
    saved = _saved(four)
    tiles = [r["tiles"] for r in four]
    assert tiles[0]["layers.0.moe.experts.w1/param"][2] == ["Shard(dim=0)", "Shard(dim=0)"]
    params = {f"{n}/param": saved["params"][n] for n in STACKED}
    params.update({f"{n}/exp_avg": saved["optim"][n]["exp_avg"] for n in STACKED})
    _check_tiles(tiles, params, lambda k: k)
    # EP rank q holds experts 2q, 2q+1; EDP rank j row j of those: rank 2j+q -> expert 2q+j
    for rank, r in enumerate(four):
        assert r["tiles"]["layers.1.moe.experts.w2/param"][0] == (2 * (rank % 2) + rank // 2, 0, 0)


@pytest.mark.parametrize("where", ["ep2", "ep4", "strided"])
def test_checkpoint_loads_at_four_ranks(four, where):
    saved = _saved(four)
    for r in four:
        _equal_global(r[f"{where}_loaded"], saved)


@pytest.mark.parametrize("where", ["ep2", "ep1"])
def test_checkpoint_loads_at_two_ranks(four, two, where):
    saved = _saved(four)
    for r in two:
        _equal_global(r[f"{where}_loaded"], saved)


def test_ep1_checkpoint_loads_at_ep2(two):
    for r in two:
        _equal_global(r["ep1_to_ep2"], two[0]["ep1_saved"])


def test_full_state_dicts_load_across_expert_parallel_sizes(two):
    for r in two:
        assert _equal_dicts(r["ep2_into_ep1"], two[0]["ep2_loaded"]["params"])
        assert _equal_dicts(r["ep1_into_ep2"], r["ep1_sd"])
        assert _equal_dicts(r["plain_into_sharded"], two[0]["ep2_loaded"]["params"])
        assert r["ep1_into_ep2"]["layers.1.moe.experts.w2"].shape == (4, 48, 32)


@pytest.mark.parametrize("world", [4, 2])
def test_resume_continues_bit_for_bit(four, two, world):
    for r in four if world == 4 else two:
        assert r["resumed"] == r["uninterrupted"]
        assert _equal_dicts(r["resumed_params"], r["uninterrupted_params"])
    assert (four if world == 4 else two)[0]["uninterrupted"] != four[0]["losses"][:MORE]  # the run moved on


def test_odd_stacked_dims_tile_and_load(four):
    odd = [r["odd"] for r in four]
    for o in odd:
        assert _equal_dicts(o["ep2_initial"], o["ep1_initial"])  # the EP=1 layout, dims 0 and 1 alike
        assert _equal_dicts(o["ep1_loaded"], odd[0]["saved"])
        assert _equal_dicts(o["ep2_loaded"], odd[0]["saved"])
        assert _equal_dicts(o["ep1_to_ep2"], odd[0]["ep1_saved"])
    assert odd[0]["ep1_initial"]["0.moe.w_b"].shape == (4, 6, 3)
    tiles = [o["tiles"] for o in odd]
    assert tiles[0]["0.moe.w_b/param"][2] == ["Shard(dim=1)", "Shard(dim=0)"]
    _check_tiles(tiles, odd[0]["ep2_initial"], lambda k: k.rsplit("/", 1)[0])
    # 3 local experts over 2 EDP ranks: 2 and 1 rows
    assert [t["0.moe.w_a/param"][1].shape[0] for t in tiles] == [2, 2, 1, 1]


def test_swapped_ep_coordinates_load_other_experts(four):
    """Negative control: the checks above see an EP mapping error."""
    saved = _saved(four)["params"]
    for r in four:
        got = r["swapped_loaded"]
        for k, v in saved.items():
            if k in STACKED:
                assert not torch.equal(got[k], v), k
                assert torch.equal(got[k], v.roll(2, 0)), k  # experts 2, 3 where 0, 1 belong and back
            else:
                assert torch.equal(got[k], v), k
        assert r["swapped_continued"] != r["uninterrupted"]


def _expect(per_rank: List[Dict[str, Any]], case: str, kind: str, *fragments: str) -> None:
    for rank, r in enumerate(per_rank):
        msg = r[case]
        assert msg.startswith(kind + ":"), f"rank {rank}: {msg}"
        for f in fragments:
            assert f in msg, f"rank {rank}: {f!r} not in {msg}"


def test_local_slices_refused(four):
    _expect(four, "local_state_dict", "ValueError", "layers.0.moe.experts.w1 is (2, 32, 48)", "(4, 32, 48)",
            "stacked_expert_dims", "global tensor")


def test_undeclared_stacked_experts_refused(four):
    for case, what in (("unmarked_state_dict", "state_dict()"),
                       ("unmarked_sharded_state_dict", "sharded_state_dict()")):
        _expect(four, case, "NotImplementedError", what, "same parameter names", "layers.0.moe.experts.w1",
                "stacked_expert_dims = {'w1': 0}", "global index", "training is not affected")


def test_declaration_misuse_refused(four):
    odd = [r["odd"] for r in four]
    _expect(odd, "typo", "ValueError", "stacked_expert_dims['w_c']", "not one of its own parameters", "['w_a', 'w_b']")
    _expect(odd, "bad_dim", "ValueError", "stacked_expert_dims['w_a'] = 3", "(3, 3, 5)", "0 .. 2")
    _expect(odd, "ranks_differ_dims", "ValueError", "stacked expert parameters", "rank 3", "rank 0",
            "same experts module")
    _expect(odd, "not_expert", "ValueError", "0.dense.weight", "not expert parameters", "is_expert = True")
    for o in odd:  # -2 is dim 1 of w_b: the same declaration
        assert o["ranks_differ"] == "ok", o["ranks_differ"]
