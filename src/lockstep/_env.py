"""Every environment variable lockstep reads, and the one place that reads them.

Launchers describe the process topology through environment variables: torchrun / the elastic
agent (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), SLURM (``SLURM_PROCID``, ...) and the MPI
implementations (``OMPI_COMM_WORLD_*``, ``PMI_*``). Each is read by its class in :mod:`lockstep.clusters`
(which ``lockstep launch`` reads too); :func:`read_cluster_environment` asks them and returns one
:class:`ClusterEnvironment`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from lockstep.clusters import ClusterEnvironment, cluster_environments
from lockstep.clusters.torchrun import RAY_RAYLET_PID

# lockstep's own variables.
LOCKSTEP_DEBUG = "LOCKSTEP_DEBUG"
"""``1`` turns on debug mode: collectives check shapes across ranks first."""
LOCKSTEP_LAUNCH_CONFIG = "LOCKSTEP_LAUNCH_CONFIG"
"""JSON of the resolved launch settings, written by ``lockstep launch`` for its workers."""
LAUNCHER_PID = "LOCKSTEP_LAUNCHER_PID"
"""The pid of the ``lockstep launch`` process that started this worker (its parent)."""
LOCKSTEP_DISABLE_PROGRESS = "LOCKSTEP_DISABLE_PROGRESS_BARS"
LOCKSTEP_HOME = "LOCKSTEP_HOME"
"""Folder of ``default_config.yaml``; else ``$XDG_CACHE_HOME/lockstep``, else ``~/.cache/lockstep``."""
XDG_CACHE_HOME = "XDG_CACHE_HOME"
LOCKSTEP_LOG_LEVEL = "LOCKSTEP_LOG_LEVEL"
"""Default level of loggers made by ``lockstep.logging.get_logger``."""
LOCKSTEP_HANG_TIMEOUT = "LOCKSTEP_HANG_TIMEOUT"
"""Seconds without progress before the hang watchdog reports a hang; ``0`` or ``off`` switches it off."""
ELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torch's elastic agent wants a failing worker's error record."""
PRELOAD_WORKERS = "LOCKSTEP_PRELOAD_WORKERS"
"""``1``: ``lockstep launch`` forks its workers from a server that imported torch (and the script's other
large libraries) once, instead of starting each as a fresh interpreter (``lockstep.launcher.preloaded``)."""
FORK_LAUNCHED = "FORK_LAUNCHED"
"""Set to 1 by ``notebook_launcher`` for the processes it forks (Accelerate's variable)."""

# Accelerate's device override; Ray Train sets it in each worker to the device it assigned that worker.
ACCELERATE_TORCH_DEVICE = "ACCELERATE_TORCH_DEVICE"


@contextlib.contextmanager
def patched(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` inside the block; afterwards each variable has its previous value
    again (one that was not set before is removed)."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_cluster_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """This process's place in the job, from the first registered cluster environment that started it.

    The environments (:mod:`lockstep.clusters`, the classes ``lockstep launch`` reads the machines with)
    are asked in order: Kubeflow's older operator (one process per pod), torchrun (and Ray Train, source
    ``ray``), MPI, SLURM, then any registered with :func:`lockstep.clusters.register_cluster_environment`
    at its priority. torchrun wins over SLURM and MPI (``srun torchrun ...`` sets both), MPI over SLURM
    (``mpirun`` inside a SLURM job). Outside all of them the process is alone (source ``single``).

    Args:
        env: the environment to read; ``os.environ`` when omitted.

    Raises:
        ValueError: a malformed variable (a ``UsageError`` naming it), or a rank outside the world size.

    Example:
        >>> read_cluster_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
        1
    """
    env = os.environ if env is None else env
    for kind in cluster_environments():
        cluster = kind(env).process()
        if cluster is not None:
            break
    else:
        return ClusterEnvironment(source="single")
    if not 0 <= cluster.rank < cluster.world_size:
        raise ValueError(
            f"The {cluster.source} environment says rank {cluster.rank} of world size {cluster.world_size}, "
            "which is impossible. Check how the processes were launched."
        )
    return cluster


def torch_device_override(env: Mapping[str, str] | None = None) -> str | None:
    """The device named by ``ACCELERATE_TORCH_DEVICE`` (e.g. ``cuda:1``), if any: Accelerate's override,
    which Ray Train sets to the device it gave each worker."""
    env = os.environ if env is None else env
    return env.get(ACCELERATE_TORCH_DEVICE, "").strip() or None


def started_by_ray(env: Mapping[str, str] | None = None) -> bool:
    """Whether Ray started this process (a task, an actor, a Ray Train worker)."""
    env = os.environ if env is None else env
    return RAY_RAYLET_PID in env


def debug_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``LOCKSTEP_DEBUG`` asks for debug mode."""
    env = os.environ if env is None else env
    return env.get(LOCKSTEP_DEBUG, "").strip().lower() in {"1", "true", "yes", "on"}


def launch_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The resolved launch settings handed down by ``lockstep launch`` (empty when not launched by it)."""
    env = os.environ if env is None else env
    raw = env.get(LOCKSTEP_LAUNCH_CONFIG)
    if not raw:
        return {}
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{LOCKSTEP_LAUNCH_CONFIG} holds invalid JSON ({error}); it is written by lockstep launch."
        ) from None
    if not isinstance(settings, dict):
        raise ValueError(f"{LOCKSTEP_LAUNCH_CONFIG} must hold a JSON object, got {type(settings).__name__}.")
    return settings


def progress_bars_disabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether progress bars are switched off for batch jobs."""
    env = os.environ if env is None else env
    return env.get(LOCKSTEP_DISABLE_PROGRESS, "").strip().lower() in {"1", "true", "yes", "on"}


def log_level(env: Mapping[str, str] | None = None) -> str | None:
    """The log level asked for with ``LOCKSTEP_LOG_LEVEL``, if any."""
    env = os.environ if env is None else env
    return env.get(LOCKSTEP_LOG_LEVEL) or None


def config_home(env: Mapping[str, str] | None = None) -> str:
    """The folder that holds lockstep's ``default_config.yaml``."""
    env = os.environ if env is None else env
    if env.get(LOCKSTEP_HOME):
        return env[LOCKSTEP_HOME]
    cache = env.get(XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lockstep")


def hang_timeout(env: Mapping[str, str] | None = None) -> float | bool | None:
    """What ``LOCKSTEP_HANG_TIMEOUT`` asks for: seconds, False for "off", None when it is unset."""
    env = os.environ if env is None else env
    raw = env.get(LOCKSTEP_HANG_TIMEOUT, "").strip().lower()
    if not raw:
        return None
    if raw in {"0", "off", "false", "no"}:
        return False
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{LOCKSTEP_HANG_TIMEOUT}={env[LOCKSTEP_HANG_TIMEOUT]!r} is invalid: give the hang window in "
            "seconds (e.g. 600), or 0 / off to switch the hang watchdog off."
        )
    return seconds


def elastic_error_file(env: Mapping[str, str] | None = None) -> str | None:
    """The error file the elastic agent reads when this worker fails (None outside the agent)."""
    env = os.environ if env is None else env
    return env.get(ELASTIC_ERROR_FILE) or None


def fork_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``notebook_launcher`` forked this process (``FORK_LAUNCHED``)."""
    env = os.environ if env is None else env
    return env.get(FORK_LAUNCHED, "").strip().lower() in {"1", "true", "yes", "on"}


def launched_by_lockstep(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``lockstep launch`` started this process (it reports worker failures itself)."""
    env = os.environ if env is None else env
    return bool(env.get(LOCKSTEP_LAUNCH_CONFIG))


def set_rank0_loading(enabled: bool) -> None:
    """Switch transformers' rank-0-only weight loading on or off for models built from now on
    (``FSDP_CPU_RAM_EFFICIENT_LOADING``; switching on also sets ``ACCELERATE_USE_FSDP`` when unset, as
    transformers needs both)."""
    if enabled:
        os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True" if enabled else "False"


def announce_rank0_loading() -> None:
    """Tell transformers' ``from_pretrained`` that only local rank 0 needs the pretrained weights.

    transformers reads Accelerate's two variable names for this (``is_fsdp_enabled``); lockstep sets them
    for ``cpu_ram_efficient_loading`` so that the other processes skip reading the weights.
    """
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"


ACCELERATE_PREFIX = "ACCELERATE_"
"""``accelerate launch`` hands its config file's keys to its workers as ``ACCELERATE_<KEY>`` variables
(``dynamo_backend`` -> ``ACCELERATE_DYNAMO_BACKEND``); Accelerate's plugins fill the fields left unset from
them, and lockstep's ``TorchDynamoPlugin`` does too."""


def accelerate_variable(key: str, env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The variable ``accelerate launch`` sets for the config key ``key``, and its value (None: unset or empty).

    Example:
        >>> accelerate_variable("dynamo_mode", {"ACCELERATE_DYNAMO_MODE": "max-autotune"})
        ('ACCELERATE_DYNAMO_MODE', 'max-autotune')
    """
    env = os.environ if env is None else env
    name = ACCELERATE_PREFIX + key.upper()
    return name, env.get(name, "").strip() or None


# Accelerate's ParallelismConfig defaults (set by `accelerate launch --parallelism_config_*` for its workers).
PARALLELISM_CONFIG_PREFIX = "PARALLELISM_CONFIG_"
USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"


def parallelism_setting(name: str, default: str, env: Mapping[str, str] | None = None) -> str:
    """``PARALLELISM_CONFIG_<NAME>`` (e.g. ``tp_size`` -> ``PARALLELISM_CONFIG_TP_SIZE``), else ``default``."""
    env = os.environ if env is None else env
    return env.get(PARALLELISM_CONFIG_PREFIX + name.upper(), default)


def parallelism_config_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` asks the Accelerator for a ``ParallelismConfig``
    built from the ``PARALLELISM_CONFIG_*`` variables."""
    env = os.environ if env is None else env
    return env.get(USE_PARALLELISM_CONFIG, "").strip().lower() in {"1", "true", "yes"}
