"""From measured totals to the figures users read: seconds per phase, rates, MFU.

One step's totals give ``accelerator.step_stats``; the totals of several steps, added together, give the
figures logged every ``log_every_n_steps`` steps (times per step averaged over them, rates over them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("data", "forward_backward", "optimizer", "checkpoint")
"""Measured phases; ``other`` is the rest of the step."""

_TIME_KEYS = {phase: f"time/{phase}" for phase in PHASES}


@dataclass
class StepTotals:
    """What one or more optimizer steps of this process measured."""

    steps: int
    seconds: float
    """Wall (or device) time of the steps."""
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Seconds in each of :data:`PHASES`."""
    communication: float | None = None
    """Exposed communication seconds (None when not measured)."""
    batches: int = 0
    samples: int = 0
    tokens: int | None = None
    flops: float | None = None
    """Model FLOPs of the steps (None when not counted)."""

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(
            steps=self.steps + other.steps,
            seconds=self.seconds + other.seconds,
            phases={phase: self.phases[phase] + other.phases[phase] for phase in PHASES},
            communication=_add(self.communication, other.communication),
            batches=self.batches + other.batches,
            samples=self.samples + other.samples,
            tokens=_add(self.tokens, other.tokens),
            flops=_add(self.flops, other.flops),
        )


def _add(first: float | None, second: float | None) -> float | None:
    if first is None:
        return second
    return first if second is None else first + second


def figures(totals: StepTotals, *, num_processes: int, peak_flops: float | None) -> dict[str, float]:
    """The figures of ``totals``: ``time/*`` in seconds per step, rates for the whole job.

    Args:
        totals: one step's totals, or several steps' added together.
        num_processes: processes in the job (this process's counts times this give the job's rates).
        peak_flops: peak FLOP/s of one device (None: no MFU).
    """
    per_step = 1.0 / totals.steps
    result = {_TIME_KEYS[phase]: seconds * per_step for phase, seconds in totals.phases.items()}
    result["time/other"] = (totals.seconds - sum(totals.phases.values())) * per_step
    result["time/step"] = totals.seconds * per_step
    if totals.communication is not None:
        result["time/communication"] = totals.communication * per_step
    if totals.seconds <= 0:
        return result
    rate = num_processes / totals.seconds
    if totals.batches:
        result["samples_per_second"] = totals.samples * rate
    if totals.tokens is not None:
        result["tokens_per_second"] = totals.tokens * rate
    if totals.flops:
        result["flops_per_second"] = totals.flops * rate
        if peak_flops is not None:
            result["mfu"] = totals.flops / totals.seconds / peak_flops
    return result
