"""A cluster environment written outside ``src/``: the tests install it through the
``lockstep.cluster_environments`` entry point (or register it with ``register_cluster_environment``).

The "lab scheduler" describes a job with ``LAB_HOSTS`` (its machines, comma-separated; machine 0 first),
``LAB_HOST_INDEX`` (this machine) and ``LAB_PORT``; a process it starts itself also gets ``LAB_TASK`` and
``LAB_TASKS`` (one process per machine).
"""

from __future__ import annotations

from lockstep.clusters import Cluster, ClusterEnvironment, DetectedCluster

HOSTS, HOST_INDEX, PORT, TASK, TASKS = "LAB_HOSTS", "LAB_HOST_INDEX", "LAB_PORT", "LAB_TASK", "LAB_TASKS"


class LabCluster(Cluster):
    """The lab scheduler's job: machines for ``lockstep launch``, and the processes it starts itself."""

    name, title = "lab", "Lab scheduler"

    def machines(self) -> DetectedCluster | None:
        if HOSTS not in self.environ:
            return None
        hosts = self.environ[HOSTS].split(",")
        index = self.environ[HOST_INDEX]
        return DetectedCluster(
            name=self.name,
            title=self.title,
            num_machines=len(hosts),
            machine_rank=int(index),
            main_address=hosts[0],
            main_port=int(self.environ[PORT]),
            sources={
                "num_machines": f"{HOSTS}={self.environ[HOSTS]}",
                "machine_rank": f"{HOST_INDEX}={index}",
                "main_address": f"first of {HOSTS}",
                "main_port": f"{PORT}={self.environ[PORT]}",
            },
        )

    def process(self) -> ClusterEnvironment | None:
        if TASK not in self.environ:
            return None
        return ClusterEnvironment(
            source=self.name,
            rank=int(self.environ[TASK]),
            world_size=int(self.environ[TASKS]),
            master_addr=self.environ[HOSTS].split(",")[0],
            master_port=int(self.environ[PORT]),
        )
