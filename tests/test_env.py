import pytest

from lockstep._env import launch_settings, read_cluster_environment


def test_single_process_without_launcher_variables():
    cluster = read_cluster_environment({})
    assert (cluster.source, cluster.rank, cluster.world_size, cluster.local_rank) == ("single", 0, 1, 0)


def test_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    cluster = read_cluster_environment(env)
    assert cluster.source == "torchrun"
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (3, 4, 1, 2)
    assert (cluster.master_addr, cluster.master_port, cluster.restart_count) == ("10.0.0.1", 1234, 2)


def test_slurm_variables_derive_master_from_node_list():
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[03-04,07],cpu1",
    }
    cluster = read_cluster_environment(env)
    assert (cluster.source, cluster.rank, cluster.local_rank, cluster.world_size) == ("slurm", 5, 1, 8)
    assert cluster.local_world_size == 4
    assert cluster.master_addr == "gpu03"


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert read_cluster_environment(env).source == "torchrun"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            (2, 4, 0, 2),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}, (1, 3, 1, 3)),
    ],
)
def test_mpi_variables(env, expected):
    cluster = read_cluster_environment(env)
    assert cluster.source == "mpi"
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == expected


def test_impossible_rank_is_a_clear_error():
    with pytest.raises(ValueError, match="rank 2 of world size 2, which is impossible"):
        read_cluster_environment({"RANK": "2", "WORLD_SIZE": "2"})


def test_non_integer_is_a_clear_error():
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is invalid: it must be an integer"):
        read_cluster_environment({"RANK": "0", "WORLD_SIZE": "two"})


def test_launch_settings_json():
    assert launch_settings({}) == {}
    assert launch_settings({"LOCKSTEP_LAUNCH_CONFIG": '{"mixed_precision": "bf16"}'}) == {
        "mixed_precision": "bf16"
    }
    with pytest.raises(ValueError, match="invalid JSON"):
        launch_settings({"LOCKSTEP_LAUNCH_CONFIG": "{oops"})
