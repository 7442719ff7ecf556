"""megatron-core's GPTModel (dense, MoE alltoall, MoE allgather) under each FSDP engine with partial graphs, on N GPUs.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python tests/gpu/scripts/mcore_gpt.py --out mcore-1.json                      # 1 GPU
    CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --out mcore-2.json  # 2 GPUs
    torchrun --nproc-per-node 2 tests/gpu/scripts/mcore_gpt.py --device cpu --out mcore-cpu.json                   # Gloo

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
"""

import argparse
import contextlib
import json
import os
import sys
import traceback
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.gpu_utils import init_script_ranks  # noqa: E402

#: engine row name -> (checker engine, nvidia wrapper)
ENGINES = {"megatron_fsdp": ("megatron_fsdp", None), "nvidia": ("nvidia", "fully_shard"),
           "nvidia_mcore": ("nvidia", "mcore"), "fsdp2": ("fsdp2", None)}
CASES = [("dense", "layer"), ("dense", "attn_mlp"), ("moe_alltoall", "attn_router"), ("moe_allgather", "attn_router")]


def row(engine: str, model: str, scope: str, device: torch.device, backend: Optional[str],
        perturb: Optional[str]) -> Dict[str, Any]:
    from fsdp_cudagraph.apps import mcore_gpt

    name, wrapper = ENGINES[engine]
    out: Dict[str, Any] = {"engine": engine, "model": model, "scope": scope, "perturb": perturb}
    try:
        report = mcore_gpt.run(model=model, engine=name, scope=scope, device=device, backend=backend,
                               perturb=perturb, nvidia_wrapper=wrapper)
    except Exception as exc:  # recorded: one failing row must not hide the others
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        return out
    ok = report.culprit == perturb and not report.equal if perturb else report.equal
    out.update(ok=ok, equal=report.equal, params_equal=report.params_equal, culprit=report.culprit,
               backend=report.backend, precision=report.precision, callables=report.callables,
               losses=[(s["eager_loss"], s["graphed_loss"]) for s in report.steps],
               calls=report.calls, attention_backends=report.attention_backends, unknown_hooks=report.unknown_hooks)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--engines", nargs="*", choices=sorted(ENGINES), default=None,
                   help="default: all three on CUDA, megatron_fsdp on the CPU")
    p.add_argument("--backend", choices=["te", "torch", "protocol"], default=None)
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = init_script_ranks(args.device, args.port)
    from fsdp_cudagraph.apps import mcore_gpt

    engines = args.engines or (sorted(ENGINES) if device.type == "cuda" else ["fsdp2", "megatron_fsdp"])
    rows: List[Dict[str, Any]] = []
    with (mcore_gpt.cpu_shims() if device.type == "cpu" else contextlib.nullcontext()):
        # what each model runs (layer spec, experts, dispatcher, grouped GEMM, fused permute), for the record
        layouts = {m: mcore_gpt.layout(mcore_gpt.spec(m, device).model) for m in dict(CASES)}
        for engine in engines:
            if device.type == "cpu" and engine.startswith("nvidia"):
                raise SystemExit(f"engine {engine} needs CUDA (NVIDIA's MegatronFSDP builds CUDA streams)")
            for model, scope in CASES:
                rows.append(row(engine, model, scope, device, args.backend, None))
                rows[-1]["layout"] = layouts[model]
            layers = mcore_gpt.base_shape(device, "moe_alltoall").num_layers
            rows.append(row(engine, "moe_alltoall", "attn_router", device, args.backend,
                            f"decoder.layers.{layers - 1}.mlp.router"))
            rows[-1]["layout"] = layouts["moe_alltoall"]
            if dist.get_rank() == 0:
                for r in rows[-len(CASES) - 1:]:
                    print(f"{r['engine']:14s} {r['model']:14s} {r['scope']:12s} perturb={bool(r['perturb'])!s:5s} "
                          f"ok={r['ok']} {r.get('error', '')}", flush=True)
    ok = bool(rows) and all(r["ok"] for r in rows)
    if dist.get_rank() == 0:
        from fsdp_cudagraph.capture import te as _te

        record = {"ok": ok, "rows": rows, "layouts": layouts, "world_size": dist.get_world_size(), "command": sys.argv,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "versions": {"torch": torch.__version__, "megatron_core": mcore_gpt.MCORE_VERSION,
                               "transformer_engine": str(_te.TE_VERSION) if _te.HAS_TE else None,
                               "python": sys.version.split()[0]}}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(json.dumps({"ok": ok, "rows": len(rows), "failed": [
            f"{r['engine']}/{r['model']}/{r['scope']}{'/perturb' if r['perturb'] else ''}" for r in rows if not r["ok"]]}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
