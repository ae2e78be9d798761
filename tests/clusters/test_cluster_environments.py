"""One class per cluster environment, read by both the launcher (``detect_cluster``) and every process
(``read_cluster_environment``); registration through ``register_cluster_environment`` and the
``lockstep.cluster_environments`` entry-point group.

The worker used to parse SLURM, MPI and Kubeflow's variables itself (``_env._from_slurm``...); each case
where its reading differed from the launcher's is pinned here with the value SLURM's documented semantics
give.
"""

from __future__ import annotations

import pytest

from lockstep._env import read_cluster_environment
from lockstep.clusters import (
    Cluster,
    ClusterEnvironment,
    SlurmCluster,
    cluster_environments,
    register_cluster_environment,
    registry,
    unregister_cluster_environment,
)
from lockstep.errors import UsageError
from lockstep.launcher.clusters import cluster_choices, detect_cluster
from tests.plugins.lab_cluster import LabCluster


def _srun_task(**extra: str) -> dict[str, str]:
    """``srun --nodes=2 --ntasks=8 python train.py`` (no --ntasks-per-node): task 5, on the second node."""
    env = {
        "SLURM_JOB_ID": "4242123",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[03-04]",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
    }
    env.update(extra)
    return env


# -- SLURM: the cases where the worker's own parsing differed --------------------------------------------


def test_slurm_tasks_on_this_node_come_from_the_tasks_per_node_without_ntasks_per_node():
    place = read_cluster_environment(_srun_task())
    assert (place.source, place.rank, place.local_rank, place.world_size) == ("slurm", 5, 1, 8)
    assert place.local_world_size == 4  # was 8: the whole job, when --ntasks-per-node was not given


def test_slurm_uneven_tasks_per_node_give_this_nodes_count():
    """``srun -n 7`` on 4 nodes: SLURM writes 2(x3),1; the last node runs one task."""
    env = _srun_task(
        SLURM_NNODES="4",
        SLURM_STEP_NUM_NODES="4",
        SLURM_NODEID="3",
        SLURM_PROCID="6",
        SLURM_LOCALID="0",
        SLURM_NTASKS="7",
        SLURM_STEP_NUM_TASKS="7",
        SLURM_TASKS_PER_NODE="2(x3),1",
        SLURM_STEP_TASKS_PER_NODE="2(x3),1",
        SLURM_NTASKS_PER_NODE="2",
    )
    assert read_cluster_environment(env).local_world_size == 1  # was 2: the first count, for every node
    env["SLURM_NODEID"], env["SLURM_PROCID"] = "0", "1"
    assert read_cluster_environment(env).local_world_size == 2


def test_slurm_machine_0_is_the_first_node_of_the_step_expanded_as_scontrol_does():
    env = _srun_task(SLURM_JOB_NODELIST="rack[1-2]-n[07-09]", SLURM_STEP_NODELIST="rack[1-2]-n[08-09]")
    place = read_cluster_environment(env)
    assert place.master_addr == "rack1-n08"  # was rack1: the job's list, cut at its first bracket
    launcher = detect_cluster(
        _srun_task(
            SLURM_STEP_NODELIST="rack[1-2]-n[08-09]", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2"
        )
    )
    assert launcher is not None and launcher.main_address == place.master_addr


def test_slurm_port_is_derived_from_the_job_id_as_the_launcher_derives_it():
    place = read_cluster_environment(_srun_task())
    assert place.master_port == 12123  # was 29500 for every job: two jobs sharing a node collided
    assert read_cluster_environment(_srun_task(MASTER_PORT="29611")).master_port == 29611
    launcher = detect_cluster(_srun_task(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2"))
    assert launcher is not None and launcher.main_port == place.master_port


def test_slurm_interactive_shell_is_one_process_as_the_launcher_reads_it():
    env = _srun_task(SLURM_JOB_NAME="interactive")
    assert read_cluster_environment(env).source == "single"  # was rank 5 of 8: a hang waiting for 7 others
    assert detect_cluster(env) is None


def test_slurm_uneven_tasks_without_a_node_id_is_a_clear_error():
    env = _srun_task(SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_NTASKS="3", SLURM_PROCID="0")
    del env["SLURM_NODEID"]
    with pytest.raises(
        UsageError, match=r"SLURM_STEP_TASKS_PER_NODE=2,1 gives the nodes different task counts"
    ):
        read_cluster_environment(env)
    with pytest.raises(UsageError, match=r"SLURM_STEP_TASKS_PER_NODE='4\(x\)' is invalid"):
        read_cluster_environment(_srun_task(SLURM_STEP_TASKS_PER_NODE="4(x)"))
    with pytest.raises(ValueError, match=r"SLURM_PROCID='five' is invalid: it must be an integer >= 0"):
        read_cluster_environment(_srun_task(SLURM_PROCID="five"))


# -- MPI and Kubeflow: the same order and the same readings as the launcher's ----------------------------


def test_mpirun_inside_a_slurm_job_reads_mpi():
    """Open MPI's mpirun runs its daemons as one SLURM task per node: the processes inherit that task's
    SLURM_PROCID/SLURM_NTASKS, and only MPI's variables number them."""
    env = _srun_task(
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        OMPI_COMM_WORLD_SIZE="8",
        OMPI_COMM_WORLD_RANK="6",
        OMPI_COMM_WORLD_LOCAL_RANK="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
    )
    place = read_cluster_environment(env)
    assert (place.source, place.rank, place.world_size, place.local_rank, place.local_world_size) == (
        "mpi",
        6,
        8,
        2,
        4,
    )  # was slurm, rank 1 of 2: every process on a node claimed the same rank


def test_slurm_pmi_is_slurms_job_and_pmi_alone_outside_slurm_is_mpis():
    pmi = {"PMI_RANK": "5", "PMI_SIZE": "8"}
    assert read_cluster_environment(_srun_task(**pmi)).source == "slurm"  # srun --mpi=pmi2
    place = read_cluster_environment(pmi)
    assert (place.source, place.rank, place.world_size) == ("mpi", 5, 8)


def test_kubeflow_older_operator_runs_one_process_per_pod():
    pod = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
    }
    place = read_cluster_environment(pod)
    assert (place.source, place.rank, place.world_size, place.local_rank) == ("kubeflow", 2, 3, 0)
    assert place.local_world_size == 1  # was 3: torchrun's default of the whole world on one machine
    assert (place.master_addr, place.master_port) == ("job-master-0", 23456)
    launcher = detect_cluster(pod)
    assert launcher is not None and (launcher.num_machines, launcher.machine_rank) == (3, 2)
    torchrun_worker = {**pod, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert read_cluster_environment(torchrun_worker).source == "torchrun"


def test_built_ins_are_registered_in_the_order_both_readers_ask_them():
    names = [cluster.name for cluster in cluster_environments()]
    assert names[:6] == ["kubeflow", "torchrun", "mpi", "slurm", "lsf", "pbs"]
    assert cluster_choices()[:7] == ("auto", "none", "kubeflow", "mpi", "slurm", "lsf", "pbs")


# -- Registration -----------------------------------------------------------------------------------------


@pytest.fixture
def lab_registered():
    register_cluster_environment(LabCluster)
    yield LabCluster
    unregister_cluster_environment("lab")


LAB_MACHINE = {"LAB_HOSTS": "lab07,lab08", "LAB_HOST_INDEX": "1", "LAB_PORT": "24567"}


def test_a_registered_environment_is_read_by_the_launcher_and_the_worker(lab_registered):
    machines = detect_cluster(LAB_MACHINE)
    assert machines is not None
    assert (machines.name, machines.num_machines, machines.machine_rank, machines.main_address) == (
        "lab",
        2,
        1,
        "lab07",
    )
    assert detect_cluster(LAB_MACHINE, choice="lab") == machines
    assert "lab" in cluster_choices()
    place = read_cluster_environment({**LAB_MACHINE, "LAB_TASK": "1", "LAB_TASKS": "2"})
    assert place == ClusterEnvironment(
        source="lab", rank=1, world_size=2, master_addr="lab07", master_port=24567
    )
    with pytest.raises(ValueError, match="rank 2 of world size 2, which is impossible"):
        read_cluster_environment({**LAB_MACHINE, "LAB_TASK": "2", "LAB_TASKS": "2"})


def test_without_registration_the_lab_is_not_read():
    assert detect_cluster(LAB_MACHINE) is None
    with pytest.raises(UsageError, match=r"--cluster 'lab' is invalid: use one of auto, none, kubeflow"):
        detect_cluster(LAB_MACHINE, choice="lab")


def test_registration_refuses_what_is_not_an_environment(lab_registered):
    with pytest.raises(
        TypeError, match=r"register_cluster_environment\(LabCluster\(\.\.\.\)\)|takes a subclass"
    ):
        register_cluster_environment(LabCluster({}))  # type: ignore[arg-type]

    class Unnamed(Cluster):
        pass

    with pytest.raises(
        ValueError, match=r"register_cluster_environment\(Unnamed\) is invalid: its name is ''"
    ):
        register_cluster_environment(Unnamed)

    class Other(LabCluster):
        pass

    with pytest.raises(ValueError, match=r"A cluster environment named 'lab' is registered already"):
        register_cluster_environment(Other)
    assert register_cluster_environment(Other, replace=True) is Other
    assert register_cluster_environment(SlurmCluster) is SlurmCluster  # the same class again is fine


def test_an_entry_point_registers_on_first_use(tmp_path, monkeypatch):
    """A distribution installed on sys.path whose entry point names the lab class: the first use after
    lockstep was imported reads it."""
    info = tmp_path / "lab_cluster-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-cluster\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[lockstep.cluster_environments]\nlab = tests.plugins.lab_cluster:LabCluster\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry.CLUSTERS, "discovered", False)
    try:
        assert "lab" in [cluster.name for cluster in cluster_environments()]
        assert read_cluster_environment({**LAB_MACHINE, "LAB_TASK": "0", "LAB_TASKS": "2"}).source == "lab"
    finally:
        unregister_cluster_environment("lab")
