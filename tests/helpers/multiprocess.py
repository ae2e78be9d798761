"""Start real multi-process gloo groups on loopback for tests.

Each worker is a process forked from this one (through :mod:`tests.helpers.forking`: it inherits the test's
set-up) with one thread, its own rank in the torchrun environment variables,
and a fresh lockstep state. A worker's exception is re-raised in the test with its rank and traceback;
a worker that does not finish in time fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import traceback
from collections.abc import Callable
from typing import Any

from tests.helpers.deadlines import scaled
from tests.helpers.forking import worker_context
from tests.helpers.ports import held_store


class WorkerError(AssertionError):
    """A worker process raised, crashed or timed out."""


PORT_WAIT = 60.0
"""How long a worker waits for the parent to send the store's port (on an idle machine: scaled)."""


def _worker(
    rank: int, world_size: int, ports: Any, fn: Callable[..., Any], args: tuple, env: dict, queue: Any
) -> None:
    wait = scaled(PORT_WAIT)
    if not ports.poll(wait):
        queue.put((rank, "error", f"the parent sent no store port within {wait:.0f}s"))
        return
    port = ports.recv()
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # every rank joins the parent's store as a client (torch's env:// rendezvous, as under torchrun)
            "TORCHELASTIC_USE_AGENT_STORE": "True",
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
    """Run ``fn(*args)`` on ``world_size`` processes; return their results ordered by rank.

    The group's store is hosted here, on a port it binds and holds from the moment it is chosen until the
    workers have ended (as torchrun's agent does): the workers are forked first (a fork must find this
    process without threads, and the store's server is one), then the store binds port 0, then each worker
    is sent its port and joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``). Choosing a free port and
    letting rank 0 bind it later raced with every other test and process of the machine.

    ``timeout`` is the wait on an idle machine; it is scaled by the load (:mod:`tests.helpers.deadlines`).
    """
    _import_before_fork()
    timeout = scaled(timeout)
    context = worker_context((fn, args))
    queue = context.Queue()
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        context.Process(
            target=_worker, args=(rank, world_size, pipes[rank][0], fn, args, env or {}, queue), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    stack = contextlib.ExitStack()
    try:
        store = stack.enter_context(held_store(world_size, timeout=max(timeout, 300.0)))
        for receive, send in pipes:
            receive.close()
            send.send(int(store["MASTER_PORT"]))
            send.close()
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
                timeout = min(timeout, scaled(15.0))  # the others are likely stuck waiting for this rank
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        stack.close()  # the store's server thread ends with it: the next fork finds no thread here
    if errors:
        first = min(errors)
        # the others' tracebacks too: a rank that lost its peer fails with gloo's "Connection closed by peer",
        # and the peer's own error (the cause) may be on a higher rank
        others = "".join(
            f"\n--- rank {r} of {world_size} also failed:\n{errors[r]}" for r in sorted(errors)[1:]
        )
        raise WorkerError(f"rank {first} of {world_size} failed:\n{errors[first]}{others}")
    return [results[r] for r in range(world_size)]
