#!/usr/bin/env bash
# Runs a named part of the GPU record on a GPU machine; its logs + JSON are written under /tmp/record/<part>/
# and tarred into $OUT/<part>[-<tag>].tgz (the lending tool returns at most 8 files). Every command is echoed
# into the log. TAG=<tag> keeps two runs of one part apart.
#   bash benchmarks/gpu_record.sh versions|readme|demo|align|bisect-13|pytest-gpu|<script args...>
#   bash benchmarks/gpu_record.sh 2gpu-10|2gpu-11-12|2gpu-13|2gpu-14-16     (on 2 GPUs: the issues' 2-GPU halves)
# With TE: stage it first (bash ../shared/gpu/te-stage.sh here, then the five carried calls that
# shared/gpu/te-install.sh describes); run the parts back to back while the machine is warm.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
part=$1; shift || true
name=$(basename "$part" .py)${TAG:+-$TAG}
dir=/tmp/record/$name; mkdir -p "$dir" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
export RECORD_DIR=$dir
TR="python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2}"
run() { echo "+ $*" | tee -a "$dir/log.txt"; "$@" 2>&1 | tee -a "$dir/log.txt"; return "${PIPESTATUS[0]}"; }
versions() {
  python3 - <<'EOF' | tee "$dir/versions.json"
import json, torch
try:
    import transformer_engine as te; tev = te.__version__
except Exception as e:  # noqa
    tev = f"absent ({type(e).__name__})"
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "te": tev,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cudnn": torch.backends.cudnn.version(),
                  "device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}))
EOF
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$dir/log.txt" 2>&1
}
rc=0
case $part in
  versions) versions ;;
  readme)
    versions
    for impl in transformer_engine local; do
      for extra in "" "--scope" "--seq-len 512" "--seq-len 64 --scope attn"; do
        tag=$(echo "$impl $extra" | tr -c 'a-z0-9\n' '-' | tr -s '-')
        run python3 examples/readme_loop.py --impl $impl $extra --out "$dir/readme-$tag.json" || rc=1
      done
    done ;;
  demo)
    run env NPROC=1 bash scripts/demo.sh || rc=1
    run env NPROC=1 bash scripts/demo.sh --scope attn || rc=1 ;;
  align)
    run python3 -m fsdp_cudagraph.apps.align "$@" --out "$dir/align-1gpu.json" || rc=1 ;;
  bisect-13)  # the open full-iteration TE no_shard row (1 GPU, TE staged): each knob alone, then the full matrix
    FI="python3 -m fsdp_cudagraph.apps.full_iteration_align --no-controls --only te:no_shard torch:no_shard"
    run $FI --out "$dir/fi-no-shard.json" || rc=1
    run $FI --no-host-sync-check --out "$dir/fi-no-shard-no-check.json" || rc=1
    run $FI --graphed-first --out "$dir/fi-no-shard-graphed-first.json" || rc=1
    run python3 -m fsdp_cudagraph.apps.full_iteration_align --out "$dir/fi-align-1gpu.json" || rc=1 ;;
  # The 2-GPU halves of issues 10-16 (nvidia-h200-x2), each part well inside one 10-minute call.
  2gpu-10)
    versions
    for impl in transformer_engine local; do
      run $TR examples/readme_loop.py --impl $impl --out "$dir/readme-$impl-2gpu.json" || rc=1
      run $TR examples/readme_loop.py --impl $impl --scope --seq-len 100 --out "$dir/readme-$impl-layers-2gpu.json" || rc=1
    done
    run $TR -m fsdp_cudagraph.apps.align --out "$dir/align-2gpu.json" || rc=1
    run env NPROC=2 bash scripts/demo.sh || rc=1 ;;
  2gpu-11-12)
    run $TR tests/gpu_engine_parity.py "$dir/parity-2gpu.json" || rc=1
    rm -rf "$dir/parity-2gpu.json.dcp"
    run $TR benchmarks/hf_models.py --out "$dir/hf-2gpu.json" || rc=1 ;;
  2gpu-13)
    run $TR -m fsdp_cudagraph.apps.full_iteration_align --out "$dir/fi-align-2gpu.json" || rc=1
    run $TR benchmarks/bench_full_iteration.py --out "$dir/fi-bench-2gpu.json" || rc=1 ;;
  2gpu-14-16)
    run $TR benchmarks/bench_offload.py --sdpa math --out "$dir/offload-2gpu.json" || rc=1
    run $TR -m fsdp_cudagraph.apps.vision --out "$dir/length-buckets-record-2gpu.json" || rc=1
    run $TR benchmarks/bench_length_buckets.py --out "$dir/length-buckets-bench-2gpu.json" || rc=1
    run $TR benchmarks/bench_inference.py --out "$dir/inference-2gpu.json" || rc=1 ;;
  pytest-gpu)
    run env FSDP_CUDAGRAPH_RESULTS="$dir" python3 -m pytest -q -m gpu -ra "$@" || rc=1 ;;
  *) run python3 "$part" "$@" || rc=1 ;;  # a script; its --out should point into $dir (RECORD_DIR)
esac
tar -C /tmp/record -czf "$OUT/$name.tgz" "$name"
exit $rc
