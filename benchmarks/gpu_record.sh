#!/usr/bin/env bash
# One stage of a GPU record, logs and JSON under $OUT (the device tool's output folder).
#   COMMIT=<sha> bash benchmarks/gpu_record.sh fi|pytest|perf|engines [extra args for engines_align.py]
# fi      the full-iteration alignment matrix on 1 GPU, the graphed-first order, partial graphs under engines
# pytest  `pytest -m gpu` wall time with per-test durations
# perf    bench_partial_graphs --suite full (issue 22's regression check)
# engines benchmarks/engines_align.py alone (all engines; nvidia needs megatron-core, e.g. PYTHONPATH=/tmp/site)
# align   the partial-graph alignment matrix (python -m fsdp_cudagraph.apps.align) on 1 GPU
# profile benchmarks/profile_step.py: the compute step's kernel time by category, ours vs FSDP2 (NPROC=2: 2 GPUs)
# memory  graph memory on the demo's model: benchmarks/graph_memory_snapshot.py (fused wgrad on and off), the demo
# multi   on 2+ GPUs: pytest -m gpu -k 2gpu (every 2-GPU record) and the demo on 2 ranks
# engines2 on 2 GPUs: engines_align.py (fsdp2, megatron_fsdp, nvidia) and the alignment checker per engine,
#         each on 2 ranks (nvidia needs megatron-core: PYTHONPATH=/tmp/site)
# scaling the perf suite on 1 GPU and on 2, bench_peers --engine all on 1 and on 2 (Megatron-FSDP from .whl),
#         the demo on 1 GPU; then, here: python benchmarks/scaling.py perf_goals-1gpu.json perf_goals-2gpu.json
# avg     on NPROC GPUs (default 2): NCCL's AVG against the pre-scaled SUM (tests/gpu/nccl_average.py), the
#         compute profile with AVG and again with the pre-scale (--prescale, our eager column only), what is
#         live at the compute peak (ours vs FSDP2), then the perf suite on NPROC GPUs and on 1
# suites  the end of avg alone: the compute peak's composition on NPROC GPUs, the perf suite on NPROC and on 1
# peak    benchmarks/peak_composition.py: what is allocated at the peak, our eager step vs FSDP2 (compute, launch)
#         (NPROC=2: on 2 GPUs)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD NCCL_NVLS_ENABLE=0
# the records' "commit" (fsdp_cudagraph.checker.records.versions): the device's copy of .git can name an older
# HEAD than the tree that runs (S9: 17c334a in JSON written by 3a60ccd)
[ -n "${COMMIT:-}" ] && export GIT_COMMIT=${GIT_COMMIT:-$COMMIT}
versions() {
  python3 - <<'PY' > "$OUT/versions-$1.json"
import json, os, torch
te_error = None
try:  # before the cuDNN query below: on the 2 x H100 of S9, importing TE after it failed with a cuDNN symbol
    import transformer_engine.pytorch  # noqa: F401  # error, while every run that imported TE first worked
except Exception as exc:  # noqa: BLE001 - recorded, not fatal
    te_error = f"{type(exc).__name__}: {exc}"[:300]
def cudnn():  # with TE loaded, torch refuses to report a system cuDNN other than its own (S9, S10: 9.14 vs 9.19)
    try:
        return torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except RuntimeError as exc:
        return f"error: {exc}"[:300]
v = {"commit": os.environ.get("COMMIT", "unknown"), "torch": torch.__version__, "cuda": torch.version.cuda,
     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
     "cudnn": cudnn(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
from importlib import metadata
for dist in ("transformer_engine", "megatron-core"):  # installed versions; the import is what the runs test
    try:
        v[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        v[dist] = None
if te_error:
    v["transformer_engine_import_error"] = te_error
try:
    import transformers
    v["transformers"] = transformers.__version__
except Exception:
    v["transformers"] = None
print(json.dumps(v, indent=1))
PY
  cat "$OUT/versions-$1.json"
}
step() { echo "+ $*" | tee -a "$OUT/commands.txt"; local t0=$SECONDS; "$@"; local rc=$?; echo "rc=$rc ${SECONDS}-${t0}s: $*" | tee -a "$OUT/commands.txt"; return 0; }
stage=$1; shift
versions "$stage"
case "$stage" in
  fi)
    step python3 -m fsdp_cudagraph.apps.full_iteration_align --out "$OUT/fi-align-1gpu.json" > "$OUT/fi-align.log" 2>&1
    tail -4 "$OUT/fi-align.log"
    step python3 -m fsdp_cudagraph.apps.full_iteration_align --no-controls --graphed-first --only te:no_shard torch:no_shard \
      --out "$OUT/fi-graphed-first.json" > "$OUT/fi-graphed-first.log" 2>&1
    tail -2 "$OUT/fi-graphed-first.log"
    step python3 benchmarks/engines_align.py --out "$OUT/engines-align.json" "$@" > "$OUT/engines.log" 2>&1
    tail -25 "$OUT/engines.log" ;;
  engines)
    step python3 benchmarks/engines_align.py --out "$OUT/engines-align.json" "$@" > "$OUT/engines.log" 2>&1
    tail -25 "$OUT/engines.log" ;;
  pytest)
    step timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=30 > "$OUT/pytest-gpu.log" 2>&1
    tail -45 "$OUT/pytest-gpu.log" ;;
  perf)
    step timeout 560 python3 benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals.json" > "$OUT/perf.log" 2>&1
    tail -40 "$OUT/perf.log" ;;
  align)
    step python3 -m fsdp_cudagraph.apps.align --out "$OUT/align-1gpu.json" "$@" > "$OUT/align.log" 2>&1
    tail -3 "$OUT/align.log" ;;
  profile)
    # NPROC=2: rank 0's kernels on 2 GPUs, with the collective time no other kernel overlapped
    step timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-1} benchmarks/profile_step.py \
      --out "$OUT/profile-compute-${NPROC:-1}gpu.json" "$@" > "$OUT/profile.log" 2>&1
    tail -30 "$OUT/profile.log" ;;
  multi)
    # the 2-GPU tests (alignment matrix, README loop, engine parity and DCP, full-iteration, HF, inference,
    # offload; each a torchrun of 2 processes), then the demo on 2 ranks; results kept under $OUT/records.
    # With TE they take about 8 minutes on 2 H100s (S9): split them over two calls with MULTI_SELECT, e.g.
    #   MULTI_SELECT="2gpu and (alignment or readme or parity or dcp or full_iteration)"
    #   MULTI_SELECT="2gpu and (hf or offload or inference or vision)"
    step env FSDP_CUDAGRAPH_RESULTS="$OUT/records" timeout ${MULTI_PYTEST_S:-400} python3 -m pytest -m gpu -k "${MULTI_SELECT:-2gpu}" -q -p no:cacheprovider --durations=0 > "$OUT/pytest-2gpu.log" 2>&1
    tail -25 "$OUT/pytest-2gpu.log"
    step timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m fsdp_cudagraph.apps.demo > "$OUT/demo-2gpu.log" 2>&1
    tail -4 "$OUT/demo-2gpu.log" ;;
  engines2)
    step timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/engines_align.py \
      --engines fsdp2 megatron_fsdp nvidia --out "$OUT/engines-align-2gpu.json" > "$OUT/engines-2gpu.log" 2>&1
    tail -12 "$OUT/engines-2gpu.log"
    for e in fsdp2 nvidia; do
      step timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m fsdp_cudagraph.check \
        --engine $e --model tests.apps.test_check_engines:dense_gpt_factory --json "$OUT/check-$e-2gpu.json" > "$OUT/check-$e-2gpu.log" 2>&1
      tail -3 "$OUT/check-$e-2gpu.log"
    done ;;
  scaling)
    step env CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-1gpu.json" > "$OUT/perf-1gpu.log" 2>&1
    step timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-2gpu.json" > "$OUT/perf-2gpu.log" 2>&1
    grep -E "^\| (compute|launch) \|" "$OUT/perf-1gpu.log" "$OUT/perf-2gpu.log" | tail -40
    for n in 1 2; do
      step timeout 200 python3 benchmarks/bench_peers.py --engine all --wheel-dir .whl --nproc-per-node $n --vocab 1024 --out "$OUT/peers-${n}gpu.json" > "$OUT/peers-${n}gpu.log" 2>&1
      tail -8 "$OUT/peers-${n}gpu.log"
    done
    step env CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m fsdp_cudagraph.apps.demo > "$OUT/demo-1gpu.log" 2>&1
    tail -6 "$OUT/demo-1gpu.log" ;;
  peak)
    # NPROC=2: on 2 GPUs (rank 0's allocator trace)
    pc="python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-1} benchmarks/peak_composition.py"
    step timeout 200 $pc --config compute --columns eager fsdp2 --out "$OUT/peak-compute.json" > "$OUT/peak-compute.log" 2>&1
    step timeout 200 $pc --config launch --columns eager full_iteration fsdp2 --out "$OUT/peak-launch.json" > "$OUT/peak-launch.log" 2>&1
    step timeout 200 $pc --config demo --columns eager partial full_iteration --steps 6 --out "$OUT/peak-demo.json" > "$OUT/peak-demo.log" 2>&1
    step env CUBLAS_WORKSPACE_CONFIG=:16:8 timeout 200 $pc --config demo --columns eager partial full_iteration --steps 6 --out "$OUT/peak-demo-ws16.json" > "$OUT/peak-demo-ws16.log" 2>&1
    for c in compute launch demo demo-ws16; do grep -E "^(eager|partial|full_iteration|fsdp2) " "$OUT/peak-$c.log"; done ;;
  memory)
    for f in on off; do
      step timeout 200 python3 benchmarks/graph_memory_snapshot.py --fuse-wgrad $f --out "$OUT/graph-memory-fuse-$f.json" > "$OUT/graph-memory-fuse-$f.log" 2>&1
      head -30 "$OUT/graph-memory-fuse-$f.log"
    done
    step timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m fsdp_cudagraph.apps.demo > "$OUT/demo.log" 2>&1
    tail -6 "$OUT/demo.log"
    step timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m fsdp_cudagraph.apps.demo --no-fuse-wgrad > "$OUT/demo-unfused.log" 2>&1
    tail -3 "$OUT/demo-unfused.log" ;;
  avg)
    n=${NPROC:-2}; run="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
    step timeout 120 $run tests/gpu/nccl_average.py --out "$OUT/nccl-average-${n}gpu.json" > "$OUT/nccl-average.log" 2>&1
    tail -3 "$OUT/nccl-average.log"
    step timeout 200 $run benchmarks/profile_step.py --out "$OUT/profile-compute-${n}gpu.json" > "$OUT/profile.log" 2>&1
    tail -32 "$OUT/profile.log"
    step timeout 150 $run benchmarks/profile_step.py --columns ours --prescale --out "$OUT/profile-compute-${n}gpu-prescale.json" > "$OUT/profile-prescale.log" 2>&1
    tail -24 "$OUT/profile-prescale.log" ;&
  suites)  # also the end of avg
    n=${NPROC:-2}; run="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
    step timeout 150 $run benchmarks/peak_composition.py --config compute --columns eager fsdp2 --out "$OUT/peak-compute-${n}gpu.json" > "$OUT/peak-compute.log" 2>&1
    grep -E "^(eager|fsdp2) " "$OUT/peak-compute.log"
    step timeout 200 $run benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-${n}gpu.json" > "$OUT/perf-${n}gpu.log" 2>&1
    step env CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-1gpu.json" > "$OUT/perf-1gpu.log" 2>&1
    grep -E "^\| (compute|launch) \|" "$OUT/perf-1gpu.log" "$OUT/perf-${n}gpu.log" | tail -40 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
