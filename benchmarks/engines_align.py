"""Partial CUDA graphs under the FSDP engines users run: eager vs graphed, bit for bit, and step times.

For each engine (``--engines``) and backend (``--backends``): the reference GPT (TE layers for the te backend,
plain torch layers for the torch backend; seq 100, not a multiple of 128) trained on the default CUDA stream
for ``--steps`` steps, eagerly and with per-layer graphs captured at step 3 (scope ``--scope``: whole layers
by default), same seeds. Every step's loss and every final parameter must be ``torch.equal``. Negative
controls: the engine's unsafe setting is refused when PartialCudaGraphs is built; a parameter moved after
capture is refused before the replay; under NVIDIA Megatron-FSDP, its double buffer asked to move a unit's
bucket to the other slot is refused. Step times (median after ``--skip``) of eager vs graphed, side by
side in one run; for FSDP2 also FSDP2 captured whole the torchtitan way (``_fsdp2_graph.py``).

Engines: ``fsdp2`` (torch.distributed.fsdp.fully_shard per layer and root, keep_unsharded_storage, bf16
parameters), its variants ``fsdp2_mp`` (fp32 sharded parameters under ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, as FSDP2 users train), ``fsdp2_slots`` (bf16 parameters, ``use_unsharded_slots``: two
preallocated slots, units alternating; 2+ ranks, skipped with the reason on one) and ``fsdp2_slots_mp`` (both;
their extra control: a unit moved to the other slot after capture is refused), ``megatron_fsdp`` (ours, bf16
compute, ZeRO-3 with double buffering), ``nvidia`` (NVIDIA Megatron-FSDP through megatron-core's bundled copy,
``megatron.core.distributed.fsdp.src.megatron_fsdp``: ZeRO-3, bf16 module, fp32 main parameters and gradients,
``fsdp_double_buffer`` and, where the version has it, ``fsdp_db_use_persist_buf_on_alloc_fail``; the unsafe
setting is the latter off, or the double buffer off where it is missing). ``nvidia`` is skipped, with the
reason printed and recorded, where megatron-core is not importable or there is no GPU (NVIDIA's engine
builds CUDA streams and buffers, so ``--cpu-smoke`` skips it). Run (1 GPU)::

    python benchmarks/engines_align.py --out engines-align.json
    python benchmarks/engines_align.py --engines nvidia --out engines-align-nvidia.json

Exit status 1 if a row is not bit-equal or a control is not caught.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # NVLink multicast off
    os.environ.setdefault(_name, "1" if _name != "NCCL_NVLS_ENABLE" else "0")

import _common  # noqa: F401,E402 - the repository root on sys.path


ENGINES = ("fsdp2", "fsdp2_mp", "fsdp2_slots", "fsdp2_slots_mp", "megatron_fsdp", "nvidia")


def fsdp2_unavailable(engine: str) -> Optional[str]:
    """Why an FSDP2 variant cannot run here (None: it can): the slots need 2+ ranks."""
    import torch.distributed as dist

    if "slots" in engine and dist.get_world_size() < 2:
        return (f"use_unsharded_slots needs 2+ ranks (world size {dist.get_world_size()}): on one rank FSDP2 copies "
                "its all-gather into the outputs' storage directly")
    return None


def nvidia_unavailable() -> Optional[str]:
    """Why ``--engines nvidia`` cannot run here (None: it can): the alignment checker's own answer
    (``fsdp_cudagraph.engines``, one builder per engine folder), which imports megatron-core only when asked."""
    import torch

    from fsdp_cudagraph.engines.nvidia.build import NVIDIA_PIP
    from fsdp_cudagraph.engines.registry import registered_builders
    CHECKER_ENGINES = registered_builders()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    why = CHECKER_ENGINES["nvidia"].unavailable(device)
    return None if why is None else f"{why}; {NVIDIA_PIP}"


def _nvidia(gpt, device, keep: bool):
    """The GPT under NVIDIA Megatron-FSDP (megatron-core's copy): (engine, its optimizer, info)."""
    import inspect

    import torch
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    gpt = gpt.to(torch.bfloat16)  # NVIDIA computes in the module's dtype
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-3)
    accepted = inspect.signature(mf.fully_shard).parameters
    options: Dict[str, Any] = dict(fsdp_unit_modules=[gpt.unit_class], zero_dp_strategy="optim_grads_params",
                                   device=device, fsdp_double_buffer=True, overlap_grad_reduce=True,
                                   overlap_param_gather=True, sync_model_each_microbatch=True)
    if "fsdp_db_use_persist_buf_on_alloc_fail" in accepted:  # 0.6.1
        options["fsdp_db_use_persist_buf_on_alloc_fail"] = keep
        unsafe_setting = "fsdp_db_use_persist_buf_on_alloc_fail=False"
    else:  # 0.3.1 has no such option: the unsafe setting is no double buffer
        options["fsdp_double_buffer"] = keep
        unsafe_setting = "fsdp_double_buffer=False"
    if "mixed_precision_policy" in accepted:
        options["mixed_precision_policy"] = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                    main_grads_dtype=torch.float32)
    model, opt = mf.fully_shard(gpt, opt, **options)
    opt.state.clear()  # fully_shard_optimizer's eager zero step would start Adam's count at 1
    import megatron.core

    info = {"megatron_fsdp": getattr(mf, "__version__", None), "megatron_core": megatron.core.__version__,
            "unsafe_setting": unsafe_setting}
    return model, opt, info


def _model(engine: str, use_te: bool, seq: int, keep: bool = True):
    """(model, cfg, optimizer, info) for one run; ``keep=False``: the engine's unsafe setting."""
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    from fsdp_cudagraph.apps.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, seq_len=seq, use_te=use_te)
    gpt = GPT(cfg).to(device)
    if engine.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from fsdp_cudagraph import keep_unsharded_storage, use_unsharded_slots
        from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2
        from fsdp_cudagraph.engines.fsdp2.build import FSDP2_MIXED_PRECISION

        if engine.endswith("_mp"):  # fp32 shards, bf16 compute by FSDP2's policy (the checker's --fsdp2-mp bf16)
            policy = MixedPrecisionPolicy(**FSDP2_MIXED_PRECISION["bf16"])
        else:
            policy = MixedPrecisionPolicy()
            gpt = gpt.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        shard_fsdp2(gpt, list(gpt.layers), device=device, mp_policy=policy)
        storage = "use_unsharded_slots" if "slots" in engine else "keep_unsharded_storage"
        if keep:
            (use_unsharded_slots if "slots" in engine else keep_unsharded_storage)(gpt)
        return gpt, cfg, torch.optim.Adam(gpt.parameters(), lr=1e-3), {"unsafe_setting": f"no {storage}",
                                                                       "storage": storage, "policy": repr(policy)}
    if engine == "nvidia":
        model, opt, info = _nvidia(gpt, device, keep)
        return model, cfg, opt, info
    from megatron_fsdp import fully_shard

    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy="optim_grads_params",
                        compute_dtype=torch.bfloat16 if device.type == "cuda" else None, fsdp_double_buffer=keep,
                        fsdp_db_use_persist_buf_on_alloc_fail=keep)
    return (model, cfg, torch.optim.Adam(model.optimizer_parameters(), lr=1e-3),
            {"unsafe_setting": "fsdp_double_buffer=False, fsdp_db_use_persist_buf_on_alloc_fail=False"})


def _full_params(engine: str, model, opt) -> Dict[str, Any]:
    if engine.startswith("fsdp2"):
        return {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
    if engine == "nvidia":  # this rank's optimizer parameters (the whole model on one rank), in the optimizer's order
        return {f"param_groups[{g}][{i}]": (p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu()
                for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])}
    return {k: v.float().cpu() for k, v in model.full_state_dict().items() if not k.endswith("_extra_state")}


def _move_a_parameter(engine: str, model) -> None:
    """The moved-parameter control: after capture, the first replay tensor of layer 1 gets new storage."""
    from fsdp_cudagraph.engines import adapter_for

    adapter = adapter_for(model)
    unit = adapter.root.layers[1]
    _, t = adapter.replay_tensors(unit)[0]
    if engine != "nvidia":
        t.data = t.data.clone()
        return
    # NVIDIA's unshard hook points the compute parameters into its bucket again at every forward, which would
    # undo a move made here; move the parameter from a hook placed right after that unshard instead (what the
    # double buffer handing the unit the other slot would do), so the graph layer's check sees it.
    from fsdp_cudagraph.engines.nvidia.hooks import identify_hook

    def move(module, args, kwargs):
        t.data = t.data.clone()

    unit.register_forward_pre_hook(move, with_kwargs=True)
    order = list(unit._forward_pre_hooks.items())
    mover = order.pop()
    unshard = next(i for i, (_, h) in enumerate(order)
                   if (identify_hook(h, adapter.engine) or ("",))[0] == "pre_forward")
    order.insert(unshard + 1, mover)
    unit._forward_pre_hooks.clear()
    unit._forward_pre_hooks.update(order)


def _take_a_planned_slot(model) -> None:
    """The slot control (NVIDIA): layer 0's bucket is all-gathered into its planned slot and, while it holds it,
    layer 2's (planned for the same slot): what a unit gathered two places early would do. The pin must refuse
    the second instead of moving it to the other slot. (Fetching layer 2 alone after capture is no control: the
    engine has released every bucket by then, so its planned slot is free.)"""
    from fsdp_cudagraph.engines import adapter_for

    adapter = adapter_for(model)
    buffer = adapter.engine.param_and_grad_buffer
    weights = [buffer.parameter_groups[buffer.param_to_param_group[next(adapter.root.layers[i].parameters())]]
               .model_weight_buffer for i in (0, 2)]
    if not all(getattr(w, "is_data_distributed", True) for w in weights):
        raise SlotControlNotApplicable(
            "one data-parallel rank: NVIDIA's weight buffers are not distributed, so fetch_bucket hands out the "
            "persistent local buffer and no double-buffer slot exists to move (runs on 2+ GPUs)")
    for w in weights:
        w.fetch_bucket()


class SlotControlNotApplicable(Exception):
    """The NVIDIA slot control has nothing to exercise on this run (the reason is the message)."""


def run(engine: str, backend: str, args: argparse.Namespace, *, mode: str) -> Dict[str, Any]:
    """``mode``: eager, graphed, moved (graphed, a parameter moved after capture), slot (graphed, NVIDIA's double
    buffer asked to move a unit after capture) or whole (FSDP2 captured whole)."""
    import torch
    import torch.distributed as dist

    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs, match_graph_attention
    from fsdp_cudagraph.apps.model import loss_fn, synthetic_batch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(torch.cuda.default_stream())  # as a fresh user process starts
    model, cfg, opt, info = _model(engine, backend == "te", args.seq_len)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, 2 * world, cfg, device)
        data.append((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
    config = CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                             cuda_graph_modules=args.scope, cuda_graph_warmup_steps=3,
                             use_megatron_fsdp=not engine.startswith("fsdp2"), fsdp_double_buffer=True,
                             fsdp_db_use_persist_buf_on_alloc_fail=True)
    graphs = matcher = whole = None
    if mode in ("graphed", "moved", "slot"):
        graphs = PartialCudaGraphs(model, config, backend=backend if cuda else "protocol")
    else:
        matcher = match_graph_attention(model, config)
    if mode == "whole":
        from _fsdp2_graph import Fsdp2GraphStep

        def fwd_bwd(x, y):
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        whole = Fsdp2GraphStep(fwd_bwd, warmup=3, device=torch.device("cuda"))
    losses: List[Any] = []
    times: List[float] = []
    error: Optional[str] = None
    for step, (x, y) in enumerate(data):
        if graphs is not None and step == 3:
            graphs.capture()
            if mode == "moved":
                _move_a_parameter(engine, model)
            elif mode == "slot" and engine.startswith("fsdp2"):
                try:  # the FSDP2 double buffer asked to move a captured unit to the other slot
                    from fsdp_cudagraph.engines.fsdp2.storage import slots_of

                    slots = slots_of(model)
                    unit = model.layers[1]
                    slots.assign(unit, (slots.slot_of(unit) + 1) % slots.num_slots)
                except RuntimeError as exc:
                    error = str(exc)
                    break
            elif mode == "slot":
                try:
                    _take_a_planned_slot(model)
                except SlotControlNotApplicable as exc:
                    info["slot_not_applicable"] = str(exc)
                except RuntimeError as exc:
                    error = str(exc)
                    break
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (0, 0)
        if cuda:
            start.record()
        try:
            if whole is not None:
                losses.append(whole(x, y))
            else:
                loss = loss_fn(model(x), y)
                loss.backward()
                losses.append(loss.detach())
        except RuntimeError as exc:
            error = str(exc)
            break
        opt.step()
        opt.zero_grad(set_to_none=whole is None)
        if cuda:
            end.record()
            times.append((start, end))
    if cuda:
        torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times]
    out = {"losses": [l.float().cpu() for l in losses], "error": error,
           "step_ms": statistics.median(ms[args.skip:]) if len(ms) > args.skip else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "info": info}
    if error is None:
        out["params"] = _full_params(engine, model, opt)
    if graphs is not None:
        out["callables"] = len(graphs.report.callables) if graphs.report else 0
        if error is None:
            graphs.delete()
    if matcher is not None:
        matcher.uninstall()
    return out


def unsafe(engine: str, backend: str, args: argparse.Namespace) -> Optional[str]:
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    import torch

    model = _model(engine, backend == "te", args.seq_len, keep=False)[0]
    try:
        PartialCudaGraphs(model, CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                                                 cuda_graph_modules=args.scope),
                          backend=backend if torch.cuda.is_available() else "protocol")
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                   help="nvidia: NVIDIA Megatron-FSDP, skipped with the reason where megatron-core or a GPU is missing")
    p.add_argument("--backends", nargs="+", default=["te", "torch"], choices=["te", "torch"])
    p.add_argument("--scope", nargs="*", default=[], help="cuda_graph_modules (default: whole layers)")
    p.add_argument("--seq-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=6)
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="on CPU: the same rows on Gloo with the protocol backend "
                   "(no graphs, no timings): checks this script, not the GPU")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("benchmarks/engines_align.py needs a CUDA GPU (CUDA graphs, NCCL); nothing to run on this machine")
        return 0
    import torch.distributed as dist

    from _common import init_process_group, record_fields
    from fsdp_cudagraph.checker.records import write_record
    from fsdp_cudagraph.apps.train import use_deterministic_kernels
    from fsdp_cudagraph.capture.te import HAS_TE

    use_deterministic_kernels()
    init_process_group(cuda=torch.cuda.is_available(), default_port=29533)
    rows, ok = [], True
    for engine in args.engines:
        why = nvidia_unavailable() if engine == "nvidia" else fsdp2_unavailable(engine)
        if why is not None:
            rows.append({"engine": engine, "skipped": why})
            if dist.get_rank() == 0:
                print(f"{engine:14s} skipped: {why}", flush=True)
            continue
        for backend in args.backends:
            if backend == "te" and (not HAS_TE or not torch.cuda.is_available()):
                rows.append({"engine": engine, "backend": backend, "skipped": "TransformerEngine not installed"})
                continue
            eager = run(engine, backend, args, mode="eager")
            graphed = run(engine, backend, args, mode="graphed")
            moved = run(engine, backend, args, mode="moved")
            refused = unsafe(engine, backend, args)
            slot = run(engine, backend, args, mode="slot") if engine == "nvidia" or "slots" in engine else None
            loss_eq = [torch.equal(a, b) for a, b in zip(eager["losses"], graphed["losses"])]
            equal = (graphed["error"] is None and len(loss_eq) == args.steps and all(loss_eq)
                     and all(torch.equal(eager["params"][k], graphed["params"][k]) for k in eager["params"]))
            row = {"engine": engine, "backend": backend, "equal": equal, "losses_equal": loss_eq,
                   "first_mismatch": next((i for i, e in enumerate(loss_eq) if not e), None),
                   "graphed_error": graphed["error"], "callables": graphed.get("callables"),
                   "eager_ms": eager["step_ms"], "graphed_ms": graphed["step_ms"],
                   "eager_peak_gib": eager["peak_gib"], "graphed_peak_gib": graphed["peak_gib"],
                   "moved_caught": moved["error"] is not None and "captured at" in moved["error"],
                   "moved_error": (moved["error"] or "")[:400], "unsafe_refused": refused is not None,
                   "unsafe_error": (refused or "")[:400], "engine_info": eager["info"]}
            if slot is not None and "slot_not_applicable" in slot["info"]:
                row["slot_not_applicable"] = slot["info"]["slot_not_applicable"]
            elif slot is not None:
                row["slot_caught"] = slot["error"] is not None and any(
                    w in slot["error"] for w in ("out of its planned slot", "was captured reading its unsharded"))
                row["slot_error"] = (slot["error"] or "")[:400]
            if engine == "fsdp2" and torch.cuda.is_available():
                whole = run(engine, backend, args, mode="whole")
                row["whole_ms"], row["whole_error"] = whole["step_ms"], whole["error"]
            ok &= equal and row["moved_caught"] and row["unsafe_refused"] and row.get("slot_caught", True)
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{engine:14s} {backend:5s} {'EQUAL' if equal else 'MISMATCH at ' + str(row['first_mismatch'])}"
                      f"  eager {row['eager_ms'] or float('nan'):.2f} ms  graphed {row['graphed_ms'] or float('nan'):.2f} ms"
                      + (f"  whole {row['whole_ms']:.2f} ms" if row.get("whole_ms") else "")
                      + f"  moved caught {row['moved_caught']}  unsafe refused {row['unsafe_refused']}"
                      + (f"  slot move refused {row['slot_caught']}" if "slot_caught" in row else "")
                      + ("  slot control n/a (1 rank)" if "slot_not_applicable" in row else ""), flush=True)
    if dist.get_rank() == 0:
        print(f"engines alignment: {'all bit-equal, controls caught' if ok else 'FAILED'}")
        if args.out:
            write_record(args.out, {**record_fields(), "steps": args.steps, "scope": args.scope,
                                    "seq_len": args.seq_len, "rows": rows, "all_ok": ok})
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(main())
