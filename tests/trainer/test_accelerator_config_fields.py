"""``accelerator_config``'s ``gradient_accumulation_kwargs`` and ``use_configured_state`` (transformers' fields,
which lockstep's ``AcceleratorConfig`` lacked: 219 of 220 default values of ``TrainingArguments().to_dict()``
were transformers', the 220th this config)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.state import PartialState
from lockstep.trainer import TrainerCallback
from lockstep.trainer.accelerator_config import AcceleratorConfig
from lockstep.trainer.accelerator_factory import create_accelerator_and_postprocess
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import make_dataset, make_model

transformers = pytest.importorskip("transformers")


def test_the_fields_and_defaults_are_transformers():
    from transformers.trainer_pt_utils import AcceleratorConfig as Theirs

    theirs = [(f.name, f.default) for f in dataclasses.fields(Theirs)]
    assert [(f.name, f.default) for f in dataclasses.fields(AcceleratorConfig)] == theirs
    assert TrainingArguments().to_dict()["accelerator_config"] == Theirs().to_dict()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"num_step": 2},
            r"gradient_accumulation_kwargs has unknown key\(s\) \['num_step'\]; known keys: num_steps",
        ),
        (
            {"num_steps": 0},
            r"gradient_accumulation_kwargs num_steps=0 is invalid: it must be an integer >= 1",
        ),
        (
            {"sync_each_batch": "yes"},
            r"gradient_accumulation_kwargs sync_each_batch='yes' is invalid: it must be",
        ),
        (
            [2],
            r"gradient_accumulation_kwargs=\[2\] is invalid: it must be a dict \(a JSON object\) of num_steps",
        ),
        (
            {"use_configured_state": 1},
            r"accelerator_config\) use_configured_state=1 is invalid: it must be true or",
        ),
    ],
)
def test_bad_values_are_refused_naming_them(value, message):
    config = value if "use_configured_state" in value else {"gradient_accumulation_kwargs": value}
    with pytest.raises(ValueError, match=message):
        TrainingArguments(accelerator_config=config)


def test_num_steps_takes_the_place_of_gradient_accumulation_steps(tmp_path, caplog):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 4, "sync_with_dataloader": False}},
    )
    with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
        accelerator = create_accelerator_and_postprocess(args, nn.Linear(2, 2))
    assert args.gradient_accumulation_steps == 4 and accelerator.gradient_accumulation_steps == 4
    assert accelerator.gradient_state.sync_each_batch is False
    assert (
        "accelerator_config gradient_accumulation_kwargs sync_with_dataloader=False: no effect in the Trainer, "
        "which accumulates and steps its scheduler itself (as in transformers)."
    ) in caplog.messages
    both = TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=2,
        accelerator_config='{"gradient_accumulation_kwargs": {"num_steps": 4}}',
    )
    with pytest.raises(
        ValueError,
        match=r"^TrainingArguments\(gradient_accumulation_steps=2\) and accelerator_config "
        r"gradient_accumulation_kwargs num_steps=4 both set the accumulation steps",
    ):
        create_accelerator_and_postprocess(both, nn.Linear(2, 2))


def test_use_configured_state_needs_a_state_made_before(tmp_path, monkeypatch):
    monkeypatch.setattr(PartialState, "_context", None)  # a fresh process: nothing configured yet
    args = TrainingArguments(output_dir=str(tmp_path), accelerator_config={"use_configured_state": True})
    message = (
        r"^TrainingArguments\(accelerator_config=\{'use_configured_state': True\}\) uses the Accelerator or "
        r"PartialState the script created before the arguments set up the devices, and there is none yet\."
    )
    with pytest.raises(ValueError, match=message):
        args.device  # noqa: B018
    with pytest.raises(ValueError, match=message):
        Trainer(make_model(), args, train_dataset=make_dataset(8))
    assert PartialState._context is None  # nothing was created behind the user's back
    configured = PartialState(cpu=True)
    assert args.device == configured.device and args.world_size == 1


def _mse(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, labels, reduction="sum") / num_items_in_batch


def _record_gradients(sync_each_batch: bool) -> list[bool]:
    """On 2 processes, 2 accumulation steps: after each micro-batch's backward, whether both ranks hold the
    same gradients (all-reduced) or their own."""
    seen: list[bool] = []

    class AfterBackward(TrainerCallback):
        """After each micro-batch but the last of a step (transformers' on_substep_end)."""

        def on_substep_end(
            self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any
        ) -> None:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            everyone = [torch.zeros_like(grads) for _ in range(2)]
            torch.distributed.all_gather(everyone, grads)
            seen.append(torch.equal(everyone[0], everyone[1]))

    args = TrainingArguments(
        output_dir="unused",
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}},
        optim="sgd",
        learning_rate=0.1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        make_model(),
        args,
        train_dataset=make_dataset(16),
        compute_loss_func=_mse,
        callbacks=[AfterBackward()],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return seen


def test_sync_each_batch_all_reduces_every_micro_batch_on_two_processes():
    assert run_distributed(_record_gradients, 2, False, timeout=120)[0] == [
        False
    ]  # the first micro-batch: own
    assert run_distributed(_record_gradients, 2, True, timeout=120)[0] == [True]
