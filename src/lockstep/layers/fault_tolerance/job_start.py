"""One history for the whole job, whatever order and delay its replica groups start in.

torchft heals a group whose step count is below the quorum's highest from a group at that step, and takes
groups at equal step counts to hold equal weights. That holds while every group descends from one start. It
breaks when two quorums each start from step 0: a group that starts first and trains alone, then two late
groups that form a quorum of their own while it is busy, make two histories that later meet at equal step
counts with different weights, and neither heals (seen with 3 groups started a few seconds apart: batch 0
trained twice, the final model 5.7e-3 from a replay of the committed steps).

So a group that starts at step 0 (nothing committed, nothing received from a peer) follows two rules, read
from the lighthouse's status page (torchft's dashboard, ``GET /status``):

1. **It waits for the others.** Before its first quorum it waits until the lighthouse sees every one of the
   job's ``num_replica_groups`` groups (each heartbeats from its start), until another group already asks
   for a quorum, or until the job already has a history (the lighthouse's last quorum stood past step 0).
   Then a quorum of groups that all stand at step 0 trains only with every group of the job in it; until
   then its groups ask again (a group is up a while before it asks: it builds its model and loaders). After
   ``FaultToleranceConfig(timeout=...)`` seconds it trains with the groups that are up, and a group that
   comes later heals from them before its first batch.
2. **It never starts a second history.** A quorum of groups at step 0 trains only when none of them saw a
   history at the lighthouse when it started. Otherwise they train nothing and ask again, until a group
   holding the history joins them and they heal from it; after ``timeout`` seconds without one,
   :class:`~lockstep.errors.ReplicaQuorumError` says that the groups holding the history have ended or are
   lost.

The groups of a quorum decide alike: process 0 of each reads the lighthouse and votes, the votes meet in one
all-reduce over the quorum (maximum of the history steps seen and of the windows run out), and each group's
process 0 tells its other processes.

A group whose status page cannot be read (a lighthouse behind a gRPC-only proxy) skips both rules, with a
warning: it behaves as torchft alone does.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import torch
import torch.distributed as dist

from lockstep.errors import ReplicaQuorumError

logger = logging.getLogger("lockstep.layers")
POLL_SECONDS = 0.05
"""How often a starting group reads the lighthouse's status page, and how long it waits before asking again
for a quorum that may not train."""

_PREVIOUS_QUORUM = re.compile(r"<h3>Previous Quorum</h3>(?P<section>.*?)<h2>Heartbeats</h2>", re.DOTALL)
_STEP = re.compile(r"Step:\s*(-?\d+)")
_HEARTBEAT = re.compile(r'<li class="heartbeat(?P<flags>[^"]*)">\s*(?P<replica>[^\s<]+?): seen')
_ASKING = re.compile(r"\[(\d+)/\d+ participants healthy\]")
_GROUP = re.compile(r"^lockstep_replica_(\d+):")


@dataclass(frozen=True)
class LighthouseView:
    """What the lighthouse's status page says about the job.

    Attributes:
        history_step: the highest step of the lighthouse's last quorum (0 when it has none yet).
        live_groups: the replica groups whose heartbeat is fresh.
        asking: the groups waiting for a quorum now.
    """

    history_step: int
    live_groups: frozenset[int]
    asking: int


def parse_status(page: str) -> LighthouseView:
    """The :class:`LighthouseView` of torchft's status page (``templates/status.html``)."""
    previous = _PREVIOUS_QUORUM.search(page)
    steps = [int(step) for step in _STEP.findall(previous.group("section"))] if previous else []
    live = set()
    for heartbeat in _HEARTBEAT.finditer(page):
        group = _GROUP.match(heartbeat.group("replica"))
        if group is not None and "old" not in heartbeat.group("flags"):
            live.add(int(group.group(1)))
    asking = _ASKING.search(page)
    return LighthouseView(
        history_step=max([0, *steps]),
        live_groups=frozenset(live),
        asking=int(asking.group(1)) if asking else 0,
    )


def read_lighthouse(address: str, timeout: float) -> LighthouseView | None:
    """The lighthouse's view of the job; None when its status page cannot be read or parsed."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as response:
            page = response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    if "Next quorum status" not in page:
        return None
    return parse_status(page)


@final
class JobStart:
    """The two start rules (module doc) for one process of a replica group.

    Args:
        group: this replica group's number.
        groups: the job's replica groups (``num_replica_groups``).
        address: the lighthouse's address.
        timeout: seconds to wait for the others under each rule.
        process: this process's index in its group (rank 0 reads the lighthouse and tells the others).
        processes: the processes of the group.
        read: reads the lighthouse (a parameter for unit tests).
    """

    def __init__(
        self,
        *,
        group: int,
        groups: int,
        address: str,
        timeout: float,
        process: int = 0,
        processes: int = 1,
        read: Callable[[str, float], LighthouseView | None] = read_lighthouse,
    ) -> None:
        self.group, self.groups, self.address, self.timeout = group, groups, address, timeout
        self.process, self.processes = process, processes
        self._read = read
        self.history_step: int | None = None
        """The job's history step seen at the lighthouse when this group started (None: not read yet)."""
        self._window_ends: float | None = None
        self._history_deadline: float | None = None

    def wait_for_groups(self) -> None:
        """Rule 1, before the first quorum of a group at step 0 (every process of the group calls it); starts
        the window within which the job's first quorum waits for every group."""
        self._window_ends = time.monotonic() + self.timeout
        self.history_step = int(self._for_the_group(self._poll))

    def _for_the_group(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on the group's process 0, its answer on every process of the group (so that they act
        alike whatever their clocks say)."""
        answer: list[Any] = [decide() if self.process == 0 else None]
        if self.processes > 1:
            dist.broadcast_object_list(answer, src=0)
        return answer[0]

    def _poll(self) -> int:
        assert self._window_ends is not None
        while True:
            view = self._read(self.address, min(self.timeout, 5.0))
            if view is None:
                logger.warning(
                    "replica group %d could not read the status page of the torchft lighthouse at %s, so it "
                    "cannot check that the job's groups start as one history: it joins the quorum as torchft "
                    "alone does",
                    self.group,
                    self.address,
                )
                return 0
            everyone = set(range(self.groups)) <= view.live_groups
            if everyone or view.asking > 0 or view.history_step > 0 or time.monotonic() >= self._window_ends:
                return view.history_step
            time.sleep(POLL_SECONDS)

    def may_ask(self, *, training: bool) -> bool:
        """Before a quorum while this group stands at step 0 (every process calls it): whether to ask for one.
        A group that saw a history at the lighthouse and finds no other group alive there has nothing to heal
        from: ``prepare``'s quorum is skipped (the group may still resume from a checkpoint), and a training
        step ends the process (see :meth:`may_train`)."""
        if not self.history_step:
            return True
        alone = self._for_the_group(self._alone_at_lighthouse)
        if alone and training:
            self._end(self.history_step)
        return not alone

    def no_quorum(self, *, training: bool) -> bool:
        """After a quorum request of a group at step 0 timed out (every process calls it): True to go on
        without a quorum (``prepare``), when the job has a history and no other group is alive at the
        lighthouse (they ended while this group started: their heartbeats were still fresh when it asked); a
        training step ends the process then. False: the timeout is an error."""
        if not self.history_step or not self._for_the_group(self._alone_at_lighthouse):
            return False
        if training:
            self._end(self.history_step)
        return True

    def _alone_at_lighthouse(self) -> bool:
        view = self._read(self.address, min(self.timeout, 5.0))
        return view is not None and not (view.live_groups - {self.group})

    def _end(self, history: int) -> None:
        logger.warning(
            "replica group %d started at step 0 after the job's history ended: the lighthouse's last quorum "
            "stood at step %d and no other replica group is alive (they have ended, or are lost: their own "
            "launches say which). It has no live group to heal from and trained nothing, so it exits now (exit "
            "code 0) rather than start a second history.",
            self.group,
            history,
        )
        raise SystemExit(0)

    def may_train(self, manager: Any, *, training: bool = True) -> bool | None:
        """Rules 1 and 2 after each quorum while this group stands at step 0 (every process calls it).

        Args:
            manager: this process's torchft manager, right after its quorum.
            training: the quorum is a training step's; False for the one ``prepare`` joins, where a group
                that only found groups at step 0 while the job has a history does not wait: it may still
                resume from a checkpoint, and its first training step asks again.

        Returns:
            True: the step may train. False: ask for a quorum again. None (``training=False`` only): go on
            without training; the first training step asks again.

        Raises:
            ReplicaQuorumError: no group holding the job's history joined within ``timeout`` seconds.
            SystemExit: (code 0) the job's history has ended: no other group is alive at the lighthouse.
        """
        if manager.current_step() > 0:  # it stands in the history (healed, or resumed from a checkpoint)
            return True
        if self._window_ends is None:
            self._window_ends = time.monotonic() + self.timeout
        verdict, history = self._for_the_group(lambda: self._verdict(manager))
        if verdict == "train":
            return True
        if history > 0 and not training:
            return None
        if verdict == "ended":
            self._end(history)
        if history > 0:
            self._wait_for_history(history)
        time.sleep(POLL_SECONDS)
        return False

    def _verdict(self, manager: Any) -> tuple[str, int]:
        """``train``, ``wait`` or ``ended``, and the history step any group of the quorum saw (on the group's
        process 0 only: the quorum's processes 0 agree through one all-reduce)."""
        assert self._window_ends is not None
        over = time.monotonic() >= self._window_ends
        votes = torch.tensor([float(self.history_step or 0), float(over)])
        manager.allreduce(votes, reduce_op=dist.ReduceOp.MAX).wait()
        if manager.errored() is not None:  # a group of the quorum was lost meanwhile: ask again
            return "wait", 0
        history, over = int(votes[0].item()), bool(votes[1].item())
        if history > 0:
            return ("ended" if self._alone_at_lighthouse() else "wait"), history
        participants = manager.num_participants()
        if participants >= self.groups:
            return "train", 0
        if over:
            logger.warning(
                "replica group %d starts the job with %d of its %d replica groups, after waiting %g s for the "
                "others: they will heal from these when they join",
                self.group,
                participants,
                self.groups,
                self.timeout,
            )
            return "train", 0
        return "wait", 0

    def _wait_for_history(self, history: int) -> None:
        now = time.monotonic()
        if self._history_deadline is None:
            self._history_deadline = now + self.timeout
            logger.info(
                "replica group %d waits for a group that holds the job's history (step %d at the lighthouse) "
                "before it trains",
                self.group,
                history,
            )
        if now >= self._history_deadline:
            raise ReplicaQuorumError(
                f"Replica group {self.group} started at step 0 in a job whose history stands at step {history} "
                f"(the torchft lighthouse at {self.address}), and no live group holding that history joined its "
                f"quorum within {self.timeout:g} s: the other groups have ended or are lost. It trained "
                "nothing, so no second history began. To continue the job, restart every group from its last "
                "checkpoint (accelerator.resume_from_latest_checkpoint())."
            )
