"""The CPUs this process may run on, and the intra-op threads each rank gets (no torch import).

Under SLURM (cgroup cpusets, task binding), ``taskset`` or a container's ``--cpuset-cpus`` a
process may use fewer CPUs than the machine has: ``os.cpu_count()`` counts the machine, the
affinity mask counts what this process gets. More threads than CPUs thrash.

Who shares the mask: torchrun's workers share their agent's (``LOCAL_WORLD_SIZE`` of them per
node). srun's tasks share the step's CPUs on the node unless srun bound each task to its own
(``--cpu-bind``, the default with ``--cpus-per-task`` on most clusters): then the mask is this
task's alone. srun sets no ``LOCAL_WORLD_SIZE``; its tasks per node are in
``SLURM_STEP_TASKS_PER_NODE`` (``4(x2),3``: 4 tasks on each of two nodes, 3 on the third).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count where there is no mask API)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_per_rank(cpus: int, local_ranks: int) -> int:
    """Intra-op threads for each of ``local_ranks`` ranks sharing ``cpus`` CPUs: at least one."""
    return max(1, cpus // max(local_ranks, 1))


def tasks_per_node(value: str) -> list[int]:
    """SLURM's tasks-per-node list, one entry per node: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse SLURM tasks per node {value!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_local_tasks(env: Mapping[str, str]) -> int | None:
    """srun's tasks on this node (None when SLURM does not say): the step's layout
    (``SLURM_STEP_TASKS_PER_NODE``, this node's entry by ``SLURM_NODEID``, the largest when that
    does not pick one), else ``SLURM_NTASKS_PER_NODE`` or the job's ``SLURM_TASKS_PER_NODE``."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            try:
                counts = tasks_per_node(env[name])
            except ValueError:
                continue
            node = env.get("SLURM_NODEID", "")
            if len(set(counts)) > 1 and node.isdigit() and int(node) < len(counts):
                return counts[int(node)]
            return max(counts)
    return None


def slurm_mask_is_per_task(env: Mapping[str, str], cpus: int) -> bool:
    """Whether srun bound this task to CPUs of its own: a CPU binding is in force
    (``SLURM_CPU_BIND_TYPE``, not ``none``), or the mask is no larger than the task's CPUs
    (``SLURM_CPUS_PER_TASK``)."""
    bind = env.get("SLURM_CPU_BIND_TYPE", "").strip().rstrip(",")
    if bind and not bind.startswith("none"):
        return True
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    return per_task.isdigit() and cpus <= int(per_task)


def default_threads(env: Mapping[str, str], kind: str, world_size: int, cpus: int) -> int:
    """Intra-op threads for a rank started by ``kind`` ("single", "torchrun", "slurm") whose
    affinity mask holds ``cpus`` CPUs: the mask divided among the ranks that share it."""
    if kind == "slurm":
        if slurm_mask_is_per_task(env, cpus):
            return max(1, cpus)
        local = slurm_local_tasks(env)
        return threads_per_rank(cpus, world_size if local is None else local)
    return threads_per_rank(cpus, int(env.get("LOCAL_WORLD_SIZE", world_size)))
