#!/usr/bin/env bash
# Run megatronish on this machine with N processes: scripts/launch_local.sh N [overrides...]
# On CPU every rank gets one intra-op thread; on GPUs one rank per GPU.
# PYTHON picks the interpreter (default .venv/bin/python); TORCHRUN_ARGS adds torchrun options,
# e.g. TORCHRUN_ARGS="--max-restarts 2" restarts every worker from the latest checkpoint when
# one dies. torchrun passes SIGTERM and SIGUSR2 on to the workers: they save and stop
# (docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/launch_local.sh NPROC [key=value ...]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Restarted workers must not meet in torchrun's shared store: it still holds the addresses of
# the workers that died (pytorch/pytorch#135712), and the new ones would try to connect to those.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# Workers get STOP_GRACE_S seconds to save after a stop signal before torchrun SIGKILLs them.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-240}
PY=${PYTHON:-.venv/bin/python}
source scripts/lib/torchrun.sh
source scripts/lib/cuda_alloc.sh  # expandable segments unless PYTORCH_(CUDA_)ALLOC_CONF is set
# shellcheck disable=SC2086,SC2046  # TORCHRUN_ARGS and the signal options are lists of options
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
  $(torchrun_signal_args "$PY") ${TORCHRUN_ARGS:-} -m megatronish.train "$@"
