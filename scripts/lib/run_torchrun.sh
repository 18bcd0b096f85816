#!/usr/bin/env bash
# Runs torchrun on this node and exits with its workers' exit code (train.py's: 4 after a
# graceful stop, 7 when the run was already complete, ...), not torchrun's own, which is 1 after
# any worker failure and after any signal, whatever its workers returned.
#
#   run_torchrun.sh [--forward-signals] PYTHON [torchrun options] -- [train.py arguments]
#
# Each worker runs under record_exit.sh, which writes its code to a directory of this node;
# see workers_exit_code in torchrun.sh for how the codes become this script's. torchrun runs as
# quiet_torchrun.py: after a stop signal, or workers that stopped with a checkpoint (4) or found
# the run complete (7), the one line below stands instead of torchrun's traceback.
#
# Stop signals: with --forward-signals (scripts/launch_local.sh) torchrun runs in a process
# group of its own and this script passes each stop signal it gets on to torchrun, once: a
# Ctrl-C in the terminal reaches torchrun once, not twice. Without it (one srun task per node,
# scripts/slurm/train.sbatch) SLURM signals the task's processes, torchrun among them, and this
# script only waits for it.
set -uo pipefail
forward=0
if [[ ${1:-} == --forward-signals ]]; then
  forward=1
  shift
fi
python=${1:?usage: run_torchrun.sh [--forward-signals] PYTHON [torchrun options] -- [args]}
shift
options=()
while (($#)) && [[ $1 != -- ]]; do
  options+=("$1")
  shift
done
if (($#)); then shift; fi  # the --
lib=$(cd "$(dirname "$0")" && pwd)
source "$lib/torchrun.sh"

codes=$(mktemp -d "${TMPDIR:-/tmp}/megatronish-workers.XXXXXX") || exit 1
trap 'rm -rf "$codes"' EXIT
# shellcheck disable=SC2046  # the signal options: a list
cmd=("$python" "$lib/quiet_torchrun.py" "${options[@]}" $(torchrun_signal_args "$python")
  --no-python bash "$lib/record_exit.sh" "$codes" "$python" -m megatronish.train "$@")
if ((forward)); then
  set -m  # torchrun in a process group of its own: the terminal's signals reach this shell only
fi
"${cmd[@]}" &
pid=$!
for sig in TERM INT HUP QUIT USR2; do
  if ((forward)); then
    # shellcheck disable=SC2064  # the signal and pid are fixed now
    trap "kill -s $sig $pid 2>/dev/null" "$sig"
  else
    trap : "$sig"
  fi
done
# A trapped signal ends `wait` early: wait again until torchrun has exited.
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"
  rc=$?
done
wait "$pid"  # its own status: a trapped signal may have ended the last wait just as it exited
rc=$?
code=$(workers_exit_code "$codes" "$rc")
if ((code != rc)); then
  echo "torchrun exited with $rc, its workers with $code: exiting with $code" >&2
fi
exit "$code"
