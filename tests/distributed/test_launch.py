"""Launcher detection: plain process, torchrun, SLURM one task per rank."""

from megatronish.distributed.launch import detect_launch, first_host


def test_plain_process():
    env = detect_launch({})
    assert (env.kind, env.rank, env.world_size) == ("single", 0, 1)


def test_torchrun():
    env = detect_launch(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RUN_ID": "abc",
        }
    )
    assert (env.kind, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)
    assert (env.master_addr, env.master_port, env.run_id) == ("n1", 1234, "abc")


def test_slurm_one_task_per_rank():
    env = detect_launch(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "5",
            "SLURM_JOB_ID": "777",
            "SLURM_JOB_NODELIST": "gpu[03-04]",
        }
    )
    assert (env.kind, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 16, 5)
    assert env.master_addr == "gpu03" and env.master_port == 10777 and env.run_id == "777"


def test_single_slurm_task_is_a_plain_process():
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).kind == "single"


def test_first_host_of_node_lists():
    assert first_host("node1") == "node1"
    assert first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_host("a[7,9]") == "a7"
