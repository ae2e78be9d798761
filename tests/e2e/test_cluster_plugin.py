"""A cluster environment installed from outside ``src/`` through its entry point
(``lockstep.cluster_environments``; the class is tests/plugins/lab_cluster.py): two processes the lab
scheduler starts itself form one job of world 2 from its variables alone, and so do two ``lockstep launch``
processes, one per machine, with the same class's view of the machines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cluster_launch import ONE_JOB_OF_TWO, _launch_two_nodes, _reports
from tests.helpers.cli import REPO, SCRIPTS, cli_env
from tests.helpers.deadlines import scaled
from tests.helpers.ports import reserved_port

pytestmark = pytest.mark.distributed


@pytest.fixture
def installed(tmp_path: Path) -> str:
    """A PYTHONPATH on which the lab plugin is an installed distribution with its entry point."""
    info = tmp_path / "lab_cluster-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-cluster\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[lockstep.cluster_environments]\nlab = tests.plugins.lab_cluster:LabCluster\n"
    )
    return f"{tmp_path}{os.pathsep}{REPO}"


def test_processes_the_lab_starts_read_their_place_from_the_plugin(installed: str) -> None:
    port = str(reserved_port())  # both processes are told it before rank 0 binds it
    workers = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "cluster_place.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=cli_env(
                PYTHONPATH=installed,
                OMP_NUM_THREADS="1",
                LAB_HOSTS="127.0.0.1,127.0.0.1",
                LAB_HOST_INDEX=str(task),
                LAB_PORT=port,
                LAB_TASK=str(task),
                LAB_TASKS="2",
            ),
        )
        for task in range(2)
    ]
    outputs = [worker.communicate(timeout=scaled(120)) for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs):
        assert worker.returncode == 0, stderr
    reports = _reports("".join(stdout for stdout, _ in outputs))
    assert [(r["source"], r["rank"], r["world"], r["local_world"], r["sum"]) for r in reports] == [
        ("lab", 0, 2, 1, 3.0),
        ("lab", 1, 2, 1, 3.0),
    ]


def test_lockstep_launch_reads_the_machines_from_the_plugin(installed: str) -> None:
    port = reserved_port()  # both launchers are told it before machine 0 binds it

    def node_env(node: int) -> dict[str, str]:
        hosts = "127.0.0.1,127.0.0.1"
        return {
            "PYTHONPATH": installed,
            "LAB_HOSTS": hosts,
            "LAB_HOST_INDEX": str(node),
            "LAB_PORT": str(port),
        }

    reports, stderrs = _launch_two_nodes(node_env)
    assert [(r["rank"], r["world"], r["machine"], r["sum"]) for r in reports] == ONE_JOB_OF_TWO
    assert f"lab job: machine 1 of 2, 1 process here, rendezvous at 127.0.0.1:{port} (static)" in stderrs[1]
