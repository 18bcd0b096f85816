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
