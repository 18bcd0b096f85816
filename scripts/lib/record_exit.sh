# One torchrun worker: record_exit.sh DIR COMMAND... runs COMMAND (python -m megatronish.train
# ...) and writes its exit code to DIR/<LOCAL_RANK> for scripts/lib/run_torchrun.sh, which
# starts it through `torchrun --no-python bash record_exit.sh DIR ...`. The file holds
# "running" until COMMAND ends: a worker SIGKILLed with this shell leaves no code.
dir=$1
shift
file=$dir/${LOCAL_RANK:-0}
echo running >"$file"
# torchrun signals the worker's process group, this shell and COMMAND: COMMAND acts on the
# signal (a graceful stop) and this shell, trapping it, waits for COMMAND's code.
trap : TERM INT HUP QUIT USR2
"$@"
rc=$?
echo "$rc" >"$file"
exit "$rc"
