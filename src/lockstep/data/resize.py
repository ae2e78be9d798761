"""Where a loader resumes when the checkpoint was saved on another number of processes.

A prepared loader's position is saved in global terms too (see :mod:`lockstep.data._position`)::

    "global_start": int,        # global batches of the epoch consumed before this attempt dealt any
    "global_batches": int,      # global batches of the epoch consumed (the original batch sampler's batches)
    "sampler_batch_size": int,  # the batch size of the original batch sampler (-1 if unknown)
    "samples_consumed": int,    # samples of the epoch consumed, all processes together
    "samples_before": int,      # loaders without a batch sampler: samples consumed before this attempt

The epoch's order is rebuilt from what the position already saves (sampler seed, epoch, generator state at
the epoch start), so on ``W'`` processes the loader deals the same global batches from number
``global_batches`` on: every sample of the epoch is read exactly once across all attempts, whatever the
world sizes. A stream (an iterable dataset) resumes exactly when its dataset restores its own state, or when
the samples consumed make whole steps of the new size; otherwise resuming is refused, with the choices.

Example:
    >>> point = resume_point({"epoch": 0, "batches_yielded": 4, "num_processes": 3, "total_batch_size": 6,
    ...     "global_batches": 12, "sampler_batch_size": 2}, world=2, total=4, batch_size=2, deals_global=True)
    >>> point.skip, point.global_start, point.resize.samples_consumed
    (0, 12, 24)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resize:
    """A resume on another number of processes, as the restart line tells it."""

    old_world: int
    new_world: int
    epoch: int
    samples_consumed: int
    old_total_batch_size: int
    """Samples per step (one micro-batch on every process) when the checkpoint was saved; -1 if unknown."""
    new_total_batch_size: int


@dataclass(frozen=True)
class ResumePoint:
    """Where the resumed epoch starts."""

    skip: int
    """This process's batches to skip (counted by the new rules)."""
    global_start: int = 0
    """Global batches of the epoch consumed before those (the new rules deal the epoch from there)."""
    samples_before: int = 0
    """Loaders without a batch sampler: samples consumed before this attempt's own batches."""
    resize: Resize | None = None
    """Set when the checkpoint was saved on another number of processes."""
    in_stream: bool = False
    """The dataset resumes from its own state (nothing is skipped by reading)."""


def resume_point(
    state: Mapping[str, Any],
    *,
    world: int,
    total: int | None,
    batch_size: int | None,
    deals_global: bool,
    own_stream: bool = False,
) -> ResumePoint:
    """Where a loader on ``world`` processes, reading ``total`` samples per step from an original batch
    sampler of ``batch_size``, resumes the position ``state``.

    Args:
        state: a prepared loader's ``state_dict()``.
        world: processes now.
        total: samples per step now (None when unknown).
        batch_size: the original batch sampler's batch size now (None when unknown).
        deals_global: the loader deals the global batches of an original batch sampler (map-style data).
        own_stream: the data source restores its own position from the state (a stateful dataset).
    """
    position = int(state["batches_yielded"])
    saved_world = int(state.get("num_processes", world))
    saved_total = int(state.get("total_batch_size", -1))
    start, before = int(state.get("global_start", 0)), int(state.get("samples_before", 0))
    same_total = saved_total <= 0 or not total or saved_total == total
    if saved_world == world:
        # The same processes: the saved batch count, or (another batch size) the nearest batch before it.
        return ResumePoint(position, start, before) if same_total else _rounded(position, saved_total, total)
    samples = int(state.get("samples_consumed", before + position * max(saved_total, 0)))
    resize = Resize(saved_world, world, int(state["epoch"]), samples, saved_total, int(total or -1))
    if position == 0 and start == 0 and before == 0:
        return ResumePoint(0, resize=resize)  # at an epoch boundary
    if deals_global:
        same_sampler = int(state.get("sampler_batch_size", -1)) == int(batch_size or -1)
        if "global_batches" in state and same_sampler:
            return ResumePoint(0, int(state["global_batches"]), resize=resize)
        if "global_batches" not in state and batch_size and samples % batch_size == 0:  # an older format
            return ResumePoint(0, samples // batch_size, resize=resize)
    if own_stream:
        return ResumePoint(0, samples_before=samples, resize=resize, in_stream=True)
    if total and samples % total == 0:
        return ResumePoint(samples // total, samples_before=0, resize=resize)
    raise ValueError(
        f"The dataloader state was saved on {saved_world} processes after {samples} samples of epoch "
        f"{resize.epoch} ({saved_total} per step), and this loader reads {total} per step on {world} "
        f"processes: {samples} is not a whole number of its steps and its data source cannot restart there "
        "by itself, so resuming would repeat or skip samples. Choices: give the dataset state_dict() and "
        "load_state_dict() and prepare with DataLoaderConfiguration(use_stateful_dataloader=True), so that it "
        f"resumes from its own state; or resume on {saved_world} processes; or use a per-process batch size "
        f"that makes {samples} a whole number of steps; or read a map-style dataset through a sampler."
    )


def _rounded(position: int, saved_total: int, total: int | None) -> ResumePoint:
    """The same processes with another batch size: the nearest batch at or before the saved position."""
    seen, total = position * saved_total, int(total or 1)
    rounded = seen // total
    warnings.warn(
        f"The dataloader state was saved with {saved_total} samples per step and this loader takes "
        f"{total}: resuming at batch {rounded} of the epoch, which re-reads {seen - rounded * total} "
        f"of the {seen} samples already seen.",
        stacklevel=4,
    )
    return ResumePoint(rounded)


def repeated_samples(remaining: int, total: int) -> int:
    """Samples from the epoch's start that its last step repeats when ``remaining`` real samples are dealt
    ``total`` per step (all processes together) and the last step is completed to a full one (``even_batches``,
    or an iterable dataset's last buffer): after a resize, samples the resumed run trains twice.

    Example:
        >>> repeated_samples(26, 4), repeated_samples(14, 6), repeated_samples(24, 12)
        (2, 4, 0)
    """
    if remaining <= 0 or total <= 0:
        return 0
    return -remaining % total
