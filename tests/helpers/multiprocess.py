"""Start real multi-process gloo groups on loopback for tests.

Each worker is a forked process with one thread, its own rank in the torchrun environment variables,
and a fresh lockstep state. A worker's exception is re-raised in the test with its rank and traceback;
a worker that does not finish in time fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("fork")


class WorkerError(AssertionError):
    """A worker process raised, crashed or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, env: dict, queue: Any
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    reset_lockstep_state()
    try:
        # Plain pickle: torch's multiprocessing pickler would share tensor memory with this exiting process.
        result = pickle.dumps(fn(*args))
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from lockstep import _process_group

        _process_group.shutdown(barrier=False)


def reset_lockstep_state() -> None:
    from lockstep.state import GradientState, PartialState

    PartialState._reset_state()
    GradientState._reset_state()


def _import_before_fork() -> None:
    """Import in this process, once, what every worker would otherwise import for itself after the fork.

    The first ``optimizer.step()`` or ``zero_grad()`` of a process imports ``torch._dynamo`` (torch wraps
    them in ``torch._disable_dynamo``, which imports it lazily): some 800 modules with sympy, about 3 s of CPU
    per rank on the CI machine, paid again by every rank of every forked group. Imported here, the forked
    workers inherit it. The import starts no thread, so forking afterwards stays safe.
    """
    import torch._dynamo  # noqa: F401


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes; return their results ordered by rank."""
    _import_before_fork()
    port = free_port()
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(target=_worker, args=(rank, world_size, port, fn, args, env or {}, queue), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise WorkerError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s"
                    + "".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in errors.items())
                ) from None
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                timeout = min(timeout, 15.0)  # the others are likely stuck waiting for this rank
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        first = min(errors)
        # the others' tracebacks too: a rank that lost its peer fails with gloo's "Connection closed by peer",
        # and the peer's own error (the cause) may be on a higher rank
        others = "".join(
            f"\n--- rank {r} of {world_size} also failed:\n{errors[r]}" for r in sorted(errors)[1:]
        )
        raise WorkerError(f"rank {first} of {world_size} failed:\n{errors[first]}{others}")
    return [results[r] for r in range(world_size)]
