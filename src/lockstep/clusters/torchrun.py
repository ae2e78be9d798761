"""torchrun and torch's elastic agent (which ``lockstep launch`` runs too): the processes it started.

Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``. Ray Train's TorchTrainer publishes the same variables in
the workers Ray starts (``RAY_RAYLET_PID`` set): their source is ``ray``. It is asked before MPI and SLURM:
``srun torchrun ...`` and ``mpirun torchrun ...`` leave the scheduler's variables in torchrun's workers.

torchrun has no view of machines here: ``lockstep launch`` is the launcher on each machine.
"""

from __future__ import annotations

from lockstep.clusters._variables import MASTER_ADDR, MASTER_PORT, integer, text
from lockstep.clusters.base import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, Cluster, ClusterEnvironment

NAME, TITLE = "torchrun", "torchrun"
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE = "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RAY_RAYLET_PID = "RAY_RAYLET_PID"
"""Set in every process Ray starts (tasks, actors, Ray Train's workers)."""


class TorchElasticCluster(Cluster):
    """The workers of torchrun (or of Ray Train, which publishes torchrun's variables).

    Example:
        >>> place = TorchElasticCluster({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).process()
        >>> place.source, place.rank, place.local_world_size, place.uses_env_rendezvous
        ('torchrun', 1, 2, True)
    """

    name, title, priority = NAME, TITLE, 20

    def process(self) -> ClusterEnvironment | None:
        """This worker's place, when torchrun's ``RANK`` and ``WORLD_SIZE`` are set; else None.

        Raises:
            UsageError: a malformed variable.
        """
        rank, world = text(self.environ, RANK), text(self.environ, WORLD_SIZE)
        if rank is None or world is None:
            return None
        world_size = integer(WORLD_SIZE, world, minimum=1)
        return ClusterEnvironment(
            source="ray" if RAY_RAYLET_PID in self.environ else NAME,
            rank=integer(RANK, rank),
            local_rank=self._number(LOCAL_RANK, 0),
            world_size=world_size,
            local_world_size=self._number(LOCAL_WORLD_SIZE, world_size, minimum=1),
            master_addr=text(self.environ, MASTER_ADDR) or DEFAULT_MASTER_ADDR,
            master_port=self._number(MASTER_PORT, DEFAULT_MASTER_PORT, minimum=1),
            restart_count=self._number(RESTART_COUNT, 0),
        )

    def _number(self, name: str, default: int, *, minimum: int = 0) -> int:
        value = text(self.environ, name)
        return default if value is None else integer(name, value, minimum=minimum)
