"""The Accelerator's own training state, shared with a backend that heals replica groups from live peers.

A run with the :class:`~lockstep.backends.capabilities.LiveRecovery` capability (fault tolerance's layer, on
torchft) moves the models and optimizers itself. What the Accelerator holds besides is shared here, so that a
group that (re)joins continues exactly where its peers stand:

* ``lockstep_positions``: each prepared loader's position, as it was when the last step ended (by the time
  a peer asks, the live loader has read the next batch already);
* ``lockstep_state``: schedulers, the fp16 scaler, objects registered with ``register_for_checkpointing``
  and the accumulation counter, as they are when the peer asks (the scheduler has stepped by then).

Random number generators are not sent: each group draws from its own streams (a relaunched group's differ
from the lost one's either way), and a loader's shuffling order travels with its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.backends.capabilities import LiveRecovery

POSITIONS_KEY = "lockstep_positions"
STATE_KEY = "lockstep_state"


class LiveTrainingState:
    """The prepared loaders, schedulers, scaler, registered objects and counters of one Accelerator.

    Args:
        prepared: the prepared and registered objects (read when a peer asks, so later ones count).
        scaler: the backend's fp16 GradScaler, if any.
        accumulation: the accumulation position.
    """

    def __init__(self, prepared: PreparedObjects, scaler: Any, accumulation: GradientAccumulation) -> None:
        self.prepared = prepared
        self.scaler = scaler
        self.accumulation = accumulation

    def _loaders(self) -> list[Any]:
        return [dl for dl in self.prepared.dataloaders if hasattr(dl, "state_dict")]

    def positions(self) -> dict[str, Any]:
        return {"dataloaders": [dl.state_dict() for dl in self._loaders()]}

    def load_positions(self, state: dict[str, Any]) -> None:
        self._load_in_order("dataloaders", "prepared dataloaders", self._loaders(), state["dataloaders"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "schedulers": [s.state_dict() for s in self.prepared.schedulers],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "custom": [obj.state_dict() for obj in self.prepared.custom],
            "step": self.accumulation.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_each("prepared schedulers", self.prepared.schedulers, state["schedulers"])
        self._load_in_order(
            "custom", "objects registered for checkpointing", self.prepared.custom, state["custom"]
        )
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.accumulation.step = int(state["step"])

    def _load_in_order(self, kind: str, what: str, targets: Sequence[Any], states: Sequence[Any]) -> None:
        """Load ``states`` into ``targets`` in order; states beyond this process's objects wait for the ones it
        adds later (a Trainer registers its state after ``prepare``, where a returning group heals)."""
        if len(states) < len(targets):
            _check_same(what, len(states), len(targets))
        for target, state in zip(targets, states, strict=False):
            target.load_state_dict(state)
        self.prepared.awaiting[kind] = list(states[len(targets) :])


def _check_same(what: str, peer: int, here: int) -> None:
    if peer != here:
        raise ValueError(
            f"This replica group healed from a live peer that has {peer} {what}, and it has {here} when it "
            "joined: every group must prepare and register the same objects in the same order, and prepare its "
            "training dataloaders and schedulers in the prepare() call of its optimizer or before it (a group "
            "joins the running job when that call returns; objects registered later take the peer's state then)."
        )


def _load_each(what: str, targets: Sequence[Any], states: Sequence[Any]) -> None:
    _check_same(what, len(states), len(targets))
    for target, state in zip(targets, states, strict=True):
        target.load_state_dict(state)


def share_live_state(
    live: LiveRecovery | None, scaler: Any, prepared: PreparedObjects, accumulation: GradientAccumulation
) -> LiveRecovery | None:
    """Share the Accelerator's state with ``live``, the run's live recovery (fault tolerance's layer), if any;
    returns it. ``scaler`` is the backend's fp16 GradScaler, if any."""
    if live is None:
        return None
    state = LiveTrainingState(prepared, scaler, accumulation)
    live.share_training_state(POSITIONS_KEY, state.positions, state.load_positions, at_step_end=True)
    live.share_training_state(STATE_KEY, state.state_dict, state.load_state_dict)
    return live
