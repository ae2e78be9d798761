"""Plugins: settings objects that switch on a feature of the Accelerator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lockstep.config.enums import DynamoBackend


@dataclass(kw_only=True)
class GradientAccumulationPlugin:
    """How ``Accelerator.accumulate`` accumulates gradients.

    Example:
        >>> plugin = GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=True)
    """

    num_steps: int | None = None
    """Number of micro-batches per optimizer step."""
    adjust_scheduler: bool = True
    """Count scheduler steps as if every micro-batch were a step (keeps warm-up lengths in batches)."""
    sync_with_dataloader: bool = True
    """Force a gradient sync (and an optimizer step) on the last batch of the dataloader."""
    sync_each_batch: bool = False
    """All-reduce gradients on every micro-batch (more communication, less memory)."""

    def __post_init__(self) -> None:
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) is invalid: it must be an integer >= 1."
            )

    def to_kwargs(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }


@dataclass(kw_only=True)
class TorchDynamoPlugin:
    """``torch.compile`` settings. The model is compiled before it is wrapped for DDP.

    Example:
        >>> plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune")
    """

    backend: DynamoBackend | str = DynamoBackend.NO
    """Compiler backend (``no`` disables compilation)."""
    mode: str | None = None
    """``default``, ``reduce-overhead``, ``max-autotune`` or ``max-autotune-no-cudagraphs``."""
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)
    disable: bool = False

    def __post_init__(self) -> None:
        self.backend = DynamoBackend.parse(self.backend, argument="TorchDynamoPlugin(backend=...)")
        modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if self.mode not in modes:
            raise ValueError(f"TorchDynamoPlugin(mode={self.mode!r}) is invalid: it must be one of {modes}.")

    @property
    def enabled(self) -> bool:
        return self.backend != DynamoBackend.NO and not self.disable

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile``."""
        kwargs: dict[str, Any] = {"backend": self.backend.value, "fullgraph": self.fullgraph}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.dynamic is not None:
            kwargs["dynamic"] = self.dynamic
        if self.options:
            kwargs["options"] = self.options
        return kwargs
