"""What ``lockstep launch`` reads from a cluster: SLURM host lists, each environment's variables as its
scheduler or launcher sets them, and how they merge with flags and the config file.

MPI's variables are pinned here as MPICH's Hydra and Open MPI 5 set them (checked with their mpiexec);
tests/e2e/test_cluster_launch.py runs MPICH's real ``mpiexec``.
"""

from __future__ import annotations

import argparse
import re

import pytest

from lockstep.cli.launch_flags import add_launch_flags, given_flags
from lockstep.cli.main import main
from lockstep.clusters import expand_hostlist
from lockstep.config.file import ClusterConfig
from lockstep.errors import UsageError
from lockstep.launcher.clusters import detect_cluster
from lockstep.launcher.elastic import prepare_worker_environment
from lockstep.launcher.settings import LaunchSettings, resolve

# -- SLURM host lists, as `scontrol show hostnames` expands them ----------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[03-05,07],cpu1", ["gpu03", "gpu04", "gpu05", "gpu07", "cpu1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("nid[001234-001236]", ["nid001234", "nid001235", "nid001236"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("compute-0-[0,9]", ["compute-0-0", "compute-0-9"]),
        ("lrdn[0001-0002,0005],lrdn0100", ["lrdn0001", "lrdn0002", "lrdn0005", "lrdn0100"]),
        ("ib[1-2]-eth,login", ["ib1-eth", "ib2-eth", "login"]),
        ("jwb[0099-0100].juwels", ["jwb0099.juwels", "jwb0100.juwels"]),
        ("host0 host1", ["host0", "host1"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_hostlist_expands_as_scontrol_does(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[1-3", "opens a bracket it never closes"),
        ("node1-3]", "closes a bracket it never opened"),
        ("node[[1-2]]", "nests brackets"),
        ("node[3-1]", "the range 3-1 ends below its start"),
        ("node[a-b]", r"\[a-b\] must hold numbers or ranges such as 01-04, not 'a-b'"),
        ("node[1-99999999]", "more than 1000000 hosts"),
        ("", "names no host"),
    ],
)
def test_bad_hostlists_are_named(hostlist, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(hostlist)


# -- SLURM ----------------------------------------------------------------------------------------------
def _srun_one_per_node(node: int = 2, **extra: str) -> dict[str, str]:
    """`srun --nodes=4 --ntasks-per-node=1 lockstep launch ...` on the third node of an 8-GPU job."""
    return {
        "SLURM_JOB_ID": "4242123",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x4)",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
        "SLURM_JOB_NODELIST": "gpu-[12-13,20,22]",
        "SLURM_NODELIST": "gpu-[12-13,20,22]",
        "SLURM_STEP_NODELIST": "gpu-[12-13,20,22]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.0.12",
        "SLURMD_NODENAME": "gpu-20",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_ON_NODE": "96",
        **extra,
    }


def test_slurm_one_launcher_per_node():
    cluster = detect_cluster(_srun_one_per_node())
    assert cluster is not None and cluster.name == "slurm"
    assert (cluster.num_machines, cluster.machine_rank, cluster.main_address) == (4, 2, "gpu-12")
    assert cluster.main_port == 10000 + 4242123 % 20000 == 12123
    assert (cluster.processes_per_machine, cluster.cpus_per_machine) == (8, 96)
    assert cluster.sources["main_address"] == "first host of SLURM_STEP_NODELIST=gpu-[12-13,20,22]"
    assert cluster.sources["main_port"] == "derived from SLURM_JOB_ID=4242123: 10000 + id % 20000"


def test_slurm_exported_master_address_and_port_win():
    cluster = detect_cluster(_srun_one_per_node(MASTER_ADDR="10.1.0.12", MASTER_PORT="29400"))
    assert (cluster.main_address, cluster.main_port) == ("10.1.0.12", 29400)
    assert cluster.sources["main_port"] == "MASTER_PORT=29400"


def test_slurm_batch_script_of_one_node_launches_normally():
    """`sbatch --nodes=1 --ntasks-per-node=4` then `lockstep launch` in the script: the script is one copy."""
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "0"}
    cluster = detect_cluster(env)
    assert (cluster.num_machines, cluster.machine_rank, cluster.main_port) == (1, None, None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "0"},
            r"SLURM_NNODES=2 but SLURM_STEP_ID is not set: this is the job's batch script, which runs on the "
            r"first node only.*srun --ntasks-per-node=1 lockstep launch train.py",
        ),
        (
            _srun_one_per_node(SLURM_STEP_TASKS_PER_NODE="4(x4)"),
            r"SLURM started 4 tasks on a node \(SLURM_STEP_TASKS_PER_NODE=4\(x4\)\).*they would form separate "
            r"jobs.*srun python train.py",
        ),
        (
            {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_NNODES": "2", "SLURM_NTASKS": "8"},
            r"SLURM started 4 tasks on a node \(SLURM_NTASKS=8 on 2 nodes\)",
        ),
        (_srun_one_per_node(SLURM_NODEID="two"), "SLURM_NODEID='two' is invalid: it must be an integer >= 0"),
        (_srun_one_per_node(SLURM_NODEID="4"), "SLURM_NODEID=4 is impossible with SLURM_STEP_NUM_NODES=4"),
        (
            _srun_one_per_node(SLURM_STEP_NODELIST="gpu-[12-13"),
            r"SLURM_STEP_NODELIST: host list 'gpu-\[12-13' opens a bracket it never closes",
        ),
        (_srun_one_per_node(SLURM_STEP_TASKS_PER_NODE="x"), "SLURM_STEP_TASKS_PER_NODE='x' is invalid"),
    ],
)
def test_slurm_jobs_that_cannot_form_one_job_are_refused(env, message):
    with pytest.raises(UsageError, match=message):
        detect_cluster(env)


def test_slurm_interactive_shell_is_not_read():
    assert detect_cluster(_srun_one_per_node(SLURM_JOB_NAME="interactive")) is None


# -- Kubeflow -------------------------------------------------------------------------------------------
PYTORCHJOB_WORKER_1 = {
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "4",
    "PET_MASTER_ADDR": "bert-finetune-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "bert-finetune-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "8",
    "RANK": "1",
    "PYTHONUNBUFFERED": "1",
}


def test_kubeflow_pet_variables():
    cluster = detect_cluster(PYTORCHJOB_WORKER_1)
    assert (cluster.name, cluster.title) == ("kubeflow", "Kubeflow PyTorchJob")
    assert (cluster.num_machines, cluster.machine_rank) == (2, 1)
    assert (cluster.main_address, cluster.main_port, cluster.processes_per_machine) == (
        "bert-finetune-master-0",
        23456,
        4,
    )


def test_kubeflow_elastic_policy_uses_c10d_and_keyword_nproc_leaves_the_default():
    env = {
        "PET_NNODES": "3:3",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "job-master-0:29400",
        "PET_NPROC_PER_NODE": "auto",
    }
    cluster = detect_cluster(env)
    assert (cluster.num_machines, cluster.machine_rank, cluster.rdzv_backend) == (3, None, "c10d")
    assert (cluster.main_address, cluster.main_port, cluster.processes_per_machine) == (
        "job-master-0",
        29400,
        None,
    )


def test_kubeflow_older_operator_one_pod_one_machine():
    env = {
        "MASTER_ADDR": "mnist-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }
    cluster = detect_cluster(env)
    assert cluster.title == "Kubeflow PyTorchJob (older operator)"
    assert (cluster.num_machines, cluster.machine_rank, cluster.main_address) == (3, 2, "mnist-master-0")
    # torchrun's workers have the same variables plus LOCAL_RANK: they are not a cluster to launch in.
    assert detect_cluster({**env, "LOCAL_RANK": "0"}) is None
    # Outside a pod, a shell that exported them is not a job of several machines.
    assert detect_cluster({k: v for k, v in env.items() if k != "KUBERNETES_SERVICE_HOST"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4' asks for an elastic range of pods"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is impossible with PET_NNODES=2"),
        ({"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "nohost"}, "must be HOST:PORT"),
    ],
)
def test_kubeflow_bad_variables_are_named(env, message):
    with pytest.raises(UsageError, match=message):
        detect_cluster(env)


# -- LSF and PBS: host files ----------------------------------------------------------------------------
def test_lsf_host_file_places_this_host(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node17\nnode17\nnode18\nnode18\n")
    env = {"LSB_JOBID": "123456", "LSB_DJOB_HOSTFILE": str(hostfile)}
    cluster = detect_cluster(env, hostname="node18.cluster.local")
    assert (cluster.name, cluster.num_machines, cluster.machine_rank) == ("lsf", 2, 1)
    assert (cluster.main_address, cluster.main_port) == ("node17", 13456)
    mcpu = detect_cluster({"LSB_JOBID": "9", "LSB_MCPU_HOSTS": "hostA 4 hostB 4 hostC 4"}, hostname="hostC")
    assert (mcpu.num_machines, mcpu.machine_rank, mcpu.main_address) == (3, 2, "hostA")


def test_lsf_jsrun_skips_the_launch_node_and_refuses_several_per_host(tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch3\na01n05\na01n05\na01n06\n")
    env = {"LSB_JOBID": "5", "LSB_DJOB_RANKFILE": str(rankfile), "JSM_NAMESPACE_SIZE": "2"}
    cluster = detect_cluster({**env, "JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_LOCAL_SIZE": "1"})
    assert (cluster.num_machines, cluster.machine_rank, cluster.main_address) == (2, 1, "a01n05")
    with pytest.raises(UsageError, match=r"jsrun started 6 copies .*JSM_NAMESPACE_LOCAL_SIZE=6"):
        detect_cluster({**env, "JSM_NAMESPACE_RANK": "0", "JSM_NAMESPACE_LOCAL_SIZE": "6"})


def test_pbs_node_file(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn01\ncn01\ncn02\ncn02\n")
    env = {"PBS_JOBID": "8842.pbs01", "PBS_NODEFILE": str(nodefile)}
    cluster = detect_cluster(env, hostname="cn02")
    assert (cluster.name, cluster.num_machines, cluster.machine_rank) == ("pbs", 2, 1)
    assert (cluster.main_address, cluster.main_port) == ("cn01", 18842)
    with pytest.raises(UsageError, match=r"PBS_NODEFILE='/nonexistent' cannot be read"):
        detect_cluster({"PBS_JOBID": "1.s", "PBS_NODEFILE": "/nonexistent"})


def test_pbs_node_number_of_pbsdsh_wins_over_the_host_name(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn01\ncn01\ncn02\ncn02\n")
    env = {"PBS_JOBID": "8842.pbs01", "PBS_NODEFILE": str(nodefile), "PBS_NODENUM": "1"}
    cluster = detect_cluster(env, hostname="login2")  # a name not in the node file: no hint needed
    assert (cluster.num_machines, cluster.machine_rank, cluster.missing) == (2, 1, {})
    assert cluster.sources["machine_rank"] == "PBS_NODENUM=1"
    assert detect_cluster({**env, "PBS_NODENUM": "0"}, hostname="cn02").machine_rank == 0
    with pytest.raises(UsageError, match=r"PBS_NODENUM='x' is invalid: it must be an integer >= 0"):
        detect_cluster({**env, "PBS_NODENUM": "x"})
    with pytest.raises(
        UsageError, match=r"PBS_NODENUM=2 is impossible with hosts in PBS_NODEFILE=.* \(2 machines"
    ):
        detect_cluster({**env, "PBS_NODENUM": "2"})


def test_host_not_in_the_host_file_needs_machine_rank(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn01\ncn02\n")
    cluster = detect_cluster({"PBS_JOBID": "8842", "PBS_NODEFILE": str(nodefile)}, hostname="login2")
    assert cluster.machine_rank is None
    with pytest.raises(
        UsageError, match=r"this machine's name 'login2' is not among the hosts .*--machine-rank"
    ):
        resolve({}, cluster=cluster)
    assert resolve({"machine_rank": 1}, cluster=cluster).machine_rank == 1


# -- MPI: its variables as mpiexec sets them ------------------------------------------------------------
OPEN_MPI_RANK_1 = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
}


def test_open_mpi_and_hydra_launchers():
    cluster = detect_cluster({**OPEN_MPI_RANK_1, "MASTER_ADDR": "node0"})
    assert (cluster.name, cluster.title, cluster.num_machines, cluster.machine_rank) == (
        "mpi",
        "Open MPI",
        2,
        1,
    )
    hydra = {"PMI_SIZE": "3", "PMI_RANK": "0", "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0"}
    cluster = detect_cluster(hydra)
    assert (cluster.title, cluster.num_machines, cluster.machine_rank) == ("MPICH / Intel MPI (Hydra)", 3, 0)
    # mpirun inside a SLURM allocation describes the launchers; SLURM only the allocation.
    assert detect_cluster({**_srun_one_per_node(), **OPEN_MPI_RANK_1}).name == "mpi"
    # srun --mpi=pmi2 gives PMI_RANK/PMI_SIZE without Hydra's MPI_LOCALNRANKS: SLURM describes that job.
    slurm_pmi = {
        **_srun_one_per_node(),
        "PMI_RANK": "2",
        "PMI_SIZE": "4",
        "PMI_FD": "7",
        "PMI_JOBID": "4242123.0",
    }
    assert detect_cluster(slurm_pmi).name == "slurm"


def test_mpi_needs_the_address_of_rank_0_and_one_launcher_per_host():
    cluster = detect_cluster(OPEN_MPI_RANK_1)
    with pytest.raises(UsageError, match=r"MPI does not say which host runs rank 0: pass --main-process-ip"):
        resolve({}, cluster=cluster)
    assert resolve({"main_process_ip": "10.0.0.5"}, cluster=cluster).main_process_ip == "10.0.0.5"
    with pytest.raises(UsageError, match=r"mpirun started 2 copies .*OMPI_COMM_WORLD_LOCAL_SIZE=2"):
        detect_cluster({**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    # what MPICH's mpiexec -np 2 on one host sets (Hydra's option for one per host is -ppn 1)
    hydra_two_here = {"PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"}
    with pytest.raises(
        UsageError, match=r"copies .*\(MPI_LOCALNRANKS=2\).*\(mpirun -np MACHINES -ppn 1 lockstep"
    ):
        detect_cluster(hydra_two_here)


# -- choosing, and merging with flags and the config file ----------------------------------------------
def test_cluster_choice():
    env = _srun_one_per_node()
    assert detect_cluster(env, choice="none") is None
    assert detect_cluster(env, choice="slurm").name == "slurm"
    assert detect_cluster({}) is None
    with pytest.raises(UsageError, match=r"--cluster pbs: this process is not in a pbs job"):
        detect_cluster(env, choice="pbs")


def _settings(*argv: str, env: dict[str, str], file_config: ClusterConfig | None = None) -> LaunchSettings:
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    flags = given_flags(parser.parse_args(["--cpu", *argv]))
    cluster = detect_cluster(env, choice=flags.get("cluster", "auto"))
    return resolve(flags, file_config, "cfg.yaml", cluster=cluster)


def test_cluster_values_beat_the_config_file_and_explain_their_source():
    config = ClusterConfig(
        distributed_type="MULTI_CPU",
        num_machines=1,
        machine_rank=0,
        main_process_ip="10.9.9.9",
        num_processes=16,
    )
    settings = _settings(env=_srun_one_per_node(), file_config=config)
    assert (settings.num_machines, settings.machine_rank, settings.main_process_ip) == (4, 2, "gpu-12")
    assert (settings.main_process_port, settings.cluster, settings.cpus_per_machine) == (12123, "slurm", 96)
    assert settings.num_processes == 16  # the file's choice beats the GPUs SLURM gave
    explained = {name: source for name, _, source in settings.explain()}
    assert explained["machine_rank"] == "SLURM: SLURM_NODEID=2"
    assert explained["cluster"] == "detected: SLURM"
    assert _settings(env=_srun_one_per_node()).num_processes == 4  # --cpu: one per machine, GPUs unused
    on_gpus = resolve({}, cluster=detect_cluster(_srun_one_per_node()))
    assert on_gpus.num_processes == 32  # SLURM_GPUS_ON_NODE=8 x 4 nodes
    assert on_gpus.sources["num_processes"] == "SLURM: SLURM_GPUS_ON_NODE=8 x machines"


def test_flags_win_over_the_cluster_where_they_do_not_contradict_it():
    settings = _settings("--main-process-ip", "10.1.0.12", "--num-machines", "4", env=_srun_one_per_node())
    assert (settings.main_process_ip, settings.sources["main_process_ip"]) == ("10.1.0.12", "flag")
    assert _settings("--num-processes", "4", env=_srun_one_per_node()).processes_per_machine == 1


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--num-machines", "3"],
            _srun_one_per_node(),
            r"^--num-machines 3 contradicts the SLURM environment: SLURM_STEP_NUM_NODES=4: 4 machines\. Drop "
            r"the flag to use what SLURM says, or pass --cluster none to ignore the SLURM variables\.$",
        ),
        (
            ["--machine-rank", "0"],
            _srun_one_per_node(),
            r"^--machine-rank 0 contradicts the SLURM environment: SLURM_NODEID=2: this machine is rank 2\.",
        ),
        (
            ["--num-processes", "6"],
            PYTORCHJOB_WORKER_1,
            r"^--num-processes 6 contradicts the Kubeflow PyTorchJob environment: PET_NPROC_PER_NODE=4: 4 "
            r"processes per machine, 8 in all; --num-processes counts the whole job",
        ),
    ],
)
def test_a_flag_contradicting_the_cluster_is_an_error_naming_both(argv, env, message):
    with pytest.raises(UsageError, match=message):
        _settings(*argv, env=env)


def test_cluster_none_ignores_the_variables_and_one_machine_keeps_a_free_port():
    settings = _settings("--cluster", "none", "--num-machines", "3", env=_srun_one_per_node())
    assert (settings.num_machines, settings.cluster) == (3, "none")
    one = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NNODES": "1", "SLURM_NODELIST": "n1"}
    settings = _settings(env=one)
    assert (settings.num_machines, settings.main_process_port, settings.main_process_ip) == (
        1,
        None,
        "127.0.0.1",
    )


def test_kubeflow_nproc_sets_the_process_count():
    settings = _settings(env=PYTORCHJOB_WORKER_1)
    assert (settings.num_processes, settings.processes_per_machine, settings.machine_rank) == (8, 4, 1)
    assert settings.sources["num_processes"] == "Kubeflow PyTorchJob: PET_NPROC_PER_NODE=4 x machines"


def test_worker_threads_share_the_cores_the_scheduler_gave():
    settings = _settings("--num-processes", "8", env=_srun_one_per_node())
    environ: dict[str, str] = {}
    prepare_worker_environment(settings, environ)
    assert environ["OMP_NUM_THREADS"] == "48"  # SLURM_CPUS_ON_NODE=96 over 2 processes per machine


def test_cli_refuses_a_contradiction_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path))
    for name, value in _srun_one_per_node().items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--cpu", "--num-machines", "3", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep launch: error: --num-machines 3 contradicts the SLURM environment")
    assert "Traceback" not in err and err.count("\n") == 1
    assert main(["config", "explain", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"main_process_port +12123 +\(SLURM: derived from SLURM_JOB_ID=4242123: 10000 \+ id", out
    )


def test_env_prints_the_detected_cluster_and_derived_values(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path))
    for name, value in PYTORCHJOB_WORKER_1.items():
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "Cluster environment (what lockstep launch reads): Kubeflow PyTorchJob" in out
    assert re.search(r"machine_rank +: 1 \(PET_NODE_RANK=1\)", out)
    assert re.search(r"processes_per_machine +: 4 \(PET_NPROC_PER_NODE=4\)", out)


def test_env_reports_invalid_cluster_variables_instead_of_failing():
    from lockstep.cli.env_cmd import cluster_report

    title, rows = cluster_report({"SLURM_JOB_ID": "77", "SLURM_NNODES": "2"})
    assert title == "invalid"
    assert rows[0][0] == "error" and rows[0][1].startswith("SLURM_NNODES=2 but SLURM_STEP_ID is not set")
