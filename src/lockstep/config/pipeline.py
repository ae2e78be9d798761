"""``TorchPipelineParallelConfig``: how pipeline parallelism (``ParallelismConfig(pp_size=...)``) splits and runs
a model. lockstep's extension of Accelerate's ``ParallelismConfig`` (Accelerate trains no pipeline).

The model is cut into stages at module names (``split_points=["layers.2"]``: a stage begins at each), or
automatically (``"auto"``: the model's longest list of repeated blocks, cut evenly by parameter count).
Each pipeline rank holds ``stages_per_rank`` stages; a batch is cut into ``num_microbatches`` micro-batches
that flow through the stages in the order of ``schedule`` (torch's ``torch.distributed.pipelining``).

Example:
    >>> config = TorchPipelineParallelConfig(schedule="gpipe", num_microbatches=4, split_points=["layers.2"])
    >>> config.schedule_class_name, config.stage_layout
    ('ScheduleGPipe', 'loop')
    >>> TorchPipelineParallelConfig(schedule="pipedream")
    Traceback (most recent call last):
    ValueError: TorchPipelineParallelConfig(schedule='pipedream') is invalid: it must be one of 'gpipe', '1f1b', 'interleaved_1f1b', 'looped_bfs', 'interleaved_zero_bubble', 'zbv_zero_bubble'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", True, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", True, "v"),
}
"""Schedule name -> (torch class in ``torch.distributed.pipelining``, runs several stages per rank, how
stages are placed on ranks: ``"loop"`` puts stage ``s`` on rank ``s % pp_size``, ``"v"`` folds them back)."""


@dataclass
class TorchPipelineParallelConfig:
    """How pipeline parallelism splits the model and schedules micro-batches (lockstep's addition).

    Example:
        >>> TorchPipelineParallelConfig(schedule="interleaved_1f1b").stages_per_rank
        2
    """

    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"interleaved_zero_bubble"`` or
    ``"zbv_zero_bubble"`` (torch's ``ScheduleGPipe``, ``Schedule1F1B``, ... of the same names)."""
    num_microbatches: int | None = None
    """Micro-batches each batch is cut into (they must divide the batch); default: the number of stages."""
    stages_per_rank: int | None = None
    """Stages each pipeline rank holds: 1 for ``gpipe``/``1f1b`` (the default), 2 by default for the others."""
    split_points: Sequence[str] | str = "auto"
    """Module names where a stage begins (``["layers.4"]``), or ``"auto"``: the model's longest list of
    repeated blocks (e.g. a decoder's layers) cut evenly by parameter count."""
    example_args: tuple[Any, ...] | None = None
    """One batch of the model's positional inputs (what ``pipeline_step`` receives), used once to trace the
    model so that it can be cut (``torch.distributed.pipelining.pipeline``)."""
    example_kwargs: dict[str, Any] | None = None
    """One batch of the model's keyword inputs (e.g. ``{"attention_mask": mask}``), traced with
    ``example_args``; ``pipeline_step`` must then receive the same keywords. The Trainer fills both from
    its first training batch when neither is given."""
    loss_fn: Callable[..., Any] | None = None
    """``loss_fn(outputs, target)`` on the last stage, per micro-batch (mean-reduced losses); may also be
    given to ``pipeline_step``."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"TorchPipelineParallelConfig(schedule={self.schedule!r}) is invalid: it must be one of "
                f"{', '.join(map(repr, SCHEDULES))}."
            )
        multi = SCHEDULES[self.schedule][1]
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if multi else 1
        _check_positive("stages_per_rank", self.stages_per_rank)
        if self.num_microbatches is not None:
            _check_positive("num_microbatches", self.num_microbatches)
        if not multi and self.stages_per_rank != 1:
            raise ValueError(
                f"TorchPipelineParallelConfig(schedule={self.schedule!r}, stages_per_rank={self.stages_per_rank}) "
                "is invalid: this schedule runs one stage per rank. Use 'interleaved_1f1b', 'looped_bfs' or a "
                "zero-bubble schedule for several."
            )
        if self.schedule == "zbv_zero_bubble" and self.stages_per_rank != 2:
            raise ValueError(
                f"TorchPipelineParallelConfig(schedule='zbv_zero_bubble', stages_per_rank={self.stages_per_rank}) "
                "is invalid: the ZBV schedule runs exactly two stages per rank."
            )
        if isinstance(self.split_points, str):
            if self.split_points != "auto":
                raise ValueError(
                    f"TorchPipelineParallelConfig(split_points={self.split_points!r}) is invalid: pass 'auto' or a "
                    "list of module names where a stage begins, e.g. ['layers.4']."
                )
        else:
            self.split_points = list(self.split_points)
        if self.example_args is not None and not isinstance(self.example_args, tuple):
            self.example_args = (self.example_args,)
        if self.example_kwargs is not None and not isinstance(self.example_kwargs, dict):
            raise TypeError(
                f"TorchPipelineParallelConfig(example_kwargs=...) got {type(self.example_kwargs).__name__}; pass "
                "a dict of keyword inputs, e.g. {'attention_mask': mask}."
            )

    @property
    def schedule_class_name(self) -> str:
        """The torch class of ``schedule``."""
        return SCHEDULES[self.schedule][0]

    @property
    def stage_layout(self) -> str:
        """``"loop"`` (stage ``s`` on rank ``s % pp_size``) or ``"v"`` (rank ``r`` holds ``r`` and ``2p-1-r``)."""
        return SCHEDULES[self.schedule][2]

    def to_json(self) -> dict[str, Any]:
        """The settings that are plain data (not the example inputs nor the loss function)."""
        return {
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "stages_per_rank": self.stages_per_rank,
            "split_points": self.split_points,
        }


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"TorchPipelineParallelConfig({name}={value!r}) is invalid: it must be an integer >= 1."
        )
