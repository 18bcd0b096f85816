#!/usr/bin/env bash
# Create .venv (if missing) and install megatronish with its dev extra.
#
# torch is special: an existing torch (a cluster's CUDA build, say) is left alone; without one,
# a machine with an NVIDIA GPU gets the default (CUDA) wheel and a machine without gets the CPU
# build: first a wheel already on local disk (pip's find-links), then PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] GPU found: installing the default (CUDA) torch wheel"
  pip install "torch>=2.7"
else
  echo "[install] no GPU: installing the CPU build of torch"
  if ! pip install --no-index --no-deps "torch>=2.7" 2>/dev/null; then
    pip install "torch>=2.7" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi

pip install -q -e ".[dev]"
echo "[install] done: $("$PY" -c 'import torch; print("torch", torch.__version__)')"
