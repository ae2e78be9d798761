"""The registered cluster environments, asked in order by the launcher and by every process.

The built-ins register themselves through :func:`register_cluster_environment`, the function user code calls
too; an installed package adds its own through the ``lockstep.cluster_environments`` entry-point group (each
entry point names a :class:`~lockstep.clusters.base.Cluster` subclass, or a module that registers on import).
Entry points are read on first use (the first :func:`cluster_environments` call), not at import.
"""

from __future__ import annotations

from typing import TypeVar

from lockstep.clusters.base import Cluster
from lockstep.clusters.kubeflow import KubeflowCluster
from lockstep.clusters.lsf import LsfCluster
from lockstep.clusters.mpi import MpiCluster
from lockstep.clusters.pbs import PbsCluster
from lockstep.clusters.slurm import SlurmCluster
from lockstep.clusters.torchrun import TorchElasticCluster
from lockstep.entry_points import Registry

ENTRY_POINT_GROUP = "lockstep.cluster_environments"
"""The entry-point group an installed package registers its cluster environments under."""
C = TypeVar("C", bound=type[Cluster])


def _has_a_name_of_its_own(cluster: type[Cluster], others: list[type[Cluster]]) -> None:
    name = cluster.name
    if not isinstance(name, str) or not name or name in ("auto", "none"):
        raise ValueError(
            f"register_cluster_environment({cluster.__name__}) is invalid: its name is {name!r}; set the class's "
            "name to a word of its own (not 'auto' or 'none', which --cluster uses)."
        )


CLUSTERS: Registry[type[Cluster]] = Registry(
    noun="cluster environment",
    function="register_cluster_environment",
    kind=Cluster,
    subclasses=True,
    name_of=lambda cluster: cluster.name,
    order=lambda cluster: (cluster.priority, cluster.name),
    group=ENTRY_POINT_GROUP,
    check=_has_a_name_of_its_own,
)
"""The table of cluster environments (the built-ins are registered when this module is imported)."""


def register_cluster_environment(cluster: C, *, replace: bool = False) -> C:
    """Have ``lockstep launch`` and every process read the environment ``cluster`` describes (usable as a
    class decorator).

    Environments are asked in increasing ``priority`` (the built-ins: Kubeflow 10, torchrun 20, MPI 30,
    SLURM 40, LSF 50, PBS 60; a class that keeps the default 0 is asked first). The launcher takes the first
    whose :meth:`~lockstep.clusters.base.Cluster.machines` answers, and ``--cluster NAME`` names one; a
    process takes the first whose :meth:`~lockstep.clusters.base.Cluster.process` answers.

    Args:
        cluster: a subclass of :class:`~lockstep.clusters.base.Cluster` with a ``name``.
        replace: replace an environment registered under the same name (a built-in too).

    Raises:
        TypeError: ``cluster`` is not a ``Cluster`` subclass.
        ValueError: its name is empty, ``auto`` or ``none``, or registered already without ``replace``.

    Example:
        >>> from lockstep.clusters import Cluster, ClusterEnvironment
        >>> @register_cluster_environment
        ... class Lab(Cluster):
        ...     name, title = "lab", "the lab's scheduler"
        ...     def process(self) -> ClusterEnvironment | None:
        ...         rank = self.environ.get("LAB_RANK")
        ...         return None if rank is None else ClusterEnvironment(source="lab", rank=int(rank), world_size=4)
        >>> from lockstep._env import read_cluster_environment
        >>> read_cluster_environment({"LAB_RANK": "2"}).rank
        2
        >>> unregister_cluster_environment("lab")
    """
    return CLUSTERS.register(cluster, replace=replace)


def unregister_cluster_environment(name: str) -> None:
    """Remove a registered environment (tests, notebooks that redefine one); unknown names are ignored."""
    CLUSTERS.unregister(name)


def cluster_environments() -> list[type[Cluster]]:
    """Every registered environment, in the order they are asked (entry points are read on the first call)."""
    return CLUSTERS.entries()


for _built_in in (KubeflowCluster, TorchElasticCluster, MpiCluster, SlurmCluster, LsfCluster, PbsCluster):
    register_cluster_environment(_built_in)
