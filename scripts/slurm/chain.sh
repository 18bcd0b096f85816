#!/usr/bin/env bash
# Submit N training jobs that run one after another, each resuming from the checkpoint the one
# before saved (checkpoint.resume=auto): scripts/slurm/chain.sh N [key=value ...]
#
# SBATCH_ARGS adds sbatch options to every job ("--nodes=4 --time=12:00:00"), SCRIPT picks the
# batch script (default scripts/slurm/train.sbatch), JOB_NAME names the jobs (default
# megatronish). DEPENDENCY=afterany (default): job k+1 starts when job k has ended, however it
# ended. DEPENDENCY=singleton: SLURM runs at most one job of this name and user at a time.
# The job ids go to CHAIN_DIR (default outputs/chains, visible from the compute nodes), one file
# per chain: the job that ends the run (trainer.max_steps reached, or found already reached)
# cancels the chain's later jobs, which would have nothing to do.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the jobs' SLURM_SUBMIT_DIR: the repository root
n=${1:?usage: scripts/slurm/chain.sh N [key=value ...]}
shift
if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
  echo "chain.sh: N is the number of jobs to submit (1 or more), got '$n'" >&2
  exit 2
fi
script=${SCRIPT:-scripts/slurm/train.sbatch}
dependency=${DEPENDENCY:-afterany}
if [[ $dependency != afterany && $dependency != singleton ]]; then
  echo "chain.sh: DEPENDENCY=$dependency; use afterany or singleton" >&2
  exit 2
fi

chain_dir=${CHAIN_DIR:-outputs/chains}
mkdir -p "$chain_dir"
chain_file=$(cd "$chain_dir" && pwd)/$(date +%Y%m%d-%H%M%S)-$$.jobs
export MEGATRONISH_CHAIN_FILE=$chain_file  # sbatch passes it on to every job (train.sbatch)
: >"$chain_file"

prev=""
for ((i = 1; i <= n; i++)); do
  dep=()
  if [[ $dependency == singleton ]]; then
    dep=(--dependency=singleton)
  elif [[ -n $prev ]]; then
    dep=(--dependency="afterany:$prev")
  fi
  # shellcheck disable=SC2086  # SBATCH_ARGS is a list of options
  out=$(sbatch --parsable --job-name="${JOB_NAME:-megatronish}" "${dep[@]}" ${SBATCH_ARGS:-} \
    "$script" "$@")
  prev=${out%%;*}  # --parsable prints "jobid" or "jobid;cluster"
  echo "$prev" >>"$chain_file"
  echo "job $i/$n: $prev ${dep[*]}"
done
echo "job ids: $chain_file"
