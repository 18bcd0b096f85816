# Sourced by the launch scripts. torchrun_signal_args PYTHON prints the torchrun options that pass
# every stop signal on to the workers: torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT by
# default, SIGUSR2 (a graceful stop, what `sbatch --signal` sends) only when asked, and older
# versions cannot be asked: there SIGUSR2 ends torchrun and leaves its workers running.
torchrun_signal_args() {
  local run_py
  # Locates torch without importing it (a few ms instead of seconds).
  run_py=$("$1" -c 'import importlib.util, os
print(os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "distributed", "run.py"))' 2>/dev/null)
  if [ -n "$run_py" ] && grep -q "signals.to.handle" "$run_py" 2>/dev/null; then
    echo "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
  fi
}

# workers_exit_code DIR TORCHRUN_CODE prints the exit code a torchrun launch stands for, from
# the codes its workers wrote to DIR (scripts/lib/record_exit.sh): 0 when torchrun exited 0;
# else, when every worker of the last attempt wrote its code, the highest (as srun reports its
# tasks'); else (no worker started, or one was SIGKILLed) torchrun's own.
workers_exit_code() {
  local dir=$1 torchrun_code=$2 highest=-1 code file
  if ((torchrun_code == 0)); then
    echo 0
    return
  fi
  for file in "$dir"/*; do
    [[ -f $file ]] || continue
    code=$(<"$file")
    if ! [[ $code =~ ^[0-9]+$ ]]; then
      echo "$torchrun_code"
      return
    fi
    if ((code > highest)); then highest=$code; fi
  done
  if ((highest < 0)); then highest=$torchrun_code; fi
  echo "$highest"
}
