"""IBM Spectrum LSF: one launcher per host (``blaunch``, or ``jsrun`` with one resource set per host).

Under ``jsrun``, ``JSM_NAMESPACE_SIZE`` / ``JSM_NAMESPACE_RANK`` number the launchers and
``JSM_NAMESPACE_LOCAL_SIZE`` says how many run on this host; machine 0 is the first compute host of
``LSB_DJOB_RANKFILE`` (whose first line is the launch node, as Lightning's ``LSFEnvironment`` reads it).
Otherwise the hosts are those of ``LSB_DJOB_HOSTFILE`` (one line per slot), else ``LSB_MCPU_HOSTS``
(``hostA 4 hostB 4``), else ``LSB_HOSTS``; this machine's rank is the position of its host name among them.
The port is ``MASTER_PORT`` if exported, else ``10000 + LSB_JOBID % 20000``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.clusters._variables import (
    MASTER_ADDR,
    LauncherNumbering,
    host_layout,
    main_port,
    numbered_launchers,
    read_host_file,
    text,
    unique_hosts,
)
from lockstep.clusters.base import Cluster, DetectedCluster
from lockstep.errors import UsageError

NAME, TITLE = "lsf", "LSF"
JOB_ID, HOSTFILE, RANKFILE = "LSB_JOBID", "LSB_DJOB_HOSTFILE", "LSB_DJOB_RANKFILE"
MCPU_HOSTS, HOSTS = "LSB_MCPU_HOSTS", "LSB_HOSTS"
JSRUN = LauncherNumbering(
    "jsrun",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_RANK",
    "JSM_NAMESPACE_LOCAL_SIZE",
    "jsrun -r 1 lockstep launch ...",
)


class LsfCluster(Cluster):
    """An LSF job: its launchers, one per host (LSF's tasks are not read as processes)."""

    name, title, priority = NAME, TITLE, 50

    def machines(self) -> DetectedCluster | None:
        """The job LSF describes; ``hostname`` (default: this machine's) places this machine among its hosts.

        Raises:
            UsageError: a malformed variable, an unreadable host file, no host list at all, or several
                launchers on one host under ``jsrun``.
        """
        if text(self.environ, JOB_ID) is None:
            return None
        if text(self.environ, JSRUN.size) is not None:
            values, sources, missing = _read_jsrun(self.environ)
        else:
            hosts, described = _hosts(self.environ)
            values, sources, missing = host_layout(hosts, described, self.hostname, self.environ)
        if values["num_machines"] > 1:
            port, source = main_port(self.environ, JOB_ID)
            values["main_port"], sources["main_port"] = port, source
        return DetectedCluster(name=NAME, title=TITLE, sources=sources, missing=missing, **values)


def _hosts(environ: Mapping[str, str]) -> tuple[list[str], str]:
    path = text(environ, HOSTFILE)
    if path is not None:
        return read_host_file(HOSTFILE, path), f"{HOSTFILE}={path}"
    mcpu = text(environ, MCPU_HOSTS)
    if mcpu is not None:
        return mcpu.split()[::2], f"{MCPU_HOSTS}={mcpu}"
    hosts = text(environ, HOSTS)
    if hosts is not None:
        return hosts.split(), f"{HOSTS}={hosts}"
    raise UsageError(
        f"{JOB_ID} is set but none of {HOSTFILE}, {MCPU_HOSTS}, {HOSTS} is, so the LSF job's hosts are "
        "unknown. Pass --num-machines, --machine-rank and --main-process-ip, or --cluster none."
    )


def _read_jsrun(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    values, sources, missing = numbered_launchers(environ, JSRUN)
    rankfile = text(environ, RANKFILE)
    if "main_address" not in values and rankfile is not None:
        compute_hosts = unique_hosts(read_host_file(RANKFILE, rankfile)[1:])  # line 1: the launch node
        if compute_hosts:
            values["main_address"] = compute_hosts[0]
            sources["main_address"] = f"first compute host in {RANKFILE}={rankfile}"
    if "main_address" not in values:
        missing["main_address"] = f"neither {MASTER_ADDR} nor {RANKFILE} names it; pass --main-process-ip"
    return values, sources, missing
