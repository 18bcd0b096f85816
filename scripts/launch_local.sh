#!/usr/bin/env bash
# Run megatronish on this machine with N processes: scripts/launch_local.sh N [overrides...]
# On CPU every rank gets one intra-op thread; on GPUs one rank per GPU.
# PYTHON picks the interpreter (default .venv/bin/python); TORCHRUN_ARGS adds torchrun options,
# e.g. TORCHRUN_ARGS="--max-restarts 2" restarts every worker from the latest checkpoint when
# one dies. torchrun passes SIGTERM on to the workers: they save and stop (docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/launch_local.sh NPROC [key=value ...]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Restarted workers must not meet in torchrun's shared store: it still holds the addresses of
# the workers that died (pytorch/pytorch#135712), and the new ones would try to connect to those.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options
exec "${PYTHON:-.venv/bin/python}" -m torch.distributed.run --standalone --nproc-per-node "$n" \
  ${TORCHRUN_ARGS:-} -m megatronish.train "$@"
