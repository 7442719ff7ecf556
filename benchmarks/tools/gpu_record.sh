#!/usr/bin/env bash
# The GPU record, by suite: versions, logs and JSON of each stage under $OUT (default /tmp/out).
#
#   COMMIT=<sha> [NPROC=<n>] bash benchmarks/tools/gpu_record.sh <stage> [<stage> ...]
#
# Stages (each sized to run in under 10 minutes, except `all`; NPROC defaults to the GPUs
# visible, and the NPROC-GPU half of a stage is skipped on one GPU):
#   align           the partial-graph alignment matrix (python -m fsdp_cudagraph.apps.align: TE and torch
#                   backends) on 1 GPU and on NPROC                                  -> align-{1,N}gpu.json
#   full_iteration  the full-iteration alignment matrix on 1 GPU and on NPROC        -> fi-align-{1,N}gpu.json
#   engines         benchmarks/engines_align.py (fsdp2 and its slots/mp variants, megatron_fsdp, nvidia) on 1
#                   and NPROC, the alignment checker (python -m fsdp_cudagraph.check) per engine and FSDP2
#                   setting on NPROC (FSDP2 mixed precision also on 1), NCCL's AVG against the
#                   (ENGINES_1 / ENGINES_N: engines_align's --engines on 1 / NPROC; CHECKS_FROM=3: only the
#                   checker's FSDP2-setting rows)
#                   pre-scaled SUM (tests/gpu/scripts/nccl_average.py) on NPROC; nvidia needs megatron-core
#                   (e.g. PYTHONPATH=/tmp/site)                                       -> engines-*.json, check-*.json
#   pytest          pytest -m gpu with per-test durations: the 1-GPU tests on one GPU beside the multi-GPU tests on
#                   NPROC, four processes side by side on 2+ GPUs, then one verdict line per test file
#                   (tools/pytest_verdict.py) -> pytest-verdict.json (PYTEST_MARK="gpu or matrix": with the full
#                   matrices; PYTEST_SELECT: a -k expression, to split a run over several calls)
#   perf            the performance suite (bench_partial_graphs.py --suite full) on 1 GPU and NPROC and its
#                   1 -> N table (tools/scaling.py); bench_peers --engine all where .whl/ holds Megatron-FSDP;
#                   the compute step's budget (diagnose/profile_step.py) and what is live at its peak
#                   (diagnose/peak_composition.py) on NPROC. PERF_PARTS picks parts: "suite peers profile peak"
#   depth           host cost per graphed layer at 8, 32, 64 layers (benchmarks/bench_depth.py) -> depth.json
#   features        offload (bench_offload.py), length buckets (bench_length_buckets.py), inference graphs
#                   (bench_inference.py), Hugging Face models (hf_models.py), each on 1 GPU
#   demo            scripts/demo.sh (NPROC ranks) and the demo on 1 GPU, with their wall times
#   moe             the MoE rows of the alignment matrices (align --rows MoE, full_iteration_align --moe-only)
#                   and the MoE layer's CUDA tests, on 1 GPU and NPROC                  -> align-moe-*.json
#   mcore           megatron-core's GPTModel (dense, MoE alltoall/allgather) under our engine, NVIDIA's
#                   fully_shard and megatron-core's FullyShardedDataParallel (tests/gpu/scripts/mcore_gpt.py), on 1
#                   GPU and NPROC; needs megatron-core (PYTHONPATH=/tmp/site)        -> mcore-*.json
#   bench           the engines side by side (benchmarks/bench_engines.py): the Llama-3-8B-shaped config and
#                   the OLMoE-shaped one on NPROC (BENCH_CONFIGS, BENCH_ARGS)       -> bench-*.json
#   ep              expert parallelism on NPROC (and on 2 when NPROC > 2): our MoE under our engine
#                   (tests/gpu/scripts/ep_align.py), FSDP2 in torchtitan's layout (fsdp2_ep.py), megatron-core's
#                   GPTModel under ours and NVIDIA's (mcore_gpt.py --only-ep; needs PYTHONPATH=/tmp/site), and the
#                   Qwen3-30B-A3B-shaped benchmark (bench_engines.py --config qwen3moe) at sequence 1024 and
#                   4096 (EP_SEQS, EP_PARTS: "align fsdp2 mcore bench"; MCORE_EP_DEBUG=1: the megatron-core part under
#                   TORCH_DISTRIBUTED_DEBUG=DETAIL)                           -> ep-*.json, bench-qwen3moe-*.json
#   tp              tensor parallelism on 2 and NPROC GPUs: the reference GPT on the (dp, tp) grid
#                   (tests/gpu/scripts/tp_graphs.py), FSDP2 with DTensor TP (fsdp2_tp_graphs.py), megatron-core's
#                   GPTModel with TP under ours and NVIDIA's FullyShardedDataParallel (mcore_gpt.py --only-tp;
#                   PYTHONPATH=/tmp/site)                                       -> tp-*.json
#   fp8             FP8 with TE (needs TE): apps.align --rows FP8 and full_iteration_align --fp8-only on 1 GPU and
#                   NPROC, the FP8 all-gather rows (tests/gpu/scripts/fp8_gather.py: ours, ours-kept, nvidia) on 1
#                   and NPROC, and
#                   benchmarks/fp8_numerics.py (every recipe and delayed with FP8 attention beside bf16,
#                   FP8_STEPS=300) on 1 GPU
#                                                     -> fp8-align-*.json, fp8-fi-*.json, fp8-gather-*.json, fp8-numerics-1gpu.json
#   hsdp            hybrid sharding on NPROC as (NPROC/2) x 2 or 2 x 1: bench_hsdp.py --align (flat vs HSDP, both
#                   engines, eager vs partial graphs bit for bit, bytes across the slow dimension) and the
#                   demo with --hsdp                                                 -> hsdp-*.json
#   all             every stage above, in that order
#
# Every command runs under tools/limit.py: past its limit the whole process group (torchrun and its ranks) prints
# its stacks, then stops, and the step's rc is 124.
# Write-ups: benchmarks/results/<topic>_<hw>_<date>.md cite the JSON this writes (benchmarks/README.md).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD NCCL_NVLS_ENABLE=0
# One cuDNN in the process, torch's: TE opens libcudnn from CUDNN_PATH before the library path, and cuDNN its parts
# from the library path, so both point at torch's ([Note: two cuDNNs in one process] in capture/te.py; docs/fp8.md,
# "Which cuDNN runs"). KEEP_LD_LIBRARY_PATH=1: both as given. The package warns at import when TE's cuDNN still
# differs from torch's; the check below prints that once, up front.
CUDNN_LIB=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
if [ -n "$CUDNN_LIB" ] && [ "${KEEP_LD_LIBRARY_PATH:-0}" != 1 ]; then
  export CUDNN_PATH=${CUDNN_LIB%/lib} LD_LIBRARY_PATH=$CUDNN_LIB:${LD_LIBRARY_PATH:-}
fi
CUDNN_SAYS=$(python3 -W ignore -c "from fsdp_cudagraph.capture.te import cudnn_mismatch as m; print(m() or 'TE and torch agree, or no TE')" 2>&1 | tail -1)
echo "cuDNN: CUDNN_PATH=${CUDNN_PATH:-unset}, first on LD_LIBRARY_PATH ${CUDNN_LIB:-none}; $CUDNN_SAYS"
# The records' "commit" (fsdp_cudagraph.checker.records.versions): a copy of .git on the GPU machine can name an older
# HEAD than the tree that runs, so COMMIT, when given, wins.
[ -n "${COMMIT:-}" ] && export GIT_COMMIT=${GIT_COMMIT:-$COMMIT}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
N=${NPROC:-$NGPU}
RUN_N="python3 -m torch.distributed.run --standalone --nproc-per-node $N"
ONE="env CUDA_VISIBLE_DEVICES=0"
# every command under a time limit that prints each process's stacks before it stops a hung run (tools/limit.py)
LIMIT="python3 $PWD/benchmarks/tools/limit.py"

versions() {  # the records' versions (device, torch, CUDA, NCCL, cuDNN, TE, commit) + installed packages
  python3 - "$1" <<'PY' > "$OUT/versions-$1.json"
import json, sys
from importlib import metadata
from fsdp_cudagraph.checker.records import versions  # imports TE before asking for cuDNN (see _cudnn_version)
v = versions()
for dist in ("transformer_engine", "megatron-core", "transformers"):
    try:
        v[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        v[dist] = None
v["stage"] = sys.argv[1]
print(json.dumps(v, indent=1))
PY
  cat "$OUT/versions-$1.json"
}
# step <log> <command...>: run, log to $OUT/<log>, record the command, its exit status and seconds.
step() {
  local log=$1; shift
  echo "+ $*" | tee -a "$OUT/commands.txt"
  local t0=$SECONDS
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "rc=$rc $((SECONDS - t0))s: $*" | tee -a "$OUT/commands.txt"
  return 0
}
multi() { [ "$N" -gt 1 ]; }

stage_align() {
  step align-1gpu.log $ONE $LIMIT 280 python3 -m fsdp_cudagraph.apps.align --out "$OUT/align-1gpu.json"
  tail -3 "$OUT/align-1gpu.log"
  if multi; then
    step align-${N}gpu.log $LIMIT 280 $RUN_N -m fsdp_cudagraph.apps.align --out "$OUT/align-${N}gpu.json"
    tail -3 "$OUT/align-${N}gpu.log"
  fi
}

stage_full_iteration() {
  step fi-align-1gpu.log $ONE $LIMIT 260 python3 -m fsdp_cudagraph.apps.full_iteration_align --out "$OUT/fi-align-1gpu.json"
  tail -4 "$OUT/fi-align-1gpu.log"
  if multi; then
    step fi-align-${N}gpu.log $LIMIT 300 $RUN_N -m fsdp_cudagraph.apps.full_iteration_align --out "$OUT/fi-align-${N}gpu.json"
    tail -4 "$OUT/fi-align-${N}gpu.log"
  fi
}

stage_engines() {
  step engines-1gpu.log $ONE $LIMIT 200 python3 benchmarks/engines_align.py ${ENGINES_1:+--engines $ENGINES_1} \
    --out "$OUT/engines-1gpu.json"
  tail -12 "$OUT/engines-1gpu.log"
  step check-fsdp2-mp-bf16-1gpu.log $ONE $LIMIT 100 python3 -m fsdp_cudagraph.check --engine fsdp2 --fsdp2-mp bf16 \
    --model tests.apps.test_check_engines:dense_gpt_factory --json "$OUT/check-fsdp2-mp-bf16-1gpu.json"
  tail -3 "$OUT/check-fsdp2-mp-bf16-1gpu.log"
  if multi; then
    step engines-${N}gpu.log $LIMIT 200 $RUN_N benchmarks/engines_align.py ${ENGINES_N:+--engines $ENGINES_N} \
      --out "$OUT/engines-${N}gpu.json"
    tail -12 "$OUT/engines-${N}gpu.log"
    local checks=("fsdp2" "megatron_fsdp" "nvidia" "fsdp2 --fsdp2-storage slots" "fsdp2 --fsdp2-mp bf16"
                  "fsdp2 --fsdp2-storage slots --fsdp2-mp bf16")
    [ -n "${CHECKS_FROM:-}" ] && checks=("${checks[@]:$CHECKS_FROM}")  # e.g. 3: only the FSDP2 settings
    for e in "${checks[@]}"; do
      local tag=$(echo "$e" | sed 's/ --fsdp2-storage /-/; s/ --fsdp2-mp /-mp-/')
      step check-$tag-${N}gpu.log $LIMIT 100 $RUN_N -m fsdp_cudagraph.check --engine $e \
        --model tests.apps.test_check_engines:dense_gpt_factory --json "$OUT/check-$tag-${N}gpu.json"
      tail -3 "$OUT/check-$tag-${N}gpu.log"
    done
    step nccl-average-${N}gpu.log $LIMIT 60 $RUN_N tests/gpu/scripts/nccl_average.py --out "$OUT/nccl-average-${N}gpu.json"
    tail -3 "$OUT/nccl-average-${N}gpu.log"
  fi
}

stage_pytest() {
  # The 1-GPU half on one GPU alone (CUDA_VISIBLE_DEVICES: the multi-GPU tests skip there, naming the count) beside
  # the multi-GPU tests on every GPU; with 2+ GPUs each half runs as two pytest processes side by side (1-GPU: one
  # on GPU 0, one on GPU 1), split by PYTEST_SPLIT (a -k expression and its negation). Then one verdict line per
  # file. PYTEST_MARK: the marker expression (default gpu; "gpu or matrix" adds the full matrices).
  # The default split moves the expert- and tensor-parallel NCCL tests to the lighter half: on 2 x H200 at 1ca97bc the
  # two 2-GPU processes took 239 and 271 s without TE, 401 and 385 s with it (the 1-GPU ones 100-365 s).
  # Under CUDA_VISIBLE_DEVICES=a,b (e.g. two records side by side on one 4-GPU machine, with and without TE) the
  # 1-GPU halves take GPUs a and b and the multi-GPU tests see a,b.
  local mark=${PYTEST_MARK:-gpu} split=${PYTEST_SPLIT:-(alignment or check_engines or args) and not (expert_parallel or tensor_parallel)}
  local py="$LIMIT ${PYTEST_S:-560} python3 -m pytest -q -p no:cacheprovider --durations=30 -rs"
  local sel=${PYTEST_SELECT:+ and ($PYTEST_SELECT)}
  local devs
  IFS=, read -ra devs <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}"
  if multi; then
    local part=0 k
    for k in "($split)$sel" "not ($split)$sel"; do
      part=$((part + 1))
      step pytest-gpu-1-$part.log env FSDP_CUDAGRAPH_RESULTS="$OUT/records" CUDA_VISIBLE_DEVICES=${devs[$((part - 1))]} \
        $py -m "$mark" -k "$k" --junitxml "$OUT/pytest-1gpu-$part.xml" &
      step pytest-gpu-$N-$part.log env FSDP_CUDAGRAPH_RESULTS="$OUT/records-$N-$part" $py -m "($mark) and multigpu" \
        -k "$k" --junitxml "$OUT/pytest-${N}gpu-$part.xml" &
    done
    wait
    tail -n 4 "$OUT"/pytest-gpu-*.log
  else
    step pytest-gpu-1.log env FSDP_CUDAGRAPH_RESULTS="$OUT/records" $py -m "$mark" ${PYTEST_SELECT:+-k "$PYTEST_SELECT"} \
      --junitxml "$OUT/pytest-1gpu.xml"
    tail -40 "$OUT/pytest-gpu-1.log"
  fi
  python3 benchmarks/tools/pytest_verdict.py "$OUT"/pytest-*gpu*.xml --json "$OUT/pytest-verdict.json"
}

stage_perf() {
  local parts=${PERF_PARTS:-suite peers profile peak}
  if [[ " $parts " == *" suite "* ]]; then
    step perf-1gpu.log $ONE $LIMIT 200 python3 benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-1gpu.json"
    local files="$OUT/perf_goals-1gpu.json"
    if multi; then
      step perf-${N}gpu.log $LIMIT 240 $RUN_N benchmarks/bench_partial_graphs.py --suite full --out "$OUT/perf_goals-${N}gpu.json"
      files="$files $OUT/perf_goals-${N}gpu.json"
    fi
    grep -hE "^\| (compute|launch) \|" "$OUT"/perf-*gpu.log | tail -40
    step scaling.log python3 benchmarks/tools/scaling.py $files --out "$OUT/scaling.json"
    cat "$OUT/scaling.log"
  fi
  if [[ " $parts " == *" peers "* ]] && [ -d .whl ]; then
    for n in 1 $(multi && echo "$N"); do
      step peers-${n}gpu.log $LIMIT 200 python3 benchmarks/bench_peers.py --engine all --wheel-dir .whl --nproc-per-node $n \
        --vocab 1024 --out "$OUT/peers-${n}gpu.json"
      tail -8 "$OUT/peers-${n}gpu.log"
    done
  fi
  if [[ " $parts " == *" profile "* ]]; then
    step profile-${N}gpu.log $LIMIT 200 $RUN_N benchmarks/diagnose/profile_step.py --out "$OUT/profile-compute-${N}gpu.json"
    tail -32 "$OUT/profile-${N}gpu.log"
  fi
  if [[ " $parts " == *" peak "* ]]; then
    step peak-compute-${N}gpu.log $LIMIT 150 $RUN_N benchmarks/diagnose/peak_composition.py --config compute \
      --columns eager fsdp2 --out "$OUT/peak-compute-${N}gpu.json"
    grep -E "^(eager|fsdp2) " "$OUT/peak-compute-${N}gpu.log"
  fi
}

stage_depth() {
  step depth.log $ONE $LIMIT 400 python3 benchmarks/bench_depth.py --layers 8 32 64 --out "$OUT/depth.json"
  tail -20 "$OUT/depth.log"
}

stage_features() {
  step offload-1gpu.log $ONE $LIMIT 150 python3 benchmarks/bench_offload.py --out "$OUT/offload-1gpu.json"
  tail -8 "$OUT/offload-1gpu.log"
  step length-buckets-1gpu.log $ONE $LIMIT 150 python3 benchmarks/bench_length_buckets.py --out "$OUT/length-buckets-1gpu.json"
  tail -8 "$OUT/length-buckets-1gpu.log"
  step inference-1gpu.log $ONE $LIMIT 120 python3 benchmarks/bench_inference.py --out "$OUT/inference-1gpu.json"
  tail -12 "$OUT/inference-1gpu.log"
  step hf-1gpu.log $ONE $LIMIT 150 python3 benchmarks/hf_models.py --out "$OUT/hf-1gpu.json"
  tail -4 "$OUT/hf-1gpu.log"
}

stage_demo() {
  step demo-${N}rank.log env NPROC=$([ "$N" -gt 0 ] && echo "$N" || echo 2) $LIMIT 200 bash scripts/demo.sh
  tail -8 "$OUT/demo-${N}rank.log"
  step demo-1gpu.log $ONE $LIMIT 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m fsdp_cudagraph.apps.demo
  tail -6 "$OUT/demo-1gpu.log"
}

stage_moe() {
  for b in ${MOE_BACKENDS:-te torch}; do
    step align-moe-$b-1gpu.log $ONE $LIMIT 150 python3 -m fsdp_cudagraph.apps.align --backends $b --rows MoE \
      --out "$OUT/align-moe-$b-1gpu.json"
    tail -2 "$OUT/align-moe-$b-1gpu.log"
    if multi; then
      step align-moe-$b-${N}gpu.log $LIMIT 150 $RUN_N -m fsdp_cudagraph.apps.align --backends $b --rows MoE \
        --out "$OUT/align-moe-$b-${N}gpu.json"
      tail -2 "$OUT/align-moe-$b-${N}gpu.log"
    fi
  done
  step fi-moe-1gpu.log $ONE $LIMIT 100 python3 -m fsdp_cudagraph.apps.full_iteration_align --moe-only \
    --out "$OUT/fi-moe-1gpu.json"
  tail -2 "$OUT/fi-moe-1gpu.log"
  step pytest-moe.log $ONE $LIMIT 150 python3 -m pytest tests/graphs/test_moe_layer.py -q -p no:cacheprovider
  tail -3 "$OUT/pytest-moe.log"
}

stage_mcore() {
  for b in ${MCORE_BACKENDS:-te}; do
    step mcore-$b-1gpu.log $ONE $LIMIT 200 python3 tests/gpu/scripts/mcore_gpt.py --backend $b --out "$OUT/mcore-$b-1gpu.json"
    grep -E "ok=|\"ok\"" "$OUT/mcore-$b-1gpu.log" | tail -21
    if multi; then
      step mcore-$b-${N}gpu.log $LIMIT 200 $RUN_N tests/gpu/scripts/mcore_gpt.py --backend $b --out "$OUT/mcore-$b-${N}gpu.json"
      grep -E "ok=|\"ok\"" "$OUT/mcore-$b-${N}gpu.log" | tail -21
    fi
  done
}

stage_bench() {
  for c in ${BENCH_CONFIGS:-llama8b olmoe}; do
    step bench-$c-${N}gpu.log $LIMIT ${BENCH_S:-400} python3 benchmarks/bench_engines.py --config $c --nproc-per-node $N \
      ${BENCH_ARGS:-} --out "$OUT/bench-$c-${N}gpu.json"
    tail -40 "$OUT/bench-$c-${N}gpu.log"
  done
}

stage_ep() {
  multi || { echo "ep: needs 2+ GPUs"; return 0; }
  local parts=${EP_PARTS:-align fsdp2 mcore bench} n
  local sizes="$N"; [ "$N" -gt 2 ] && sizes="2 $N"
  for n in $sizes; do
    local run="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
    if [[ " $parts " == *" align "* ]]; then
      step ep-align-${n}gpu.log $LIMIT 200 $run tests/gpu/scripts/ep_align.py --out "$OUT/ep-align-${n}gpu.json"
      grep -E "^(ok |BAD|control)|\"ok\"" "$OUT/ep-align-${n}gpu.log"
    fi
    if [[ " $parts " == *" fsdp2 "* ]]; then
      step ep-fsdp2-${n}gpu.log $LIMIT 150 $run tests/gpu/scripts/fsdp2_ep.py --out "$OUT/ep-fsdp2-${n}gpu.json"
      tail -6 "$OUT/ep-fsdp2-${n}gpu.log"
    fi
    if [[ " $parts " == *" mcore "* ]]; then
      # MCORE_EP_DEBUG=1: torch checks that the ranks call the same collectives in the same order and raises naming
      # the first pair that differ (TORCH_DISTRIBUTED_DEBUG=DETAIL) instead of hanging
      step ep-mcore-${n}gpu.log env ${MCORE_EP_DEBUG:+TORCH_DISTRIBUTED_DEBUG=DETAIL} $LIMIT 240 $run \
        tests/gpu/scripts/mcore_gpt.py --only-ep --out "$OUT/ep-mcore-${n}gpu.json"
      grep -E "ok=|\"ok\"" "$OUT/ep-mcore-${n}gpu.log" | tail -24
    fi
  done
  if [[ " $parts " == *" bench "* ]]; then
    local seq
    for seq in ${EP_SEQS:-1024 4096}; do
      step bench-qwen3moe-seq$seq-${N}gpu.log $LIMIT ${BENCH_S:-400} python3 benchmarks/bench_engines.py --config qwen3moe \
        --nproc-per-node $N --seq $seq ${BENCH_ARGS:-} --out "$OUT/bench-qwen3moe-seq$seq-${N}gpu.json"
      grep -vE "^(W1|\[rank)" "$OUT/bench-qwen3moe-seq$seq-${N}gpu.log" | tail -30
    done
  fi
}

stage_tp() {
  multi || { echo "tp: needs 2+ GPUs"; return 0; }
  local sizes="$N" n; [ "$N" -gt 2 ] && sizes="2 $N"
  for n in $sizes; do
    local run="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
    step tp-graphs-${n}gpu.log $LIMIT 200 $run tests/gpu/scripts/tp_graphs.py --out "$OUT/tp-graphs-${n}gpu.json"
    tail -4 "$OUT/tp-graphs-${n}gpu.log"
    step tp-fsdp2-${n}gpu.log $LIMIT 200 $run tests/gpu/scripts/fsdp2_tp_graphs.py --out "$OUT/tp-fsdp2-${n}gpu.json"
    tail -4 "$OUT/tp-fsdp2-${n}gpu.log"
    step tp-mcore-${n}gpu.log $LIMIT 240 $run tests/gpu/scripts/mcore_gpt.py --tensor-parallel 2 --only-tp \
      --out "$OUT/tp-mcore-${n}gpu.json"
    grep -E "ok=|\"ok\"" "$OUT/tp-mcore-${n}gpu.log" | tail -12
  done
}

stage_fp8() {
  # FP8 with TE: the per-layer and whole-step rows on 1 GPU (side by side on two GPUs when there are two) and NPROC,
  # then the numerics run (every recipe beside bf16 for FP8_STEPS steps, benchmarks/fp8_numerics.py) on 1 GPU.
  local other=$([ "$NGPU" -gt 1 ] && echo 1 || echo 0)
  step fp8-align-1gpu.log $ONE $LIMIT 200 python3 -m fsdp_cudagraph.apps.align --backends te --rows FP8 \
    --out "$OUT/fp8-align-1gpu.json" &
  step fp8-fi-1gpu.log env CUDA_VISIBLE_DEVICES=$other $LIMIT 200 python3 -m fsdp_cudagraph.apps.full_iteration_align \
    --fp8-only --models te --out "$OUT/fp8-fi-1gpu.json" &
  wait
  tail -3 "$OUT/fp8-align-1gpu.log" "$OUT/fp8-fi-1gpu.log"
  if multi; then
    step fp8-align-${N}gpu.log $LIMIT 200 $RUN_N -m fsdp_cudagraph.apps.align --backends te --rows FP8 \
      --out "$OUT/fp8-align-${N}gpu.json"
    step fp8-fi-${N}gpu.log $LIMIT 200 $RUN_N -m fsdp_cudagraph.apps.full_iteration_align --fp8-only --models te \
      --out "$OUT/fp8-fi-${N}gpu.json"
    tail -3 "$OUT/fp8-align-${N}gpu.log" "$OUT/fp8-fi-${N}gpu.log"
  fi
  # TE's FP8 weights gathered as FP8 bytes against TE quantizing bf16 weights, eager and graphed (tests/gpu/scripts);
  # the kept bf16 shards against casting at every gather, eager and graphed (--engine ours-kept); then NVIDIA
  # Megatron-FSDP gathering them, eager against per-layer graphs (--engine nvidia; PYTHONPATH=/tmp/site)
  local e tag
  for e in ours ours-kept nvidia; do
    tag=$([ $e = ours ] && echo "" || echo "-$e")
    step fp8-gather$tag-1gpu.log $ONE $LIMIT 150 python3 tests/gpu/scripts/fp8_gather.py --engine $e \
      --out "$OUT/fp8-gather$tag-1gpu.json"
    tail -3 "$OUT/fp8-gather$tag-1gpu.log"
    if multi; then
      step fp8-gather$tag-${N}gpu.log $LIMIT 150 $RUN_N tests/gpu/scripts/fp8_gather.py --engine $e \
        --out "$OUT/fp8-gather$tag-${N}gpu.json"
      tail -3 "$OUT/fp8-gather$tag-${N}gpu.log"
    fi
  done
  step fp8-numerics-1gpu.log $ONE $LIMIT ${FP8_NUMERICS_S:-400} python3 benchmarks/fp8_numerics.py \
    --steps ${FP8_STEPS:-300} --recipes delayed current block delayed+attention --out "$OUT/fp8-numerics-1gpu.json"
  tail -8 "$OUT/fp8-numerics-1gpu.log"
}

stage_hsdp() {
  multi || { echo "hsdp: needs 2+ GPUs"; return 0; }
  local r=${HSDP_REPLICATE:-2}
  step hsdp-${N}gpu.log $LIMIT 200 $RUN_N benchmarks/bench_hsdp.py --replicate $r --align --out "$OUT/hsdp-${N}gpu.json"
  tail -8 "$OUT/hsdp-${N}gpu.log"
  step demo-hsdp-${N}gpu.log $LIMIT 150 $RUN_N -m fsdp_cudagraph.apps.demo --hsdp $r --out "$OUT/demo-hsdp-${N}gpu.json"
  tail -4 "$OUT/demo-hsdp-${N}gpu.log"
}

STAGES="align full_iteration engines pytest perf depth features demo moe mcore bench ep tp fp8 hsdp"
[ $# -ge 1 ] || { echo "usage: bash benchmarks/tools/gpu_record.sh <stage>... (stages: $STAGES all)"; exit 2; }
for stage in "$@"; do
  for s in $([ "$stage" = all ] && echo "$STAGES" || echo "$stage"); do
    case " $STAGES " in
      *" $s "*) versions "$s"; "stage_$s" ;;
      *) echo "unknown stage '$s'; stages: $STAGES all"; exit 2 ;;
    esac
  done
done
