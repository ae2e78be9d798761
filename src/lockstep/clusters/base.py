"""A cluster environment: one class that reads what a scheduler or launcher says about the job, for both
readers of it.

``lockstep launch`` asks :meth:`Cluster.machines` (the job as machines, one launcher on each); every
process asks :meth:`Cluster.process` (who this process is, when the environment started it as one of the
job's processes, as ``srun python train.py`` does). Both views are derived from the same parsing of the
environment's variables, in its class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
"""torch's defaults for the rendezvous host and port, used when nothing names them."""


@dataclass(frozen=True, kw_only=True)
class DetectedCluster:
    """The job as a scheduler or cluster launcher describes it to the launcher of one machine.

    A value that is None is not known from the environment: the flag (or the launcher's default) decides,
    or, where ``missing`` has a hint for it, a job of several machines cannot be formed without the flag.
    """

    name: str
    """``slurm``, ``kubeflow``, ``lsf``, ``pbs``, ``mpi`` or a registered environment's name."""
    title: str
    """How messages name it: ``SLURM``, ``Kubeflow PyTorchJob``, ``Open MPI`` ..."""
    num_machines: int
    """Machines (nodes, pods) taking part, one launcher on each."""
    machine_rank: int | None = None
    """Rank of this machine; None where the rendezvous assigns it (c10d) or the environment cannot tell."""
    main_address: str | None = None
    """Address of machine 0 (the rendezvous host)."""
    main_port: int | None = None
    """Rendezvous port on machine 0, the same on every machine."""
    processes_per_machine: int | None = None
    """Workers on each machine, where the environment says it."""
    cpus_per_machine: int | None = None
    """Cores this machine gives the job (the workers' threads share them)."""
    rdzv_backend: str | None = None
    """``c10d`` where the environment asks for torch's elastic rendezvous."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each value came from: field name -> ``VARIABLE=value`` (or the rule that derived it)."""
    strict: frozenset[str] = frozenset({"num_machines", "machine_rank"})
    """Fields a flag may not contradict: the job is laid out this way whatever the flag says."""
    missing: Mapping[str, str] = field(default_factory=dict)
    """For a value the environment cannot give: what the user can pass instead."""

    def rows(self) -> list[tuple[str, str, str]]:
        """(field, value, source) of every value known, for ``lockstep env``."""
        names = (
            "num_machines",
            "machine_rank",
            "main_address",
            "main_port",
            "processes_per_machine",
            "cpus_per_machine",
            "rdzv_backend",
        )
        rows = []
        for name in names:
            value = getattr(self, name)
            if value is not None:
                rows.append((name, str(value), self.sources.get(name, "")))
            elif name in self.missing:
                rows.append((name, "unknown", self.missing[name]))
        return rows


@dataclass(frozen=True)
class ClusterEnvironment:
    """Who this process is, as the launcher that started it described it.

    Attributes:
        source: which environment the values came from: ``torchrun``, ``ray`` (Ray Train's TorchTrainer,
            which publishes torchrun's variables), ``slurm``, ``mpi``, ``kubeflow``, a registered
            environment's name, or ``single``.
        rank: global rank of this process.
        local_rank: rank of this process on its machine.
        world_size: number of processes in the job.
        local_world_size: number of processes on this machine.
        master_addr: address of the rendezvous host (rank 0).
        master_port: port of the rendezvous store.
        restart_count: how many times the elastic agent restarted the workers (0 on the first try).
    """

    source: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    restart_count: int = 0

    @property
    def uses_env_rendezvous(self) -> bool:
        """True when torchrun (or Ray Train) already published ``MASTER_ADDR``/``RANK``... for ``env://``."""
        return self.source in ("torchrun", "ray")


class Cluster:
    """One kind of cluster environment, built on the variables of one process (``environ``).

    A subclass sets ``name`` (what ``--cluster`` and ``lockstep env`` call it), ``title`` (how messages name
    it) and ``priority`` (environments are asked in increasing priority: the built-ins use 10 to 60, and a
    registered one asked first keeps the default 0), parses its variables once, and answers either view or
    both: :meth:`machines` for ``lockstep launch``, :meth:`process` for each process of the job. A view it
    does not have answers None. Register it with
    :func:`~lockstep.clusters.register_cluster_environment` or the ``lockstep.cluster_environments``
    entry-point group.

    Example:
        >>> class Lab(Cluster):
        ...     name, title = "lab", "the lab's scheduler"
        ...     def process(self) -> ClusterEnvironment | None:
        ...         if "LAB_RANK" not in self.environ:
        ...             return None
        ...         rank, size = int(self.environ["LAB_RANK"]), int(self.environ["LAB_SIZE"])
        ...         return ClusterEnvironment(source=self.name, rank=rank, world_size=size, local_world_size=size)
        >>> Lab({"LAB_RANK": "1", "LAB_SIZE": "2"}).process().rank
        1
        >>> Lab({}).machines() is None
        True
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, environ: Mapping[str, str], *, hostname: str | None = None) -> None:
        """Read ``environ``; ``hostname`` (default: this machine's) places this machine among a job's hosts
        for environments that list hosts by name (LSF, PBS)."""
        self.environ = environ
        self.hostname = hostname

    def machines(self) -> DetectedCluster | None:
        """The job as machines, one ``lockstep launch`` on each; None when this environment does not
        describe the job this launcher runs in.

        Raises:
            UsageError: the variables are malformed, contradict each other, or describe a job that one
                launcher per machine cannot form (say which command to use instead).
        """
        return None

    def process(self) -> ClusterEnvironment | None:
        """This process's place in the job, when this environment started it as one of the job's
        processes; None otherwise.

        Raises:
            UsageError: the variables are malformed or contradict each other.
        """
        return None

    @classmethod
    def describes_machines(cls) -> bool:
        """Whether this environment has the launcher's view (``--cluster`` offers it)."""
        return cls.machines is not Cluster.machines
