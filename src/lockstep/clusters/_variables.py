"""The small readers every cluster environment shares: a variable as text or a number, the port a job id
implies, host files and host lists, launchers numbered by a process launcher."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.errors import UsageError

JOB_PORT_BASE = 10000
JOB_PORT_SPAN = 20000
"""A port derived from a job id lies in ``[10000, 30000)``: above the well-known ports, below Linux's
ephemeral range (32768+), so no machine's outgoing connections take it first."""
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
"""torch's variables: when a job script exports them, they win over what the scheduler implies."""


def text(environ: Mapping[str, str], name: str) -> str | None:
    """A variable's value with surrounding blanks removed; None when unset or empty."""
    value = environ.get(name, "").strip()
    return value or None


def first_set(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set: (name, value)."""
    for name in names:
        value = text(environ, name)
        if value is not None:
            return name, value
    return None


def integer(name: str, value: str, *, minimum: int = 0) -> int:
    """``value`` of variable ``name`` as an integer >= ``minimum``.

    Raises:
        UsageError: naming the variable and its value.
    """
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise UsageError(
            f"{name}={value!r} is invalid: it must be an integer >= {minimum}. It is set by the cluster's "
            "scheduler or launcher: correct or unset it, or check how the job was started."
        )
    return number


def job_port(variable: str, job_id: str) -> tuple[int, str]:
    """The rendezvous port every machine of a job derives from its id: ``10000 + id % 20000``.

    Ids such as PBS's ``1234.server`` or ``1234[5].server`` count by their leading digits.

    Example:
        >>> job_port("SLURM_JOB_ID", "4242123")
        (12123, 'derived from SLURM_JOB_ID=4242123: 10000 + id % 20000')
    """
    digits = job_id[: len(job_id) - len(job_id.lstrip("0123456789"))]
    if not digits:
        raise UsageError(
            f"{variable}={job_id!r} does not start with a number, so no port can be derived from it. "
            "Pass --main-process-port (the same on every machine) or export MASTER_PORT."
        )
    port = JOB_PORT_BASE + int(digits) % JOB_PORT_SPAN
    return port, f"derived from {variable}={job_id}: {JOB_PORT_BASE} + id % {JOB_PORT_SPAN}"


def main_port(environ: Mapping[str, str], job_variable: str | None) -> tuple[int | None, str]:
    """``MASTER_PORT`` when the job script exported it, else the port derived from the job id."""
    given = text(environ, MASTER_PORT)
    if given is not None:
        return integer(MASTER_PORT, given, minimum=1), f"{MASTER_PORT}={given}"
    job_id = text(environ, job_variable) if job_variable else None
    if job_id is None:
        return None, ""
    return job_port(job_variable or "", job_id)


def unique_hosts(hosts: list[str]) -> list[str]:
    """Hosts in order of first appearance (host files list a host once per slot)."""
    return list(dict.fromkeys(host for host in hosts if host))


def read_host_file(variable: str, path: str) -> list[str]:
    """The host of each line of a scheduler's host file (``LSB_DJOB_HOSTFILE``, ``PBS_NODEFILE``).

    Raises:
        UsageError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as file:
            return [line.split()[0] for line in file if line.strip()]
    except OSError as error:
        raise UsageError(
            f"{variable}={path!r} cannot be read ({error.strerror}); the scheduler writes this file on the "
            "job's first node: run lockstep launch inside the job, or pass --num-machines and --machine-rank."
        ) from None


def host_rank(hosts: list[str], hostname: str | None) -> int | None:
    """This machine's position among the job's hosts, matched by full or short name; None if absent."""
    hostname = hostname or _hostname()
    for candidate in (hostname, hostname.split(".")[0]):
        for rank, host in enumerate(hosts):
            if candidate in (host, host.split(".")[0]):
                return rank
    return None


def _hostname() -> str:
    import socket

    return socket.gethostname()


def host_layout(
    hosts: list[str], described: str, hostname: str | None, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """Values, sources and missing-value hints of a job given as its list of hosts (one launcher each):
    machine 0 is the first host (unless ``MASTER_ADDR`` is exported), this machine's rank is the position of
    its host name."""
    machines = unique_hosts(hosts)
    if not machines:
        raise UsageError(f"{described} lists no host; the scheduler writes it: run inside the job.")
    values: dict[str, Any] = {"num_machines": len(machines)}
    sources = {"num_machines": f"hosts in {described}"}
    missing: dict[str, str] = {}
    if len(machines) == 1:
        return values, sources, missing
    address = text(environ, MASTER_ADDR)
    values["main_address"] = address or machines[0]
    sources["main_address"] = f"{MASTER_ADDR}={address}" if address else f"first host in {described}"
    name = hostname or _hostname()
    rank = host_rank(machines, name)
    if rank is None:
        missing["machine_rank"] = (
            f"this machine's name {name!r} is not among the hosts in {described} "
            f"({', '.join(machines[:4])}{', ...' if len(machines) > 4 else ''}); pass --machine-rank"
        )
    else:
        values["machine_rank"] = rank
        sources["machine_rank"] = f"position of this host ({name}) in {described}"
    return values, sources, missing


@dataclass(frozen=True)
class LauncherNumbering:
    """The variables a process launcher (mpirun, jsrun) numbers its copies of ``lockstep launch`` with."""

    tool: str
    """How the refusal names the launcher: ``mpirun``, ``jsrun``."""
    size: str
    """Copies in the job: the machine count."""
    rank: str
    """This copy's number: the machine rank."""
    local_size: str
    """Copies on this host: more than one would form separate jobs."""
    one_per_host: str
    """The command line that starts one copy per host."""


def numbered_launchers(
    environ: Mapping[str, str], numbering: LauncherNumbering
) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """Values, sources and missing-value hints of a job whose launchers a process launcher numbered: its
    size is the machine count, its rank the machine rank, and the main address is ``MASTER_ADDR`` if
    exported (the caller may find it elsewhere).

    Raises:
        UsageError: a malformed variable, or several copies on this host.
    """
    size, rank, local = (
        text(environ, name) for name in (numbering.size, numbering.rank, numbering.local_size)
    )
    if local is not None and integer(numbering.local_size, local, minimum=1) > 1:
        raise UsageError(
            f"{numbering.tool} started {local} copies of lockstep launch on this host ({numbering.local_size}"
            f"={local}): they would form separate jobs. Start one per host ({numbering.one_per_host}), or let "
            f"{numbering.tool} start every process ({numbering.tool} ... python train.py)."
        )
    values: dict[str, Any] = {"num_machines": integer(numbering.size, size or "", minimum=1)}
    sources = {"num_machines": f"{numbering.size}={size}"}
    missing: dict[str, str] = {}
    if rank is not None:
        values["machine_rank"] = integer(numbering.rank, rank)
        sources["machine_rank"] = f"{numbering.rank}={rank}"
    address = text(environ, MASTER_ADDR)
    if address is not None:
        values["main_address"], sources["main_address"] = address, f"{MASTER_ADDR}={address}"
    return values, sources, missing
