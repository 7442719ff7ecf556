#!/usr/bin/env bash
# The README's main job: set up, then train the tiny demo on 2 processes (Gloo on CPU, NCCL on GPUs),
# eagerly and with partial graphs, printing both loss columns, step times and memory.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
# Two processes; on a machine with one GPU, one (NCCL puts one rank on each GPU).
NPROC=${NPROC:-$($PY -c "import torch; n = torch.cuda.device_count(); print(min(2, n) if n else 2)")}
exec $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m fsdp_cudagraph.apps.demo "$@"
