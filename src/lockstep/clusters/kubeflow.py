"""Kubeflow's PyTorchJob: one launcher per pod.

The training operator describes the job in torchrun's own way, with ``PET_*`` variables that torchrun reads
as its flags' defaults: ``PET_NNODES`` (``--nnodes``; ``N`` or ``N:N``), ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE`` (a number, or ``auto``/``gpu``/``cpu``
for lockstep's default) and, with an elastic policy, ``PET_RDZV_BACKEND`` and ``PET_RDZV_ENDPOINT``.
Unset ones take torchrun's defaults (one node, rank 0, ``127.0.0.1:29500``).

The older operator, without ``PET_*``, gave each pod ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (the
number of pods) and ``RANK`` (this pod's index), with no ``LOCAL_RANK`` (which torchrun's workers always
have); they are read only inside a Kubernetes pod (``KUBERNETES_SERVICE_HOST``). Lightning's ``KubeflowEnvironment`` reads them the same way: one pod is one machine.
"""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.clusters._variables import MASTER_ADDR, MASTER_PORT, integer, text
from lockstep.clusters.base import Cluster, ClusterEnvironment, DetectedCluster
from lockstep.errors import UsageError

NAME, TITLE, LEGACY_TITLE = "kubeflow", "Kubeflow PyTorchJob", "Kubeflow PyTorchJob (older operator)"
NNODES, NODE_RANK, NPROC_PER_NODE = "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE"
PET_MASTER_ADDR, PET_MASTER_PORT = "PET_MASTER_ADDR", "PET_MASTER_PORT"
RDZV_BACKEND, RDZV_ENDPOINT = "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT"
WORLD_SIZE, RANK, LOCAL_RANK, ELASTIC_RUN_ID = "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"
KUBERNETES = "KUBERNETES_SERVICE_HOST"
"""Set by Kubernetes in every pod."""
TORCHRUN_DEFAULT_ADDR, TORCHRUN_DEFAULT_PORT = "127.0.0.1", 29500
NPROC_KEYWORDS = ("auto", "gpu", "cpu")


class KubeflowCluster(Cluster):
    """A Kubeflow PyTorchJob: its pods' launchers (``PET_*``, or the older operator's per-pod variables),
    and, under the older operator, the one process each pod runs (``python train.py``).

    Example:
        >>> pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
        ...        "WORLD_SIZE": "3", "RANK": "2"}
        >>> place = KubeflowCluster(pod).process()
        >>> place.rank, place.world_size, place.local_rank, place.local_world_size
        (2, 3, 0, 1)
    """

    name, title, priority = NAME, TITLE, 10

    def machines(self) -> DetectedCluster | None:
        """The job the PyTorchJob describes (``hostname`` is unused: pods are numbered by the operator).

        Raises:
            UsageError: a malformed variable, or an elastic node range.
        """
        if _has_pet(self.environ):
            return _read_pet(self.environ)
        return _read_legacy(self.environ) if _is_legacy(self.environ) else None

    def process(self) -> ClusterEnvironment | None:
        """Under the older operator, this pod's one process: its pod's rank among the pods; None otherwise
        (``PET_*`` are torchrun's defaults: the processes torchrun starts read torchrun's variables).

        Raises:
            UsageError: a malformed variable.
        """
        if not _is_legacy(self.environ):
            return None
        pods = _read_legacy(self.environ)
        return ClusterEnvironment(
            source=NAME,
            rank=pods.machine_rank or 0,
            world_size=pods.num_machines,
            master_addr=pods.main_address or TORCHRUN_DEFAULT_ADDR,
            master_port=pods.main_port or TORCHRUN_DEFAULT_PORT,
        )


def _has_pet(environ: Mapping[str, str]) -> bool:
    return any(text(environ, name) for name in (NNODES, NODE_RANK, PET_MASTER_ADDR, RDZV_ENDPOINT))


def _is_legacy(environ: Mapping[str, str]) -> bool:
    """In a Kubernetes pod (``KUBERNETES_SERVICE_HOST``), ``MASTER_ADDR``/``WORLD_SIZE``/``RANK`` without
    torchrun's worker variables: a shell that merely exported them elsewhere is not taken for a job."""
    given = all(text(environ, name) for name in (MASTER_ADDR, WORLD_SIZE, RANK, KUBERNETES))
    return given and not any(name in environ for name in (LOCAL_RANK, ELASTIC_RUN_ID))


def _read_pet(environ: Mapping[str, str]) -> DetectedCluster:
    sources: dict[str, str] = {}
    values: dict[str, object] = {"num_machines": _nnodes(environ, sources)}
    endpoint = text(environ, RDZV_ENDPOINT)
    backend = text(environ, RDZV_BACKEND)
    if endpoint is not None and backend not in (None, "static"):
        host, port = _endpoint(endpoint)
        values.update(rdzv_backend=backend, main_address=host, main_port=port)
        sources.update(
            rdzv_backend=f"{RDZV_BACKEND}={backend}",
            main_address=f"{RDZV_ENDPOINT}={endpoint}",
            main_port=f"{RDZV_ENDPOINT}={endpoint}",
        )
    else:
        _take(environ, values, sources, "machine_rank", NODE_RANK, 0)
        address = text(environ, PET_MASTER_ADDR) or TORCHRUN_DEFAULT_ADDR
        values["main_address"] = address
        sources["main_address"] = (
            f"{PET_MASTER_ADDR}={address}"
            if text(environ, PET_MASTER_ADDR)
            else (f"torchrun's default ({PET_MASTER_ADDR} unset)")
        )
        _take(environ, values, sources, "main_port", PET_MASTER_PORT, TORCHRUN_DEFAULT_PORT, minimum=1)
    nproc = text(environ, NPROC_PER_NODE)
    if nproc is not None and nproc.lower() not in NPROC_KEYWORDS:
        values["processes_per_machine"] = integer(NPROC_PER_NODE, nproc, minimum=1)
        sources["processes_per_machine"] = f"{NPROC_PER_NODE}={nproc}"
    return DetectedCluster(
        name=NAME,
        title=TITLE,
        sources=sources,
        strict=frozenset({"num_machines", "machine_rank", "processes_per_machine"}),
        **values,  # type: ignore[arg-type]
    )


def _take(
    environ: Mapping[str, str],
    values: dict[str, object],
    sources: dict[str, str],
    field: str,
    variable: str,
    default: int,
    *,
    minimum: int = 0,
) -> None:
    raw = text(environ, variable)
    values[field] = default if raw is None else integer(variable, raw, minimum=minimum)
    sources[field] = f"{variable}={raw}" if raw is not None else f"torchrun's default ({variable} unset)"


def _nnodes(environ: Mapping[str, str], sources: dict[str, str]) -> int:
    """``PET_NNODES`` as one number: ``N`` or ``N:N`` (an elastic range ``MIN:MAX`` is refused)."""
    raw = text(environ, NNODES)
    if raw is None:
        sources["num_machines"] = f"torchrun's default ({NNODES} unset)"
        return 1
    low, _, high = raw.partition(":")
    count = integer(NNODES, low.strip(), minimum=1)
    if high and integer(NNODES, high.strip(), minimum=1) != count:
        raise UsageError(
            f"{NNODES}={raw!r} asks for an elastic range of pods, but lockstep launch runs a fixed number of "
            "machines. Give the PyTorchJob a fixed size (elasticPolicy minReplicas equal to maxReplicas), or "
            "pass --cluster none with --num-machines, --machine-rank and --main-process-ip."
        )
    sources["num_machines"] = f"{NNODES}={raw}"
    return count


def _endpoint(endpoint: str) -> tuple[str, int]:
    host, colon, port = endpoint.rpartition(":")
    if not colon or not host:
        raise UsageError(
            f"{RDZV_ENDPOINT}={endpoint!r} is invalid: it must be HOST:PORT, such as job-master-0:29400."
        )
    return host.strip("[]"), integer(RDZV_ENDPOINT, port, minimum=1)


def _read_legacy(environ: Mapping[str, str]) -> DetectedCluster:
    world, rank, address = (environ[name].strip() for name in (WORLD_SIZE, RANK, MASTER_ADDR))
    port = text(environ, MASTER_PORT)
    return DetectedCluster(
        name=NAME,
        title=LEGACY_TITLE,
        num_machines=integer(WORLD_SIZE, world, minimum=1),
        machine_rank=integer(RANK, rank),
        main_address=address,
        main_port=integer(MASTER_PORT, port, minimum=1) if port else TORCHRUN_DEFAULT_PORT,
        sources={
            "num_machines": f"{WORLD_SIZE}={world} (pods)",
            "machine_rank": f"{RANK}={rank} (this pod)",
            "main_address": f"{MASTER_ADDR}={address}",
            "main_port": f"{MASTER_PORT}={port}" if port else f"torchrun's default ({MASTER_PORT} unset)",
        },
    )
