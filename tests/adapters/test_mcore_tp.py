"""megatron-core's GPTModel with tensor parallelism (``tensor_model_parallel_size`` > 1, sequence parallelism) under
our engine, on Gloo.

The model is ``fsdp_cudagraph.apps.mcore_gpt``'s dense GPT (local spec: ``ColumnParallelLinear`` /
``RowParallelLinear``, a vocabulary-parallel embedding and output layer; the norms
``SequenceParallelLayerNorm``, [Note: megatron-core's local norm under sequence parallelism]), built after
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)``. The engine
(``megatron_fsdp.fully_shard``, ZeRO-3, double buffer) gets megatron-core's own groups (``ModelSpec.tensor_groups``:
``get_tensor_model_parallel_group()``, ``get_data_parallel_group()``); every TP rank of a data-parallel group
trains the same micro-batch. One spawned job (a module fixture): 2 ranks as 1 (dp) x 2 (tp); 4 ranks as 2 x 2 run
the same job in tests/adapters/test_mcore_tp_2x2.py (its own file: four spawned ranks take about 40 s on two
shared cores). What must hold:

- megatron-core's layout is the engine's ([Note: tensor parallelism] in megatron_fsdp/_tensor.py): TP groups
  contiguous, DP groups strided, and the engine holds exactly those; megatron-core tags the TP shards
  (``tensor_model_parallel``, the embedding's vocabulary split included) and the norms ``sequence_parallel``;
- each TP rank's weights are the TP=1 model's (same seed) cut along megatron-core's ``partition_dim``
  (``torch.equal``): megatron-core's CPU initialisation draws the full weight and keeps its rank's part;
- graphed (scopes ``attn_mlp``, and ``layer`` on 1 x 2; protocol backend, the TP all-gathers and
  reduce-scatters inside the captured callables) against eager: every loss and final parameter ``torch.equal``
  on every rank, every call after capture replayed;
- negative control (1 x 2): the last MLP's graph scaled by 1.01 is named as the culprit;
- against TP=1 (the same global weights, sliced along ``partition_dim``; the same global batch, [Note: mcore TP
  tolerance]): the mean loss over the global batch of every step and every rank's final parameters (its slice
  of the TP=1 parameters) within ``RTOL``; with the norms' ``sequence_parallel`` tags removed (so the engine no
  longer sums their gradients over TP) they are not (1 x 2);
- misuse refused with the value, the rule and the fix: TP on an MoE model, TP with EP, TP not dividing the
  heads or the world size, engine fsdp2 and engine nvidia with wrapper fully_shard with TP (the app, the checker
  and NVIDIA's builder), and NVIDIA's builder with wrapper mcore given groups that are not parallel_state's or a
  model without sequence parallelism. Engine nvidia with wrapper mcore is let through by the app and stops only
  at the engine's need for CUDA: NVIDIA's engine cannot be built on the CPU (CUDA streams, a "cuda" device mesh),
  so its TP runs, graphed against eager and against our engine, are rows of tests/gpu/scripts/mcore_gpt.py.

[Note: mcore TP tolerance]
fp32, deterministic. The global batch is the same: at TP=2 the data-parallel rank ``j`` takes rows ``2j, 2j+1``
(micro-batch 2), at TP=1 over the same ranks rank ``r`` takes row ``r`` (micro-batch 1), so the mean of the
ranks' losses is the same number and so is the gradient of it. What differs is where sums run: a
row-parallel GEMM sums partial products over TP (its reduce-scatter), the column-parallel weight gradients see
every position after the all-gather, the norms' gradients are summed over TP by the engine, and the vocabulary-
parallel cross entropy takes its max and sum over TP. That regroups fp32 additions: a few ulp. Adam's first update
``lr * g / (|g| + eps)`` would amplify an ulp where a gradient element nearly cancels, so these runs use
``eps = 1e-3`` as tests/adapters/test_mcore_ep.py does and for the same reason. Measured (4 steps, torch 2.13
CPU, megatron-core 0.16.1): 1 x 2 mean losses within 9.8e-8 relative and parameters within 4.0e-7 (the largest
difference over the tensor's largest magnitude); 2 x 2 losses 9.8e-8, parameters 3.5e-7. ``RTOL = 4e-6``
leaves a margin of about 10x; the negative control (the norms' ``sequence_parallel`` tags removed, so their
gradients stay partial and differ between the TP ranks) moves the parameters by 1.0 relative (a norm's bias,
near zero), and must exceed ``1000 * RTOL``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from fsdp_cudagraph.apps import mcore_gpt
from tests.dist_utils import outcome, run_gloo

pytestmark = pytest.mark.skipif(not mcore_gpt.HAS_MCORE, reason=mcore_gpt.MCORE_REASON)

CPU = torch.device("cpu")
TP = 2
STEPS = 5
CAPTURE_AT = 2
AGREE_STEPS = 4
RTOL = 4e-6
SEED = 1234
LAYERS = ["decoder.layers.0", "decoder.layers.1"]
SCOPE_CALLABLES = {"attn_mlp": [f"{l}.{m}" for l in LAYERS for m in ("self_attention", "mlp")], "layer": LAYERS}


def _shape(tp: int = TP, **kw: Any) -> mcore_gpt.MCoreShape:
    return mcore_gpt.base_shape(CPU, "dense", tensor_parallel_size=tp, **kw)


def _check(scope: str, perturb: Optional[str] = None) -> Dict[str, Any]:
    report = mcore_gpt.run(model="dense", engine="megatron_fsdp", scope=scope, device=CPU, steps=STEPS,
                           capture_step=CAPTURE_AT, backend="protocol", perturb=perturb, shape=_shape())
    return {"equal": report.equal, "params_equal": report.params_equal, "steps": report.steps,
            "callables": report.callables, "calls": report.calls, "culprit": report.culprit,
            "precision": report.precision}


def _layout() -> Dict[str, Any]:
    """megatron-core's groups and tags, the engine's groups, and the TP=2 weights against the TP=1 weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp import fully_shard

    mcore_gpt.init_parallel_state(SEED, CPU, 1, 1)
    torch.manual_seed(SEED)
    full = {n: p.detach().clone() for n, p in mcore_gpt.build(_shape(1), CPU).named_parameters()}
    torch.manual_seed(SEED)
    spec = mcore_gpt.spec("dense", CPU, _shape())
    tp_rank = ps.get_tensor_model_parallel_rank()
    tags = {n: {"tp": bool(getattr(p, "tensor_model_parallel", False)), "dim": getattr(p, "partition_dim", None),
                "sp": bool(getattr(p, "sequence_parallel", False))} for n, p in spec.model.named_parameters()}
    slices_equal = {n: torch.equal(p.detach(), _slice(full[n], p, tp_rank)) for n, p in spec.model.named_parameters()}
    tp_group, dp_group = spec.tensor_groups
    sharded = fully_shard(spec.model, fsdp_unit_modules=[TransformerLayer], sharding_strategy="optim_grads_params",
                          fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                          process_group=dp_group, tensor_parallel_group=tp_group)
    ranks = dist.get_process_group_ranks
    return {"mcore_tp": ranks(ps.get_tensor_model_parallel_group()), "mcore_dp": ranks(ps.get_data_parallel_group()),
            "engine_tp": ranks(sharded.tensor_parallel_group), "engine_dp": ranks(sharded.group),
            "tags": tags, "slices_equal": slices_equal, "norm": type(spec.model.decoder.final_layernorm).__name__}


# ---------------------------------------------------------------------------------------------- against TP=1


def _slice(full: torch.Tensor, shard: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This TP rank's part of the TP=1 tensor ``full``, cut as megatron-core cuts it (contiguous chunks along the
    shard's ``partition_dim``); ``full`` itself for a parameter replicated over TP."""
    if not getattr(shard, "tensor_model_parallel", False):
        return full
    tp = full.shape[shard.partition_dim] // shard.shape[shard.partition_dim]
    return full.chunk(tp, dim=shard.partition_dim)[tp_rank]


def _train_plain(tp: int, start: Dict[str, torch.Tensor], *, untag_norms: bool = False
                 ) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, Optional[int]]]:
    """Train the model at ``tp`` from the TP=1 weights ``start`` (sliced for this TP rank) on the global batch of
    ``world`` rows per step; the mean loss over the global batch of each step, this rank's final parameters (its
    TP slice) and each parameter's ``partition_dim`` (None: replicated over TP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp import fully_shard

    world = dist.get_world_size()
    shape = _shape(tp, micro_batch_size=tp)  # world rows per step: tp rows on each of world / tp DP ranks
    mcore_gpt.init_parallel_state(SEED, CPU, 1, tp)
    torch.manual_seed(SEED)
    model = mcore_gpt.build(shape, CPU)
    tp_rank = ps.get_tensor_model_parallel_rank()
    dims = {n: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_slice(start[n], p, tp_rank))
            if untag_norms and getattr(p, "sequence_parallel", False):
                p.sequence_parallel = False
    groups = mcore_gpt.tensor_groups()
    kw = {} if groups is None else dict(tensor_parallel_group=groups[0], process_group=groups[1])
    sharded = fully_shard(model, fsdp_unit_modules=[TransformerLayer], sharding_strategy="optim_grads_params",
                          fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True, **kw)
    opt = torch.optim.Adam(sharded.optimizer_parameters(), lr=1e-3, eps=1e-3)  # [Note: mcore TP tolerance]
    losses = []
    for step in range(AGREE_STEPS):
        loss = mcore_gpt.loss(sharded, mcore_gpt.batch(step, shape, CPU, seed=SEED))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every TP rank holds its DP rank's loss: the world's mean is the global batch's
        losses.append(float(mean) / world)
    params = {k: v.detach().clone() for k, v in sharded.full_state_dict().items() if not k.endswith("_extra_state")}
    return losses, params, dims


def _agreement(*, control: bool) -> Dict[str, Any]:
    from megatron.core import parallel_state as ps

    mcore_gpt.init_parallel_state(SEED, CPU, 1, 1)
    torch.manual_seed(SEED)
    start = {n: p.detach().clone() for n, p in mcore_gpt.build(_shape(1), CPU).named_parameters()}
    ref_losses, ref, _ = _train_plain(1, start)
    out: Dict[str, Any] = {"ref_loss_spread": max(ref_losses) - min(ref_losses)}
    for name, untag in (("tp", False), ("untagged", True))[:2 if control else 1]:
        losses, params, dims = _train_plain(TP, start, untag_norms=untag)
        tp_rank = ps.get_tensor_model_parallel_rank()

        def part(n: str) -> torch.Tensor:
            return ref[n] if dims[n] is None else ref[n].chunk(TP, dim=dims[n])[tp_rank]

        out[name] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param": max(float((params[n] - part(n)).abs().max() / part(n).abs().max()) for n in params),
            "names": sorted(params)}
    out["ref_names"] = sorted(ref)
    return out


# ---------------------------------------------------------------------------------------------- misuse


def _misuse() -> Dict[str, str]:
    from fsdp_cudagraph.check import check_alignment
    from fsdp_cudagraph.engines.registry import registered_builders

    out: Dict[str, str] = {}

    def catch(key: str, fn: Any, *exc: type) -> None:
        out[key] = outcome(fn, *exc)

    for engine in ("fsdp2", "nvidia"):
        catch(f"app_{engine}", lambda: mcore_gpt.run(model="dense", engine=engine, scope="attn_mlp", device=CPU,
                                                     shape=_shape()), NotImplementedError)
    # the app lets nvidia wrapper mcore through: what stops it on the CPU is the engine's own need for CUDA
    catch("app_nvidia_mcore", lambda: mcore_gpt.run(model="dense", engine="nvidia", scope="attn_mlp", device=CPU,
                                                    shape=_shape(), nvidia_wrapper="mcore"), RuntimeError)
    catch("checker_fsdp2", lambda: check_alignment(lambda dev: mcore_gpt.spec("dense", dev, _shape()), steps=3,
                                                   capture_step=1, backend="protocol", device=CPU, engine="fsdp2",
                                                   cuda_graph_modules=["attn", "mlp"]), NotImplementedError)
    catch("world", lambda: mcore_gpt.init_parallel_state(SEED, CPU, 1, 4), ValueError)
    # NVIDIA's builder refuses before it builds NVIDIA's engine (so on the CPU too)
    nvidia = registered_builders()["nvidia"]
    spec = mcore_gpt.spec("dense", CPU, _shape())
    tp_group, dp_group = spec.tensor_groups
    common = dict(unit_modules=["TransformerLayer"], make_optimizer=lambda ps_: torch.optim.Adam(ps_), device=CPU,
                  sharding_strategy="optim_grads_params", compute_dtype=None)
    catch("nvidia_fully_shard", lambda: nvidia.build(spec.model, options={"wrapper": "fully_shard"},
                                                     tensor_groups=(tp_group, dp_group), **common),
          NotImplementedError)
    catch("nvidia_mcore_groups", lambda: nvidia.build(spec.model, options={"wrapper": "mcore"},
                                                      tensor_groups=(dp_group, tp_group), **common), ValueError)
    spec.model.config.sequence_parallel = False
    catch("nvidia_mcore_no_sp", lambda: nvidia.build(spec.model, options={"wrapper": "mcore"},
                                                     tensor_groups=(tp_group, dp_group), **common),
          NotImplementedError)
    return out


# ---------------------------------------------------------------------------------------------- the jobs


def job(rank: int, world: int) -> Dict[str, Any]:
    with mcore_gpt.cpu_shims():
        res: Dict[str, Any] = {"layout": _layout(), "attn_mlp": _check("attn_mlp"),
                               "agreement": _agreement(control=world == 2)}
        if world == 2:  # the same code paths; on 4 ranks they would add their time to the slowest fixture
            res.update(layer=_check("layer"), perturbed=_check("attn_mlp", perturb="decoder.layers.1.mlp"),
                       misuse=_misuse())
    return res


@pytest.fixture(scope="module")
def two() -> List[Dict[str, Any]]:
    return run_gloo(job, 2)


def check_layout(results: List[Dict[str, Any]]) -> None:
    world = len(results)
    for rank, r in enumerate(results):
        lay = r["layout"]
        first = rank // TP * TP
        assert lay["mcore_tp"] == lay["engine_tp"] == list(range(first, first + TP)), (rank, lay)  # contiguous
        assert lay["mcore_dp"] == lay["engine_dp"] == list(range(rank % TP, world, TP)), (rank, lay)  # strided


@pytest.mark.gloo
def test_megatron_core_groups_are_the_engines_layout(two: List[Dict[str, Any]]) -> None:
    check_layout(two)


@pytest.mark.gloo
def test_megatron_core_tags_and_slices(two: List[Dict[str, Any]]) -> None:
    """The engine reads megatron-core's tags: TP shards (``tensor_model_parallel``, the vocabulary-parallel
    embedding among them, split along the vocabulary) and the norms ``sequence_parallel``; each rank's weights
    are the TP=1 weights cut along ``partition_dim``."""
    for r in two:
        tags, lay = r["layout"]["tags"], r["layout"]
        assert tags["embedding.word_embeddings.weight"] == {"tp": True, "dim": 0, "sp": False}, tags
        assert tags["output_layer.weight"]["tp"] and tags["output_layer.weight"]["dim"] == 0, tags
        for l in LAYERS:
            assert tags[f"{l}.self_attention.linear_qkv.weight"]["dim"] == 0
            assert tags[f"{l}.self_attention.linear_proj.weight"]["dim"] == 1
            assert tags[f"{l}.mlp.linear_fc1.weight"]["dim"] == 0 and tags[f"{l}.mlp.linear_fc2.weight"]["dim"] == 1
        norms = [n for n in tags if "layernorm" in n]
        assert len(norms) == 2 * 2 * len(LAYERS) + 2, norms  # weight and bias of 2 norms per layer, and the final
        assert all(tags[n] == {"tp": False, "dim": None, "sp": True} for n in norms), {n: tags[n] for n in norms}
        assert set(tags) == {n for n in tags if tags[n]["tp"]} | set(norms), tags  # nothing else is replicated
        assert lay["norm"] == "LayerNorm"
        assert all(lay["slices_equal"].values()), lay["slices_equal"]


def check_equal(results: List[Dict[str, Any]], key: str) -> None:
    for rank, r in enumerate(results):
        rep = r[key]
        assert rep["callables"] == SCOPE_CALLABLES[key], (rank, rep["callables"])
        assert len(rep["steps"]) == STEPS and all(s["equal"] for s in rep["steps"]), (rank, rep["steps"])
        assert rep["equal"] and rep["params_equal"], (rank, rep)
        assert f"tensor parallel {TP}" in rep["precision"], rep["precision"]
        for name, c in rep["calls"].items():
            assert c["replays"] == STEPS - CAPTURE_AT and c["eager_calls"] == 0, (rank, name, c)
    # the TP ranks of a DP group trained the same micro-batch, the DP ranks different ones
    first = [r[key]["steps"][0]["eager_loss"] for r in results]
    for dp in range(len(results) // TP):
        assert len(set(first[dp * TP:(dp + 1) * TP])) == 1, first
    assert len(set(first)) == len(results) // TP, first


@pytest.mark.gloo
@pytest.mark.parametrize("scope", ["attn_mlp", "layer"])
def test_graphs_bit_exact_at_tp2(two: List[Dict[str, Any]], scope: str) -> None:
    check_equal(two, scope)


@pytest.mark.gloo
def test_perturbed_mlp_is_named(two: List[Dict[str, Any]]) -> None:
    for r in two:
        rep = r["perturbed"]
        assert not rep["equal"] and not rep["params_equal"]
        assert all(s["equal"] for s in rep["steps"][:CAPTURE_AT]) and not rep["steps"][CAPTURE_AT]["equal"]
        assert rep["culprit"] == "decoder.layers.1.mlp"


def check_agreement(results: List[Dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        a = r["agreement"]
        assert a["tp"]["names"] == a["ref_names"], (a["tp"]["names"], a["ref_names"])
        assert a["ref_loss_spread"] > 1000 * RTOL, a  # the losses change over the steps: the comparison can fail
        assert a["tp"]["loss"] <= RTOL and a["tp"]["param"] <= RTOL, (rank, a["tp"]["loss"], a["tp"]["param"])
        if "untagged" in a:  # the control runs on 1 x 2 (the same code path)
            assert a["untagged"]["param"] > 1000 * RTOL, (rank, a["untagged"])


@pytest.mark.gloo
def test_agrees_with_tp1(two: List[Dict[str, Any]]) -> None:
    """[Note: mcore TP tolerance]: the TP=2 run from the TP=1 weights stays within RTOL of TP=1 (losses of the
    global batch, every rank's slice); without the norms' TP sum it does not."""
    check_agreement(two)
    assert all("untagged" in r["agreement"] for r in two)


@pytest.mark.gloo
def test_misuse_refused(two: List[Dict[str, Any]]) -> None:
    m = two[0]["misuse"]
    for engine in ("fsdp2", "nvidia"):
        text = m[f"app_{engine}"]
        assert text.startswith("NotImplementedError") and "tensor_parallel_size=2" in text \
            and "--engine megatron_fsdp" in text and "--nvidia-wrapper mcore" in text, text
    assert "nvidia_wrapper='fully_shard'" in m["app_nvidia"], m["app_nvidia"]
    assert m["app_nvidia_mcore"].startswith("RuntimeError") and "needs a GPU" in m["app_nvidia_mcore"], \
        m["app_nvidia_mcore"]
    assert m["checker_fsdp2"].startswith("NotImplementedError") and "TP=2" in m["checker_fsdp2"] \
        and "engine='megatron_fsdp'" in m["checker_fsdp2"] and "wrapper='mcore'" in m["checker_fsdp2"], \
        m["checker_fsdp2"]
    assert m["world"].startswith("ValueError") and "does not divide the world size 2" in m["world"], m["world"]
    text = m["nvidia_fully_shard"]
    assert text.startswith("NotImplementedError") and "wrapper='fully_shard'" in text and "TP=2" in text \
        and "use engine_options wrapper='mcore'" in text, text
    text = m["nvidia_mcore_groups"]
    assert text.startswith("ValueError") and "are not megatron-core's parallel-state groups (TP [0, 1]" in text \
        and "get_tensor_model_parallel_group()" in text, text
    text = m["nvidia_mcore_no_sp"]
    assert text.startswith("NotImplementedError") and "sequence_parallel=False" in text \
        and "sequence_parallel=True" in text, text


@pytest.mark.parametrize("kw,words", [
    (dict(model="moe_alltoall", tensor_parallel_size=2), "on an MoE model"),
    (dict(model="moe_alltoall", tensor_parallel_size=2, expert_parallel_size=2), "the engine takes one of the two"),
    (dict(model="dense", tensor_parallel_size=3), "does not divide num_heads=4"),
    (dict(model="dense", tensor_parallel_size=0), "positive integer"),
])
def test_shape_refusals(kw: Dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        mcore_gpt.base_shape(CPU, kw.pop("model"), **kw)


def test_engine_refusals_without_a_group() -> None:
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        mcore_gpt.check_tensor_parallel_world(4, 6)
    for engine, wrapper in (("fsdp2", None), ("nvidia", None), ("nvidia", "fully_shard")):
        with pytest.raises(NotImplementedError, match="use --engine megatron_fsdp, or --engine nvidia "
                                                      "--nvidia-wrapper mcore"):
            mcore_gpt.check_engine_tensor_parallel(engine, 2, wrapper)
        mcore_gpt.check_engine_tensor_parallel(engine, 1, wrapper)
    mcore_gpt.check_engine_tensor_parallel("megatron_fsdp", 2)
    mcore_gpt.check_engine_tensor_parallel("nvidia", 2, "mcore")
