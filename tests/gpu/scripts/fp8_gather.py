"""FP8 weights gathered as FP8 bytes under megatron_fsdp, with TransformerEngine, on 1 or more GPUs.

    torchrun --nproc-per-node 2 tests/gpu/scripts/fp8_gather.py --out fp8-gather-2gpu.json

Three TE ``TransformerLayer`` units (RMSNorm, SwiGLU, grouped-query attention, no bias, as the Llama benchmark's)
and a plain head, bf16 weights, ZeRO-3 with double buffering (three units, two slots: the first unit is gathered
again in backward), Adam, current scaling with one ``FP8Recipe.autocast()`` around each forward. Rows:

- ``reference``: the layers built with bf16 weights; TE quantizes them in every forward.
- ``gather``: the same layers built under ``te.quantized_model_init`` (primary FP8 weights, the bf16 values kept
  as the initial values): the engine gathers them as FP8 bytes ([Note: FP8 parameter all-gather] in
  megatron_fsdp/_fp8.py). Every loss and every main parameter against ``reference``: the weight's scale is
  that of the whole bf16 weight in both, so the bytes are the same; ``equal`` is ``torch.equal``, ``max_rel`` the
  largest difference if not.
- ``gather + per-layer graphs`` (TE's graph maker, whole layers, captured at step ``CAPTURE_AT``) and ``gather +
  whole-step graph`` against ``gather``: ``torch.equal``.
- Each row without fused weight-gradient accumulation too (``..., unfused``: the weights' gradients through
  ``.grad``; the QKV weight stays fused, as TE requires of FP8 weights).
- Bytes all-gathered in step 1 by dtype, and the peak memory, of each row.

``--engine nvidia`` (one GPU green at ``907f506``): NVIDIA Megatron-FSDP (megatron-core's bundled copy) on the same
FP8 layers, which it gathers as bytes, ZeRO-3 with its double buffer and ``keep_fp8_transpose_cache=True``, unfused weight
gradients (the adapter refuses fused ones under NVIDIA's engine) and the head in bf16. Rows: ``nvidia gather``
(eager) and ``nvidia gather + per-layer graphs`` against it (``torch.equal``, every loss and this rank's shard of
every main parameter; [Note: NVIDIA's FP8 parameters and replay] in fsdp_cudagraph/engines/nvidia/adapter.py), and
two controls: ``nvidia control: transpose moved`` (a weight's transpose, its scale-inverse where TE keeps no
transpose, replaced after capture: the next forward must be refused before the replay, naming it) and ``nvidia
control: keep_fp8_transpose_cache=False`` (refused when the graphs are built).

``--engine ours-kept``: the layers with bf16 weights under ``fully_shard(keep_compute_shard=True)`` (the bf16 cast
of each unit's shards kept across gathers) against the default cast at every gather, eager, with per-layer graphs
and with a whole-step graph (``KEPT_PLAN``), every loss and main parameter ``torch.equal``, and where each unit keeps
its cast.

Rank 0 writes the JSON (``ok``: every row ran and every comparison is equal); exit status 1 if not.
"""

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import megatron_fsdp  # noqa: E402
from megatron_fsdp import _collectives  # noqa: E402
from tests.gpu_utils import RowGuard, init_script_ranks  # noqa: E402

H, FFN, HEADS, KV, SEQ, BATCH, LAYERS = 256, 512, 4, 2, 128, 2, 3
STEPS, CAPTURE_AT = 5, 2


class Net(nn.Module):
    def __init__(self, quantized: bool, fuse: bool) -> None:
        super().__init__()
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling

        init = (te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True)
                if quantized else contextlib.nullcontext())
        with init:
            self.layers = nn.ModuleList(
                te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=KV, hidden_dropout=0.0, attention_dropout=0.0,
                                    layer_number=i + 1, self_attn_mask_type="causal", normalization="RMSNorm",
                                    activation="swiglu", bias=False, params_dtype=torch.bfloat16, seq_length=SEQ,
                                    # TE refuses FP8 weights split into q, k, v parameters ("Splitting QuantizedTensor
                                    # into multiple params is not supported"): the QKV weight stays one parameter
                                    fuse_wgrad_accumulation=fuse, fuse_qkv_params=True)
                for i in range(LAYERS))
        self.head = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, dev: torch.device):
    g = torch.Generator(device="cpu").manual_seed(100 + step)
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(SEQ, BATCH * world, H, generator=g)[:, rank * BATCH:(rank + 1) * BATCH]
    y = torch.randn(SEQ, BATCH * world, H, generator=g)[:, rank * BATCH:(rank + 1) * BATCH]
    return x.to(dev, torch.bfloat16).contiguous(), y.to(dev, torch.bfloat16).contiguous()


def train(dev: torch.device, *, quantized: bool, fuse: bool, graphs: Optional[str],
          keep: bool = False) -> Dict[str, Any]:
    import transformer_engine.pytorch as te

    from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph, PartialCudaGraphs
    from fsdp_cudagraph.capture.fp8 import FP8Recipe

    torch.manual_seed(7)
    torch.cuda.manual_seed_all(7)
    with dev:
        net = Net(quantized, fuse)
    model = megatron_fsdp.fully_shard(net, fsdp_unit_modules=[te.TransformerLayer], sharding_strategy="optim_grads_params",
                                      compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                                      fsdp_db_use_persist_buf_on_alloc_fail=True, keep_compute_shard=keep)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    fp8 = FP8Recipe("current")
    fp8_units = [u.name for u in model.units if u.fp8 is not None]

    def forward_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with fp8.autocast():
            out = m(x)
        return nn.functional.mse_loss(out.float(), y.float())

    partial = full = None
    if graphs == "partial":
        partial = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=[],
                                                           cuda_graph_warmup_steps=CAPTURE_AT, use_megatron_fsdp=True,
                                                           fsdp_double_buffer=True,
                                                           fsdp_db_use_persist_buf_on_alloc_fail=True),
                                    backend="te", fp8=fp8)
    elif graphs == "full":
        full = FullIterationCudaGraph(model, forward_loss, CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                                            cuda_graph_warmup_steps=CAPTURE_AT),
                                      backend="torch")
    torch.cuda.reset_peak_memory_stats(dev)
    losses: List[torch.Tensor] = []
    gathered: Dict[str, int] = {}
    original = _collectives.all_gather
    try:
        for step in range(STEPS):
            if partial is not None and step == CAPTURE_AT:
                partial.capture()
            x, y = batch(step, dev)
            if step == 1:
                def counting(out, shard, group, what):
                    key = str(out.dtype)
                    gathered[key] = gathered.get(key, 0) + out.numel() * out.element_size()
                    return original(out, shard, group, what)

                _collectives.all_gather = counting
            if full is not None:
                loss = full.step([(x, y)]).sum()
                full.optimizer_step(opt)
            else:
                loss = forward_loss(model, x, y)
                loss.backward()
                opt.step()
            _collectives.all_gather = original
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float().clone())
        torch.cuda.synchronize(dev)
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    finally:
        _collectives.all_gather = original
        if partial is not None:
            partial.delete()
        if full is not None:
            full.delete()
    units = list(model.all_units())
    return {"losses": [float(v) for v in torch.stack(losses).cpu()], "state": state, "fp8_units": fp8_units,
            "gathered_bytes_step1": gathered, "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
            "units": sorted(u.name for u in units), "with_copy": sorted(u.name for u in units if u._kept),
            "own_buffer": sorted(u.name for u in units if u.param_buffer.kind == "persistent")}


def compare(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    keys = [k for k in b["state"] if not k.endswith("_extra_state")]
    equal = a["losses"] == b["losses"] and all(torch.equal(a["state"][k], b["state"][k]) for k in keys)
    rel = max((float((a["state"][k] - b["state"][k]).abs().max() / b["state"][k].abs().max().clamp_min(1e-30))
               for k in keys), default=0.0)
    loss_rel = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["losses"], b["losses"]))
    return {"equal": equal, "max_rel_param": rel, "max_rel_loss": loss_rel}


def nvidia_model(dev: torch.device, *, keep_transpose: bool):
    """The FP8 layers under NVIDIA Megatron-FSDP (megatron-core's copy): (engine, its optimizer)."""
    import inspect

    import transformer_engine.pytorch as te
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    torch.manual_seed(7)
    torch.cuda.manual_seed_all(7)
    with dev:
        net = Net(True, fuse=False)
    net.head.to(torch.bfloat16)  # NVIDIA computes in the module's dtype; the FP8 layers are bf16 already
    accepted = inspect.signature(mf.fully_shard).parameters
    options: Dict[str, Any] = dict(fsdp_unit_modules=[te.TransformerLayer], zero_dp_strategy="optim_grads_params",
                                   device=dev, fsdp_double_buffer=True, keep_fp8_transpose_cache=keep_transpose,
                                   overlap_grad_reduce=True, overlap_param_gather=True, sync_model_each_microbatch=True)
    if "fsdp_db_use_persist_buf_on_alloc_fail" in accepted:  # 0.6.1
        options["fsdp_db_use_persist_buf_on_alloc_fail"] = True
    if "mixed_precision_policy" in accepted:  # 0.6.1
        options["mixed_precision_policy"] = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                    main_grads_dtype=torch.float32)
    model, opt = mf.fully_shard(net, torch.optim.Adam(net.parameters(), lr=1e-3), **options)
    opt.state.clear()  # fully_shard_optimizer's eager zero step would start Adam's count at 1
    return model, opt


def train_nvidia(dev: torch.device, *, graphs: bool, move_after_capture: bool = False) -> Dict[str, Any]:
    """NVIDIA's engine over the FP8 layers, eagerly or with per-layer graphs (whole layers, TE's graph maker);
    ``move_after_capture``: replace a weight's transpose (its scale-inverse without one) after the capture and
    return the refusal of the next forward."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
    from fsdp_cudagraph.capture.fp8 import FP8Recipe

    model, opt = nvidia_model(dev, keep_transpose=True)
    fp8 = FP8Recipe("current")
    partial = None
    if graphs:
        partial = PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=[],
                                                           cuda_graph_warmup_steps=CAPTURE_AT), backend="te", fp8=fp8)
    losses: List[torch.Tensor] = []
    try:
        for step in range(STEPS):
            if partial is not None and step == CAPTURE_AT:
                partial.capture()
                if move_after_capture:
                    w = next(p for n, p in model.raw_param.items()  # the compute parameters: TE's Float8Tensors
                             if n.startswith("layers.0.") and hasattr(p, "_scale_inv"))
                    attr = "_transpose" if getattr(w, "_transpose", None) is not None else "_scale_inv"
                    setattr(w, attr, getattr(w, attr).clone())
                    x, _ = batch(step, dev)
                    try:
                        with fp8.autocast():
                            model(x)
                    except RuntimeError as exc:
                        return {"moved": attr, "refusal": str(exc)}
                    return {"moved": attr, "refusal": None}
            x, y = batch(step, dev)
            with fp8.autocast():
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float().clone())
        torch.cuda.synchronize(dev)
        held = [p for g in opt.param_groups for p in g["params"]]
        state = {str(i): (p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu()
                 for i, p in enumerate(held)}  # this rank's shard of every main parameter
    finally:
        if partial is not None:
            partial.delete()
    return {"losses": [float(v) for v in torch.stack(losses).cpu()], "state": state, "fp8_units": ["(NVIDIA)"],
            "gathered_bytes_step1": {}, "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30}


def nvidia_rows(dev: torch.device, guard: RowGuard) -> List[Dict[str, Any]]:
    """``--engine nvidia``: NVIDIA Megatron-FSDP gathering FP8 weights, eager against per-layer graphs, and two
    controls (see the module's docstring)."""
    rows: List[Dict[str, Any]] = []
    runs: Dict[str, Any] = {}
    for key, graphs in (("nvidia gather", False), ("nvidia gather + per-layer graphs", True)):
        try:
            runs[key] = train_nvidia(dev, graphs=graphs)
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
            rows.append({"row": key, **RowGuard.failed(key, exc)})
            guard.end_of_row(key)
            continue
        guard.end_of_row(key)
        row = {"row": key, "losses": runs[key]["losses"], "peak_gib": runs[key]["peak_gib"], "ok": True}
        if graphs:
            if "nvidia gather" not in runs:
                row.update(ok=False, error="no nvidia gather run to compare with")
            else:
                row.update(against="nvidia gather", **compare(runs[key], runs["nvidia gather"]))
                row["ok"] = row["equal"]
        rows.append(row)
    key = "nvidia control: transpose moved"
    try:
        got = train_nvidia(dev, graphs=True, move_after_capture=True)
        name = {"_transpose": "(transpose)", "_scale_inv": "(scale_inv)"}[got["moved"]]
        refusal = got["refusal"] or ""
        rows.append({"row": key, **got, "ok": name in refusal and "captured at" in refusal})
    except Exception as exc:  # noqa: BLE001
        rows.append({"row": key, **RowGuard.failed(key, exc)})
    guard.end_of_row(key)
    key = "nvidia control: keep_fp8_transpose_cache=False"
    try:
        from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs
        from fsdp_cudagraph.capture.fp8 import FP8Recipe

        model, _ = nvidia_model(dev, keep_transpose=False)
        try:
            PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=[]),
                              backend="te", fp8=FP8Recipe("current")).delete()
            rows.append({"row": key, "refusal": None, "ok": False})
        except ValueError as exc:
            rows.append({"row": key, "refusal": str(exc), "ok": "keep_fp8_transpose_cache=True" in str(exc)})
    except Exception as exc:  # noqa: BLE001
        rows.append({"row": key, **RowGuard.failed(key, exc)})
    guard.end_of_row(key)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", choices=("ours", "ours-kept", "nvidia"), default="ours",
                    help="ours: megatron_fsdp's rows (the default); ours-kept: keep_compute_shard's rows; nvidia: "
                         "NVIDIA Megatron-FSDP's rows")
    args = ap.parse_args()
    dev = init_script_ranks("cuda", 29533)
    guard = RowGuard()  # [Note: a row that raises on one rank] in tests/gpu_utils.py
    if args.engine == "nvidia":
        return finish(args.out, nvidia_rows(dev, guard), expected=4, ratio=None)
    if args.engine == "ours-kept":
        return finish(args.out, kept_rows(dev, guard), expected=len(KEPT_PLAN), ratio=None)
    rows: List[Dict[str, Any]] = []
    runs: Dict[str, Any] = {}
    plan = [("reference", False, None), ("gather", True, None), ("gather + per-layer graphs", True, "partial"),
            ("gather + whole-step graph", True, "full")]
    for fuse in (True, False):
        suffix = "" if fuse else ", unfused"
        for name, quantized, graphs in plan:
            key = name + suffix
            try:
                runs[key] = train(dev, quantized=quantized, fuse=fuse, graphs=graphs)
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
                rows.append({"row": key, **RowGuard.failed(key, exc)})
                guard.end_of_row(key)
                continue
            guard.end_of_row(key)
            r = runs[key]
            row = {"row": key, "losses": r["losses"], "fp8_units": r["fp8_units"],
                   "gathered_bytes_step1": r["gathered_bytes_step1"], "peak_gib": r["peak_gib"], "ok": True}
            against = None if name == "reference" else ("reference" if name == "gather" else "gather") + suffix
            if against is not None:
                if against not in runs:
                    row.update(ok=False, error=f"no {against} run to compare with")
                else:
                    row.update(against=against, **compare(r, runs[against]))
                    row["ok"] = row["equal"] and (quantized == bool(r["fp8_units"]))
            rows.append(row)
    ref, got = runs.get("reference", {}), runs.get("gather", {})
    ratio = None
    if ref and got:
        ratio = sum(got["gathered_bytes_step1"].values()) / max(sum(ref["gathered_bytes_step1"].values()), 1)
    finish(args.out, rows, expected=2 * len(plan), ratio=ratio)


#: ``--engine ours-kept``: (row, per-layer or whole-step graphs, the row it must equal); ``cast`` casts the fp32
#: shards into the gather buffer at every gather (the default), the others keep the bf16 cast
#: (``fully_shard(keep_compute_shard=True)``, [Note: cast on gather] in megatron_fsdp/_unit.py)
KEPT_PLAN = [("cast", None, None), ("kept", None, "cast"), ("kept + per-layer graphs", "partial", "kept"),
             ("kept + whole-step graph", "full", "kept")]


def kept_rows(dev: torch.device, guard: RowGuard) -> List[Dict[str, Any]]:
    """The layers with bf16 weights (TE quantizes them in forward), casting at every gather against keeping the
    cast; every loss and main parameter ``torch.equal``. Where each unit's cast lives is checked too: at one rank
    every unit holds it in an unshard buffer of its own, at more the layers keep a copy and gather into their slot
    (the head is the root's, which has its own buffer either way)."""
    world = dist.get_world_size()
    rows: List[Dict[str, Any]] = []
    runs: Dict[str, Any] = {}
    for name, graphs, against in KEPT_PLAN:
        try:
            runs[name] = r = train(dev, quantized=False, fuse=True, graphs=graphs, keep=name != "cast")
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
            rows.append({"row": name, **RowGuard.failed(name, exc)})
            guard.end_of_row(name)
            continue
        guard.end_of_row(name)
        row = {"row": name, "losses": r["losses"], "peak_gib": r["peak_gib"], "with_copy": r["with_copy"],
               "own_buffer": r["own_buffer"], "ok": True}
        if name != "cast":
            layers = [u for u in r["units"] if u != "<root>"]
            placed = len(layers) == LAYERS and (
                r["own_buffer"] == r["units"] and not r["with_copy"] if world == 1
                else r["own_buffer"] == ["<root>"] and r["with_copy"] == layers)
            row.update(placed=placed)
            if against not in runs:
                row.update(ok=False, error=f"no {against} run to compare with")
            else:
                row.update(against=against, **compare(r, runs[against]))
                row["ok"] = row["equal"] and placed
        rows.append(row)
    return rows


def finish(out: str, rows: List[Dict[str, Any]], *, expected: int, ratio: Optional[float]) -> None:
    """Every rank's rows to rank 0, which writes the JSON; exit status 1 unless every row is ok."""
    everything: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, rows)
    ok = all(r["ok"] for rs in everything for r in rs) and len(rows) == expected
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ok": ok, "world_size": dist.get_world_size(), "gather_bytes_ratio": ratio, "rows": everything,
                       "versions": {"torch": torch.__version__, "te": __import__("transformer_engine").__version__,
                                    "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                                    "device": torch.cuda.get_device_name(torch.cuda.current_device())}},
                      f, indent=1)
        for r in rows:
            print({k: v for k, v in r.items() if k not in ("losses", "traceback")}, flush=True)
        print("gather bytes / reference bytes (step 1):", ratio, "ok:", ok, flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
