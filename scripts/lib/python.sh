# Sourced by the launch scripts: the interpreter they run, and a check that it can train.
#
# launcher_python REPO prints the interpreter: $PYTHON when set; else the active environment's
# ($VIRTUAL_ENV/bin/python for a virtualenv, $CONDA_PREFIX/bin/python for conda); else
# REPO/.venv/bin/python when it exists (what `make install` and `make train` create); else
# python3 from PATH.
launcher_python() {
  local repo=$1
  if [[ -n ${PYTHON:-} ]]; then
    echo "$PYTHON"
  elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    echo "$VIRTUAL_ENV/bin/python"
  elif [[ -n ${CONDA_PREFIX:-} && -x $CONDA_PREFIX/bin/python ]]; then
    echo "$CONDA_PREFIX/bin/python"
  elif [[ -x $repo/.venv/bin/python ]]; then
    echo "$repo/.venv/bin/python"
  else
    echo python3
  fi
}

# require_launcher_python WHO PYTHON exits 2 with one line on stderr (WHO: the script's name)
# unless PYTHON runs and finds torch and megatronish. Run from the repository root: megatronish
# is found there without being installed, as `python -m megatronish.train` finds it. The
# modules are located, not imported (milliseconds, not the seconds torch takes to import).
require_launcher_python() {
  local who=$1 python=$2 missing
  if ! missing=$("$python" -c 'import importlib.util as u
print(", ".join(m for m in ("torch", "megatronish") if u.find_spec(m) is None))' 2>/dev/null); then
    echo "$who: cannot run the interpreter '$python'; set PYTHON=/path/to/bin/python of an" \
      "environment with torch and megatronish (make install creates .venv)" >&2
    exit 2
  fi
  if [[ -n $missing ]]; then
    echo "$who: the interpreter '$python' cannot import $missing; set PYTHON=/path/to/bin/python" \
      "of an environment that has them (make install creates .venv)" >&2
    exit 2
  fi
}
