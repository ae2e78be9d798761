"""What a starting replica group reads at the lighthouse (lockstep.layers.fault_tolerance.job_start), against
torchft's real lighthouse and its status page; and the training state a returning group receives for objects
it registers after ``prepare`` (lockstep.accelerator.live_state). The start rules themselves, with groups
started apart and a group killed and relaunched: tests/e2e/test_fault_tolerance_one_history.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.live_state import LiveTrainingState
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.layers.fault_tolerance.job_start import read_lighthouse
from lockstep.state import GradientState

pytest.importorskip("torchft")


def test_the_lighthouse_view_names_live_groups_the_history_step_and_who_asks() -> None:
    from torchft._torchft import LighthouseClient
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=60_000)
    try:
        address = server.address()
        view = read_lighthouse(address, 5)
        assert view is not None and (view.history_step, view.live_groups, view.asking) == (0, frozenset(), 0)
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        quorum = client.quorum(  # a group's quorum at step 7 (it asks alone: the only group heartbeating)
            replica_id="lockstep_replica_0:9a1b",
            timeout=timedelta(seconds=5),
            address="http://127.0.0.1:1",
            store_address="127.0.0.1:2",
            step=7,
            world_size=1,
            shrink_only=False,
        )
        assert [member.step for member in quorum.participants] == [7]
        client.heartbeat("lockstep_replica_2:5f0c")
        client.heartbeat("someone_else:1")  # not a lockstep group
        view = read_lighthouse(address, 5)
        assert view is not None and (view.history_step, view.live_groups, view.asking) == (7, {0, 2}, 0)
    finally:
        server.shutdown()


def test_an_address_that_is_not_a_lighthouse_reads_as_none() -> None:
    with socket.socket() as listener:  # bound, not listening: connections are refused
        listener.bind(("127.0.0.1", 0))
        assert read_lighthouse(f"http://127.0.0.1:{listener.getsockname()[1]}", 2) is None


class _Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def test_objects_registered_after_a_heal_take_the_peer_s_state_when_they_are_registered() -> None:
    peer, here = PreparedObjects(), PreparedObjects()
    peer.register_for_checkpointing((_Counter(5), _Counter(9)))
    sent = LiveTrainingState(peer, None, GradientAccumulation(GradientState())).state_dict()
    received = LiveTrainingState(here, None, GradientAccumulation(GradientState()))
    here.register_for_checkpointing((_Counter(),))
    received.load_state_dict(sent)  # the heal, in prepare: one object registered so far
    assert [obj.value for obj in here.custom] == [5]
    later = _Counter()
    here.register_for_checkpointing((later,))  # as the Trainer registers its state after prepare
    assert later.value == 9 and not here.awaiting["custom"]


def test_a_group_with_more_registered_objects_than_its_peer_is_refused_by_name() -> None:
    peer, here = PreparedObjects(), PreparedObjects()
    sent = LiveTrainingState(peer, None, GradientAccumulation(GradientState())).state_dict()
    here.register_for_checkpointing((_Counter(),))
    with pytest.raises(ValueError, match="has 0 objects registered for checkpointing, and it has 1 when it"):
        LiveTrainingState(here, None, GradientAccumulation(GradientState())).load_state_dict(sent)
