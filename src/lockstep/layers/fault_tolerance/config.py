"""``FaultToleranceConfig``: which replica group this job is, and which lighthouse keeps the quorum.

Torch-free: the launcher and the config file read it without importing torch or torchft.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The variable torchft's own launchers set to the lighthouse's address; read when ``lighthouse`` is None."""


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Train as one replica group of a fault-tolerant job: gradients are averaged across the live groups of
    each step (torchft's per-step quorum), and a group that dies leaves the others stepping.

    Each replica group is an ordinary lockstep job (one process, or several with DDP or FSDP2 inside the
    group); start one per group with its own ``replica_group``,
    all pointing at the same lighthouse (``torchft_lighthouse --min_replicas 1 --bind [::]:29510``, or
    ``torchft.coordination.LighthouseServer`` from Python).

    Example:
        >>> config = FaultToleranceConfig(replica_group=0, num_replica_groups=2, lighthouse="http://127.0.0.1:29510")
        >>> config.replica_id
        'lockstep_replica_0'
        >>> FaultToleranceConfig(replica_group=0, num_replica_groups=2, min_replicas=3)
        Traceback (most recent call last):
        ...
        ValueError: FaultToleranceConfig(min_replicas=3, num_replica_groups=2) is invalid: a step needs min_replicas live groups, and only 2 exist, so no step could ever commit. Pass min_replicas <= 2.
    """

    replica_group: int
    """This job's replica group, from 0 (each group is a separate lockstep job)."""
    num_replica_groups: int
    """How many replica groups the job starts with (each step's batches are dealt over the groups of that step)."""
    min_replicas: int = 1
    """Live groups a step needs to commit; a step with fewer is discarded and retried."""
    lighthouse: str | None = None
    """The lighthouse's address (``http://host:port``); None: the ``TORCHFT_LIGHTHOUSE`` variable."""
    hostname: str | None = None
    """The name other groups reach this one by (its quorum server and store); None: this machine's name."""
    timeout: float = 30.0
    """Seconds to reach the lighthouse, form a quorum, or finish a cross-group all-reduce before an error."""

    def __post_init__(self) -> None:
        _check_int("replica_group", self.replica_group, minimum=0)
        _check_int("min_replicas", self.min_replicas, minimum=1)
        _check_int("num_replica_groups", self.num_replica_groups, minimum=1)
        self._check_against_groups(self.num_replica_groups)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float):
            raise TypeError(f"FaultToleranceConfig(timeout={self.timeout!r}) must be a number of seconds.")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(
                f"FaultToleranceConfig(timeout={self.timeout!r}) is invalid: it must be a positive, finite "
                "number of seconds (an unbounded wait would hang on a lost lighthouse)."
            )
        if self.lighthouse is not None and (not isinstance(self.lighthouse, str) or not self.lighthouse):
            raise ValueError(
                f"FaultToleranceConfig(lighthouse={self.lighthouse!r}) is invalid: pass the lighthouse's "
                "address as a string such as 'http://10.0.0.1:29510'."
            )

    def _check_against_groups(self, groups: int) -> None:
        if self.min_replicas > groups:
            raise ValueError(
                f"FaultToleranceConfig(min_replicas={self.min_replicas}, num_replica_groups={groups}) is "
                f"invalid: a step needs min_replicas live groups, and only {groups} exist, so no step could "
                f"ever commit. Pass min_replicas <= {groups}."
            )
        if self.replica_group >= groups:
            raise ValueError(
                f"FaultToleranceConfig(replica_group={self.replica_group}, num_replica_groups={groups}) is "
                f"invalid: groups are numbered 0 to {groups - 1}."
            )

    @property
    def replica_id(self) -> str:
        """The name this group registers under at the lighthouse (torchft adds a fresh suffix per start)."""
        return f"lockstep_replica_{self.replica_group}"

    def lighthouse_address(self) -> str:
        """The lighthouse to join: the given address, else ``TORCHFT_LIGHTHOUSE``.

        Raises:
            ValueError: neither is set.
        """
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                "FaultToleranceConfig(lighthouse=None) found no lighthouse: TORCHFT_LIGHTHOUSE is not set "
                "either. Start one (torchft_lighthouse --min_replicas 1 --bind [::]:29510) and pass "
                "lighthouse='http://<host>:29510'."
            )
        return address


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"FaultToleranceConfig({name}={value!r}) must be an int.")
    if value < minimum:
        raise ValueError(f"FaultToleranceConfig({name}={value}) is invalid: it must be >= {minimum}.")
