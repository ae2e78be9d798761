"""Telling the other ranks about a hang, through the process group's key-value store.

The store (a TCP store held by the launcher or rank 0) keeps answering while every rank is blocked
in a collective, so the ranks use it to agree that a hang is being diagnosed, to hand each other their
reports and to say when the summary is out. Every call is non-blocking or bounded: a rank never waits
on the store longer than the grace period it was given. When the store itself is gone, each method
degrades to "nothing heard" and the rank reports alone.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

_PREFIX = "lockstep_hang/"
_FLAG = _PREFIX + "flag"
_COUNT = _PREFIX + "count"
_DONE = _PREFIX + "done"
_POLL = 0.05


class PeerExchange:
    """Hang coordination for one rank.

    Args:
        store: a ``torch.distributed.Store`` shared by every rank of the job.
        rank: this rank.
        world_size: the number of ranks.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def for_default_group(cls) -> PeerExchange | None:
        """The exchange over the default process group's store, or None when there is none."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_initialized():
            return None
        try:
            store = distributed_c10d._get_default_store()
        except Exception as error:  # a group built without a store (e.g. MPI)
            logger.debug("no store for hang reports: %s", error)
            return None
        return cls(store, dist.get_rank(), dist.get_world_size())

    def raise_flag(self, reason: str) -> str:
        """Announce a hang; returns the reason of whichever rank announced first."""
        try:
            return self.store.compare_set(_FLAG, "", reason).decode()
        except Exception as error:
            logger.debug("could not raise the hang flag: %s", error)
            return reason

    def flag(self) -> str | None:
        """The reason another rank gave for a hang, or None when nobody announced one."""
        try:
            if self.store.check([_FLAG]):
                return self.store.get(_FLAG).decode()
        except Exception as error:
            logger.debug("could not read the hang flag: %s", error)
        return None

    def publish(self, report: dict[str, Any]) -> None:
        try:
            self.store.set(f"{_PREFIX}report/{self.rank}", json.dumps(report))
            self.store.add(_COUNT, 1)
        except Exception as error:
            logger.debug("could not publish the hang report: %s", error)

    def collect(self, grace: float) -> dict[int, dict[str, Any]]:
        """Every rank's report, waiting at most ``grace`` seconds for the ones not in yet."""
        deadline = time.monotonic() + grace
        try:
            while self.store.add(_COUNT, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(_POLL)
            reports = {}
            for rank in range(self.world_size):
                key = f"{_PREFIX}report/{rank}"
                if self.store.check([key]):
                    reports[rank] = json.loads(self.store.get(key))
            return reports
        except Exception as error:
            logger.debug("could not collect hang reports: %s", error)
            return {}

    def mark_done(self) -> None:
        try:
            self.store.set(_DONE, "1")
        except Exception as error:
            logger.debug("could not mark the hang summary done: %s", error)

    def wait_done(self, timeout: float) -> bool:
        """Wait until the reporting rank has printed the summary (so it is not stopped before it does)."""
        deadline = time.monotonic() + timeout
        try:
            while not self.store.check([_DONE]):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL)
            return True
        except Exception as error:
            logger.debug("could not wait for the hang summary: %s", error)
            return False
