"""SLURM: ``srun --ntasks-per-node=1 lockstep launch train.py``, one launcher per node, or
``srun python train.py``, one task per process.

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
is refused. With one task per process, run ``srun python train.py`` instead: each process reads its place
from the same variables (:meth:`SlurmCluster.process`), and no launcher is involved: its rank is
``SLURM_PROCID`` of the step's tasks (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``), the tasks on its node
are this node's entry (``SLURM_NODEID``) of the tasks per node above (``2(x3),1`` is 2, 2, 2 and 1), and
machine 0 and the port are the ones the launchers read.

Outside a step, ``lockstep launch`` runs in the job's batch script, which SLURM starts once, on the first
node: fine for a job of one node (whatever ``--ntasks-per-node`` says), refused for several nodes, where the
others would never join.

As in Lightning, a job named ``bash`` or ``interactive`` (``srun --job-name=interactive --pty bash``) is not
read, by the launcher or by a process, so that a shell inside an allocation can launch by hand (and a script
run there is one process); ``--cluster none`` does the same for the launcher.
"""

from __future__ import annotations

import re

from lockstep.clusters._variables import MASTER_ADDR, first_set, integer, main_port, text
from lockstep.clusters.base import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    Cluster,
    ClusterEnvironment,
    DetectedCluster,
)
from lockstep.clusters.hostlist import expand_hostlist
from lockstep.errors import UsageError

NAME, TITLE = "slurm", "SLURM"
JOB_ID, JOB_NAME, STEP_ID, NODEID = "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_STEP_ID", "SLURM_NODEID"
PROCID, LOCALID = "SLURM_PROCID", "SLURM_LOCALID"
NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
GPUS_ON_NODE, CPUS_ON_NODE = "SLURM_GPUS_ON_NODE", "SLURM_CPUS_ON_NODE"
INTERACTIVE_JOB_NAMES = ("bash", "interactive")


class SlurmCluster(Cluster):
    """A SLURM job (not an interactive shell): its launchers (``srun --ntasks-per-node=1 lockstep launch``)
    and its tasks (``srun python train.py``), read from the same parsing of SLURM's variables.

    Example:
        >>> task = {"SLURM_JOB_ID": "731", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
        ...         "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1",
        ...         "SLURM_NODELIST": "gpu[07-08]"}
        >>> place = SlurmCluster(task).process()
        >>> place.rank, place.world_size, place.local_world_size, place.master_addr, place.master_port
        (3, 4, 1, 'gpu07', 10731)
    """

    name, title, priority = NAME, TITLE, 40

    def machines(self) -> DetectedCluster | None:
        """The job as nodes, one launcher on each (``hostname`` is unused: SLURM numbers its nodes itself).

        Raises:
            UsageError: a malformed variable, several launchers per node, or a job of several nodes started
                from its batch script (no ``srun``), where only the first node would run.
        """
        if not self._in_job():
            return None
        nodes_var, nodes_text, num_machines = self._nodes()
        sources = {"num_machines": f"{nodes_var}={nodes_text}"}
        values: dict[str, object] = {"num_machines": num_machines}
        if text(self.environ, STEP_ID) is not None:  # an srun step: its tasks are the launchers
            self._check_one_task_per_node(num_machines)
        elif num_machines > 1:
            raise UsageError(
                f"{nodes_var}={nodes_text} but {STEP_ID} is not set: this is the job's batch script, which runs "
                "on the first node only, so the other nodes would never join. Start one launcher per node with "
                "srun: srun --ntasks-per-node=1 lockstep launch train.py"
            )
        if num_machines > 1:
            values.update(self._layout(sources))
        gpus = text(self.environ, GPUS_ON_NODE)
        if gpus is not None and integer(GPUS_ON_NODE, gpus) > 0:
            values["processes_per_machine"] = int(gpus)
            sources["processes_per_machine"] = f"{GPUS_ON_NODE}={gpus}"
        cpus = text(self.environ, CPUS_ON_NODE)
        if cpus is not None:
            values["cpus_per_machine"] = integer(CPUS_ON_NODE, cpus, minimum=1)
            sources["cpus_per_machine"] = f"{CPUS_ON_NODE}={cpus}"
        return DetectedCluster(name=NAME, title=TITLE, sources=sources, **values)  # type: ignore[arg-type]

    def process(self) -> ClusterEnvironment | None:
        """This task's place in the step (``SLURM_PROCID`` of the step's tasks); None outside a task.

        The tasks on this node are its entry (``SLURM_NODEID``) of the step's tasks per node, machine 0 and
        the port are what the launchers' view reads (the first node of the step, the job's port).

        Raises:
            UsageError: a malformed variable, or uneven tasks per node without ``SLURM_NODEID``.
        """
        rank_text, tasks = text(self.environ, PROCID), first_set(self.environ, *TASKS)
        if not self._in_job() or rank_text is None or tasks is None:
            return None
        world_size = integer(tasks[0], tasks[1], minimum=1)
        local_text = text(self.environ, LOCALID)
        address = self._main_address()
        port, _ = main_port(self.environ, JOB_ID)
        return ClusterEnvironment(
            source=NAME,
            rank=integer(PROCID, rank_text),
            local_rank=0 if local_text is None else integer(LOCALID, local_text),
            world_size=world_size,
            local_world_size=self._tasks_on_this_node(world_size),
            master_addr=DEFAULT_MASTER_ADDR if address is None else address[0],
            master_port=DEFAULT_MASTER_PORT if port is None else port,
        )

    def _in_job(self) -> bool:
        """A SLURM job that is not an interactive shell."""
        return (
            text(self.environ, JOB_ID) is not None and self.environ.get(JOB_NAME) not in INTERACTIVE_JOB_NAMES
        )

    def _nodes(self) -> tuple[str, str, int]:
        """(variable, value, count) of the nodes: the step's, else the job's; 1 when none is set."""
        nodes_var, nodes_text = first_set(self.environ, *NODES) or ("SLURM_NNODES", "1")
        return nodes_var, nodes_text, integer(nodes_var, nodes_text, minimum=1)

    def _main_address(self) -> tuple[str, str] | None:
        """(address, source) of machine 0: ``MASTER_ADDR`` if exported, else the first host of the step's
        node list (else the job's); None when neither is set.

        Raises:
            UsageError: a node list that is not one.
        """
        address = text(self.environ, MASTER_ADDR)
        if address is not None:
            return address, f"{MASTER_ADDR}={address}"
        found = first_set(self.environ, *NODELISTS)
        if found is None:
            return None
        try:
            first = expand_hostlist(found[1])[0]
        except ValueError as error:
            raise UsageError(f"{found[0]}: {error}") from None
        return first, f"first host of {found[0]}={found[1]}"

    def _task_counts(self) -> tuple[list[int], str] | None:
        """The tasks on each node (the step's, else the job's, else ``--ntasks-per-node``), and where they
        came from; None when SLURM gave none of them.

        Raises:
            UsageError: a value that is not SLURM's task-count syntax.
        """
        found = first_set(self.environ, *TASKS_PER_NODE)
        if found is None:
            return None
        try:
            return tasks_per_node(found[1]), f"{found[0]}={found[1]}"
        except ValueError:
            raise UsageError(
                f"{found[0]}={found[1]!r} is invalid: SLURM writes task counts such as 4 or 2(x3),1."
            ) from None

    def _tasks_on_this_node(self, world_size: int) -> int:
        """The tasks SLURM placed on this node: this node's entry of the tasks per node, else the tasks
        spread evenly over the nodes."""
        counts = self._task_counts()
        _, _, num_nodes = self._nodes()
        if counts is None:
            return -(-world_size // num_nodes)
        per_node, described = counts
        node_text = text(self.environ, NODEID)
        if node_text is not None and len(per_node) > 1:
            node = integer(NODEID, node_text)
            if node >= len(per_node):
                raise UsageError(
                    f"{NODEID}={node_text} is impossible with {described} ({len(per_node)} nodes). Check how "
                    "the job was started."
                )
            return per_node[node]
        if len(set(per_node)) > 1:
            raise UsageError(
                f"{described} gives the nodes different task counts, and {NODEID} is not set, so this node's "
                "count is unknown. Start the processes with srun, which sets it."
            )
        return per_node[0]

    def _layout(self, sources: dict[str, str]) -> dict[str, object]:
        """Machine rank, main address and port of a job of several nodes."""
        rank_text = text(self.environ, NODEID)
        if rank_text is None:
            raise UsageError(
                f"{NODEID} is not set, so this node's rank in the SLURM job is unknown. Start lockstep launch "
                "with srun (srun --ntasks-per-node=1 lockstep launch ...), which sets it."
            )
        values: dict[str, object] = {"machine_rank": integer(NODEID, rank_text)}
        sources["machine_rank"] = f"{NODEID}={rank_text}"
        address = self._main_address()
        if address is None:
            raise UsageError(
                f"none of {', '.join(NODELISTS)} is set, so the SLURM job's first node is unknown. Pass "
                "--main-process-ip (the first node's address) or export MASTER_ADDR."
            )
        values["main_address"], sources["main_address"] = address
        port, source = main_port(self.environ, JOB_ID)
        if port is not None:
            values["main_port"], sources["main_port"] = port, source
        return values

    def _check_one_task_per_node(self, num_machines: int) -> None:
        counts = self._task_counts()
        if counts is not None:
            most, described = max(counts[0]), counts[1]
        else:
            tasks = first_set(self.environ, *TASKS)
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
