"""The Trainer's step plan after a resume on another number of processes (units; the real run is
tests/e2e/test_trainer_resize.py): the rest of the resumed epoch in steps of the new size, then whole epochs."""

from __future__ import annotations

import pytest

from lockstep import TrainingArguments
from lockstep.data.resize import Resize
from lockstep.trainer._step_plan import StepPlan, resized_plan


class Restored:
    """A prepared loader just restored: ``len`` is this process's batches left in the epoch."""

    def __init__(self, batches_left: int, resized: Resize | None) -> None:
        self.batches_left, self.resized = batches_left, resized

    def __len__(self) -> int:
        return self.batches_left


def _args(tmp_path, **options) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, **options)


SHRUNK = Resize(
    old_world=3, new_world=2, epoch=0, samples_consumed=24, old_total_batch_size=6, new_total_batch_size=4
)
WHOLE_ON_2 = StepPlan(max_steps=16, num_epochs=2, updates_per_epoch=8)  # 64 samples, 8 per step


def test_the_rest_of_the_epoch_then_whole_epochs_of_the_new_size(tmp_path):
    # 40 samples left of 64: 10 micro-batches of 2 per process, 5 steps; then epoch 1's 8 steps
    plan = resized_plan(
        _args(tmp_path, num_train_epochs=2),
        Restored(10, SHRUNK),
        whole=WHOLE_ON_2,
        global_step=2,
        dataset=range(64),
    )
    assert plan is not None and (plan.max_steps, plan.num_epochs, plan.updates_per_epoch) == (15, 2, 8)
    assert [plan.epoch_at(step) for step in (2, 7, 11, 15)] == [0.375, 1.0, 1.5, 2.0]


def test_fractional_epochs_count_samples_and_max_steps_is_kept(tmp_path):
    loader = Restored(10, SHRUNK)
    half = resized_plan(
        _args(tmp_path, num_train_epochs=1.5), loader, whole=WHOLE_ON_2, global_step=2, dataset=range(64)
    )
    assert half is not None and half.max_steps == 2 + 5 + 4  # the rest of epoch 0, half of epoch 1
    early = resized_plan(
        _args(tmp_path, num_train_epochs=0.5), loader, whole=WHOLE_ON_2, global_step=2, dataset=range(64)
    )
    assert early is not None and early.max_steps == 2 + 1  # 8 of the 40 samples left: ceil(5 x 8 / 40)
    steps = resized_plan(
        _args(tmp_path, max_steps=30), loader, whole=WHOLE_ON_2, global_step=2, dataset=range(64)
    )
    assert steps is not None and (steps.max_steps, steps.num_epochs) == (30, 4)  # 2 + 5 + 8 + 8 + 8 >= 30


def test_growing_and_not_resized(tmp_path):
    grown = Resize(
        old_world=2, new_world=3, epoch=1, samples_consumed=24, old_total_batch_size=4, new_total_batch_size=6
    )
    whole_on_3 = StepPlan(max_steps=18, num_epochs=3, updates_per_epoch=6)  # 11 micro-batches, 6 steps
    plan = resized_plan(  # 40 left: 7 micro-batches of 6 (the last padded), 4 steps; then epoch 2's 6
        _args(tmp_path, num_train_epochs=3),
        Restored(7, grown),
        whole=whole_on_3,
        global_step=11,
        dataset=range(64),
    )
    assert plan is not None and plan.max_steps == 11 + 4 + 6
    assert plan.epoch_at(11) == pytest.approx(1.375) and plan.epoch_at(21) == 3.0
    not_resized = resized_plan(
        _args(tmp_path, num_train_epochs=3),
        Restored(7, None),
        whole=whole_on_3,
        global_step=11,
        dataset=range(64),
    )
    assert not_resized is None
