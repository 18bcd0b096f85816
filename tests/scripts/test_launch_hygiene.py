"""Launch hygiene: threads from the CPUs a process may use, one GPU per local rank (refused
before any process group otherwise), and the launchers' CUDA allocator setting."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatronish import train
from megatronish.config.validate import ConfigError
from megatronish.distributed import cpus
from megatronish.distributed.launch import LaunchEnv, gpu_for_local_rank, pick_device
from megatronish.testing.fake_slurm import fake_slurm_env
from megatronish.testing.runs import test_config as tiny_config
from megatronish.training.job import set_threads

REPO = Path(__file__).resolve().parents[2]


# -- threads --------------------------------------------------------------------------------
def test_threads_per_rank_share_the_usable_cpus():
    assert cpus.threads_per_rank(len({0, 1, 2, 3, 4, 5}), 2) == 3
    assert cpus.threads_per_rank(6, 4) == 1
    assert cpus.threads_per_rank(2, 8) == 1  # never zero
    assert cpus.threads_per_rank(16, 0) == 16


@pytest.fixture
def machine_of_64_cpus_with_3_usable(monkeypatch):
    """A SLURM task bound to CPUs {4, 9, 11} of a 64-CPU node."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 9, 11}, raising=False)


def test_usable_cpus_is_the_affinity_mask_not_the_machine(machine_of_64_cpus_with_3_usable):
    assert cpus.usable_cpus() == 3


def test_set_threads_divides_the_affinity_mask_among_local_ranks(
    machine_of_64_cpus_with_3_usable, monkeypatch
):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = tiny_config([], 1)
    before = torch.get_num_threads()
    try:
        set_threads(cfg, LaunchEnv("single", 0, 1, 0, "127.0.0.1", 29500, None))
        assert torch.get_num_threads() == 3  # not 64
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        set_threads(cfg, LaunchEnv("torchrun", 1, 4, 1, "127.0.0.1", 29500, None))
        assert torch.get_num_threads() == 1  # 3 CPUs / 2 ranks, not 32
    finally:
        torch.set_num_threads(before)


def _slurm_threads(monkeypatch, mask: int, **env) -> int:
    """set_threads of srun task 3 of 16 (no LOCAL_WORLD_SIZE, as under srun) bound to ``mask``
    CPUs of a 96-CPU node, with the SLURM variables ``env``."""
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(mask)), raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["LOCAL_WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    try:
        set_threads(tiny_config([], 1), LaunchEnv("slurm", 3, 16, 3, "node1", 29500, "7"))
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "mask,env,want",
    [
        # --cpus-per-task=12 with srun's CPU binding: the mask is this task's own 12 CPUs
        (12, {"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_NTASKS_PER_NODE": "8"}, 12),
        (12, {"SLURM_CPUS_PER_TASK": "12", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, 12),
        # no binding: the step's 96 CPUs on the node, shared by its 8 tasks there
        (96, {"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_CPU_BIND_TYPE": "none"}, 12),
        (96, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "12"}, 12),
        (96, {"SLURM_STEP_TASKS_PER_NODE": "8,4,4", "SLURM_NODEID": "2"}, 24),
        (96, {"SLURM_TASKS_PER_NODE": "4(x4)"}, 24),
        (96, {}, 6),  # nothing says: the world (16) shares it, as before
    ],
)
def test_srun_tasks_get_their_own_cpus_or_a_share_of_the_nodes(monkeypatch, mask, env, want):
    assert _slurm_threads(monkeypatch, mask, **env) == want


def test_slurm_tasks_per_node_lists():
    assert cpus.tasks_per_node("4(x2),3") == [4, 4, 3]
    assert cpus.tasks_per_node("8") == [8]
    assert cpus.slurm_local_tasks({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}) == 4  # node unknown
    assert cpus.slurm_local_tasks({"SLURM_STEP_TASKS_PER_NODE": "junk"}) is None
    with pytest.raises(ValueError, match="4,x"):
        cpus.tasks_per_node("4,x")


# -- one GPU per local rank -----------------------------------------------------------------
def test_each_local_rank_gets_its_own_gpu_or_a_one_line_refusal(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert [gpu_for_local_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]
    for local_rank, count, bound in ((2, 2, False), (4, 4, False), (3, 2, True), (5, 1, True)):
        with pytest.raises(ConfigError) as e:
            gpu_for_local_rank(local_rank, count, bound, env={"CUDA_VISIBLE_DEVICES": "0,1"})
        line = str(e.value)
        assert "\n" not in line and line.startswith("invalid config: ")
        assert f"local rank {local_rank}" in line and f"shows {count} GPU(s)" in line
        assert "CUDA_VISIBLE_DEVICES=0,1" in line and f"at most {count} rank(s)" in line
        assert ("--gpus-per-task=1" in line) == bound


@pytest.mark.parametrize(
    "env,own_gpu",
    [
        ({"SLURM_GPUS_PER_TASK": "1"}, True),  # srun --gpus-per-task=1: bound per task
        ({"SLURM_GPUS_PER_TASK": "h100:1"}, True),
        ({"SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7", "SLURM_STEP_TASKS_PER_NODE": "8"}, True),
        ({"CUDA_VISIBLE_DEVICES": "5"}, True),  # a wrapper gave local rank 5 its GPU
        # 8 tasks on a node whose step has one GPU: they would all take GPU 0
        ({"SLURM_STEP_GPUS": "0", "SLURM_STEP_TASKS_PER_NODE": "8"}, False),
        ({"CUDA_VISIBLE_DEVICES": "0"}, False),
        ({}, False),
    ],
)
def test_one_visible_gpu_under_srun_only_when_slurm_bound_it_to_the_task(env, own_gpu):
    if own_gpu:
        assert gpu_for_local_rank(5, 1, task_bound=True, env=env) == 0
    else:
        with pytest.raises(ConfigError, match="local rank 5 has no GPU of its own"):
            gpu_for_local_rank(5, 1, task_bound=True, env=env)
    with pytest.raises(ConfigError):  # torchrun's workers never share a GPU
        gpu_for_local_rank(5, 1, task_bound=False, env=env)


@pytest.fixture
def node_with_2_gpus(monkeypatch):
    """torch.cuda answering for a node with 2 GPUs; set_device calls are recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_pick_device_refuses_a_third_rank_before_touching_a_gpu(node_with_2_gpus):
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own"):
        pick_device("cuda", 2)
    assert node_with_2_gpus == []  # no set_device, so no NCCL "Duplicate GPU" later


def test_the_entry_point_exits_2_with_one_line_before_any_process_group(
    node_with_2_gpus, capsys, monkeypatch
):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = tiny_config(["trainer.device=cuda", "checkpoint.dir=null"], 1)
    launch = LaunchEnv("torchrun", 2, 4, 2, "127.0.0.1", 29500, "r")  # 4 ranks, 2 GPUs
    before = torch.get_num_threads()
    try:
        code = train.main_with_config(cfg, launch)
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err.strip()
    assert code == train.EXIT_CONFIG == 2
    assert len(err.splitlines()) == 1 and "local rank 2 has no GPU of its own" in err, err
    assert not torch.distributed.is_initialized() and node_with_2_gpus == []


# -- the launchers' allocator setting -------------------------------------------------------
STAND_IN = """#!/usr/bin/env bash
if [[ $1 == -c ]]; then exit 0; fi  # the launchers' probes: an interpreter that has everything
printf '%s|%s\\n' "${PYTORCH_ALLOC_CONF-unset}" "${PYTORCH_CUDA_ALLOC_CONF-unset}" >> "$SEEN"
"""
DEFAULT = "expandable_segments:True|expandable_segments:True"


def _stand_in_python(tmp_path: Path) -> Path:
    """A 'python' that records the allocator variables each launch started it with."""
    path = tmp_path / "python"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def _launch(script: list[str], env: dict, tmp_path: Path) -> list[str]:
    seen = tmp_path / "seen"
    seen.unlink(missing_ok=True)
    env = {**env, "PYTHON": str(_stand_in_python(tmp_path)), "SEEN": str(seen)}
    done = subprocess.run(["bash", *script], env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return seen.read_text().splitlines()


@pytest.mark.parametrize(
    "user,want",
    [
        ({}, DEFAULT),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "unset|max_split_size_mb:512"),
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, "backend:cudaMallocAsync|unset"),
    ],
)
def test_launch_local_sets_expandable_segments_unless_the_user_chose(tmp_path, user, want):
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    seen = _launch(["scripts/launch_local.sh", "2"], {**env, **user}, tmp_path)
    assert seen == [want]  # the torchrun command


def test_sbatch_sets_expandable_segments_for_every_task(tmp_path):
    env = fake_slurm_env(tmp_path / "slurm", ntasks=2, submit_dir=str(REPO))
    env = {k: v for k, v in env.items() if "ALLOC_CONF" not in k}
    seen = _launch(["scripts/slurm/train.sbatch"], {**env, "LAUNCH": "srun"}, tmp_path)
    assert seen == [DEFAULT, DEFAULT]  # each of the 2 tasks srun started
