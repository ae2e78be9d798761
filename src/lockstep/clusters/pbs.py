"""PBS Pro / OpenPBS / Torque: one launcher per host (``pbsdsh -u``, or ``mpiexec`` with one per host).

The hosts are those of ``PBS_NODEFILE`` (one line per slot), machine 0 the first host (unless ``MASTER_ADDR``
is exported). This machine's rank is ``PBS_NODENUM`` where set (the node number ``pbsdsh`` gives each task it
spawns; HPX's PBS support reads it the same way), else the position of its host name among the hosts.
The port is ``MASTER_PORT`` if exported, else ``10000 + N % 20000`` where N is the number ``PBS_JOBID``
starts with (``1234.server``).
"""

from __future__ import annotations

from lockstep.clusters._variables import (
    host_layout,
    integer,
    main_port,
    read_host_file,
    text,
)
from lockstep.clusters.base import Cluster, DetectedCluster

NAME, TITLE = "pbs", "PBS"
JOB_ID, NODEFILE, NODENUM = "PBS_JOBID", "PBS_NODEFILE", "PBS_NODENUM"


class PbsCluster(Cluster):
    """A PBS job: its launchers, one per host (PBS's tasks are not read as processes)."""

    name, title, priority = NAME, TITLE, 60

    def machines(self) -> DetectedCluster | None:
        """The job PBS describes; ``hostname`` (default: this machine's) places this machine among its hosts.

        Raises:
            UsageError: the node file cannot be read, ``PBS_NODENUM`` is not a number, or the job id gives no
                port.
        """
        path = text(self.environ, NODEFILE)
        if text(self.environ, JOB_ID) is None or path is None:
            return None
        hosts = read_host_file(NODEFILE, path)
        values, sources, missing = host_layout(hosts, f"{NODEFILE}={path}", self.hostname, self.environ)
        if values["num_machines"] > 1:
            values["main_port"], sources["main_port"] = main_port(self.environ, JOB_ID)
            node = text(self.environ, NODENUM)
            if node is not None:  # pbsdsh numbered this task's node: it wins over the host name
                values["machine_rank"], sources["machine_rank"] = integer(NODENUM, node), f"{NODENUM}={node}"
                missing.pop("machine_rank", None)
        return DetectedCluster(name=NAME, title=TITLE, sources=sources, missing=missing, **values)
