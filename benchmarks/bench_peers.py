"""FSDP engines side by side: our megatron_fsdp, PyTorch FSDP2, NVIDIA Megatron-FSDP 0.6.1 (PyPI), eager; and
our full-iteration graph against FSDP2 captured the torchtitan way.

Same reference GPT (fsdp_cudagraph/apps/model.py, loaded by file path so that no process imports the
fsdp_cudagraph package), same seed, same synthetic data, bf16 compute with fp32 main weights and fp32
gradient reduction, torch.optim.Adam(lr=1e-4), ZeRO-3, FSDP unit = TransformerBlock. Engines ``ours``,
``fsdp2``, ``mfsdp`` run eagerly; ``ours_full`` is ours with the step's forward+backward in one CUDA graph
(``FullIterationCudaGraph``, double buffer on, optimizer eager) and ``fsdp2_graph`` is FSDP2 with
forward+backward captured by ``torch.cuda.graph`` as torchtitan does (``_fsdp2_graph.py``; if torch cannot
capture FSDP2, its JSON records the error instead of times). Both capture after 3 of the warmup steps.

The PyPI package is also called ``megatron_fsdp``, so every engine runs in its own torchrun process; the
Megatron-FSDP one from a temporary cwd with PYTHONPATH = an extracted copy of the wheels (megatron_fsdp,
einops) and without the repository root. Everything at once on 2 GPUs (rank 0 of each child writes its
JSON; this launcher merges them and adds ratios)::

    python benchmarks/bench_peers.py --engine all --wheel-dir .whl --out benchmarks/results/peers.json

One engine at a time (NVLink multicast must stay off on the GPU machines used for the records)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 2 benchmarks/bench_peers.py --engine ours --out /tmp/ours.json
    torchrun --nproc-per-node 2 benchmarks/bench_peers.py --engine fsdp2 --out /tmp/fsdp2.json
    torchrun --nproc-per-node 2 benchmarks/bench_peers.py --engine ours_full --out /tmp/ours_full.json
    torchrun --nproc-per-node 2 benchmarks/bench_peers.py --engine fsdp2_graph --out /tmp/fsdp2_graph.json
    for w in .whl/megatron_fsdp-0.6.1-*.whl .whl/einops-*.whl; do python -m zipfile -e "$w" /tmp/mfsdp_site; done
    (R=$PWD; cd /tmp && PYTHONPATH=/tmp/mfsdp_site torchrun --nproc-per-node 2 $R/benchmarks/bench_peers.py \
        --engine mfsdp --mfsdp-path /tmp/mfsdp_site --out /tmp/mfsdp.json)

CPU smoke test (gloo, fp32, no TE; Megatron-FSDP needs CUDA and refuses)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_peers.py --engine ours --device cpu \
        --hidden 64 --layers 2 --seq 32 --steps 3 --warmup 1 --vocab 256 --out /tmp/ours_cpu.json

Defaults: --hidden 1024 --layers 8 --heads 16 --seq 512 --micro-batch 2 --vocab 32000, --warmup 10 untimed
steps then --steps 30 timed ones. Reports the median step time (CUDA events, slowest rank per step),
global tokens/s (world * micro-batch * seq / step time), peak memory (max_memory_allocated since a reset
after warmup, largest rank), per-step losses averaged over ranks.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("ours", "fsdp2", "mfsdp", "ours_full", "fsdp2_graph")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MFSDP_VERSION = "0.6.1"


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES + ("all",), default="all")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=30, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--use-te", action=argparse.BooleanOptionalAction, default=None,
                   help="TE layers (default: when importable and on CUDA)")
    p.add_argument("--double-buffer", action="store_true",
                   help="fsdp_double_buffer (+persist buf on alloc fail) for ours and mfsdp; FSDP2 has none")
    p.add_argument("--nproc-per-node", type=int, default=2, help="--engine all: ranks per engine")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="--engine all: which")
    p.add_argument("--wheel-dir", default=None, help="megatron_fsdp + einops wheels (default .whl/, /tmp/mfsdp)")
    p.add_argument("--mfsdp-path", default=None, help="extracted wheels, put first on sys.path for mfsdp")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/peers.json, peers_<engine>.json for one engine)")
    args = p.parse_args(argv)
    if args.out is None:
        name = "peers.json" if args.engine == "all" else f"peers_{args.engine}.json"
        args.out = os.path.join(REPO, "benchmarks", "results", name)
    return args


def git_commit() -> str:
    if os.environ.get("GIT_COMMIT"):  # a copy of the tree without .git (the GPU machine) passes it in
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a tarball has no git
        return "unknown"


def load_model_code(isolated: bool) -> Any:
    """The reference GPT (``fsdp_cudagraph/apps/model.py``, with its MoE classes from ``apps/moe.py`` and
    ``apps/moe_ep.py`` and its tensor-parallel slices from ``apps/tp.py``, which import only torch), TE probe (``fsdp_cudagraph/capture/te.py``) and FP8 settings
    (``capture/fp8.py``, which imports only torch and the probe).

    ``isolated`` (the Megatron-FSDP process, which must not import our ``megatron_fsdp``): the files are
    loaded from the repository by path, under stand-in ``fsdp_cudagraph``, ``fsdp_cudagraph.capture`` and
    ``fsdp_cudagraph.apps`` packages whose ``__init__`` never runs, so the package's imports (our engine among
    them) stay out of the process. Otherwise a plain import. (bench_peers imports no ``_common`` for this reason:
    that would put the repository on ``sys.path``.)
    """
    if isolated:
        if "fsdp_cudagraph" in sys.modules:
            raise RuntimeError("bench_peers: fsdp_cudagraph is already imported; the isolated engine process must "
                               "load the model before anything imports the package")
        src = os.path.join(REPO, "fsdp_cudagraph")
        for name, path in (("fsdp_cudagraph", src), ("fsdp_cudagraph.capture", os.path.join(src, "capture")),
                           ("fsdp_cudagraph.apps", os.path.join(src, "apps"))):
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [path]
            sys.modules[name] = stand_in
    else:
        sys.path.insert(0, REPO)
    return types.SimpleNamespace(_te=importlib.import_module("fsdp_cudagraph.capture.te"),
                                 model=importlib.import_module("fsdp_cudagraph.apps.model"))


# ------------------------------------------------------------------ engines (one per process)
def wrap_ours(model, TransformerBlock, dtype, args):
    sys.path.insert(0, REPO)
    import megatron_fsdp

    if not os.path.abspath(megatron_fsdp.__file__).startswith(REPO + os.sep):
        raise RuntimeError(f"--engine ours imported megatron_fsdp from {megatron_fsdp.__file__}, not from {REPO}")
    wrapped = megatron_fsdp.fully_shard(
        model, fsdp_unit_modules=[TransformerBlock], sharding_strategy="optim_grads_params", compute_dtype=dtype,
        fsdp_double_buffer=args.double_buffer or args.engine == "ours_full",
        fsdp_db_use_persist_buf_on_alloc_fail=args.double_buffer or args.engine == "ours_full", prefetch=True)
    return wrapped, torch.optim.Adam(wrapped.optimizer_parameters(), lr=args.lr), {"source": "repo"}


def wrap_fsdp2(model, TransformerBlock, dtype, args):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_cudagraph.engines.fsdp2 import shard_fsdp2

    mp = MixedPrecisionPolicy(param_dtype=dtype if dtype != torch.float32 else None, reduce_dtype=torch.float32)
    shard_fsdp2(model, [m for m in model.modules() if isinstance(m, TransformerBlock)], device=args.device, mp_policy=mp)
    return model, torch.optim.Adam(model.parameters(), lr=args.lr), {"source": f"torch {torch.__version__}"}


def wrap_mfsdp(model, TransformerBlock, dtype, args):
    if args.mfsdp_path:
        sys.path.insert(0, os.path.abspath(args.mfsdp_path))
    import megatron_fsdp as mf

    where = os.path.abspath(mf.__file__)
    if where.startswith(REPO + os.sep) or getattr(mf, "__version__", None) != MFSDP_VERSION:
        raise RuntimeError(f"--engine mfsdp needs Megatron-FSDP {MFSDP_VERSION} from the wheel, got "
                           f"{getattr(mf, '__version__', 'no __version__')} at {where}; pass --mfsdp-path")
    # Megatron-FSDP computes in the module's own dtype and keeps fp32 main weights/grads in its buffers,
    # so its fp32 masters start from the bf16-rounded init (the others keep the fp32 init): losses track the
    # peers' to ~1e-4 rather than bit for bit. The first step sees the same bf16 weights everywhere.
    model = model.to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    wrapped, opt = mf.fully_shard(
        model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy="optim_grads_params",
        device=torch.device("cuda", torch.cuda.current_device()),
        mixed_precision_policy=mf.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                       main_grads_dtype=torch.float32),
        fsdp_double_buffer=args.double_buffer, fsdp_db_use_persist_buf_on_alloc_fail=args.double_buffer,
        overlap_grad_reduce=True, overlap_param_gather=True, sync_model_each_microbatch=True)
    # fully_shard_optimizer takes one zero-gradient step to build Adam state eagerly (update 0, step count
    # 1); drop that state so bias correction counts from 0 like the other engines.
    opt.state.clear()
    return wrapped, opt, {"source": where, "version": mf.__version__}


GRAPH_ENGINES = ("ours_full", "fsdp2_graph")
GRAPH_CAPTURE_STEP = 3


def make_graph_step(args: argparse.Namespace, model: Any, opt: Any, code: Any, device: torch.device) -> Any:
    """``step(x, y) -> loss`` of a graph engine: forward, backward, optimizer step and zero_grad."""
    if args.device != "cuda" and args.engine == "fsdp2_graph":
        sys.exit("bench_peers: --engine fsdp2_graph captures CUDA graphs; it needs --device cuda")
    if args.engine == "ours_full":  # on CPU: the protocol backend (the same schedule, no graphs): a smoke test
        from fsdp_cudagraph import CudaGraphConfig, FullIterationCudaGraph

        graph = FullIterationCudaGraph(model, lambda m, x, y: code.model.loss_fn(m(x), y),
                                       CudaGraphConfig(cuda_graph_impl="full_iteration",
                                                       cuda_graph_warmup_steps=GRAPH_CAPTURE_STEP))

        def ours_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = graph.step([(x, y)])[0]
            graph.optimizer_step(opt)
            opt.zero_grad(set_to_none=True)
            return loss

        return ours_step
    from _fsdp2_graph import Fsdp2GraphStep

    def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = code.model.loss_fn(model(x), y)
        loss.backward()
        return loss

    fsdp2 = Fsdp2GraphStep(fwd_bwd, warmup=GRAPH_CAPTURE_STEP, device=device)

    def fsdp2_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = fsdp2(x, y)
        opt.step()
        opt.zero_grad(set_to_none=False)  # FSDP2 accumulates into the gradients that existed at capture
        return loss

    return fsdp2_step


def write_failure(args: argparse.Namespace, exc: BaseException, step: int) -> int:
    """Rank 0 writes why a graph engine failed (e.g. torch cannot capture FSDP2) instead of times."""
    import traceback

    if dist.get_rank() == 0:
        traceback.print_exc()
        result = {"engine": args.engine, "error": f"{type(exc).__name__}: {exc}"[:3000], "failed_at_step": step,
                  "torch": torch.__version__, "command": " ".join([sys.executable] + sys.argv),
                  "git_commit": git_commit()}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[{args.engine}] failed at step {step}: {result['error'][:300]}")
    return 0


# ------------------------------------------------------------------ one engine, under torchrun
def worker(args: argparse.Namespace) -> int:
    if args.engine == "mfsdp" and args.device != "cuda":
        sys.exit("bench_peers: Megatron-FSDP 0.6.1 runs on CUDA with NCCL only (it builds a 'cuda' "
                 "DeviceMesh and CUDA streams); drop --device cpu or use --engine ours/fsdp2")
    for k, v in NVLS_OFF.items():
        os.environ.setdefault(k, v)
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            sys.exit("bench_peers: --device cuda but no GPU is visible; use --device cpu for the smoke test")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    code = load_model_code(isolated=args.engine == "mfsdp")
    use_te = (code._te.HAS_TE and cuda) if args.use_te is None else args.use_te
    if use_te and not (cuda and code._te.HAS_TE):
        sys.exit(f"bench_peers: --use-te needs CUDA and TE: {code._te.TE_REASON or 'on CPU'}")
    cfg = code.model.GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                               seq_len=args.seq, vocab_size=args.vocab, use_te=use_te)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(args.seed)
    model = code.model.GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    wrap = {"ours": wrap_ours, "fsdp2": wrap_fsdp2, "mfsdp": wrap_mfsdp, "ours_full": wrap_ours,
            "fsdp2_graph": wrap_fsdp2}[args.engine]
    model, opt, engine_info = wrap(model, code.model.TransformerBlock, dtype, args)
    graph_step = make_graph_step(args, model, opt, code, device) if args.engine in GRAPH_ENGINES else None

    mbs, total = args.micro_batch, args.warmup + args.steps
    losses, events, host_ms = [], [], []
    base_mem = 0
    for step in range(total):
        x, y = code.model.synthetic_batch(step, mbs * world, cfg, device, seed=args.seed)
        x, y = x[rank * mbs:(rank + 1) * mbs], y[rank * mbs:(rank + 1) * mbs]
        timed = step >= args.warmup
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
        if timed and cuda:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        t0 = time.perf_counter()
        if graph_step is not None:
            try:
                loss = graph_step(x, y)
            except Exception as exc:  # noqa: BLE001 - a capture that fails is a result: record why
                return write_failure(args, exc, step)
        else:
            loss = code.model.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if timed and cuda:
            events[-1][1].record()
        elif timed:
            host_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach().float())
        if rank == 0:
            bar = "#" * (20 * (step + 1) // total)
            print(f"\r[{args.engine}] step {step + 1}/{total} [{bar:<20}]", end="", file=sys.stderr, flush=True)
    if cuda:
        torch.cuda.synchronize()
        host_ms = [s.elapsed_time(e) for s, e in events]
    if rank == 0:
        print(file=sys.stderr)
    # Slowest rank per step, largest peak over ranks, losses averaged over ranks (gloo has no AVG).
    ms = torch.tensor(host_ms, dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    mem = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0, base_mem,
                        torch.cuda.max_memory_reserved() if cuda else 0], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    loss_t = torch.stack(losses).to(torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= world
    step_ms = ms.tolist()
    median = statistics.median(step_ms)
    tokens = world * mbs * args.seq
    if rank == 0:
        te_v = code._te.TE_VERSION
        result = {
            "engine": args.engine, "engine_info": engine_info, "world_size": world, "device": str(device),
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "te": str(te_v) if te_v is not None else None, "use_te": use_te,
            "command": " ".join([sys.executable] + sys.argv), "git_commit": git_commit(),
            "config": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                       "micro_batch": mbs, "vocab": args.vocab, "warmup": args.warmup, "steps": args.steps,
                       "lr": args.lr, "seed": args.seed, "compute_dtype": str(dtype),
                       "double_buffer": args.double_buffer, "params": n_params,
                       "nvls_env": {k: os.environ.get(k) for k in NVLS_OFF}},
            "median_step_ms": median, "step_ms": step_ms, "tokens_per_step": tokens,
            "tokens_per_s": tokens / (median * 1e-3),
            "peak_memory_gib": mem[0].item() / 2**30, "memory_after_warmup_gib": mem[1].item() / 2**30,
            "peak_reserved_gib": mem[2].item() / 2**30,
            "losses": loss_t.tolist(),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[{args.engine}] median {median:.2f} ms/step, {result['tokens_per_s']:.0f} tokens/s, peak "
              f"{result['peak_memory_gib']:.3f} GiB, loss {loss_t[0].item():.4f} -> {loss_t[-1].item():.4f}")
    dist.barrier()  # no rank tears Gloo down while rank 0 still writes (that aborted rank 1 at exit on CPU)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ launcher for --engine all
def stage_mfsdp(args: argparse.Namespace, tmp: str) -> str:
    site = os.path.abspath(args.mfsdp_path or os.path.join(tmp, "mfsdp_site"))
    if os.path.isfile(os.path.join(site, "megatron_fsdp", "__init__.py")):
        return site
    dirs = [args.wheel_dir] if args.wheel_dir else [os.path.join(REPO, ".whl"), "/tmp/mfsdp"]
    wheels = [w for d in dirs for w in sorted(glob.glob(os.path.join(d, "*.whl")))]
    if not any(os.path.basename(w).startswith(f"megatron_fsdp-{MFSDP_VERSION}-") for w in wheels):
        raise FileNotFoundError(f"no megatron_fsdp-{MFSDP_VERSION}-*.whl in {dirs}; pass --wheel-dir")
    os.makedirs(site, exist_ok=True)
    for w in wheels:
        if os.path.basename(w).split("-")[0] in ("megatron_fsdp", "einops"):
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
    return site


def child_argv(args: argparse.Namespace, engine: str, out: str, site: str) -> List[str]:
    a = ["--engine", engine, "--device", args.device, "--out", out, "--hidden", args.hidden, "--layers",
         args.layers, "--heads", args.heads, "--seq", args.seq, "--micro-batch", args.micro_batch, "--vocab",
         args.vocab, "--steps", args.steps, "--warmup", args.warmup, "--lr", args.lr, "--seed", args.seed]
    if args.use_te is not None:
        a.append("--use-te" if args.use_te else "--no-use-te")
    if args.double_buffer:
        a.append("--double-buffer")
    if engine == "mfsdp":
        a += ["--mfsdp-path", site]
    return [str(v) for v in a]


def launch_all(args: argparse.Namespace, argv: List[str]) -> int:
    tmp = tempfile.mkdtemp(prefix="bench_peers_")
    engines = list(dict.fromkeys(args.engines))
    runs: Dict[str, Any] = {}
    site = None
    for engine in engines:
        if engine == "mfsdp" and args.device != "cuda":
            runs[engine] = {"error": "skipped: Megatron-FSDP needs CUDA"}
            continue
        env = {**os.environ, **NVLS_OFF}
        cwd = REPO
        if engine == "mfsdp":
            site = site or stage_mfsdp(args, tmp)
            keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                    if p and os.path.abspath(p) != REPO and os.path.abspath(p) != os.getcwd()]
            env["PYTHONPATH"], cwd = os.pathsep.join([site] + keep), tmp
        out = os.path.join(tmp, f"{engine}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc_per_node), os.path.abspath(__file__)] + child_argv(args, engine, out, site or "")
        print(f"== {engine}: {' '.join(cmd)}  (cwd {cwd})", flush=True)
        rc = subprocess.run(cmd, env=env, cwd=cwd).returncode
        if rc == 0 and os.path.isfile(out):
            with open(out) as f:
                runs[engine] = json.load(f)
        else:
            runs[engine] = {"error": f"torchrun exited {rc}", "command": " ".join(cmd)}
    ok = {e: r for e, r in runs.items() if "error" not in r}
    summary: Dict[str, Any] = {}
    if ok:
        best = max(r["tokens_per_s"] for r in ok.values())
        low = min(r["peak_memory_gib"] for r in ok.values())
        for e, r in ok.items():
            summary[e] = {"median_step_ms": r["median_step_ms"], "tokens_per_s": r["tokens_per_s"],
                          "tokens_per_s_vs_best": r["tokens_per_s"] / best, "peak_memory_gib": r["peak_memory_gib"],
                          "peak_memory_vs_lowest": r["peak_memory_gib"] / low if low else None, "first_loss": r["losses"][0],
                          "last_loss": r["losses"][-1]}
        peers = [e for e in ok if e not in ("ours",) + GRAPH_ENGINES]  # eager against eager
        if "ours_full" in ok and "fsdp2_graph" in ok:
            summary["graphs"] = {"ours_full_vs_fsdp2_graph_step_ratio":
                                 ok["ours_full"]["median_step_ms"] / ok["fsdp2_graph"]["median_step_ms"]}
        if "ours" in ok and peers:
            bp = max(peers, key=lambda e: ok[e]["tokens_per_s"])
            lp = min(peers, key=lambda e: ok[e]["peak_memory_gib"])
            summary["ours_vs_peers"] = {
                "best_peer": bp, "tokens_per_s_ratio": ok["ours"]["tokens_per_s"] / ok[bp]["tokens_per_s"],
                "lowest_memory_peer": lp,
                "peak_memory_ratio": ok["ours"]["peak_memory_gib"] / ok[lp]["peak_memory_gib"]
                if ok[lp]["peak_memory_gib"] else None}
        first = [r["losses"][0] for r in ok.values()]
        spread = max(first) - min(first)
        # bf16 has 8 mantissa bits (eps 2^-7 relative); first-step losses see the same bf16 weights.
        summary["first_loss_spread"] = spread
        summary["first_loss_agree_bf16"] = spread <= 2**-7 * max(abs(v) for v in first)
        summary["use_te"] = sorted({str(r["use_te"]) for r in ok.values()})
    any_r = next(iter(ok.values()), {})
    merged = {
        "benchmark": "bench_peers", "command": " ".join([sys.executable] + argv), "git_commit": git_commit(),
        "device_name": any_r.get("device_name"), "torch": any_r.get("torch"), "cuda": any_r.get("cuda"),
        "nccl": any_r.get("nccl"), "te": any_r.get("te"), "config": any_r.get("config"),
        "nproc_per_node": args.nproc_per_node, "summary": summary, "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 1 if any(r.get("error", "").startswith("torchrun") for r in runs.values()) else 0


def main() -> int:
    argv = sys.argv
    args = parse_args(argv[1:])
    if args.engine == "all":
        return launch_all(args, argv)
    return worker(args)


if __name__ == "__main__":
    from fsdp_cudagraph.checker.records import exit_process  # noqa: PLC0415 - [Note: a group another library keeps alive]

    exit_process(main())
