"""Partial CUDA graphs under a released FSDP engine: bit-exact against the same engine eagerly, and step times.

The same small TE GPT (``fsdp_cudagraph``'s reference model, TE layers, bf16, seed fixed, synthetic data)
trains ``--steps`` steps on the default CUDA stream, as a user writes the loop:

- ``eager``: the engine alone;
- ``te`` / ``torch``: the same, with ``fsdp_cudagraph.PartialCudaGraphs(model, CudaGraphConfig(...),
  backend=...)`` built before the first step (whole FSDP units graphed) and ``capture()`` after
  ``--capture-step`` eager steps.

Every loss and every final optimizer parameter of a graphed run must be ``torch.equal`` to the eager run's.
Negative controls: a parameter moved after capture must raise before the replay; an unsafe engine setting
must be refused when ``PartialCudaGraphs`` is built; the double buffer must refuse to move a unit's bucket.
Step time: median over the steps after capture, CUDA events, eager and graphed in one process.

Engines (``--engine``):
- ``nvidia_mfsdp``: NVIDIA Megatron-FSDP through megatron-core's bundled copy
  (``megatron.core.distributed.fsdp.src.megatron_fsdp``; megatron-core 0.19.2 = Megatron-FSDP 0.6.1),
  ZeRO-3 with ``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``.
- ``fsdp2``: PyTorch FSDP2; a hook left for the FSDP2 adapter's author (see :func:`build_fsdp2`).

One H100 (megatron-core 0.19.2 on Python 3.12, TE 2.20.2, torch 2.11)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 1 benchmarks/engines_align.py --engine nvidia_mfsdp \\
        --out benchmarks/results/engines_align_nvidia_mfsdp.json

(plain ``python benchmarks/engines_align.py ...`` runs as a one-rank group too). Exit status 0 only if every
graphed run matched and every control was caught. ``--help`` works without CUDA or megatron.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("nvidia_mfsdp", "fsdp2")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, default="nvidia_mfsdp")
    p.add_argument("--backends", nargs="+", choices=("te", "torch"), default=["te", "torch"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capture-step", type=int, default=3, help="eager steps before capture()")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    p.add_argument("--fsdp2-whole", action="store_true",
                   help="--engine fsdp2: also capture forward+backward whole, the torchtitan way (optional)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/engines_align_<engine>.json)")
    args = p.parse_args(argv)
    if args.capture_step < 1 or args.capture_step >= args.steps:
        p.error(f"--capture-step {args.capture_step} must be >= 1 and < --steps {args.steps}: capture needs an "
                "eager step before it and steps after it to compare")
    if args.out is None:
        args.out = os.path.join(REPO, "benchmarks", "results", f"engines_align_{args.engine}.json")
    return args


# ------------------------------------------------------------------ environment
def init(args: argparse.Namespace) -> Any:
    """One rank per process on its GPU (torchrun, or a one-rank group); deterministic kernels."""
    import torch
    import torch.distributed as dist

    for k, v in NVLS_OFF.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
        dist.init_process_group("nccl", device_id=device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return device


def versions(engine_info: Dict[str, Any]) -> Dict[str, Any]:
    import platform

    import torch

    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - a copy of the tree without .git
            commit = "unknown"
    try:
        import transformer_engine

        te = transformer_engine.__version__
    except ImportError as exc:
        te = f"absent ({exc})"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "te": te,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version(),
            "device": torch.cuda.get_device_name(), "commit": commit, **engine_info}


def model_code() -> Any:
    """The reference GPT (an application module of fsdp_cudagraph; apps/ after the layout refactor)."""
    try:
        from fsdp_cudagraph.apps import model as gpt
    except ImportError:
        from fsdp_cudagraph import model as gpt
    return gpt


# ------------------------------------------------------------------ engines
def build_nvidia_mfsdp(args: argparse.Namespace, device: Any, *, persist: bool = True) -> Tuple[Any, Any, Dict]:
    """The GPT under NVIDIA Megatron-FSDP (megatron-core's copy), ZeRO-3, with the settings partial graphs need."""
    import torch
    from megatron.core.distributed.fsdp.src import megatron_fsdp as mf

    gpt = model_code()
    cfg = gpt.GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq,
                        vocab_size=args.vocab, use_te=True)
    torch.manual_seed(args.seed)
    model = gpt.GPT(cfg).to(device=device, dtype=torch.bfloat16)  # NVIDIA computes in the module's dtype
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, opt = mf.fully_shard(
        model, opt, fsdp_unit_modules=[gpt.TransformerBlock], zero_dp_strategy="optim_grads_params", device=device,
        mixed_precision_policy=mf.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                       main_grads_dtype=torch.float32),
        fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=persist,
        overlap_grad_reduce=True, overlap_param_gather=True, sync_model_each_microbatch=True)
    opt.state.clear()  # fully_shard_optimizer's eager zero step would start Adam's count at 1
    import megatron.core

    return model, opt, {"engine": "NVIDIA Megatron-FSDP", "megatron_fsdp": mf.__version__,
                        "megatron_core": megatron.core.__version__, "unsafe_setting":
                        "fsdp_db_use_persist_buf_on_alloc_fail=False"}


def build_fsdp2(args: argparse.Namespace, device: Any, *, persist: bool = True) -> Tuple[Any, Any, Dict]:
    """PyTorch FSDP2: left for the FSDP2 adapter (branch ``fsdp2``, ``fsdp_cudagraph.engines.fsdp2``) to fill.

    Fill in: the GPT with ``fully_shard`` on each ``TransformerBlock`` and on the root (mixed precision bf16
    compute, fp32 reduce), ``keep_unsharded_storage(model)`` for address-stable ZeRO-3 when ``persist`` is
    True (False: the unsafe setting, which ``PartialCudaGraphs`` must refuse), and an ``info`` dict with
    ``unsafe_setting``. The rest of this script (runs, comparison, controls, timing) is engine-agnostic.
    ``--fsdp2-whole`` is for an optional extra run capturing forward+backward whole, as torchtitan does
    (``benchmarks/_fsdp2_graph.py``), compared the same way.
    """
    raise NotImplementedError("engines_align --engine fsdp2 is not filled in yet: build_fsdp2 is the hook for the "
                              "FSDP2 adapter (fsdp_cudagraph.engines.fsdp2); use --engine nvidia_mfsdp")


BUILDERS: Dict[str, Callable[..., Tuple[Any, Any, Dict]]] = {"nvidia_mfsdp": build_nvidia_mfsdp, "fsdp2": build_fsdp2}


def graph_config(args: argparse.Namespace, backend: str) -> Any:
    from fsdp_cudagraph import CudaGraphConfig

    return CudaGraphConfig(cuda_graph_impl="transformer_engine" if backend == "te" else "local",
                           cuda_graph_modules=[], cuda_graph_warmup_steps=args.capture_step,
                           use_megatron_fsdp=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True)


def make_graphs(model: Any, args: argparse.Namespace, backend: str) -> Any:
    """PartialCudaGraphs over the engine's units, refusing a checkout whose graph layer predates the contract."""
    import fsdp_cudagraph
    from fsdp_cudagraph.engines import EngineAdapter, adapter_for

    adapter = adapter_for(model)
    if adapter is None:
        raise RuntimeError(f"no registered engine adapter recognises {type(model).__module__}."
                           f"{type(model).__qualname__}; registered: {fsdp_cudagraph.engines.registered_engines()}")
    graphs = fsdp_cudagraph.PartialCudaGraphs(model, graph_config(args, backend), backend=backend)
    if not isinstance(getattr(graphs, "engine", None), EngineAdapter):
        raise RuntimeError("this checkout's PartialCudaGraphs does not speak to engines through "
                           "fsdp_cudagraph.engines.adapter_for (merge the layout refactor first)")
    return graphs


# ------------------------------------------------------------------ one run
def train(args: argparse.Namespace, device: Any, backend: Optional[str]) -> Dict[str, Any]:
    """``--steps`` steps on the default stream; ``backend`` None: eager. Losses, final params, step times."""
    import torch
    import torch.distributed as dist

    gpt = model_code()
    torch.cuda.set_stream(torch.cuda.default_stream(device))  # each run starts as a user's loop: default stream
    model, opt, info = BUILDERS[args.engine](args, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt.GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq,
                        vocab_size=args.vocab, use_te=True)
    graphs = make_graphs(model, args, backend) if backend is not None else None
    matcher = None
    if graphs is None:  # the eager baseline runs the attention backend a graph would (as the graphed run does)
        from fsdp_cudagraph import CudaGraphConfig, match_graph_attention

        matcher = match_graph_attention(model.module, CudaGraphConfig(
            cuda_graph_impl="transformer_engine", cuda_graph_module_patterns=["TransformerBlock"]))
    losses, times, capture_s, report = [], [], None, None
    mbs = args.micro_batch
    for step in range(args.steps):
        x, y = gpt.synthetic_batch(step, mbs * world, cfg, device, seed=args.seed)
        x, y = x[rank * mbs:(rank + 1) * mbs], y[rank * mbs:(rank + 1) * mbs]
        if graphs is not None and step == args.capture_step:
            t0 = time.perf_counter()
            report = graphs.capture()
            capture_s = time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = gpt.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        end.record()
        losses.append(loss.detach().float().clone())
        times.append((start, end))
    torch.cuda.synchronize()
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu().clone()
              for g in opt.param_groups for p in g["params"]]
    step_ms = [s.elapsed_time(e) for s, e in times]
    if matcher is not None:
        matcher.uninstall()
    if graphs is not None:
        graphs.delete()
    return {"backend": backend or "eager", "losses": [v.item() for v in losses], "_losses": losses,
            "_params": params, "step_ms": step_ms, "capture_s": capture_s, "info": info,
            "median_step_ms_after_capture": statistics.median(step_ms[args.capture_step + 1:]),
            "callables": report.callables if report is not None else None,
            "unknown_hooks": report.unknown_hooks if report is not None else None}


def compare(eager: Dict[str, Any], graphed: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    loss_eq = [bool(torch.equal(a, b)) for a, b in zip(eager["_losses"], graphed["_losses"])]
    param_eq = [bool(torch.equal(a, b)) for a, b in zip(eager["_params"], graphed["_params"])]
    same_count = len(eager["_params"]) == len(graphed["_params"]) and len(loss_eq) == len(eager["_losses"])
    return {"equal": same_count and all(loss_eq) and all(param_eq),
            "first_loss_mismatch_step": next((i for i, ok in enumerate(loss_eq) if not ok), None),
            "params_equal": sum(param_eq), "params_total": len(eager["_params"]),
            "step_ratio_graphed_vs_eager": graphed["median_step_ms_after_capture"] / eager["median_step_ms_after_capture"]}


# ------------------------------------------------------------------ negative controls
def controls(args: argparse.Namespace, device: Any, backend: str) -> List[Dict[str, Any]]:
    """Runs that must fail, each recorded with how."""
    import torch

    from fsdp_cudagraph.engines import adapter_for
    from fsdp_cudagraph.engines.nvidia_megatron_fsdp import identify_hook

    gpt = model_code()
    cfg = gpt.GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq,
                        vocab_size=args.vocab, use_te=True)
    out: List[Dict[str, Any]] = []

    def expect(name: str, fn: Callable[[], Any], exc: Any, must_say: str) -> None:
        try:
            fn()
            out.append({"control": name, "backend": backend, "caught": False, "detail": "no error"})
        except exc as e:  # noqa: PERF203
            msg = f"{type(e).__name__}: {e}"
            out.append({"control": name, "backend": backend, "caught": must_say in msg, "detail": msg[:600]})

    # 1. An unsafe setting: refused when PartialCudaGraphs is built, before any step.
    def unsafe() -> None:
        model, _, _ = BUILDERS[args.engine](args, device, persist=False)
        make_graphs(model, args, backend)

    expect("unsafe engine setting refused at construction", unsafe, ValueError, "fsdp_db_use_persist_buf_on_alloc_fail")

    def captured() -> Tuple[Any, Any, Any, Any, Any]:
        model, opt, _ = BUILDERS[args.engine](args, device)
        graphs = make_graphs(model, args, backend)
        x, y = gpt.synthetic_batch(0, args.micro_batch, cfg, device, seed=args.seed)
        gpt.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        graphs.capture()
        return model, opt, graphs, x, y

    # 2. A parameter moved after capture, between the engine's unshard and the replay: the address check raises.
    def moved() -> None:
        model, _, graphs, x, y = captured()
        unit = adapter_for(model).unit_modules()[1]
        param = next(unit.parameters())

        def move(module: Any, args_: Any, kwargs: Any) -> None:
            param.data = param.data.clone()  # what a bucket moved to the other slot does to the parameters

        handle = unit.register_forward_pre_hook(move, with_kwargs=True)
        hooks = unit._forward_pre_hooks
        items = list(hooks.items())
        unshard = next(i for i, (_, h) in enumerate(items) if (identify_hook(h, model) or ("",))[0] == "pre_forward")
        mover = items.pop()  # run the mover right after NVIDIA's unshard, before the graph layer's check
        items.insert(unshard + 1, mover)
        hooks.clear()
        hooks.update(items)
        try:
            gpt.loss_fn(model(x), y).backward()
        finally:
            handle.remove()
            graphs.delete()

    expect("parameter moved before replay", moved, RuntimeError, "captured at")

    # 3. The double buffer asked to move a unit's bucket (its slot held by the unit two places on): refused.
    def slot_taken() -> None:
        model, _, graphs, x, y = captured()
        buffer = model.param_and_grad_buffer
        units = adapter_for(model).unit_modules()
        twin = buffer.param_to_param_group[next(units[2].parameters())]
        wbuf = buffer.parameter_groups[twin].model_weight_buffer
        wbuf.fetch_bucket()  # unit 2 now holds slot 0, which unit 0 needs next
        try:
            gpt.loss_fn(model(x), y).backward()
        finally:
            wbuf.free_bucket_storage()
            graphs.delete()

    if args.engine == "nvidia_mfsdp" and args.layers >= 3:
        expect("double buffer asked to move a unit", slot_taken, RuntimeError, "would move bucket")
    torch.cuda.synchronize()
    return out


# ------------------------------------------------------------------ main
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("engines_align captures CUDA graphs and needs a GPU; nothing to run here (see --help).")
        return 0
    device = init(args)
    import torch.distributed as dist

    rank = dist.get_rank()
    record: Dict[str, Any] = {"command": " ".join([sys.executable] + sys.argv), "engine": args.engine,
                              "config": {k: v for k, v in vars(args).items() if k != "out"}, "runs": {},
                              "comparisons": {}, "controls": []}
    ok = True
    eager = train(args, device, None)
    record["versions"] = versions(eager["info"])
    record["runs"]["eager"] = {k: v for k, v in eager.items() if not k.startswith("_")}
    for backend in args.backends:
        try:
            graphed = train(args, device, backend)
        except Exception as exc:  # noqa: BLE001 - a failed run is a result
            record["runs"][backend] = {"error": f"{type(exc).__name__}: {exc}"[:3000],
                                       "traceback": traceback.format_exc()[-4000:]}
            ok = False
            continue
        record["runs"][backend] = {k: v for k, v in graphed.items() if not k.startswith("_")}
        record["comparisons"][backend] = cmp = compare(eager, graphed)
        ok &= cmp["equal"]
        if rank == 0:
            print(f"[{args.engine}/{backend}] equal={cmp['equal']} params {cmp['params_equal']}/{cmp['params_total']} "
                  f"step {graphed['median_step_ms_after_capture']:.2f} ms vs eager "
                  f"{eager['median_step_ms_after_capture']:.2f} ms, capture {graphed['capture_s']:.2f} s", flush=True)
        if not args.no_controls:
            record["controls"] += controls(args, device, backend)
    ok &= all(c["caught"] for c in record["controls"])
    record["ok"] = ok
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        for c in record["controls"]:
            print(f"[control/{c['backend']}] {c['control']}: caught={c['caught']} ({c['detail'][:160]})")
        print(f"engines_align: {'OK' if ok else 'FAILED'}; wrote {args.out}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
