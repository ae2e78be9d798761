"""A checkpoint loaded on another number of processes: the global batch, and the one restart line.

The prepared loaders already continue the epoch exactly (:mod:`lockstep.data.resize`). What is left is the
optimizer step's batch: by default the script's own settings stay (per-process batch and
``gradient_accumulation_steps``), so the global batch follows the number of processes, as when a user
relaunches by hand on fewer machines. With ``Accelerator(elastic_keep_global_batch=True)`` the global batch
is kept by changing the accumulation steps, when the division is exact. Either way rank 0 logs one line::

    resumed on 2 processes from a checkpoint saved on 3: ckpt/checkpoint_4 at step 8, epoch 0, 24 of 50
    samples consumed; global batch kept at 12 samples per optimizer step (gradient_accumulation_steps 2 -> 3);
    the epoch's last micro-step repeats 2 samples from its start (even_batches), which are trained twice: ...

The last part is there when the resumed epoch does not fill its last micro-step on the new number of
processes: ``even_batches`` completes it with samples from the epoch's start (trained twice, where the run
that saved the checkpoint may have trained each once). Training the rest of the epoch unevenly instead
(``even_batches=False``, where the processes without a batch join, ``accelerator.join_uneven_inputs``) trains
each sample once with the weight every other sample has; it is not the default, since a rank with no batch
must join and batches of different sizes cannot be gathered.

The learning-rate schedule follows the samples consumed: where the global batch follows the number of
processes, Accelerate's rule (a prepared scheduler advances ``num_processes`` times per optimizer step)
already does; where it is kept, the scheduler advances as it did before the resize
(:func:`kept_scheduler_repeats`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.data.resize import Resize, repeated_samples

logger = logging.getLogger("lockstep.checkpoint")

KEEP_OPTION = "Accelerator(elastic_keep_global_batch=True)"
ACCUMULATION_COUNTER = "gradient_accumulation_steps"
OPTIMIZER_STEPS_COUNTER = "optimizer_steps"
"""The checkpoint's counter of the optimizer steps each prepared optimizer had taken (a list, in order)."""


def first_resize(loaders: Sequence[Any]) -> Resize | None:
    """The resize the first loader restored on another number of processes saw (None when none did)."""
    return next((dl.resized for dl in loaders if getattr(dl, "resized", None) is not None), None)


def kept_accumulation(resize: Resize, saved_steps: int) -> int:
    """The accumulation steps that keep the saved global batch on the new number of processes.

    Raises:
        ValueError: the saved global batch is not a whole number of the new per-step batches.
    """
    old_total, new_total = resize.old_total_batch_size, resize.new_total_batch_size
    target = old_total * saved_steps
    if old_total <= 0 or new_total <= 0 or target % new_total != 0:
        raise ValueError(
            f"{KEEP_OPTION} keeps the global batch of {target} samples per optimizer step ({old_total} per "
            f"micro-step on {resize.old_world} processes x {saved_steps} accumulation steps), but one micro-step "
            f"on {resize.new_world} processes reads {new_total} samples, which does not divide it. Choices: "
            f"resume on a number of processes whose micro-step divides {target}; change the per-process batch "
            "size so that it does; or leave elastic_keep_global_batch off, and the global batch follows the "
            "number of processes."
        )
    return target // new_total


def kept_scheduler_repeats(num_processes: int, steps_now: int, script_steps: int) -> int:
    """How often a prepared scheduler advances per optimizer step while the global batch is kept.

    Accelerate's rule advances it ``num_processes`` times: one optimizer step on N processes consumes N
    single-process steps of the schedule the script wrote (for its own accumulation steps). When a resize
    keeps the global batch by changing the accumulation steps instead, the same samples per optimizer step
    make the same advance as before the resize: ``num_processes x steps_now / script_steps``.

    Example:
        >>> kept_scheduler_repeats(2, steps_now=3, script_steps=2)  # saved on 3 processes x 2 steps
        3
    """
    return max(1, num_processes * steps_now // max(script_steps, 1))


def _convert_counter(accumulation: GradientAccumulation, saved_steps: int, new_steps: int) -> None:
    """The micro-step counter for ``new_steps`` accumulation steps, after the same optimizer steps."""
    if new_steps == saved_steps:
        return
    step = accumulation.step
    if step % saved_steps != 0:
        raise ValueError(
            f"Resuming with gradient_accumulation_steps={new_steps}, but the checkpoint was taken at micro-step "
            f"{step}, inside an accumulation cycle of {saved_steps} steps, which cannot continue with another "
            "number of steps. Save checkpoints when accelerator.sync_gradients is True, or resume with "
            f"gradient_accumulation_steps={saved_steps}."
        )
    accumulation.step = step // saved_steps * new_steps


def apply_resize(
    resize: Resize,
    *,
    accumulation: GradientAccumulation,
    saved_steps: int,
    keep_global_batch: bool,
) -> str:
    """Set the accumulation for the new number of processes; returns how the global batch is kept."""
    steps = accumulation.num_steps
    old_global = resize.old_total_batch_size * saved_steps
    if keep_global_batch:
        new_steps = kept_accumulation(resize, saved_steps)
        _convert_counter(accumulation, saved_steps, new_steps)
        accumulation.gradient_state.plugin_kwargs["num_steps"] = new_steps
        return (
            f"global batch kept at {old_global} samples per optimizer step "
            f"(gradient_accumulation_steps {saved_steps} -> {new_steps}, {KEEP_OPTION})"
        )
    _convert_counter(accumulation, saved_steps, steps)
    new_global = resize.new_total_batch_size * steps
    return (
        f"global batch follows the number of processes: {new_global} samples per optimizer step "
        f"({resize.new_total_batch_size} per micro-step x {steps} accumulation steps; it was {old_global}); "
        f"pass {KEEP_OPTION} to keep {old_global}"
    )


def repeated_at_epoch_end(loader: Any, resize: Resize) -> int | None:
    """Samples from the epoch's start that the resumed epoch's last micro-step repeats (0: none; None: it may,
    how many is unknown, as for a stream): ``even_batches`` completes a short last step on the new number of
    processes, where the run that saved the checkpoint may have had none to complete."""
    pads = loader._pads_last_step() if hasattr(loader, "_pads_last_step") else None
    if pads is False:
        return 0
    epoch_samples = loader._epoch_samples() if hasattr(loader, "_epoch_samples") else None
    if pads is None or epoch_samples is None or resize.new_total_batch_size <= 0:
        return None
    return repeated_samples(epoch_samples - resize.samples_consumed, resize.new_total_batch_size)


def _repeats(repeated: int | None) -> str:
    """What the restart line says of the samples the resumed epoch repeats (nothing when it repeats none)."""
    if repeated == 0:
        return ""
    count = "may repeat samples" if repeated is None else f"repeats {repeated} samples"
    return (
        f"; the epoch's last micro-step {count} from its start (even_batches), which are trained twice: "
        "DataLoaderConfiguration(even_batches=False), with accelerator.join_uneven_inputs under DDP, trains "
        "the rest of the epoch with each sample once"
    )


def restart_line(
    resize: Resize,
    *,
    folder: Any,
    step: int,
    epoch_samples: int | None,
    how: str,
    num_processes: int | None = None,
    optimizer_steps_known: bool = True,
    repeated: int | None = 0,
) -> str:
    """The one line a resumed run on another number of processes logs (``num_processes``: the run's
    processes, when the loaders' data-parallel ranks are fewer, as under tensor parallelism). ``step`` is
    the optimizer steps taken when the checkpoint was saved; a checkpoint from before lockstep counted
    them (``optimizer_steps_known=False``) gives the accumulation micro-steps instead. ``repeated``: what
    :func:`repeated_at_epoch_end` found, said at the end of the line."""
    of = f" of {epoch_samples}" if epoch_samples is not None else ""
    at = f"after {step} optimizer steps" if optimizer_steps_known else f"at step {step}"
    where = f"{resize.new_world} processes from a checkpoint saved on {resize.old_world}"
    if num_processes is not None and num_processes != resize.new_world:
        where = (
            f"{resize.new_world} data-parallel ranks ({num_processes} processes) from a checkpoint saved on "
            f"{resize.old_world} data-parallel ranks"
        )
    return (
        f"resumed on {where}: {folder} {at}, epoch {resize.epoch}, {resize.samples_consumed}{of} samples of "
        f"the epoch consumed; {how}{_repeats(repeated)}"
    )


def after_resized_load(
    loaders: Sequence[Any],
    *,
    folder: Any,
    counters: dict[str, Any],
    accumulation: GradientAccumulation,
    keep_global_batch: bool,
    is_main_process: bool,
    num_processes: int | None = None,
) -> str | None:
    """When a loader was restored on another number of processes: set the accumulation and log the line
    (returned, for the trackers; None when nothing was resized)."""
    resize = first_resize(loaders)
    saved_steps = int(counters.get(ACCUMULATION_COUNTER, accumulation.num_steps))
    if resize is None:
        if keep_global_batch:  # the same processes as the save: keep the steps an earlier resize chose
            accumulation.gradient_state.plugin_kwargs["num_steps"] = saved_steps
        return None
    saved_optimizer_steps = counters.get(OPTIMIZER_STEPS_COUNTER) or []
    step = int(saved_optimizer_steps[0]) if saved_optimizer_steps else accumulation.step
    how = apply_resize(
        resize, accumulation=accumulation, saved_steps=saved_steps, keep_global_batch=keep_global_batch
    )
    loader = next(dl for dl in loaders if getattr(dl, "resized", None) is resize)
    epoch_samples = loader._epoch_samples() if hasattr(loader, "_epoch_samples") else None
    line = restart_line(
        resize,
        folder=folder,
        step=step,
        epoch_samples=epoch_samples,
        how=how,
        num_processes=num_processes,
        optimizer_steps_known=bool(saved_optimizer_steps),
        repeated=repeated_at_epoch_end(loader, resize),
    )
    if is_main_process:
        logger.warning(line)
    return line
