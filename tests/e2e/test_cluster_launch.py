"""Simulated clusters on one machine: two ``lockstep launch`` processes given only a scheduler's variables
(one launcher per node, every node resolving to loopback) form one job of world 2 and reduce correctly; and
MPICH's real ``mpiexec`` starting two launchers on two loopback "hosts".

Each launcher costs an ``import torch`` in itself and in its worker, so every test starts one worker per
launcher and runs a single all_reduce (tests/scripts/cluster_reduce.py)."""

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, SCRIPTS, cli_env, lockstep_popen
from tests.helpers.deadlines import scaled
from tests.helpers.ports import reserved_port

pytestmark = pytest.mark.distributed
ONE_JOB_OF_TWO = [(0, 2, 0, 3.0), (1, 2, 1, 3.0)]
"""(rank, world size, machine, sum of rank + 1 over the job) of each worker: one job, not two of world 1."""


def _free_job_port() -> int:
    """A port in the range SLURM job ids map to (10000 + id % 20000), reserved until a launcher binds it."""
    return reserved_port(random.sample(range(10000, 30000), 200))


def _launch_two_nodes(
    node_env: Callable[[int], dict[str, str]], node_flags: Callable[[int], list[str]] = lambda node: []
) -> tuple[list[dict], list[str]]:
    """Start both nodes' launchers; the workers' reports by rank and each launcher's stderr."""
    launchers = [
        lockstep_popen(
            "launch", *node_flags(node), str(SCRIPTS / "cluster_reduce.py"), env=cli_env(**node_env(node))
        )
        for node in range(2)
    ]
    outputs = [launcher.communicate(timeout=scaled(120)) for launcher in launchers]
    for launcher, (_, stderr) in zip(launchers, outputs):
        assert launcher.returncode == 0, stderr
    return _reports("".join(stdout for stdout, _ in outputs)), [stderr for _, stderr in outputs]


def _reports(stdout: str) -> list[dict]:
    """The workers' reports, by rank."""
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    return sorted((json.loads(line[7:]) for line in lines), key=lambda report: report["rank"])


def test_slurm_variables_alone_form_one_job():
    job_id = _free_job_port() - 10000  # the port every node derives: 10000 + job_id % 20000

    def node_env(node: int) -> dict[str, str]:
        return {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NAME": "train",
            "SLURM_STEP_ID": "0",
            "SLURM_NNODES": "2",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
            "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
            "SLURM_CPUS_ON_NODE": "1",
        }

    reports, stderrs = _launch_two_nodes(node_env)
    assert [(r["rank"], r["world"], r["machine"], r["sum"]) for r in reports] == ONE_JOB_OF_TWO
    assert [r["threads"] for r in reports] == ["1", "1"]  # SLURM_CPUS_ON_NODE shared out
    summary = f"slurm job: machine 1 of 2, 1 process here, rendezvous at 127.0.0.1:{10000 + job_id} (static)"
    assert f"lockstep launch: {summary}" in stderrs[1]


def test_kubeflow_pet_variables_alone_form_one_job():
    port = str(reserved_port())  # both launchers are told it before machine 0 binds it

    def node_env(node: int) -> dict[str, str]:
        return {
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(node),
            "PET_NPROC_PER_NODE": "1",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
        }

    reports, _ = _launch_two_nodes(node_env)
    assert [(r["rank"], r["world"], r["machine"], r["sum"]) for r in reports] == ONE_JOB_OF_TWO


@pytest.mark.parametrize("scheduler", ["lsf", "pbs"])
def test_lsf_and_pbs_host_files_form_one_job(scheduler, tmp_path):
    """LSF places a machine by its host name only (unless jsrun numbers the launchers), and both launchers
    here share one host name: each is given --machine-rank, the rest comes from LSF. pbsdsh gives each
    task its node's number (PBS_NODENUM), so PBS needs no flag."""
    job_id = _free_job_port() - 10000  # the port every node derives: 10000 + job_id % 20000
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n127.0.0.1\n127.0.0.2\n127.0.0.2\n")  # one line per slot
    if scheduler == "lsf":
        job = {
            "LSB_JOBID": str(job_id),
            "LSB_DJOB_HOSTFILE": str(hostfile),
            "LSB_MCPU_HOSTS": "127.0.0.1 2 127.0.0.2 2",
            "LSB_HOSTS": "127.0.0.1 127.0.0.1 127.0.0.2 127.0.0.2",
        }
        reports, stderrs = _launch_two_nodes(lambda node: job, lambda node: ["--machine-rank", str(node)])
    else:
        job = {"PBS_JOBID": f"{job_id}.pbs01", "PBS_NODEFILE": str(hostfile), "PBS_NUM_NODES": "2"}
        reports, stderrs = _launch_two_nodes(lambda node: {**job, "PBS_NODENUM": str(node)})
    assert [(r["rank"], r["world"], r["machine"], r["sum"]) for r in reports] == ONE_JOB_OF_TWO
    summary = (
        f"{scheduler} job: machine 1 of 2, 1 process here, rendezvous at 127.0.0.1:{10000 + job_id} (static)"
    )
    assert f"lockstep launch: {summary}" in stderrs[1]


MPIEXEC = Path(sys.executable).parent / "mpiexec"
"""MPICH's mpiexec (Hydra), which the ``mpich`` wheel of the test extra installs next to python."""


@pytest.mark.skipif(not MPIEXEC.is_file(), reason="needs MPICH's mpiexec (pip install -e '.[test]')")
def test_mpiexec_starts_one_launcher_per_host_and_they_form_one_job():
    """Hydra's fork launcher runs the proxy of each of two loopback "hosts" locally, so each launcher sees
    what it would on its own node (PMI_RANK, PMI_SIZE=2, MPI_LOCALNRANKS=1); MASTER_ADDR/MASTER_PORT are
    exported to every rank, as a job script does (mpiexec -genv)."""
    port = reserved_port()  # both launchers are told it before machine 0 binds it
    command = [str(MPIEXEC), "-launcher", "fork", "-hosts", "127.0.0.1,127.0.0.2", "-ppn", "1", "-np", "2"]
    command += [sys.executable, "-m", "lockstep.cli.main", "launch", str(SCRIPTS / "cluster_reduce.py")]
    env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    reports = _reports(done.stdout)
    assert [(r["rank"], r["world"], r["machine"], r["sum"]) for r in reports] == ONE_JOB_OF_TWO
    for machine in range(2):
        summary = f"mpi job: machine {machine} of 2, 1 process here, rendezvous at 127.0.0.1:{port} (static)"
        assert f"lockstep launch: {summary}" in done.stderr
