"""MPI launchers: ``mpirun -np MACHINES --map-by ppr:1:node lockstep launch train.py`` (Open MPI; ``-ppn 1``
with MPICH and Intel MPI), one launcher per host.

Open MPI gives ``OMPI_COMM_WORLD_SIZE`` / ``_RANK`` / ``_LOCAL_SIZE``; MPICH and Intel MPI (the Hydra
process manager) give ``PMI_SIZE`` / ``PMI_RANK`` and ``MPI_LOCALNRANKS``. The launchers' MPI ranks are the
machine ranks. MPI does not say which host runs rank 0, so with several machines the job script exports
``MASTER_ADDR`` (``mpirun -x MASTER_ADDR=host0 ...``) or passes ``--main-process-ip``, as torch's own
MPI recipes do; the port is ``MASTER_PORT`` if exported, else lockstep's default.

Several launchers on one host would form separate jobs, so that is refused: to let MPI start every
process, run ``mpirun -np N python train.py`` (each process reads its rank from MPI's variables).

``PMI_SIZE``/``PMI_RANK`` without Hydra's ``MPI_LOCALNRANKS`` are SLURM's PMI (``srun --mpi=pmi2``): SLURM's
own variables describe that job, so it is left to :mod:`~lockstep.launcher.clusters.slurm`.
"""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.launcher.clusters._base import (
    MASTER_ADDR,
    MASTER_PORT,
    DetectedCluster,
    LauncherNumbering,
    integer,
    numbered_launchers,
    text,
)

NAME = "mpi"
ONE_PER_HOST = "mpirun -np MACHINES --map-by ppr:1:node lockstep launch ..."
OPEN_MPI = LauncherNumbering(
    "mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", ONE_PER_HOST
)
HYDRA = LauncherNumbering(
    "mpirun", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "mpirun -np MACHINES -ppn 1 lockstep launch ..."
)
TITLES = {OPEN_MPI.size: "Open MPI", HYDRA.size: "MPICH / Intel MPI (Hydra)"}


def detect(environ: Mapping[str, str]) -> bool:
    """Open MPI's variables, or Hydra's: ``PMI_SIZE`` alone is also what SLURM's PMI plugins give the
    tasks of ``srun --mpi=pmi2``, where SLURM describes the job; Hydra adds ``MPI_LOCALNRANKS``."""
    hydra = text(environ, HYDRA.size) is not None and text(environ, HYDRA.local_size) is not None
    return text(environ, OPEN_MPI.size) is not None or hydra


def read(environ: Mapping[str, str], hostname: str | None = None) -> DetectedCluster:
    """The job mpirun describes (``hostname`` is unused: MPI numbers its processes itself).

    Raises:
        UsageError: a malformed variable, or several launchers on this host.
    """
    numbering = OPEN_MPI if text(environ, OPEN_MPI.size) else HYDRA
    values, sources, missing = numbered_launchers(environ, numbering)
    if "machine_rank" not in values:
        missing["machine_rank"] = f"{numbering.rank} is not set; pass --machine-rank"
    if "main_address" not in values:
        missing["main_address"] = (
            f"MPI does not say which host runs rank 0: pass --main-process-ip HOST, or export {MASTER_ADDR} "
            f"to every rank (mpirun -x {MASTER_ADDR}=HOST)"
        )
    port = text(environ, MASTER_PORT)
    if port is not None:
        values["main_port"] = integer(MASTER_PORT, port, minimum=1)
        sources["main_port"] = f"{MASTER_PORT}={port}"
    return DetectedCluster(
        name=NAME, title=TITLES[numbering.size], sources=sources, missing=missing, **values
    )
