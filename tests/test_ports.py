"""No test, and no one-machine launch, picks a free port and binds it later (issue 44, item 7).

Picking a port by binding port 0 and closing the socket, then binding it again in another process, left a
window in which any other test or program of the machine could take the port. The remedies hold the port
from the moment it is chosen: ``lockstep launch`` on one machine (its store binds port 0 and keeps it),
``run_distributed`` and ``held_store`` (the test process hosts the store), ``reserved_port`` (TIME_WAIT).
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest

from tests.helpers.cli import SCRIPTS, cli_env
from tests.helpers.deadlines import scaled
from tests.helpers.multiprocess import run_distributed
from tests.helpers.ports import held_store, reserved_port


def _bindable(port: int, *, reuse: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as error:
            assert error.errno == errno.EADDRINUSE
            return False
        return True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _port_before_the_group() -> tuple[int, bool, float]:
    """In a worker, before any process group exists: is the port it was told free for anyone to take?"""
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    free_before = _bindable(port, reuse=True)
    from lockstep.state import PartialState

    PartialState()
    total = torch_sum(dist.get_rank() + 1)
    return port, free_before, total


def torch_sum(value: float) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor.item())


@pytest.mark.distributed
def test_run_distributed_holds_the_port_before_any_worker_binds_it():
    """The port a worker is told is already held (by the parent's store) before any rank makes a group:
    with the former free_port() it was free then, for rank 0 or anyone else to take."""
    threads = _threads()
    results = run_distributed(_port_before_the_group, 2)
    assert [free for _, free, _ in results] == [False, False]
    assert [total for _, _, total in results] == [3.0, 3.0]
    assert results[0][0] == results[1][0]
    assert _bindable(results[0][0], reuse=True)  # released once the workers ended
    assert _threads() == threads  # and the store's thread with it: the next group's fork finds none


def test_held_store_holds_its_port_and_lets_clients_join():
    import torch.distributed as dist

    threads = _threads()
    with held_store(2) as env:
        port = int(env["MASTER_PORT"])
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert not _bindable(port, reuse=True)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
        client.set("key", "value")
        assert client.get("key") == b"value"
        del client
    assert _bindable(port)
    assert _threads() == threads


def test_a_reserved_port_is_refused_to_others_and_given_to_a_store():
    import torch.distributed as dist

    port = reserved_port()
    assert not _bindable(port)  # a program binding it without SO_REUSEADDR is refused
    taken = []
    try:  # and the kernel gives it to no one who binds port 0
        for _ in range(500):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            taken.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
        assert port not in {sock.getsockname()[1] for sock in taken}
    finally:
        for sock in taken:
            sock.close()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False)
    assert store.port == port  # the launcher told the port binds it at once (TCPStore sets SO_REUSEADDR)
    del store


def test_reserved_port_among_candidates_skips_one_already_reserved():
    first = reserved_port(range(20000, 30000))
    assert reserved_port([first, *range(20000, 30000)]) != first


def test_one_machine_launch_binds_port_zero_and_tells_the_workers_the_port_it_holds():
    """What ``lockstep launch`` without --main-process-port hands torch's agent: an endpoint on port 0 (no
    port chosen in advance), and a rendezvous whose store holds the port the workers are told."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from lockstep.launcher.elastic import LOCAL_RENDEZVOUS, torch_launch_config
    from lockstep.launcher.settings import LaunchSettings

    config = torch_launch_config(LaunchSettings(num_processes=2, use_cpu=True))
    assert (config.rdzv_endpoint, config.rdzv_backend) == ("127.0.0.1:0", LOCAL_RENDEZVOUS)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=1,
        max_nodes=1,
        **config.rdzv_configs,
    )
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    port = info.bootstrap_store_info.master_port
    assert port > 0 and not _bindable(port, reuse=True)
    assert (info.rank, info.world_size) == (0, 1)
    assert handler.next_rendezvous().bootstrap_store_info.master_port == port  # a restart keeps it
    given = torch_launch_config(LaunchSettings(num_processes=2, use_cpu=True, main_process_port=29517))
    assert (given.rdzv_endpoint, given.rdzv_backend) == ("127.0.0.1:29517", "static")  # honoured as before


LAUNCHES = 4


@pytest.mark.distributed
def test_launches_started_together_without_a_port_all_succeed(tmp_path):
    """Four 2-process launches at once on this machine, none given a port: each store binds its own, so
    none fails with "address already in use" nor joins another's workers (each world is 2, each sum 3)."""
    script = SCRIPTS / "cluster_reduce.py"
    command = [
        sys.executable,
        "-m",
        "lockstep.cli.main",
        "launch",
        "--cpu",
        "--num-processes",
        "2",
        str(script),
    ]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
        for _ in range(LAUNCHES)
    ]
    outputs = [run.communicate(timeout=scaled(240)) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
        assert out.count('"world": 2') == 2 and out.count('"sum": 3.0') == 2, out
