#!/usr/bin/env bash
# The README's main job: set up, then train the tiny demo on 2 processes (Gloo on CPU, NCCL on GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" -m fsdp_cudagraph.demo "$@"
