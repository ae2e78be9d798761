"""torchft's ``Manager`` for one process of a replica group: its store, its start, and its orderly end.

A replica group of N processes (an ordinary lockstep job: DDP or FSDP2 over its own process group) runs one
torchft ``Manager`` per process. Rank 0 of the group serves the group's quorum and commit votes (torchft's
``ManagerServer``) and registers the group at the lighthouse; every rank finds that server through a
``TCPStore`` that rank 0 of the group opens and whose address it sends to the group's other ranks. Rank ``r``
of every group then averages gradients with rank ``r`` of the other groups of the step's quorum (torchft's
reconfigurable gloo group), and a healing rank receives its state from rank ``r`` of a live peer group.
"""

from __future__ import annotations

import gc
import socket
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore

from lockstep.errors import ReplicaQuorumError
from lockstep.layers.fault_tolerance.config import FaultToleranceConfig
from lockstep.state import PartialState


def start_manager(
    config: FaultToleranceConfig, address: str, state: PartialState
) -> tuple[Any, list[TCPStore]]:
    """torchft's Manager for this process (group rank ``state.process_index`` of ``state.num_processes``), and
    the group's store it connects to by address (held in a list that :func:`shut_down` empties: the store
    must outlive the manager, and no more; empty on the processes that do not open it)."""
    # torchft 0.2.0's _ManagerLogger.warn calls the deprecated Logger.warn (torchft/manager.py) on every
    # CPU quorum; under -W error that DeprecationWarning is raised inside the quorum, which torchft records
    # as an error, and no step would ever commit. Scoped to that module and message.
    warnings.filterwarnings(
        "ignore", message="The 'warn' method is deprecated", category=DeprecationWarning, module="torchft"
    )
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=config.timeout)
    hostname = config.hostname or socket.gethostname()
    store, store_host, store_port = _group_store(hostname, timeout, state)
    try:
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=state.process_index,
            world_size=state.num_processes,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=address,
            use_async_quorum=False,
            replica_id=config.replica_id,
            hostname=hostname,
        )
    except RuntimeError as error:
        raise ReplicaQuorumError(
            f"Replica group {config.replica_group} could not join the torchft lighthouse at {address} within "
            f"{config.timeout:g} s: {error}. Check that the lighthouse runs and that this machine reaches it, "
            "or raise FaultToleranceConfig(timeout=...)."
        ) from error
    return manager, [] if store is None else [store]


def _group_store(hostname: str, timeout: timedelta, state: PartialState) -> tuple[TCPStore | None, str, int]:
    """The group's store for torchft's managers (each connects to it by address): opened by the group's
    rank 0 on a free port, whose host and port the other ranks receive over the group's own process group.
    Returns the store (rank 0 only: it must outlive the manager), its host and its port."""
    store = None
    if state.process_index == 0:
        store = TCPStore(hostname, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    where: list[Any] = [(hostname, store.port) if store is not None else None]
    if state.num_processes > 1:
        dist.broadcast_object_list(where, src=0)
    host, port = where[0]
    return store, host, port


def shut_down(manager: Any, store: list[TCPStore]) -> None:
    """Stop torchft's servers and threads, then abort and drop its gloo group and the store, while the
    interpreter is whole. Left to interpreter exit, the gloo group's threads were torn down in no set order,
    and a finished group sometimes died with SIGABRT ("terminate called without an active exception")."""
    manager.shutdown(wait=True)
    group = getattr(manager, "_pg", None)
    if group is not None:
        group.abort(errored=False)
    store.clear()
    gc.collect()
