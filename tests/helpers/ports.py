"""Ports for tests that start processes on loopback, without a race for the port.

Picking a free port (bind port 0, read it, close) and binding it later in another process races: in
between, any other test or program of the machine that binds port 0 may be given the same port, and the
run fails with "address already in use" (or, worse, its processes join a stranger's store). Each kind of
test has one remedy here:

* processes started by the test that meet through ``env://`` or ``tcp://`` (``MASTER_ADDR``/``MASTER_PORT``):
  :func:`held_store`. The test hosts the store itself on a port it binds and holds until they end; they join
  it as clients (``TORCHELASTIC_USE_AGENT_STORE``, which is what torchrun's workers do);
* ``lockstep launch`` on one machine: no port at all (the launcher's store binds port 0 and keeps it);
* torchrun (``torch.distributed.run``/``launch``) on one machine: :data:`TORCHRUN_STANDALONE`;
* two launchers that must be told the port before the first of them binds it (two "machines" on
  loopback, a lighthouse): :func:`reserved_port`.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

TORCHRUN_STANDALONE = ["--standalone"]
"""torchrun's flag for one machine: a c10d rendezvous on ``localhost:0`` whose store binds port 0 and keeps
it, shared with the workers. Instead of ``--master_port``."""


@contextlib.contextmanager
def held_store(world_size: int, timeout: float = 300.0) -> Iterator[dict[str, str]]:
    """Host a TCPStore on a loopback port this process binds and holds; yields the variables that make
    processes of ``world_size`` ranks join it: ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``TORCHELASTIC_USE_AGENT_STORE`` (torch's ``env://`` and ``tcp://`` rendezvous then connect every rank
    as a client instead of binding the port on rank 0). Keep the block open until the processes end.

    The store's server is a thread of this process: fork nothing (``run_distributed``) inside the block.
    """
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    finally:
        del store  # its server thread ends with it


def reserved_port(candidates: Iterable[int] | None = None) -> int:
    """A loopback port for a program that binds it later, which no other program gets meanwhile: one the
    kernel picks, else the first of ``candidates`` that is free.

    The port is bound, connected to and closed from the accepting side, which leaves it in TIME_WAIT for
    a minute: the kernel then gives it to no one who binds port 0 or connects (it skips ports with a bound
    socket in TIME_WAIT), and refuses it to anyone who binds it without ``SO_REUSEADDR``; a server that
    sets ``SO_REUSEADDR`` (torch's TCPStore, what every launcher's rendezvous uses) binds it at once.
    (The trick of Yelp's ``ephemeral-port-reserve``.) Only for programs that bind with ``SO_REUSEADDR``.
    """
    for port in [0] if candidates is None else candidates:
        with contextlib.suppress(OSError):
            return _reserve(port)
    raise RuntimeError(f"no free port among {candidates}")


def _reserve(port: int) -> int:
    if port:  # refused where a socket is in TIME_WAIT: a port reserved already is not handed out twice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        # SO_REUSEADDR here too: the TIME_WAIT socket inherits it, and without it Linux refuses the port to
        # every later bind, SO_REUSEADDR or not
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            client.getsockname()  # the connection is established both ways before either side closes
            accepted.close()  # the accepting side closes first: the TIME_WAIT is on the server's port
    return int(port)
