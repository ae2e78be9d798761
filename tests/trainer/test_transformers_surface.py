"""Issue 32, item 2: every public name of transformers' ``TrainingArguments`` and ``Trainer`` is implemented
in lockstep with transformers' signature, refused with a clear error, or listed absent with the reason.

``tests/transformers_trainer_surface.json`` is generated from the installed transformers by
``dev/transformers_api.py`` (names, kinds, and each callable's parameters as ``[name, kind, default repr]``).
A name transformers adds fails the test until it gets a status here; a listed signature difference that no
longer differs fails too. Runs without transformers: it reads the committed JSON.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep import Trainer, TrainingArguments

SURFACE = json.loads(
    (Path(__file__).parents[1] / "transformers_trainer_surface.json").read_text(encoding="utf-8")
)
SECTIONS = SURFACE["sections"]
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

IMPLEMENTED, REFUSED, ABSENT = "implemented", "refused", "absent"

ABSENT_REASONS = {
    "training_arguments_members": {
        "is_torch_greater_or_equal_than_2_8": "a torch version flag imported into transformers' class body, not "
        "an argument (lockstep's default_optim already reflects it)",
        "place_model_on_device": "transformers' hook for integrations that place the model themselves; "
        "lockstep's Accelerator always places it in prepare()",
    },
    "trainer_members": {
        "create_accelerator_and_postprocess": "lockstep builds its Accelerator once in __init__ with "
        "lockstep.trainer.accelerator_factory.create_accelerator_and_postprocess(args, model); an override "
        "would not be consulted",
        "get_batch_samples": "lockstep's training step draws each accumulation cycle and counts "
        "num_items_in_batch itself (lockstep.trainer._num_items); there is no override point",
        "get_optimizer_cls_and_kwargs": "lockstep builds args.optim in lockstep.trainer.optimizers."
        "create_optimizer(model, args); Trainer(optimizer_cls_and_kwargs=...) and create_optimizer() are the "
        "override points",
        "loss_is_scaled_for_ga": "an internal flag of transformers' loss scaling (None on the class)",
        "set_initial_training_values": "the run's step plan is lockstep.trainer._step_plan.plan_steps, recorded "
        "in trainer.state (max_steps, num_train_epochs, train_batch_size)",
        "store_flos": "lockstep does not count floating-point operations (no state.total_flos)",
    },
    "trainer_attributes": {
        "can_return_loss": "lockstep does not inspect forward for return_loss: a loss in the outputs is used",
        "compute_objective": "kept by hyperparameter_search's own search object",
        "hp_name": "kept by hyperparameter_search's own search object",
        "hp_search_backend": "kept by hyperparameter_search's own search object (Optuna only)",
        "hp_space": "kept by hyperparameter_search's own search object",
        "objective": "kept by hyperparameter_search's own search object",
        "current_flos": "lockstep does not count floating-point operations",
        "current_gradient_accumulation_steps": "the accumulation is the Accelerator's "
        "(trainer.accelerator.gradient_accumulation_steps)",
        "deepspeed": "the DeepSpeed engine is trainer.model_wrapped",
        "gather_function": "evaluation gathers with trainer.accelerator.gather_for_metrics",
        "hub_model_id": "lockstep does not upload to the Hub (push_to_hub is refused)",
        "push_in_progress": "lockstep does not upload to the Hub (push_to_hub is refused)",
        "is_distributed_loading_by_transformers": "lockstep reads a tp_plan model's split from model.tp_size",
        "is_fsdp_xla_enabled": "lockstep does not run on TPUs (torch_xla)",
        "is_fsdp_xla_v1_enabled": "lockstep does not run on TPUs (torch_xla)",
        "is_fsdp_xla_v2_enabled": "lockstep does not run on TPUs (torch_xla)",
        "is_deepspeed_enabled": "lockstep does not ask which backend trains outside its backends; "
        "trainer.accelerator.distributed_type names it",
        "is_fsdp_enabled": "lockstep does not ask which backend trains outside its backends; "
        "trainer.accelerator.distributed_type names it",
        "is_in_train": "not tracked; trainer.state.global_step and max_steps tell where training is",
        "is_model_parallel": "transformers' naive model parallelism over devices of one process is not built; "
        "lockstep splits models with tensor parallelism (get_tp_size())",
        "label_smoother": "label smoothing is part of the training step's loss (label_smoothing_factor)",
        "model_preparation_time": "not measured",
        "neftune_hook_handle": "the NEFTune hook is kept privately and removed by the Trainer",
        "neftune_noise_alpha": "read args.neftune_noise_alpha",
        "place_model_on_device": "the Accelerator places the model in prepare()",
    },
}
"""Names lockstep does not have, and why."""

REFUSED_NAMES = {
    "training_arguments_members": {"set_push_to_hub": r"push_to_hub=True\) is not built in lockstep"},
    "trainer_members": {
        "push_to_hub": r"Trainer.push_to_hub\(commit_message='End of training'\) is refused: lockstep does not "
        r"upload",
        "init_hf_repo": r"Trainer.init_hf_repo\(\) is refused: lockstep does not upload",
    },
}
"""Names that exist and raise NotImplementedError, with the message they raise."""

SIGNATURE_DIFFERENCES = {
    "trainer_members.log": "start_time is not taken: lockstep's train() adds its speed metrics itself",
    "trainer_members.save_model": "_internal_call (transformers' private flag) is not taken",
    "trainer_members.train": "trial and ignore_keys_for_eval are not taken: hyperparameter_search passes the "
    "trial itself, and evaluations during training keep every output",
    "trainer_init": "lockstep's parameters after args are keyword-only (transformers' scripts pass them by "
    "name), and tokenizer= (transformers 4's name of processing_class) is taken too",
}
"""Implemented names whose parameters differ from transformers', and why."""


def status(section: str, name: str) -> str:
    if name in ABSENT_REASONS.get(section, {}):
        return ABSENT
    if name in REFUSED_NAMES.get(section, {}):
        return REFUSED
    return IMPLEMENTED


def parameters(function: Any) -> list[list[str | None]]:
    return [
        [p.name, p.kind.name, None if p.default is p.empty else _ADDRESS.sub("", repr(p.default))]
        for p in inspect.signature(function).parameters.values()
    ]


def lockstep_parameters(cls: type, name: str) -> list[list[str | None]] | None:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property) or not (callable(raw) or isinstance(raw, (staticmethod, classmethod))):
        return None
    return parameters(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw)


CLASSES = {"training_arguments_members": TrainingArguments, "trainer_members": Trainer}


@pytest.fixture
def trainer(tmp_path) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    return Trainer(torch.nn.Linear(2, 2), args)


def test_the_generated_file_is_transformers_5_surface():
    assert SURFACE["transformers_version"].startswith("5.")
    counts = {section: len(names) for section, names in SECTIONS.items()}
    assert counts == {
        "training_arguments_members": 29,
        "trainer_init": 13,
        "trainer_members": 48,
        "trainer_attributes": 45,
    }
    for section, reasons in {**ABSENT_REASONS, **REFUSED_NAMES}.items():
        assert set(reasons) <= set(SECTIONS[section]), f"{section}: listed names transformers does not have"


@pytest.mark.parametrize("section", sorted(CLASSES))
def test_every_member_is_implemented_with_transformers_signature_or_listed(section):
    cls, problems = CLASSES[section], []
    for name, recorded in SECTIONS[section].items():
        present = hasattr(cls, name)
        if status(section, name) == ABSENT:
            if present:
                problems.append(f"{name}: listed absent, but lockstep has it")
            continue
        if not present:
            problems.append(f"{name}: missing (implement it, or list it in ABSENT_REASONS with the reason)")
            continue
        if recorded["signature"] is None:
            if lockstep_parameters(cls, name) is not None and recorded["kind"] == "property":
                problems.append(f"{name}: transformers has a property, lockstep a method")
            continue
        differs = lockstep_parameters(cls, name) != recorded["signature"]
        listed = f"{section}.{name}" in SIGNATURE_DIFFERENCES
        if differs != listed:
            problems.append(f"{name}: lockstep {lockstep_parameters(cls, name)} vs {recorded['signature']}")
    assert problems == []


def test_refused_members_raise_their_message(trainer, tmp_path):
    with pytest.raises(NotImplementedError, match=REFUSED_NAMES["trainer_members"]["push_to_hub"]):
        trainer.push_to_hub()
    with pytest.raises(NotImplementedError, match=REFUSED_NAMES["trainer_members"]["init_hf_repo"]):
        trainer.init_hf_repo()
    args = TrainingArguments(output_dir=str(tmp_path))
    with pytest.raises(
        NotImplementedError, match=REFUSED_NAMES["training_arguments_members"]["set_push_to_hub"]
    ):
        args.set_push_to_hub("me/model")


def test_every_attribute_is_on_an_instance_or_listed(trainer):
    problems = []
    for name in SECTIONS["trainer_attributes"]:
        absent = status("trainer_attributes", name) == ABSENT
        if hasattr(trainer, name) == absent:
            problems.append(f"{name}: {'listed absent but present' if absent else 'missing'}")
    assert problems == []


def test_every_constructor_parameter_is_taken_with_transformers_default():
    ours = {name: (kind, default) for name, kind, default in parameters(Trainer.__init__)[1:]}
    theirs = {name: (value["kind"], value["default"]) for name, value in SECTIONS["trainer_init"].items()}
    assert {name: value[1] for name, value in theirs.items()} == {name: ours[name][1] for name in theirs}
    differs = any(ours[name][0] != kind for name, (kind, _) in theirs.items()) or set(ours) != set(theirs)
    assert differs == ("trainer_init" in SIGNATURE_DIFFERENCES)
    assert set(ours) - set(theirs) == {"tokenizer"}
