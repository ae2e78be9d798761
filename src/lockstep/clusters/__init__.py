"""Cluster environments: what a scheduler or launcher says about the job, read by one class per environment
for both of its readers.

``lockstep launch`` asks each environment for the job as machines (one launcher per machine:
:meth:`Cluster.machines`); every process asks for its own place in the job (:meth:`Cluster.process`), as
``srun python train.py`` or ``mpirun -np 4 python train.py`` start it. The built-ins, in the order they are
asked: :mod:`~lockstep.clusters.kubeflow` (``PET_*``, and the older operator's ``RANK``/``WORLD_SIZE`` per
pod), :mod:`~lockstep.clusters.torchrun` (its workers; Ray Train's too), :mod:`~lockstep.clusters.mpi`
(Open MPI, MPICH, Intel MPI), :mod:`~lockstep.clusters.slurm`, :mod:`~lockstep.clusters.lsf` and
:mod:`~lockstep.clusters.pbs`: the launcher that started this process (torchrun's ``PET_*`` defaults,
``mpirun``) before the scheduler that allocated the machines, since ``mpirun`` inside a SLURM job describes
the processes and SLURM only the allocation.

Every environment describes launchers, one per machine: a scheduler starting one task per *process* is
refused by ``lockstep launch`` with the command to use instead. A port not given is derived from the job id
(``10000 + id % 20000``), so every machine computes the same one.

Add one with :func:`register_cluster_environment` or the ``lockstep.cluster_environments`` entry-point group.

Example:
    >>> env = {"SLURM_JOB_ID": "731", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    ...        "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    >>> cluster = SlurmCluster(env).machines()
    >>> cluster.name, cluster.num_machines, cluster.machine_rank, cluster.main_address, cluster.main_port
    ('slurm', 2, 1, 'gpu07', 10731)
"""

from __future__ import annotations

from lockstep.clusters.base import Cluster, ClusterEnvironment, DetectedCluster
from lockstep.clusters.hostlist import expand_hostlist
from lockstep.clusters.kubeflow import KubeflowCluster
from lockstep.clusters.lsf import LsfCluster
from lockstep.clusters.mpi import MpiCluster
from lockstep.clusters.pbs import PbsCluster
from lockstep.clusters.registry import (
    ENTRY_POINT_GROUP,
    cluster_environments,
    register_cluster_environment,
    unregister_cluster_environment,
)
from lockstep.clusters.slurm import SlurmCluster
from lockstep.clusters.torchrun import TorchElasticCluster

__all__ = [
    "ENTRY_POINT_GROUP",
    "Cluster",
    "ClusterEnvironment",
    "DetectedCluster",
    "KubeflowCluster",
    "LsfCluster",
    "MpiCluster",
    "PbsCluster",
    "SlurmCluster",
    "TorchElasticCluster",
    "cluster_environments",
    "expand_hostlist",
    "register_cluster_environment",
    "unregister_cluster_environment",
]
