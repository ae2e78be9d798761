"""What a cluster tells ``lockstep launch`` about the job: machines, this machine's rank, machine 0's address
and a port every machine agrees on.

One module per environment, each with ``NAME``, ``detect(environ)`` and ``read(environ, hostname)``:
:mod:`~lockstep.launcher.clusters.kubeflow` (``PET_*``, and the older operator's ``RANK``/``WORLD_SIZE``
per pod), :mod:`~lockstep.launcher.clusters.mpi` (Open MPI, MPICH, Intel MPI),
:mod:`~lockstep.launcher.clusters.slurm`, :mod:`~lockstep.launcher.clusters.lsf` and
:mod:`~lockstep.launcher.clusters.pbs`. They are asked in that order: the launcher that started this process
(torchrun's ``PET_*`` defaults, ``mpirun``) before the scheduler that allocated the machines, since
``mpirun`` inside a SLURM job describes the launchers and SLURM only the allocation.

Every environment describes launchers, one per machine: a scheduler starting one task per *process* is
refused with the command to use instead. A port not given is derived from the job id
(``10000 + id % 20000``), so every machine computes the same one.

Example:
    >>> env = {"SLURM_JOB_ID": "731", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    ...        "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    >>> cluster = detect_cluster(env)
    >>> cluster.name, cluster.num_machines, cluster.machine_rank, cluster.main_address, cluster.main_port
    ('slurm', 2, 1, 'gpu07', 10731)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from lockstep.errors import UsageError
from lockstep.launcher.clusters import kubeflow, lsf, mpi, pbs, slurm
from lockstep.launcher.clusters._base import DetectedCluster
from lockstep.launcher.clusters.hostlist import expand_hostlist

__all__ = ["CLUSTER_CHOICES", "ENVIRONMENTS", "DetectedCluster", "detect_cluster", "expand_hostlist"]

ENVIRONMENTS: tuple[ModuleType, ...] = (kubeflow, mpi, slurm, lsf, pbs)
"""The environments, in the order they are asked."""
CLUSTER_CHOICES = ("auto", "none", *(module.NAME for module in ENVIRONMENTS))
"""What ``--cluster`` accepts: detect (``auto``), read none, or read only the one named."""


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
        module = next((m for m in ENVIRONMENTS if m.NAME == choice), None)
        if module is None:
            raise UsageError(f"--cluster {choice!r} is invalid: use one of {', '.join(CLUSTER_CHOICES)}.")
        if not module.detect(environ):
            raise UsageError(
                f"--cluster {choice}: this process is not in a {choice} job (its variables are not set). "
                "Run it inside the job, or drop --cluster to detect the environment."
            )
        return _checked(module.read(environ, hostname))
    for module in ENVIRONMENTS:
        if module.detect(environ):
            return _checked(module.read(environ, hostname))
    return None


def _checked(cluster: DetectedCluster) -> DetectedCluster:
    if cluster.machine_rank is not None and not 0 <= cluster.machine_rank < cluster.num_machines:
        raise UsageError(
            f"The {cluster.title} environment is inconsistent: {cluster.sources['machine_rank']} is impossible "
            f"with {cluster.sources['num_machines']} ({cluster.num_machines} machines, ranks 0 to "
            f"{cluster.num_machines - 1}). Check how the job was started."
        )
    return cluster
