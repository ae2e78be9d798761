"""SLURM: ``srun --ntasks-per-node=1 lockstep launch train.py``, one launcher per node.

What is read (an ``srun`` step's own variables first, then the job's):

- machines: ``SLURM_STEP_NUM_NODES``, ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``;
- this machine's rank: ``SLURM_NODEID``;
- machine 0: the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_NODELIST`` / ``SLURM_JOB_NODELIST``
  (compressed lists such as ``node[01-04,07]`` are expanded as ``scontrol show hostnames`` does), unless the
  job script exported ``MASTER_ADDR``;
- the port: ``MASTER_PORT`` if exported, else ``10000 + SLURM_JOB_ID % 20000`` (the same on every node);
- processes per machine: ``SLURM_GPUS_ON_NODE`` when SLURM gave GPUs; cores: ``SLURM_CPUS_ON_NODE``.

``SLURM_LAUNCH_NODE_IPADDR`` is not used for machine 0: it is the host ``srun`` ran on, which under ``salloc``
is a login node that runs no launcher.

Inside an ``srun`` step (``SLURM_STEP_ID`` set), tasks per node (``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``, else ``SLURM_NTASKS`` against the node count) tell one
launcher per node from one task per process: several launchers on a node would form separate jobs, so that
is refused. With one task per process, run ``srun python train.py`` instead: each process reads
``SLURM_PROCID``/``SLURM_NTASKS`` itself (``lockstep._env``), and no launcher is involved.

Outside a step, ``lockstep launch`` runs in the job's batch script, which SLURM starts once, on the first
node: fine for a job of one node (whatever ``--ntasks-per-node`` says), refused for several nodes, where the
others would never join.

As in Lightning, a job named ``bash`` or ``interactive`` (``srun --job-name=interactive --pty bash``) is not
read, so that a shell inside an allocation can launch by hand; ``--cluster none`` does the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lockstep.errors import UsageError
from lockstep.launcher.clusters._base import MASTER_ADDR, DetectedCluster, first_set, integer, main_port, text
from lockstep.launcher.clusters.hostlist import expand_hostlist

NAME, TITLE = "slurm", "SLURM"
JOB_ID, JOB_NAME, STEP_ID, NODEID = "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_STEP_ID", "SLURM_NODEID"
NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
GPUS_ON_NODE, CPUS_ON_NODE = "SLURM_GPUS_ON_NODE", "SLURM_CPUS_ON_NODE"
INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def detect(environ: Mapping[str, str]) -> bool:
    """A SLURM job that is not an interactive shell."""
    return text(environ, JOB_ID) is not None and environ.get(JOB_NAME) not in INTERACTIVE_JOB_NAMES


def read(environ: Mapping[str, str], hostname: str | None = None) -> DetectedCluster:
    """The job SLURM describes (``hostname`` is unused: SLURM numbers its nodes itself).

    Raises:
        UsageError: a malformed variable, several launchers per node, or a job of several nodes started
            from its batch script (no ``srun``), where only the first node would run.
    """
    sources: dict[str, str] = {}
    nodes_var, nodes_text = first_set(environ, *NODES) or ("SLURM_NNODES", "1")
    num_machines = integer(nodes_var, nodes_text, minimum=1)
    sources["num_machines"] = f"{nodes_var}={nodes_text}"
    values: dict[str, object] = {"num_machines": num_machines}
    if text(environ, STEP_ID) is not None:  # an srun step: its tasks are the launchers
        _check_one_task_per_node(environ, num_machines)
    elif num_machines > 1:
        raise UsageError(
            f"{nodes_var}={nodes_text} but {STEP_ID} is not set: this is the job's batch script, which runs "
            "on the first node only, so the other nodes would never join. Start one launcher per node with "
            "srun: srun --ntasks-per-node=1 lockstep launch train.py"
        )
    if num_machines > 1:
        values.update(_layout(environ, sources))
    gpus = text(environ, GPUS_ON_NODE)
    if gpus is not None and integer(GPUS_ON_NODE, gpus) > 0:
        values["processes_per_machine"] = int(gpus)
        sources["processes_per_machine"] = f"{GPUS_ON_NODE}={gpus}"
    cpus = text(environ, CPUS_ON_NODE)
    if cpus is not None:
        values["cpus_per_machine"] = integer(CPUS_ON_NODE, cpus, minimum=1)
        sources["cpus_per_machine"] = f"{CPUS_ON_NODE}={cpus}"
    return DetectedCluster(name=NAME, title=TITLE, sources=sources, **values)  # type: ignore[arg-type]


def _layout(environ: Mapping[str, str], sources: dict[str, str]) -> dict[str, object]:
    """Machine rank, main address and port of a job of several nodes."""
    rank_text = text(environ, NODEID)
    if rank_text is None:
        raise UsageError(
            f"{NODEID} is not set, so this node's rank in the SLURM job is unknown. Start lockstep launch "
            "with srun (srun --ntasks-per-node=1 lockstep launch ...), which sets it."
        )
    values: dict[str, object] = {"machine_rank": integer(NODEID, rank_text)}
    sources["machine_rank"] = f"{NODEID}={rank_text}"
    address = text(environ, MASTER_ADDR)
    if address is not None:
        values["main_address"], sources["main_address"] = address, f"{MASTER_ADDR}={address}"
    else:
        found = first_set(environ, *NODELISTS)
        if found is None:
            raise UsageError(
                f"none of {', '.join(NODELISTS)} is set, so the SLURM job's first node is unknown. Pass "
                "--main-process-ip (the first node's address) or export MASTER_ADDR."
            )
        try:
            values["main_address"] = expand_hostlist(found[1])[0]
        except ValueError as error:
            raise UsageError(f"{found[0]}: {error}") from None
        sources["main_address"] = f"first host of {found[0]}={found[1]}"
    port, source = main_port(environ, JOB_ID)
    if port is not None:
        values["main_port"], sources["main_port"] = port, source
    return values


def tasks_per_node(value: str) -> list[int]:
    """SLURM's per-node task counts: ``2(x3),1`` -> [2, 2, 2, 1].

    Example:
        >>> tasks_per_node("4(x2),1")
        [4, 4, 1]
    """
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(item)
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _check_one_task_per_node(environ: Mapping[str, str], num_machines: int) -> None:
    found = first_set(environ, *TASKS_PER_NODE)
    if found is not None:
        try:
            most = max(tasks_per_node(found[1]))
        except ValueError:
            raise UsageError(
                f"{found[0]}={found[1]!r} is invalid: SLURM writes task counts such as 4 or 2(x3),1."
            ) from None
        described = f"{found[0]}={found[1]}"
    else:
        tasks = first_set(environ, *TASKS)
        if tasks is None:
            return
        most = -(-integer(tasks[0], tasks[1], minimum=1) // num_machines)
        described = f"{tasks[0]}={tasks[1]} on {num_machines} node{'s' if num_machines > 1 else ''}"
    if most > 1:
        raise UsageError(
            f"SLURM started {most} tasks on a node ({described}), and each task runs lockstep launch: they "
            "would form separate jobs. Start one launcher per node "
            "(srun --ntasks-per-node=1 lockstep launch --num-processes TOTAL train.py), or let SLURM start "
            "every process (srun python train.py: each task is one process and reads SLURM_PROCID)."
        )
