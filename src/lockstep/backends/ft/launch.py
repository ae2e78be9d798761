"""``lockstep launch --fault-tolerance``: the ``fault_tolerance_config`` section, its flags, and the lighthouse
the launcher starts when none is given.

Torch-free at import (the launcher reads the key table at start-up); the lighthouse imports torchft when it
starts.

One launch is one replica group (``--replica-group I --num-replica-groups N``); every group's launch points at
the same lighthouse (``--lighthouse http://host:29510``). A launch without ``--lighthouse`` starts one in the
launcher for the duration of the launch, binds it to ``--lighthouse-port`` (default 29510) on every interface,
prints its address, and gives it to its workers.
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
DEFAULT_LIGHTHOUSE_PORT = 29510

FT_KEYS: tuple[SettingKey, ...] = (
    SettingKey(
        key="replica_group",
        field="replica_group",
        check=checks.int_range(0),
        help="this launch's replica group, from 0 (one launch per group)",
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
    from lockstep.backends.ft.config import FaultToleranceConfig

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
    kwargs = {entry.field: section[entry.key] for entry in FT_KEYS if entry.field and entry.key in section}
    return FaultToleranceConfig(**kwargs)


def check_section(section: dict[str, Any], launch: Mapping[str, Any]) -> None:
    """Refuse bad fault-tolerance settings before any process starts."""
    if launch.get("distributed_type") in ("FSDP", "DEEPSPEED") or launch.get("use_parallelism_config"):
        layout = (
            "--use-parallelism-config" if launch.get("use_parallelism_config") else launch["distributed_type"]
        )
        raise ValueError(
            f"--fault-tolerance with {layout} is not supported yet: each replica group trains one plain "
            "data-parallel replica. Drop one of the two."
        )
    processes = launch.get("num_processes")
    if processes not in (None, 1):
        raise ValueError(
            f"--fault-tolerance with --num-processes {processes}: a replica group is one process so far. Start "
            "one launch per replica group (--replica-group I), each with one process."
        )
    try:
        config_from_section(section)
    except (TypeError, ValueError) as error:
        raise ValueError(f"fault tolerance settings: {error}") from None


@contextlib.contextmanager
def lighthouse_for(section: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The section the workers get: as given with ``lighthouse``; else with the address of a lighthouse
    started here for the duration of the launch (it waits for ``min_replicas`` groups)."""
    if section.get("lighthouse"):
        yield section
        return
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        from lockstep.backends.ft.spec import PIP_LINE

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
        yield {**section, "lighthouse": address}
    finally:
        server.shutdown()
