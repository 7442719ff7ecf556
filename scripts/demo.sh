#!/usr/bin/env bash
# The README's main job: set up, then train the tiny demo on 2 processes (Gloo on CPU, NCCL on GPUs),
# eagerly and with partial graphs, printing both loss columns, step times and memory.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec $PY -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" -m fsdp_cudagraph.demo "$@"
