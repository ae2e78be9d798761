"""MPI launchers: ``mpirun -np MACHINES --map-by ppr:1:node lockstep launch train.py``, one launcher per host.

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
from typing import Any

from lockstep.errors import UsageError
from lockstep.launcher.clusters._base import MASTER_ADDR, MASTER_PORT, DetectedCluster, integer, text

NAME = "mpi"
OPEN_MPI = ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
HYDRA = ("MPICH / Intel MPI (Hydra)", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS")


def detect(environ: Mapping[str, str]) -> bool:
    """Open MPI's variables, or Hydra's: ``PMI_SIZE`` alone is also what SLURM's PMI plugins give the
    tasks of ``srun --mpi=pmi2``, where SLURM describes the job; Hydra adds ``MPI_LOCALNRANKS``."""
    hydra = text(environ, HYDRA[1]) is not None and text(environ, HYDRA[3]) is not None
    return text(environ, OPEN_MPI[1]) is not None or hydra


def read(environ: Mapping[str, str], hostname: str | None = None) -> DetectedCluster:
    """The job mpirun describes (``hostname`` is unused: MPI numbers its processes itself).

    Raises:
        UsageError: a malformed variable, or several launchers on this host.
    """
    title, size_var, rank_var, local_var = OPEN_MPI if text(environ, OPEN_MPI[1]) else HYDRA
    size, rank = text(environ, size_var) or "", text(environ, rank_var)
    local = text(environ, local_var)
    if local is not None and integer(local_var, local, minimum=1) > 1:
        raise UsageError(
            f"mpirun started {local} copies of lockstep launch on this host ({local_var}={local}): they would "
            "form separate jobs. Start one per host (mpirun -np MACHINES --map-by ppr:1:node lockstep launch "
            "...), or let MPI start every process (mpirun -np PROCESSES python train.py)."
        )
    values: dict[str, Any] = {"num_machines": integer(size_var, size, minimum=1)}
    sources = {"num_machines": f"{size_var}={size}"}
    missing: dict[str, str] = {}
    if rank is not None:
        values["machine_rank"], sources["machine_rank"] = integer(rank_var, rank), f"{rank_var}={rank}"
    else:
        missing["machine_rank"] = f"{rank_var} is not set; pass --machine-rank"
    address, port = text(environ, MASTER_ADDR), text(environ, MASTER_PORT)
    if address is not None:
        values["main_address"], sources["main_address"] = address, f"{MASTER_ADDR}={address}"
    else:
        missing["main_address"] = (
            f"MPI does not say which host runs rank 0: pass --main-process-ip HOST, or export {MASTER_ADDR} "
            f"to every rank (mpirun -x {MASTER_ADDR}=HOST)"
        )
    if port is not None:
        values["main_port"], sources["main_port"] = (
            integer(MASTER_PORT, port, minimum=1),
            f"{MASTER_PORT}={port}",
        )
    return DetectedCluster(name=NAME, title=title, sources=sources, missing=missing, **values)
