"""The Trainer's step object: chosen once from the layout, and the plain step still calls the Trainer's
``compute_loss`` (which a subclass may override with transformers' signature)."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.backends import ContextParallel, PipelineSchedule
from lockstep.trainer._training_step import PipelineStep, PlainStep, training_step_for
from tests.helpers.training import make_dataset, make_model


def mse_per_item(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels, reduction="sum") / num_items_in_batch


def _layout(**sizes: int) -> SimpleNamespace:
    """An accelerator as training_step_for reads it, on one process."""
    config = None
    if sizes:
        config = SimpleNamespace(
            **{"pp_size": 1, "cp_size": 1, "dp_shard_size": 1, "data_parallel_size": 1} | sizes
        )
    offered = {
        PipelineSchedule: bool(config and config.pp_size > 1),
        ContextParallel: bool(config and config.cp_size > 1),
    }
    return SimpleNamespace(
        capability=lambda kind: object() if offered.get(kind) else None,
        parallelism_config=config,
        deepspeed_plugin=None,
        process_index=0,
        num_processes=1,
        data_parallel_rank=0,
        data_parallel_shard_rank=0,
        device="cpu",
    )


def test_the_step_is_pipelined_only_when_the_layout_has_pipeline_stages():
    args = TrainingArguments(output_dir="unused", report_to="none")
    options = {"label_names": ["labels"], "compute_loss_func": mse_per_item}
    pipelined = training_step_for(_layout(pp_size=2), make_model(), args, **options)  # type: ignore[arg-type]
    assert type(pipelined) is PipelineStep and pipelined.item_counter is None
    assert pipelined.loss_func is mse_per_item
    for accelerator in (_layout(), _layout(pp_size=1)):
        plain = training_step_for(accelerator, make_model(), args, **options)  # type: ignore[arg-type]
        assert type(plain) is PlainStep and plain.sequence_split is None
        assert plain.item_counter is not None and plain.item_counter.loss_scale == 1


class HalvedLoss(Trainer):
    """A subclass overriding compute_loss with transformers' signature (return_outputs before the count)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[bool, int]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls.append((return_outputs, int(num_items_in_batch)))
        return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch) * 0.5


def _logged_losses(trainer_class: type[Trainer], tmp_path) -> tuple[Trainer, list[float]]:
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = trainer_class(
        make_model(), args, train_dataset=make_dataset(32), compute_loss_func=mse_per_item
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_subclass_compute_loss_is_what_the_training_step_calls(tmp_path):
    _, expected = _logged_losses(Trainer, tmp_path / "plain")
    trainer, halved = _logged_losses(HalvedLoss, tmp_path / "halved")
    assert trainer.calls == [(False, 8)] * 6  # 3 steps of 2 micro-batches, each cycle counting 8 labels
    assert len(halved) == len(expected) == 3
    assert halved == pytest.approx([loss / 2 for loss in expected], rel=1e-6)
    assert torch.tensor(expected).min() > 0
