"""Simulated clusters on one machine: two ``lockstep launch`` processes given only a scheduler's variables
(one launcher per node, every node resolving to loopback) form one job of world 2 and reduce correctly."""

import json
import random
import socket

import pytest

from tests.helpers.cli import SCRIPTS, cli_env, lockstep_popen
from tests.helpers.multiprocess import free_port

pytestmark = pytest.mark.distributed
ONE_JOB_OF_TWO = [(0, 2, 0, 3.0), (1, 2, 1, 3.0)]
"""(rank, world size, machine, sum of rank + 1 over the job) of each worker: one job, not two of world 1."""


def _free_job_port() -> int:
    """A free port in the range SLURM job ids map to (10000 + id % 20000)."""
    for port in random.sample(range(10000, 30000), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 10000 and 30000")


def _launch_two_nodes(node_env) -> tuple[list[dict], list[str]]:
    """Start both nodes' launchers; the workers' reports by rank and each launcher's stderr."""
    launchers = [
        lockstep_popen("launch", str(SCRIPTS / "cluster_reduce.py"), env=cli_env(**node_env(node)))
        for node in range(2)
    ]
    outputs = [launcher.communicate(timeout=120) for launcher in launchers]
    for launcher, (_, stderr) in zip(launchers, outputs):
        assert launcher.returncode == 0, stderr
    lines = [line for stdout, _ in outputs for line in stdout.splitlines() if line.startswith("REPORT ")]
    reports = sorted((json.loads(line[7:]) for line in lines), key=lambda report: report["rank"])
    return reports, [stderr for _, stderr in outputs]


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
    port = str(free_port())

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
