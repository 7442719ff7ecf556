"""megatron-core's GPTModel (dense, MoE alltoall, MoE allgather) under each FSDP engine with partial graphs, on N GPUs.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python tests/gpu/scripts/mcore_gpt.py --out mcore-1.json                      # 1 GPU
    CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --out mcore-2.json  # 2 GPUs
    torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --expert-parallel 2 --out mcore-ep2.json   # + EP 2
    torchrun --nproc-per-node 4 tests/gpu/scripts/mcore_gpt.py --expert-parallel 4 2 --only-ep --out mcore-ep4.json
    torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --device cpu --out mcore-cpu.json                   # Gloo
    torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --tensor-parallel 2 --only-tp --out mcore-tp2.json  # 1x2
    torchrun --nproc-per-node 4 tests/gpu/scripts/mcore_gpt.py --tensor-parallel 2 4 --only-tp --out mcore-tp4.json

Needs megatron-core (0.19.2 on the GPU image: ``pip install --no-deps --target /tmp/site .whl/*.whl``); TE is
used when importable (TE's layer spec, grouped GEMM and fused permute for MoE), else megatron-core's local spec.

Rows (``fsdp_cudagraph.apps.mcore_gpt.run``, the alignment checker underneath): engine ``megatron_fsdp`` (ours),
``nvidia`` (the bundled ``megatron_fsdp.fully_shard``) and ``nvidia_mcore`` (megatron-core's
``FullyShardedDataParallel`` with ``DistributedDataParallelConfig(use_megatron_fsdp=True)``) and ``fsdp2``
(PyTorch FSDP2 with ``keep_unsharded_storage``) x model/scope
(dense whole layers, dense attn+mlp, MoE alltoall attn+router, MoE allgather attn+router), each trained eagerly
and with graphs captured at step 2: every loss and final parameter ``torch.equal`` on every rank; plus per engine
a negative control (the last router's graph scaled by 1.01) that must be named as the culprit. On the CPU only
``megatron_fsdp`` and ``fsdp2`` run (NVIDIA's engine needs CUDA), inside ``cpu_shims``, protocol backend. A row that raises
is recorded with its error and fails ``ok``. Rank 0 writes the JSON; the exit status is 1 unless ``ok``.

Expert parallelism (megatron-core's ``expert_model_parallel_size``; ``--expert-parallel N [N ..]``, default on
2+ ranks: every ``N > 1`` that divides the world size and the 4 experts, e.g. 2 on 2 ranks, 2 and 4 on 4; ``1``:
none): per EP size rows ``moe_alltoall`` and ``moe_allgather`` x ``attn_router`` for engines ``megatron_fsdp``
(megatron-core's EP and EDP groups passed to ``fully_shard``), ``nvidia`` (NVIDIA's ``fully_shard`` with an
``expt_device_mesh`` over the EDP group) and ``nvidia_mcore`` (``FullyShardedDataParallel`` builds its expert mesh
from parallel_state), eager against graphed as above, plus per engine the negative control at that EP; ``fsdp2``
gets one row that must be refused (``NotImplementedError``: FSDP2 would shard each rank's different local experts
over all ranks; Megatron-LM refuses ``--use-torch-fsdp2`` with EP too). Every rank trains its own micro-batch;
EP changes only where the experts live. ``--only-ep`` skips the EP = 1 rows. The alltoall rows of every engine run
before the allgather ones, which take megatron-core's unfused permute (:func:`ep_overrides`).

Tensor parallelism (megatron-core's ``tensor_model_parallel_size`` with sequence parallelism; ``--tensor-parallel N
[N ..]``, opt-in, each ``N > 1`` dividing the world size): per TP size rows ``dense`` x ``layer`` and ``attn_mlp``
for engines ``megatron_fsdp`` (megatron-core's TP and DP groups passed to ``fully_shard(process_group=dp,
tensor_parallel_group=tp)``) and ``nvidia_mcore`` (``FullyShardedDataParallel`` takes them from parallel_state;
megatron-core's ``finalize_model_grads`` before each step), the TP collectives inside the captured graphs, eager
against graphed as above, plus the negative control (the last MLP's graph scaled by 1.01); for ``nvidia_mcore`` also
two ``tp_norms`` rows (:func:`tp_norms_row`): the sequence-parallel norms stay ``torch.equal`` over the TP ranks,
and with their tags removed (the TP sum skipped) they do not. ``nvidia`` (``fully_shard``) and ``fsdp2`` get one
row that must be refused (``NotImplementedError``). The TP ranks of a data-parallel group train the same
micro-batch. ``--only-tp`` runs only
these rows. After rows with TP on CUDA the script leaves without ``destroy_process_group()`` once every rank passed
a barrier ([Note: no destroy after captured NCCL collectives] in tests/gpu/scripts/tp_graphs.py).
"""

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.gpu_utils import RowGuard, init_script_ranks  # noqa: E402

#: engine row name -> (checker engine, nvidia wrapper)
ENGINES = {"megatron_fsdp": ("megatron_fsdp", None), "nvidia": ("nvidia", "fully_shard"),
           "nvidia_mcore": ("nvidia", "mcore"), "fsdp2": ("fsdp2", None)}
CASES = [("dense", "layer"), ("dense", "attn_mlp"), ("moe_alltoall", "attn_router"), ("moe_allgather", "attn_router")]


#: the MoE models of the expert-parallel rows, and the engines that shard megatron-core's local experts
EP_MODELS = ["moe_alltoall", "moe_allgather"]
EP_ENGINES = ["megatron_fsdp", "nvidia", "nvidia_mcore"]

#: the dense scopes of the tensor-parallel rows, and the engines that take megatron-core's TP groups
TP_SCOPES = ["layer", "attn_mlp"]
TP_ENGINES = ["megatron_fsdp", "nvidia_mcore"]
#: eager steps of the TP-sum rows (tp_norms_row)
TP_NORM_STEPS = 4


def ep_overrides(model: str, expert_parallel: int) -> Dict[str, Any]:
    """Shape overrides of an EP row. The allgather dispatcher at EP > 1 runs megatron-core's unfused permute: TE's
    fused permute refuses a rank whose local experts receive no token ("num_out_tokens > 0"), and this toy model
    routes nearly every token to two of its four experts (seen on 2 x H200 with TE 2.20.2 and megatron-core 0.19.2:
    counts per expert [512, 512, 0, 0]), so the rank that owns the other two has none; the alltoall rows keep it."""
    return {"moe_permute_fusion": False} if model == "moe_allgather" and expert_parallel > 1 else {}


def row(engine: str, model: str, scope: str, device: torch.device, backend: Optional[str],
        perturb: Optional[str], expert_parallel: int = 1, tensor_parallel: int = 1) -> Dict[str, Any]:
    from fsdp_cudagraph.apps import mcore_gpt

    name, wrapper = ENGINES[engine]
    out: Dict[str, Any] = {"engine": engine, "model": model, "scope": scope, "perturb": perturb,
                           "expert_parallel": expert_parallel, "tensor_parallel": tensor_parallel}
    try:
        shape = mcore_gpt.base_shape(device, model, expert_parallel_size=expert_parallel,
                                     tensor_parallel_size=tensor_parallel, **ep_overrides(model, expert_parallel))
        report = mcore_gpt.run(model=model, engine=name, scope=scope, device=device, backend=backend,
                               perturb=perturb, nvidia_wrapper=wrapper, shape=shape)
    except Exception as exc:  # recorded: one failing row must not hide the others
        out.update(RowGuard.failed(f"{engine}/{model}/{scope} ep={expert_parallel} tp={tensor_parallel}", exc))
        return out
    ok = report.culprit == perturb and not report.equal if perturb else report.equal
    out.update(ok=ok, equal=report.equal, params_equal=report.params_equal, culprit=report.culprit,
               backend=report.backend, precision=report.precision, callables=report.callables,
               losses=[(s["eager_loss"], s["graphed_loss"]) for s in report.steps],
               calls=report.calls, attention_backends=report.attention_backends, unknown_hooks=report.unknown_hooks)
    return out


def refused_row(engine: str, device: torch.device, expert_parallel: int = 1, tensor_parallel: int = 1
                ) -> Dict[str, Any]:
    """An engine that must refuse megatron-core's expert (or tensor) parallelism: ok when run() raises
    NotImplementedError."""
    from fsdp_cudagraph.apps import mcore_gpt

    name, wrapper = ENGINES[engine]
    model, scope = ("dense", "attn_mlp") if tensor_parallel > 1 else ("moe_alltoall", "attn_router")
    out: Dict[str, Any] = {"engine": engine, "model": model, "scope": scope, "perturb": None,
                           "expert_parallel": expert_parallel, "tensor_parallel": tensor_parallel,
                           "expect": "NotImplementedError"}
    try:
        mcore_gpt.run(model=model, engine=name, scope=scope, device=device, nvidia_wrapper=wrapper,
                      shape=mcore_gpt.base_shape(device, model, expert_parallel_size=expert_parallel,
                                                 tensor_parallel_size=tensor_parallel))
        out.update(ok=False, error="not refused")
    except NotImplementedError as exc:
        out.update(ok=True, refused=str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded
        out.update(RowGuard.failed(f"{engine} refusal ep={expert_parallel} tp={tensor_parallel}", exc))
    return out


def tp_norms_row(device: torch.device, tensor_parallel: int, *, untag: bool) -> Dict[str, Any]:
    """NVIDIA Megatron-FSDP (wrapper mcore) at TP: the sequence-parallel norms' copies on the TP ranks of a
    data-parallel group stay ``torch.equal`` after ``TP_NORM_STEPS`` eager steps (megatron-core's
    ``finalize_model_grads`` summed their gradients over TP, [Note: NVIDIA Megatron-FSDP under tensor parallelism]
    in fsdp_cudagraph/engines/nvidia/build.py). ``untag``: the negative control, the norms' ``sequence_parallel``
    tags removed before the build, so their gradients stay partial: ok when some norm differs between the TP ranks
    (which also shows that the steps moved the norms)."""
    from fsdp_cudagraph.apps import mcore_gpt
    from fsdp_cudagraph.engines.registry import registered_builders

    out: Dict[str, Any] = {"engine": "nvidia_mcore", "model": "dense", "scope": "tp_norms", "perturb": None,
                           "expert_parallel": 1, "tensor_parallel": tensor_parallel, "untag": untag}
    try:
        shape = mcore_gpt.base_shape(device, "dense", tensor_parallel_size=tensor_parallel)
        torch.manual_seed(1234)
        spec = mcore_gpt.spec("dense", device, shape)
        norms = [n for n, p in spec.model.named_parameters() if getattr(p, "sequence_parallel", False)]
        if untag:
            for n, p in spec.model.named_parameters():
                if n in norms:
                    p.sequence_parallel = False
        run = registered_builders()["nvidia"].build(
            spec.model, unit_modules=spec.unit_modules, make_optimizer=spec.make_optimizer, device=device,
            sharding_strategy="optim_grads_params", compute_dtype=torch.bfloat16, options={"wrapper": "mcore"},
            tensor_groups=spec.tensor_groups)
        for step in range(TP_NORM_STEPS):
            spec.loss(run.model, spec.batch(step)).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        final = {n: t for n, t in run.final_parameters().items() if n in norms}
        tp_group = spec.tensor_groups[0]
        mine = {n: t.float() for n, t in final.items()}
        each: List[Any] = [None] * dist.get_world_size(tp_group)
        dist.all_gather_object(each, mine, group=tp_group)
        differ = sorted(n for n in mine if any(not torch.equal(other[n], mine[n]) for other in each))
        out.update(norms=len(norms), differ=differ, ok=bool(norms) and (bool(differ) if untag else not differ))
    except Exception as exc:  # recorded: one failing row must not hide the others
        out.update(RowGuard.failed(f"nvidia_mcore tp norms tp={tensor_parallel} untag={untag}", exc))
    return out


def expert_parallel_sizes(asked: Optional[List[int]], world: int, num_experts: int) -> List[int]:
    """The EP sizes of the expert-parallel rows: ``asked`` (1 dropped), or every ``N > 1`` dividing both the world
    size and the number of experts; SystemExit naming the rule for a size that divides neither."""
    if asked is None:
        return [n for n in range(2, world + 1) if world % n == 0 and num_experts % n == 0]
    fits = [n for n in range(1, world + 1) if world % n == 0 and num_experts % n == 0]
    for n in asked:
        if n not in fits:
            raise SystemExit(f"--expert-parallel {n}: an EP size must divide the world size ({world}) and the "
                             f"{num_experts} experts; pick from {fits}")
    return sorted({n for n in asked if n > 1})


def _print(rows: List[Dict[str, Any]]) -> None:
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['engine']:14s} {r['model']:14s} {r['scope']:12s} ep={r['expert_parallel']} "
                  f"tp={r.get('tensor_parallel', 1)} "
                  f"perturb={bool(r['perturb'])!s:5s} ok={r['ok']} {r.get('error', '')}", flush=True)


def watch_nonfinite() -> None:
    """``MCORE_NONFINITE=1``: print, once per module type and rank, the first module whose forward output holds a
    non-finite value, and each router call that sends no token to some expert (what TE's fused permute refuses with
    "num_out_tokens > 0"). Eager forwards only (a check under capture would synchronize)."""
    seen: set = set()
    calls = {"n": 0}

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        calls["n"] += 1
        outs = output if isinstance(output, (tuple, list)) else (output,)
        name = type(module).__name__
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_floating_point() and name not in seen and not bool(torch.isfinite(t).all()):
                seen.add(name)
                print(f"[rank {dist.get_rank()}] call {calls['n']}: {name} output {i} {tuple(t.shape)} is non-finite",
                      flush=True)
            if name == "TopKRouter" and t.dtype == torch.bool and t.dim() == 2:
                per_expert = t.sum(0).tolist()
                if min(per_expert) == 0:
                    print(f"[rank {dist.get_rank()}] call {calls['n']}: TopKRouter tokens per expert {per_expert}",
                          flush=True)

    torch.nn.modules.module.register_module_forward_hook(hook)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--engines", nargs="*", choices=sorted(ENGINES), default=None,
                   help="default: all three on CUDA, megatron_fsdp on the CPU")
    p.add_argument("--backend", choices=["te", "torch", "protocol"], default=None)
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--expert-parallel", type=int, nargs="+", default=None, metavar="N",
                   help="EP sizes of the expert-parallel rows (default: every N > 1 dividing the world size and the 4 "
                        "experts; 1: none)")
    p.add_argument("--only-ep", action="store_true", help="run only the expert-parallel rows")
    p.add_argument("--tensor-parallel", type=int, nargs="+", default=[], metavar="N",
                   help="TP sizes of the tensor-parallel rows (each N > 1 dividing the world size; default: none)")
    p.add_argument("--only-tp", action="store_true", help="run only the tensor-parallel rows")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = init_script_ranks(args.device, args.port)
    if os.environ.get("MCORE_NONFINITE") == "1":
        watch_nonfinite()
    guard = RowGuard()  # [Note: a row that raises on one rank] in tests/gpu_utils.py
    from fsdp_cudagraph.apps import mcore_gpt

    engines = args.engines or (sorted(ENGINES) if device.type == "cuda" else ["fsdp2", "megatron_fsdp"])
    base = mcore_gpt.base_shape(device, "moe_alltoall")
    eps = expert_parallel_sizes(args.expert_parallel, dist.get_world_size(), base.num_experts)
    if args.only_ep and not eps:
        raise SystemExit(f"--only-ep with no expert-parallel size on {dist.get_world_size()} rank(s): nothing to run")
    tps = sorted({n for n in args.tensor_parallel if n > 1})
    for n in tps:
        if dist.get_world_size() % n:
            raise SystemExit(f"--tensor-parallel {n}: a TP size must divide the world size ({dist.get_world_size()})")
    if args.only_tp and not tps:
        raise SystemExit("--only-tp with no --tensor-parallel size > 1: nothing to run")
    if args.only_tp:
        eps = []
    only = args.only_ep or args.only_tp
    control = f"decoder.layers.{base.num_layers - 1}.mlp.router"
    rows: List[Dict[str, Any]] = []

    def add(r: Dict[str, Any]) -> None:
        rows.append(r)
        guard.end_of_row(f"{r['engine']}/{r['model']}/{r['scope']} ep={r['expert_parallel']} "
                         f"tp={r.get('tensor_parallel', 1)}{' perturbed' if r['perturb'] else ''}")
    with (mcore_gpt.cpu_shims() if device.type == "cpu" else contextlib.nullcontext()):
        for engine in engines:
            if device.type == "cpu" and engine.startswith("nvidia"):
                raise SystemExit(f"engine {engine} needs CUDA (NVIDIA's MegatronFSDP builds CUDA streams)")
        # what each model runs (layer spec, experts, dispatcher, grouped GEMM, fused permute, EP), for the record
        layouts = {} if only else {m: mcore_gpt.layout(mcore_gpt.spec(m, device).model) for m in dict(CASES)}
        for ep in eps:
            for m in EP_MODELS:
                shape = mcore_gpt.base_shape(device, m, expert_parallel_size=ep, **ep_overrides(m, ep))
                layouts[f"{m}/ep{ep}"] = mcore_gpt.layout(mcore_gpt.spec(m, device, shape).model)
        for tp in tps:
            shape = mcore_gpt.base_shape(device, "dense", tensor_parallel_size=tp)
            layouts[f"dense/tp{tp}"] = mcore_gpt.layout(mcore_gpt.spec("dense", device, shape).model)
        for engine in [] if only else engines:
            for model, scope in CASES:
                add(row(engine, model, scope, device, args.backend, None))
                rows[-1]["layout"] = layouts[model]
            add(row(engine, "moe_alltoall", "attn_router", device, args.backend, control))
            rows[-1]["layout"] = layouts["moe_alltoall"]
            _print(rows[-len(CASES) - 1:])
        for ep in eps:
            # model by model, the alltoall dispatcher's rows (and the controls) first: a row that raises on one rank
            # ends the run (RowGuard), and the alltoall rows are the ones Megatron trains EP with
            for model in EP_MODELS:
                for engine in engines:
                    if engine not in EP_ENGINES:
                        if model == EP_MODELS[0]:
                            add(refused_row(engine, device, ep))
                            _print(rows[-1:])
                        continue
                    add(row(engine, model, "attn_router", device, args.backend, None, ep))
                    rows[-1]["layout"] = layouts[f"{model}/ep{ep}"]
                    if model == "moe_alltoall":
                        add(row(engine, model, "attn_router", device, args.backend, control, ep))
                        rows[-1]["layout"] = layouts[f"{model}/ep{ep}"]
                    _print(rows[-2:] if model == "moe_alltoall" else rows[-1:])
        tp_control = f"decoder.layers.{base.num_layers - 1}.mlp"
        for tp in tps:
            for engine in engines:
                if engine not in TP_ENGINES:
                    add(refused_row(engine, device, tensor_parallel=tp))
                    _print(rows[-1:])
                    continue
                for scope in TP_SCOPES:
                    add(row(engine, "dense", scope, device, args.backend, None, tensor_parallel=tp))
                    rows[-1]["layout"] = layouts[f"dense/tp{tp}"]
                add(row(engine, "dense", "attn_mlp", device, args.backend, tp_control, tensor_parallel=tp))
                rows[-1]["layout"] = layouts[f"dense/tp{tp}"]
                _print(rows[-len(TP_SCOPES) - 1:])
                if engine == "nvidia_mcore":  # the TP sum of the norms' gradients, and its negative control
                    for untag in (False, True):
                        add(tp_norms_row(device, tp, untag=untag))
                    _print(rows[-2:])
    ok = bool(rows) and all(r["ok"] for r in rows)
    if dist.get_rank() == 0:
        from fsdp_cudagraph.capture import te as _te

        record = {"ok": ok, "rows": rows, "layouts": layouts, "world_size": dist.get_world_size(),
                  "expert_parallel_sizes": eps, "tensor_parallel_sizes": tps, "command": sys.argv,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "versions": {"torch": torch.__version__, "megatron_core": mcore_gpt.MCORE_VERSION,
                               "transformer_engine": str(_te.TE_VERSION) if _te.HAS_TE else None,
                               "python": sys.version.split()[0]}}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        failed = [f"{r['engine']}/{r['model']}/{r['scope']}/ep{r['expert_parallel']}/tp{r.get('tensor_parallel', 1)}"
                  f"{'/perturb' if r['perturb'] else ''}" for r in rows if not r["ok"]]
        print(json.dumps({"ok": ok, "rows": len(rows), "expert_parallel_sizes": eps, "tensor_parallel_sizes": tps,
                          "failed": failed}))
    if tps and device.type == "cuda":
        # [Note: no destroy after captured NCCL collectives] in tests/gpu/scripts/tp_graphs.py: the TP rows captured
        # NCCL collectives into graphs; destroy_process_group() hung there afterwards. Leave once every rank is here.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
