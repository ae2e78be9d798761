"""``lockstep launch --fault-tolerance``: the ``fault_tolerance_config`` section, its flags, and the lighthouse
the launcher starts when none is given.

Torch-free at import (the launcher reads the key table at start-up); the lighthouse imports torchft when it
starts.

One launch is one replica group (``--replica-group I --num-replica-groups N``) of one or more processes
(``--num-processes``, DDP or ``--use-fsdp`` inside the group); every group's launch points at the same
lighthouse (``--lighthouse http://host:29510``). A launch without ``--lighthouse`` starts one in the
launcher for the duration of the launch, binds it to ``--lighthouse-port`` (default 29510) on every interface,
prints its address, and gives it to its workers. ``--replica-group all`` starts every group on this machine,
each as its own launch (:mod:`lockstep.layers.fault_tolerance.all_groups`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from lockstep.config import checks
from lockstep.config.keys import SettingKey
from lockstep.errors import UsageError

SECTION = "fault_tolerance_config"
PIP_LINE = "pip install 'lockstep[ft]'  (or: pip install torchft==0.2.0 with your torch pinned)"
"""How to install torchft, in the errors of the launcher and of ``Accelerator(fault_tolerance=...)``."""
DEFAULT_LIGHTHOUSE_PORT = 29510

ALL_GROUPS = "all"
"""``--replica-group all``: every replica group on this machine, each its own launch."""


def _group_or_all(value: Any, key: str) -> int | str:
    """A replica group's number (>= 0), or ``all``."""
    if isinstance(value, str) and value.strip().lower() == ALL_GROUPS:
        return ALL_GROUPS
    try:
        return checks.int_range(0)(value, key)
    except (TypeError, ValueError):
        raise ValueError(
            f"{key} must be a replica group's number (>= 0), or 'all' to start every group on this machine; "
            f"got {value!r}"
        ) from None


FT_KEYS: tuple[SettingKey, ...] = (
    SettingKey(
        key="replica_group",
        field="replica_group",
        check=_group_or_all,
        help="this launch's replica group, from 0 (one launch per group); all: every group on this machine",
        flag=True,
    ),
    SettingKey(
        key="num_replica_groups",
        field="num_replica_groups",
        check=checks.int_range(1),
        help="replica groups the job starts with",
        flag=True,
    ),
    SettingKey(
        key="min_replicas",
        field="min_replicas",
        check=checks.int_range(1),
        help="live groups a step needs to commit (default 1)",
        flag=True,
    ),
    SettingKey(
        key="lighthouse",
        field="lighthouse",
        check=checks.string,
        help="join the torchft lighthouse at this address (http://host:port); none: the launcher starts one",
        flag=True,
    ),
    SettingKey(
        key="lighthouse_port",
        field=None,
        check=checks.int_range(0, 65535),
        help=f"port of the lighthouse the launcher starts (default {DEFAULT_LIGHTHOUSE_PORT}; 0: a free one)",
        flag=True,
    ),
    SettingKey(
        key="quorum_timeout",
        field="timeout",
        check=checks.non_negative_float,
        help="seconds to reach the lighthouse, form a quorum or finish a cross-group all-reduce (default 30)",
        flag=True,
    ),
)
"""The ``fault_tolerance_config`` keys; each is also a launch flag (``--replica-group``, ...)."""


def config_from_section(section: Mapping[str, Any]) -> Any:
    """The workers' :class:`FaultToleranceConfig` from the section the launcher passed them.

    Raises:
        ValueError: a missing or bad setting, naming the flag or key.
    """
    from lockstep.layers.fault_tolerance.config import FaultToleranceConfig

    keys = {entry.key: entry for entry in FT_KEYS}
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ValueError(
            f"{SECTION} has no key {', '.join(map(repr, unknown))}; its keys: {', '.join(keys)}."
        )
    section = {
        key: keys[key].check(value, f"{SECTION}.{key}") for key, value in section.items() if value is not None
    }
    missing = [key for key in ("replica_group", "num_replica_groups") if section.get(key) is None]
    if missing:
        names = " and ".join(f"--{key.replace('_', '-')} ({SECTION}.{key})" for key in missing)
        raise ValueError(
            f"fault tolerance needs {names}: say which replica group this launch is, and how many the job has."
        )
    if section["replica_group"] == ALL_GROUPS:
        raise ValueError(
            f"{SECTION}.replica_group='all' starts every group from `lockstep launch`; a process needs its own "
            "group's number. Launch with `lockstep launch --replica-group all`, or pass a number."
        )
    kwargs = {entry.field: section[entry.key] for entry in FT_KEYS if entry.field and entry.key in section}
    return FaultToleranceConfig(**kwargs)


def check_section(section: dict[str, Any], launch: Mapping[str, Any]) -> None:
    """Refuse bad fault-tolerance settings before any process starts."""
    if launch.get("distributed_type") == "DEEPSPEED" or launch.get("use_parallelism_config"):
        layout = "--use-parallelism-config" if launch.get("use_parallelism_config") else "DeepSpeed"
        raise ValueError(
            f"--fault-tolerance with {layout} is not supported yet: each replica group trains its replica on "
            "one process, or on several with DDP or FSDP (--use-fsdp). Drop one of the two."
        )
    try:
        if (
            section.get("replica_group") is not None
            and _group_or_all(section["replica_group"], "") == ALL_GROUPS
        ):
            check_every_group_here(launch)
            section = {**section, "replica_group": 0}  # the rest is checked as for one group
        config_from_section(section)
    except (TypeError, ValueError) as error:
        raise ValueError(f"fault tolerance settings: {error}") from None


def check_every_group_here(launch: Mapping[str, Any]) -> None:
    """``--replica-group all`` runs every group on this one machine, each with a rendezvous port of its own."""
    if int(launch.get("num_machines") or 1) > 1:
        raise ValueError(
            f"--replica-group all starts every replica group on this machine, and --num-machines is "
            f"{launch['num_machines']}. Launch each group on its machines with its own --replica-group number."
        )
    if launch.get("main_process_port"):
        raise ValueError(
            f"--replica-group all starts one launch per group, each with a rendezvous port of its own, so one "
            f"--main-process-port ({launch['main_process_port']}) cannot serve them all. Drop it: each group "
            "takes a free port."
        )


@contextlib.contextmanager
def lighthouse_for(section: dict[str, Any], settings: Any = None) -> Iterator[dict[str, Any]]:
    """The section the workers get: as given with ``lighthouse``; else with the address of a lighthouse
    started here for the duration of the launch (it waits for ``min_replicas`` groups).

    With ``replica_group: all`` this launch runs every group as a launch of its own, each given its number
    and the lighthouse, and ends with their exit code (``SystemExit``) instead of starting workers itself.
    """
    if str(section.get("replica_group")).lower() == ALL_GROUPS:
        from lockstep.layers.fault_tolerance import all_groups

        own = all_groups.group_of_this_launch()
        if own is not None:  # one of the launches started for `all`
            yield {**section, "replica_group": own[0], "lighthouse": own[1]}
            return
        with _lighthouse(section) as address:
            code = all_groups.run_every_group(int(section["num_replica_groups"]), address, settings)
        raise SystemExit(code)
    with _lighthouse(section) as address:
        yield {**section, "lighthouse": address}


@contextlib.contextmanager
def _lighthouse(section: dict[str, Any]) -> Iterator[str]:
    """The lighthouse's address: the given one; else one started here for the duration."""
    if section.get("lighthouse"):
        yield str(section["lighthouse"])
        return
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        raise UsageError(
            f"--fault-tolerance starts torchft's lighthouse, and torchft is missing: {PIP_LINE}."
        ) from error
    port = int(section.get("lighthouse_port", DEFAULT_LIGHTHOUSE_PORT))
    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=int(section.get("min_replicas", 1)))
    except Exception as error:  # torchft raises RuntimeError from its Rust server
        raise UsageError(
            f"--fault-tolerance could not start a lighthouse on port {port} ({error}): the port is taken or not "
            "allowed. Pass --lighthouse-port with another port (0: a free one), or --lighthouse ADDR to join a "
            "running one."
        ) from error
    address = server.address()
    print(f"lockstep launch: started the torchft lighthouse at {address}", file=sys.stderr, flush=True)
    try:
        yield address
    finally:
        server.shutdown()
