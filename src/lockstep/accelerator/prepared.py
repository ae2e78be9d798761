"""The registry of everything an Accelerator prepared or was asked to checkpoint.

One object, handed to the parts that work on these objects (the checkpoint manager, the step timer),
so that none of them reaches into the facade.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class PreparedObjects:
    """Prepared models, optimizers, schedulers and dataloaders, in the order they were prepared, and the
    objects registered with ``register_for_checkpointing``."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    """``AcceleratedOptimizer`` objects."""
    schedulers: list[Any] = field(default_factory=list)
    """``AcceleratedScheduler`` objects."""
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)
    """Objects with ``state_dict``/``load_state_dict`` saved and loaded with the training state."""
    awaiting: dict[str, list[Any]] = field(default_factory=dict)
    """States that a live peer sent (a fault-tolerant heal) for dataloaders and registered objects this
    process had not prepared or registered yet, by list (``dataloaders``, ``custom``): the next ones added
    take them, in order."""

    def has_model(self, model: nn.Module) -> bool:
        return any(model is prepared for prepared in self.models)

    def has_dataloader(self, dataloader: Any) -> bool:
        return any(dataloader is prepared for prepared in self.dataloaders)

    def optimizers_of(self, scheduler: Any) -> list[Any]:
        """The prepared optimizers a scheduler drives (all of them when it names none of them)."""
        inner = getattr(scheduler, "optimizer", None)
        chosen = [o for o in self.optimizers if inner is o or inner is getattr(o, "optimizer", None)]
        return chosen or list(self.optimizers)

    def register_for_checkpointing(self, objects: tuple[Any, ...]) -> None:
        """Add objects to save with the state; each needs ``state_dict`` and ``load_state_dict``.

        The error lists the invalid items in Accelerate's words ("Item at index 0, `Tensor`"), counting
        positions among all the objects passed, then says what to do.
        """
        invalid = [
            f"\n\t- Item at index {index}, `{_pretty_name(obj)}`"
            for index, obj in enumerate(objects)
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            )
        ]
        if invalid:
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. The "
                f"following inputs are invalid:{''.join(invalid)}\nregister_for_checkpointing() saves and loads "
                "each object through its state_dict() and load_state_dict(): wrap these in a class that provides "
                "both (a model or optimizer passed to prepare() is saved without registering it)."
            )
        for obj in objects:
            self._add("custom", obj)

    def add_dataloader(self, dataloader: Any) -> None:
        """Add a prepared dataloader."""
        self._add("dataloaders", dataloader)

    def _add(self, kind: str, obj: Any) -> None:
        getattr(self, kind).append(obj)
        waiting = self.awaiting.get(kind)
        if waiting:  # a live peer's state, received before this process added the object
            obj.load_state_dict(waiting.pop(0))

    def forget_prepared(self) -> None:
        """Drop the references to prepared objects (registered objects stay registered)."""
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()


def _pretty_name(obj: Any) -> str:
    """The name Accelerate's error gives an object: its own for classes and functions, else its class's."""
    named = obj if hasattr(obj, "__qualname__") or hasattr(obj, "__name__") else type(obj)
    return str(getattr(named, "__qualname__", None) or getattr(named, "__name__", None) or obj)
