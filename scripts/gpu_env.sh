#!/usr/bin/env bash
# `make gpu-check` on a machine without .venv and without network (the GPU machine): install the
# wheelhouse that `make gpu-wheels` downloaded elsewhere (Hydra's stack) into a temporary
# directory, offline, then run tools/gpu_check.py on this Python's own torch with that directory
# and the source tree on the import path. Arguments go to tools/gpu_check.py.
#
#   PYTHON=python3 GPU_WHEELS=.gpu-wheels scripts/gpu_env.sh [--smoke] [--out PATH] ...
#
# Nothing is installed into the interpreter and nothing outlives the run. pip never consults an
# index (--no-index, no pip configuration), resolves no dependencies and builds nothing
# (tools/gpu_check/wheelhouse.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
GPU_WHEELS=${GPU_WHEELS:-.gpu-wheels}

# No library may try to reach a hub or a tracker from there.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

site=$(mktemp -d "${TMPDIR:-/tmp}/megatronish-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
"$PYTHON" tools/gpu_check/wheelhouse.py install --wheelhouse "$GPU_WHEELS" --target "$site"
PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" tools/gpu_check.py "$@"
