"""The cluster environment's values merged into the launch settings: over the config file, under the flags.

A flag may override what the cluster says about the rendezvous (address, port), never the job's layout:
``--num-machines 3`` in a SLURM job of 2 nodes is an error naming both, since the nodes would wait for a
machine that never comes (or train apart).
"""

from __future__ import annotations

from typing import Any

from lockstep.clusters import DetectedCluster
from lockstep.errors import UsageError

CLUSTER_FIELDS = (
    ("num_machines", "num_machines", "--num-machines"),
    ("machine_rank", "machine_rank", "--machine-rank"),
    ("main_process_ip", "main_address", "--main-process-ip"),
    ("main_process_port", "main_port", "--main-process-port"),
    ("rdzv_backend", "rdzv_backend", "--rdzv-backend"),
    ("cpus_per_machine", "cpus_per_machine", None),
)
"""(setting, cluster value, flag): what a cluster environment sets."""
_RENDEZVOUS = ("main_address", "main_port", "rdzv_backend")
_SAYS = {"num_machines": "{} machines", "machine_rank": "this machine is rank {}"}


def apply_cluster(
    merged: dict[str, Any], sources: dict[str, str], flags: dict[str, Any], cluster: DetectedCluster
) -> None:
    """Put the cluster's values in ``merged`` (the settings so far: flags, then the config file's values)
    and their origin in ``sources``: over the config file's, under the flags.

    Raises:
        UsageError: a flag contradicts a value the cluster is strict about (its machine count, this
            machine's rank, Kubeflow's processes per pod), or a job of several machines lacks a value that
            neither the cluster nor a flag gives.
    """
    merged["cluster"], sources["cluster"] = cluster.name, f"detected: {cluster.title}"
    for setting, name, flag in CLUSTER_FIELDS:
        value = getattr(cluster, name)
        if value is None or (cluster.num_machines == 1 and name in _RENDEZVOUS):
            continue  # one machine: a free local port, never a fixed one that concurrent jobs would share
        if setting in flags:
            if name in cluster.strict and flags[setting] != value:
                raise UsageError(
                    _contradiction(f"{flag} {flags[setting]}", cluster, name, _SAYS[name].format(value))
                )
            continue
        merged[setting], sources[setting] = value, f"{cluster.title}: {cluster.sources.get(name, '')}"
    _apply_cluster_processes(merged, sources, flags, cluster)
    machines = int(merged.get("num_machines", 1))
    for name, hint in cluster.missing.items():
        setting = next(entry[0] for entry in CLUSTER_FIELDS if entry[1] == name)
        _check(
            machines == 1 or setting in flags,
            f"The {cluster.title} environment says the job has {machines} machines "
            f"({cluster.sources.get('num_machines', '')}), but {hint}.",
        )


def _apply_cluster_processes(
    merged: dict[str, Any], sources: dict[str, str], flags: dict[str, Any], cluster: DetectedCluster
) -> None:
    """Processes per machine from the cluster: strict ones (Kubeflow's nproc) beat the config file, others
    (the GPUs SLURM gave) only the default, and not with ``--cpu`` or ``--gpu-ids``."""
    per_machine = cluster.processes_per_machine
    if per_machine is None:
        return
    strict = "processes_per_machine" in cluster.strict
    if not strict and (merged.get("use_cpu") or merged.get("gpu_ids") not in (None, "all")):
        return  # the GPUs the scheduler gave are not what this job runs on
    total = per_machine * int(merged.get("num_machines", 1))
    if "num_processes" in flags:
        _check(
            not strict or flags["num_processes"] == total,
            _contradiction(
                f"--num-processes {flags['num_processes']}",
                cluster,
                "processes_per_machine",
                f"{per_machine} processes per machine, {total} in all; --num-processes counts the whole job, "
                "as in Accelerate",
            ),
        )
    elif strict or "num_processes" not in merged:
        merged["num_processes"] = total
        sources["num_processes"] = f"{cluster.title}: {cluster.sources['processes_per_machine']} x machines"


def _contradiction(given: str, cluster: DetectedCluster, name: str, says: str) -> str:
    return (
        f"{given} contradicts the {cluster.title} environment: {cluster.sources.get(name, '')}: {says}. "
        f"Drop the flag to use what {cluster.title} says, or pass --cluster none to ignore the "
        f"{cluster.title} variables."
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)
