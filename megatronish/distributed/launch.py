"""Launch environment detection (plain process, torchrun, SLURM) and process-group start-up
(with the NCCL settings that make a failed collective an error instead of an abort)."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed.comm import CollectiveError
from megatronish.distributed.cpus import slurm_local_tasks


@dataclass(frozen=True)
class LaunchEnv:
    """How this process was started and where its peers are."""

    kind: str  # "single" | "torchrun" | "slurm"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str | None  # SLURM job id or torchrun run id; None for a plain process


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's environment variables. Pure given ``env``.

    torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Under ``srun`` with
    one task per rank, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID are used and the master is the
    first host of SLURM_JOB_NODELIST. torchrun inside srun (one task per node) is torchrun.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            kind="torchrun",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            run_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID"),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        job = env.get("SLURM_JOB_ID", "0")
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return LaunchEnv(
            kind="slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_host(nodes),
            master_port=int(env.get("MASTER_PORT") or 10000 + int(job) % 20000),
            run_id=job,
        )
    return LaunchEnv("single", 0, 1, 0, "127.0.0.1", 29500, env.get("SLURM_JOB_ID"))


def slurm_binds_gpu_per_task(env: Mapping[str, str], local_rank: int) -> bool:
    """Whether SLURM shows that it gave this task a GPU of its own (so the one GPU the task sees
    is not shared with the node's other tasks): ``--gpus-per-task`` (``SLURM_GPUS_PER_TASK``;
    srun then binds each task to its GPUs unless ``--gpu-bind`` says otherwise), the step's
    GPUs on this node (``SLURM_STEP_GPUS``) at least as many as its tasks there, or
    ``CUDA_VISIBLE_DEVICES`` naming exactly this task's local id (a per-task wrapper)."""
    if re.search(r"[1-9]", env.get("SLURM_GPUS_PER_TASK", "").split(":")[-1]):
        return True
    step_gpus = [g for g in env.get("SLURM_STEP_GPUS", "").split(",") if g.strip()]
    local = slurm_local_tasks(env)
    if step_gpus and local is not None and len(step_gpus) >= local:
        return True
    return local_rank > 0 and env.get("CUDA_VISIBLE_DEVICES", "").strip() == str(local_rank)


def gpu_for_local_rank(
    local_rank: int, device_count: int, task_bound: bool = False, env: Mapping | None = None
) -> int:
    """The GPU (among the visible ones) of local rank ``local_rank``: one GPU per rank.

    ``task_bound``: srun started this rank as its own task. A task that SLURM bound to its own
    GPU (:func:`slurm_binds_gpu_per_task`: ``--gpus-per-task=1``, ``--gpu-bind``) sees it as its
    only device and takes it. Otherwise a local rank needs a visible GPU of its own index: two
    ranks on one GPU would fail later in NCCL ("Duplicate GPU detected"), or, on a node whose
    tasks all see the same single GPU, run on it together; this refuses with the numbers and
    the fix.
    """
    env = os.environ if env is None else env
    if local_rank < device_count:
        return local_rank
    if task_bound and device_count == 1 and slurm_binds_gpu_per_task(env, local_rank):
        return 0
    from megatronish.config.validate import ConfigError  # omegaconf: only when refusing

    bind = "; srun: --gpus-per-task=1 gives each task its own" if task_bound else ""
    raise ConfigError(
        [
            f"local rank {local_rank} has no GPU of its own: this node shows {device_count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at "
            f"most {device_count} rank(s) per node (torchrun --nproc-per-node, srun "
            f"--ntasks-per-node){bind} or use trainer.device=cpu"
        ]
    )


def pick_device(requested: str, local_rank: int, task_bound: bool = False) -> torch.device:
    """``auto`` takes this rank's GPU (:func:`gpu_for_local_rank`) when CUDA is available, else
    the CPU. A local rank without a GPU is a ``ConfigError`` (one line, exit 2), raised before
    any process group exists."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is visible; use cpu or auto")
        gpu = gpu_for_local_rank(local_rank, torch.cuda.device_count(), task_bound)
        torch.cuda.set_device(gpu)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(requested)


def nccl_error_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` before NCCL groups exist. Pure.

    torch's ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING (or the older
    NCCL_ASYNC_ERROR_HANDLING) whenever a group is created; its default, 3, ends the process
    from the watchdog thread (SIGABRT) when an op fails or times out. 2 ("clean up only") makes
    the watchdog abort that group's communicators, which ends the stuck kernels and frees a
    thread blocked on the device, and leaves the process alive: the training thread then gets a
    DistBackendError from its next op on the group, which the comm wrappers name (exit code 6).
    The timeout itself is the groups' ``timeout`` (``parallel.collective_timeout_s``). A value
    the user set under either name is kept.
    """
    names = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
    if any(env.get(name) for name in names):
        return {}
    return {names[0]: "2"}


def init_process_group(launch: LaunchEnv, device: torch.device, timeout_s: float) -> None:
    """Start torch.distributed for a multi-rank job: nccl on GPUs, gloo on CPUs.

    On GPUs the groups get both backends (``cpu:gloo,cuda:nccl``): tensors on the device go
    through NCCL, the few small host tensors (error agreement, stop requests, checkpoint
    bookkeeping) through gloo, so no host value needs a round trip through the device.

    ``timeout_s`` bounds the rendezvous and every op of the default group. A rendezvous that
    fails or times out raises :class:`CollectiveError` saying who waited for whom. With NCCL,
    :func:`nccl_error_env` is applied first, so failed ops raise instead of ending the process.
    """
    if launch.world_size == 1 or dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        os.environ.update(nccl_error_env(os.environ))
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    try:
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except RuntimeError as e:  # torch.distributed.DistError and backend errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise CollectiveError(
            f"starting the {backend} process group (rank {launch.rank} of {launch.world_size}, "
            f"master {master}) failed within {timeout_s:g} s: not every rank joined, or the "
            "master is unreachable; check that all ranks started and MASTER_ADDR/MASTER_PORT "
            f"(parallel.collective_timeout_s sets the wait) [{first}]"
        ) from e
