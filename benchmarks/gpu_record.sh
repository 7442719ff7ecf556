#!/usr/bin/env bash
# Runs a named part of the GPU record on a GPU machine; its logs + JSON are written under /tmp/record/<part>/
# and tarred into $OUT/<part>[-<tag>].tgz (the lending tool returns at most 8 files). Every command is echoed
# into the log. TAG=<tag> keeps two runs of one part apart.
#   bash benchmarks/gpu_record.sh versions|readme|demo|align|pytest-gpu|<script args...>
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
part=$1; shift || true
name=$(basename "$part" .py)${TAG:+-$TAG}
dir=/tmp/record/$name; mkdir -p "$dir" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
export RECORD_DIR=$dir
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
    run python3 -m fsdp_cudagraph.align "$@" --out "$dir/align-1gpu.json" || rc=1 ;;
  pytest-gpu)
    run env FSDP_CUDAGRAPH_RESULTS="$dir" python3 -m pytest -q -m gpu -ra "$@" || rc=1 ;;
  *) run python3 "$part" "$@" || rc=1 ;;  # a script; its --out should point into $dir (RECORD_DIR)
esac
tar -C /tmp/record -czf "$OUT/$name.tgz" "$name"
exit $rc
