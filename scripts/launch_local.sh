#!/usr/bin/env bash
# Run megatronish on this machine with N processes: scripts/launch_local.sh N [overrides...]
# On CPU every rank gets one intra-op thread; on GPUs one rank per GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/launch_local.sh NPROC [key=value ...]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "$n" \
  -m megatronish.train "$@"
