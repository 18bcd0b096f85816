#!/usr/bin/env bash
# Run megatronish on this machine with N processes: scripts/launch_local.sh N [overrides...]
# On CPU every rank gets one intra-op thread; on GPUs one rank per GPU.
# PYTHON picks the interpreter (default: the active virtualenv's or conda environment's, else
# .venv/bin/python, else python3: scripts/lib/python.sh); TORCHRUN_ARGS adds torchrun options,
# e.g. TORCHRUN_ARGS="--max-restarts 2" restarts every worker from the latest checkpoint when
# one dies. SIGTERM, SIGUSR2 and Ctrl-C reach the workers: they save and stop, and this script
# exits with the workers' code (4; docs/operations.md), not torchrun's.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/launch_local.sh NPROC [key=value ...]}
shift
source scripts/lib/python.sh
PY=$(launcher_python "$PWD")
require_launcher_python launch_local.sh "$PY"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Restarted workers must not meet in torchrun's shared store: it still holds the addresses of
# the workers that died (pytorch/pytorch#135712), and the new ones would try to connect to those.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# Workers get STOP_GRACE_S seconds to save after a stop signal before torchrun SIGKILLs them.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-240}
source scripts/lib/cuda_alloc.sh  # expandable segments unless PYTORCH_(CUDA_)ALLOC_CONF is set
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options
exec bash scripts/lib/run_torchrun.sh --forward-signals "$PY" --standalone --nproc-per-node "$n" \
  ${TORCHRUN_ARGS:-} -- "$@"
