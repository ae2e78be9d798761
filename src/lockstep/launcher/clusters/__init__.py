"""What a cluster tells ``lockstep launch`` about the job: machines, this machine's rank, machine 0's address
and a port every machine agrees on.

The environments are the registered :mod:`lockstep.clusters` classes (the ones the workers read too); this
module asks their launcher's view (:meth:`~lockstep.clusters.Cluster.machines`), in their order, or only the
one ``--cluster`` names, and :mod:`~lockstep.launcher.clusters.merge` puts the answer into the launch
settings.

Example:
    >>> env = {"SLURM_JOB_ID": "731", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    ...        "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    >>> cluster = detect_cluster(env)
    >>> cluster.name, cluster.num_machines, cluster.machine_rank, cluster.main_address, cluster.main_port
    ('slurm', 2, 1, 'gpu07', 10731)
"""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.clusters import DetectedCluster, cluster_environments
from lockstep.errors import UsageError

__all__ = ["cluster_choices", "detect_cluster"]


def cluster_choices() -> tuple[str, ...]:
    """What ``--cluster`` accepts: detect (``auto``), read none, or read only the registered environment named
    (those with a launcher's view)."""
    names = (cluster.name for cluster in cluster_environments() if cluster.describes_machines())
    return ("auto", "none", *names)


def detect_cluster(
    environ: Mapping[str, str], *, choice: str = "auto", hostname: str | None = None
) -> DetectedCluster | None:
    """The cluster environment this launcher runs in, read from ``environ``; None outside any.

    Args:
        environ: the environment variables to read (the CLI passes ``os.environ``).
        choice: ``auto`` (the first environment that is detected), ``none``, or an environment's name.
        hostname: this machine's host name, for environments that place machines by host name (LSF, PBS);
            ``socket.gethostname()`` when omitted.

    Raises:
        UsageError: the variables are malformed or contradict each other, describe several launchers per
            machine, or ``choice`` names an environment that is not there.
    """
    if choice == "none":
        return None
    if choice != "auto":
        kind = next((c for c in cluster_environments() if c.name == choice and c.describes_machines()), None)
        if kind is None:
            raise UsageError(f"--cluster {choice!r} is invalid: use one of {', '.join(cluster_choices())}.")
        cluster = kind(environ, hostname=hostname).machines()
        if cluster is None:
            raise UsageError(
                f"--cluster {choice}: this process is not in a {choice} job (its variables are not set). "
                "Run it inside the job, or drop --cluster to detect the environment."
            )
        return _checked(cluster)
    for kind in cluster_environments():
        cluster = kind(environ, hostname=hostname).machines()
        if cluster is not None:
            return _checked(cluster)
    return None


def _checked(cluster: DetectedCluster) -> DetectedCluster:
    if cluster.machine_rank is not None and not 0 <= cluster.machine_rank < cluster.num_machines:
        raise UsageError(
            f"The {cluster.title} environment is inconsistent: {cluster.sources['machine_rank']} is impossible "
            f"with {cluster.sources['num_machines']} ({cluster.num_machines} machines, ranks 0 to "
            f"{cluster.num_machines - 1}). Check how the job was started."
        )
    return cluster
