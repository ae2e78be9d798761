"""MPI launchers: ``mpirun -np MACHINES --map-by ppr:1:node lockstep launch train.py`` (Open MPI; ``-ppn 1``
with MPICH and Intel MPI), one launcher per host.

Open MPI gives ``OMPI_COMM_WORLD_SIZE`` / ``_RANK`` / ``_LOCAL_SIZE``; MPICH and Intel MPI (the Hydra
process manager) give ``PMI_SIZE`` / ``PMI_RANK`` and ``MPI_LOCALNRANKS``. The launchers' MPI ranks are the
machine ranks. MPI does not say which host runs rank 0, so with several machines the job script exports
``MASTER_ADDR`` (``mpirun -x MASTER_ADDR=host0 ...``) or passes ``--main-process-ip``, as torch's own
MPI recipes do; the port is ``MASTER_PORT`` if exported, else lockstep's default.

Several launchers on one host would form separate jobs, so that is refused: to let MPI start every
process, run ``mpirun -np N python train.py`` (each process reads its rank from MPI's variables).

Run that way, each process reads its rank, world size and place on its host (``OMPI_COMM_WORLD_LOCAL_RANK``,
``MPI_LOCALRANKID``) from the same variables (:meth:`MpiCluster.process`).

``PMI_SIZE``/``PMI_RANK`` without Hydra's ``MPI_LOCALNRANKS`` inside a SLURM job (``SLURM_JOB_ID`` set) are
SLURM's PMI (``srun --mpi=pmi2``): SLURM's own variables describe that job, so it is left to
:mod:`~lockstep.clusters.slurm`. Outside a SLURM job they are read as an MPI launcher's.
"""

from __future__ import annotations

from lockstep.clusters._variables import (
    MASTER_ADDR,
    MASTER_PORT,
    LauncherNumbering,
    integer,
    numbered_launchers,
    text,
)
from lockstep.clusters.base import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    Cluster,
    ClusterEnvironment,
    DetectedCluster,
)

NAME, TITLE = "mpi", "MPI (Open MPI, MPICH, Intel MPI)"
ONE_PER_HOST = "mpirun -np MACHINES --map-by ppr:1:node lockstep launch ..."
OPEN_MPI = LauncherNumbering(
    "mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", ONE_PER_HOST
)
HYDRA = LauncherNumbering(
    "mpirun", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "mpirun -np MACHINES -ppn 1 lockstep launch ..."
)
TITLES = {OPEN_MPI.size: "Open MPI", HYDRA.size: "MPICH / Intel MPI (Hydra)"}
OPEN_MPI_LOCAL_RANK, HYDRA_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"
SLURM_JOB_ID = "SLURM_JOB_ID"
"""Inside a SLURM job, ``PMI_SIZE`` without Hydra's ``MPI_LOCALNRANKS`` is SLURM's own PMI."""


class MpiCluster(Cluster):
    """An MPI launcher: the copies of ``lockstep launch`` it started (one per host), or the processes it
    started itself (``mpirun -np N python train.py``), numbered by the same variables.

    Asked before SLURM: ``mpirun`` inside a SLURM job inherits the job's ``SLURM_*`` variables (its daemons
    run as one SLURM task per node), and its own numbering is the one that describes the processes.

    Example:
        >>> rank_3 = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        ...           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
        >>> place = MpiCluster(rank_3).process()
        >>> place.source, place.rank, place.world_size, place.local_rank, place.local_world_size
        ('mpi', 3, 4, 1, 2)
    """

    name, title, priority = NAME, TITLE, 30

    def machines(self) -> DetectedCluster | None:
        """The job mpirun describes (``hostname`` is unused: MPI numbers its processes itself).

        Raises:
            UsageError: a malformed variable, or several launchers on this host.
        """
        numbering = self._numbering()
        if numbering is None:
            return None
        values, sources, missing = numbered_launchers(self.environ, numbering)
        if "machine_rank" not in values:
            missing["machine_rank"] = f"{numbering.rank} is not set; pass --machine-rank"
        if "main_address" not in values:
            missing["main_address"] = (
                f"MPI does not say which host runs rank 0: pass --main-process-ip HOST, or export {MASTER_ADDR} "
                f"to every rank (mpirun -x {MASTER_ADDR}=HOST)"
            )
        port = text(self.environ, MASTER_PORT)
        if port is not None:
            values["main_port"] = integer(MASTER_PORT, port, minimum=1)
            sources["main_port"] = f"{MASTER_PORT}={port}"
        return DetectedCluster(
            name=NAME, title=TITLES[numbering.size], sources=sources, missing=missing, **values
        )

    def process(self) -> ClusterEnvironment | None:
        """This process's MPI rank, size and place on its host; None when no MPI launcher numbered it.

        Raises:
            UsageError: a malformed variable.
        """
        numbering = self._numbering()
        rank_text = None if numbering is None else text(self.environ, numbering.rank)
        if numbering is None or rank_text is None:
            return None
        world_size = integer(numbering.size, text(self.environ, numbering.size) or "", minimum=1)
        local_rank_name = OPEN_MPI_LOCAL_RANK if numbering is OPEN_MPI else HYDRA_LOCAL_RANK
        local_rank, local_size = text(self.environ, local_rank_name), text(self.environ, numbering.local_size)
        port = text(self.environ, MASTER_PORT)
        return ClusterEnvironment(
            source=NAME,
            rank=integer(numbering.rank, rank_text),
            local_rank=0 if local_rank is None else integer(local_rank_name, local_rank),
            world_size=world_size,
            local_world_size=world_size
            if local_size is None
            else integer(numbering.local_size, local_size, minimum=1),
            master_addr=text(self.environ, MASTER_ADDR) or DEFAULT_MASTER_ADDR,
            master_port=DEFAULT_MASTER_PORT if port is None else integer(MASTER_PORT, port, minimum=1),
        )

    def _numbering(self) -> LauncherNumbering | None:
        """Open MPI's variables, or Hydra's. ``PMI_SIZE`` alone is also what SLURM's PMI plugins give the
        tasks of ``srun --mpi=pmi2``, where SLURM describes the job; Hydra adds ``MPI_LOCALNRANKS``."""
        if text(self.environ, OPEN_MPI.size) is not None:
            return OPEN_MPI
        if text(self.environ, HYDRA.size) is None:
            return None
        hydra = text(self.environ, HYDRA.local_size) is not None or text(self.environ, SLURM_JOB_ID) is None
        return HYDRA if hydra else None
