"""Stand-ins for ``srun``, ``scancel``, ``scontrol`` and ``sbatch`` on one machine, for tests.

They let ``scripts/slurm/*.sh`` and ``train.sbatch`` run as they would in an allocation of one
node: ``srun`` records its options, starts its tasks with ``SLURM_PROCID`` / ``SLURM_LOCALID`` /
``SLURM_NTASKS`` (and ``SLURM_CPUS_PER_TASK`` from ``--cpus-per-task``) set, each in its own
process group, and exits with the highest task exit code; ``scancel --signal`` on the running
job signals those process groups (as slurmstepd signals every process of a step); other
``scancel`` calls are only recorded; ``scontrol show hostnames`` splits a plain comma list and
``scontrol show job`` says ``Requeue=$FAKE_SLURM_REQUEUE`` (default 0); ``sbatch --parsable``
records its arguments (and, in ``sbatch.env``, the environment the last job would get) and prints
job ids 1001, 1002, ... Everything they record goes to ``$FAKE_SLURM_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

SRUN = r"""#!/usr/bin/env bash
set -m  # every task in its own process group
ntasks=${SLURM_NTASKS:-1}
options=()
while [[ $# -gt 0 && $1 == -* ]]; do
  options+=("$1")
  case $1 in
    --ntasks=*|--ntasks-per-node=*) ntasks=${1#*=} ;;
    --cpus-per-task=*) export SLURM_CPUS_PER_TASK=${1#*=} ;;
  esac
  shift
done
echo "${options[*]}" >> "$FAKE_SLURM_DIR/srun"
pids=()
for ((i = 0; i < ntasks; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=$ntasks SLURM_STEP_ID=0 "$@" &
  pids+=($!)
done
echo "${pids[*]}" > "$FAKE_SLURM_DIR/tasks"
rc=0
for pid in "${pids[@]}"; do
  wait "$pid"
  code=$?
  if ((code > rc)); then rc=$code; fi
done
exit $rc
"""

SCANCEL = r"""#!/usr/bin/env bash
sig=KILL
running=0
for arg in "$@"; do
  case $arg in
    --signal=*) sig=${arg#*=} ;;
    "$SLURM_JOB_ID") running=1 ;;
  esac
done
echo "scancel $*" >> "$FAKE_SLURM_DIR/calls"
if ((!running)); then exit 0; fi
for pid in $(cat "$FAKE_SLURM_DIR/tasks" 2>/dev/null); do
  kill -s "$sig" -- "-$pid" 2>/dev/null || true
done
"""

SCONTROL = r"""#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/calls"
if [[ $1 == show && $2 == hostnames ]]; then
  tr ',' '\n' <<< "$3"
elif [[ $1 == show && $2 == job ]]; then
  echo "JobId=$3 JobName=megatronish Requeue=${FAKE_SLURM_REQUEUE:-0} Restarts=0 BatchFlag=1"
fi
"""

SBATCH = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_SLURM_DIR/sbatch"
env > "$FAKE_SLURM_DIR/sbatch.env"
echo $((1000 + $(wc -l < "$FAKE_SLURM_DIR/sbatch")))
"""

TOOLS = {"srun": SRUN, "scancel": SCANCEL, "scontrol": SCONTROL, "sbatch": SBATCH}


def fake_slurm_env(
    state_dir: Path, *, job_id: int = 4242, ntasks: int = 1, submit_dir: str | None = None
) -> dict[str, str]:
    """The environment of a batch job on one node ("localhost"), fake tools first on PATH."""
    bin_dir = state_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in TOOLS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        FAKE_SLURM_DIR=str(state_dir),
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="megatronish",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_NTASKS=str(ntasks),
        SLURM_SUBMIT_DIR=submit_dir or os.getcwd(),
    )
    return env
