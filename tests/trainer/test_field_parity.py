"""Issue 16, item 1: every field of transformers' TrainingArguments, with its default, a checked-in status,
and a command-line option; fields not built refuse any other value at construction."""

import dataclasses
import typing

import pytest

from lockstep import ParallelismConfig, TrainingArguments
from lockstep.trainer._field_status import (
    ACCEPTED,
    FIELD_STATUS,
    IMPLEMENTED,
    LOCKSTEP_ONLY,
    NOT_BUILT,
    add_on_fields,
)

transformers = pytest.importorskip("transformers")

OURS = {f.name: f for f in dataclasses.fields(TrainingArguments)}
HINTS = typing.get_type_hints(TrainingArguments)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_the_checked_in_list_is_the_installed_transformers_field_list():
    theirs = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert set(FIELD_STATUS) == theirs, (
        f"new in transformers: {sorted(theirs - set(FIELD_STATUS))}; gone: {sorted(set(FIELD_STATUS) - theirs)}"
    )
    added = {spec.trainer_argument for spec, _ in add_on_fields()}  # fault_tolerance, registered layers'
    assert set(OURS) == set(FIELD_STATUS) | set(LOCKSTEP_ONLY) | added
    assert {status for status, _ in FIELD_STATUS.values()} == {IMPLEMENTED, ACCEPTED, NOT_BUILT}
    assert all(note for status, note in FIELD_STATUS.values() if status != IMPLEMENTED)


def test_every_default_is_transformers_default():
    theirs = {f.name: _default(f) for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    differing = {
        name: (_default(OURS[name]), value) for name, value in theirs.items() if _default(OURS[name]) != value
    }
    assert differing == {}
    args = TrainingArguments()
    assert (args.optim, args.output_dir, args.gradient_checkpointing, args.fsdp) == (
        "adamw_torch_fused",
        "trainer_output",
        False,
        None,  # transformers 5.24 leaves fsdp (and fsdp_config) None without FSDP
    )


def test_post_init_interplay_follows_transformers():
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", save_steps=10, eval_steps=5)
    assert (args.metric_for_best_model, args.greater_is_better, args.do_eval) == ("loss", False, True)
    args = TrainingArguments(metric_for_best_model="accuracy")
    assert args.greater_is_better is True
    args = TrainingArguments(
        gradient_checkpointing=True, gradient_checkpointing_kwargs='{"use_reentrant": true}'
    )
    assert args.activation_checkpointing is True and args.activation_checkpointing_kwargs == {
        "use_reentrant": True
    }
    args = TrainingArguments(eval_strategy="steps", logging_steps=7, include_num_input_tokens_seen=True)
    assert (args.eval_steps, args.include_num_input_tokens_seen) == (7, "all")
    assert TrainingArguments(warmup_steps=0.25).warmup_steps_for(10) == 3  # a fraction, rounded up
    assert TrainingArguments(warmup_steps=4).warmup_steps_for(10) == 4
    assert TrainingArguments(use_cpu=True).dataloader_pin_memory is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"load_best_model_at_end": True, "eval_strategy": "epoch"},
            r"load_best_model_at_end=True, eval_strategy='epoch', save_strategy='steps'\) is invalid: .*same",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 4, "save_steps": 6},
            r"save_steps=6, eval_steps=4\) is invalid: save_steps must be a multiple of eval_steps",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 0.1, "save_steps": 5},
            r"one is a fraction of the run and the other a number of steps",
        ),
        ({"save_strategy": "best"}, r"save_strategy='best'\) saves when an evaluation .* eval_strategy='no'"),
        (
            {"lr_scheduler_type": "reduce_lr_on_plateau"},
            r"reduce_lr_on_plateau'\) lowers the rate .* never evaluates",
        ),
        (
            {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"power": 2}},
            r"lr_scheduler_kwargs=\{'power': 2\}\) is invalid for lr_scheduler_type='cosine': it does not take "
            r"power \(it takes: num_cycles\)",
        ),
        (
            {"optim": "adam"},
            r"optim='adam'\) is invalid: it must be one of 'adamw_torch', 'adamw_torch_fused', 'adafactor'",
        ),
        ({"optim": "sgd", "optim_args": "momentum"}, r"'momentum' is not key=value"),
        (
            {"optim": "sgd", "optim_args": "betas=0.9"},
            r"'betas' is not an argument of this optimizer; it takes momentum",
        ),
        ({"warmup_steps": 2.5}, r"warmup_steps=2.5\) is invalid: a value >= 1 is a whole number"),
        ({"label_smoothing_factor": 1.0}, r"label_smoothing_factor=1.0\) is invalid: it must be in \[0, 1\)"),
        ({"log_level": "loud"}, r"log_level='loud'\) is invalid: it must be one of 'passive', 'debug'"),
        (
            {"torch_empty_cache_steps": 0},
            r"torch_empty_cache_steps=0\) is invalid: it must be an integer >= 1",
        ),
        ({"include_for_metrics": ["logits"]}, r"include_for_metrics='logits'\) is invalid"),
        ({"eval_delay": -1}, r"eval_delay=-1\) is invalid"),
    ],
)
def test_bad_combinations_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**kwargs)


def test_optimizers_that_need_other_packages_say_which_and_the_pip_line():
    with pytest.raises(
        NotImplementedError,
        match=r"optim='adamw_torch_4bit'\) is not built in lockstep: it needs "
        r"torchao \(pip install torchao\).*Trainer\(optimizers=\(optimizer, None\)\)",
    ):
        TrainingArguments(optim="adamw_torch_4bit")
    with pytest.raises(NotImplementedError, match=r"pip install bitsandbytes"):
        TrainingArguments(optim="paged_adamw_8bit")
    with pytest.raises(NotImplementedError, match=r"lr_scheduler_type='greedy'\) is not built"):
        TrainingArguments(lr_scheduler_type="greedy", eval_strategy="epoch")


NOT_BUILT_VALUES = {
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "use_liger_kernel": True,
    "liger_kernel_config": {"rope": True},
    "project": "mine",
    "trackio_space_id": "me/space",
    "trackio_bucket_id": "b",
    "trackio_static_space_id": "me/static",
    "push_to_hub": True,
    "hub_token": "hf_x",
    "hub_private_repo": True,
    "hub_model_id": "me/model",
    "hub_strategy": "end",
    "hub_always_push": True,
    "hub_revision": "dev",
    "ignore_data_skip": True,
    "dataloader_in_order": False,
    "debug": "underflow_overflow",
    "skip_memory_metrics": False,
    "optim_target_modules": ["attn"],
    "eval_use_gather_object": True,
}


def test_fields_not_built_refuse_other_values_at_construction():
    not_built = {name for name, (status, _) in FIELD_STATUS.items() if status == NOT_BUILT}
    assert not_built <= set(NOT_BUILT_VALUES)
    for name, value in NOT_BUILT_VALUES.items():
        with pytest.raises(
            NotImplementedError, match=rf"TrainingArguments\({name}=.*\) is not built in lockstep: "
        ):
            TrainingArguments(**{name: value})
    with pytest.raises(
        NotImplementedError, match=r"push_to_hub=True\) .*pip install huggingface_hub\) and network"
    ):
        TrainingArguments(push_to_hub=True)


CLI_SAMPLES = {
    "parallelism_config": ('{"tp_size": 2}', ParallelismConfig(tp_size=2)),
    "output_dir": ("runs/x", "runs/x"),
    "lr_scheduler_type": ("cosine", "cosine"),
    "lr_scheduler_kwargs": ('{"num_cycles": 2}', {"num_cycles": 2}),
    "warmup_steps": ("0.1", 0.1),
    "optim": ("sgd", "sgd"),
    "optim_args": ("momentum=0.9", "momentum=0.9"),
    "include_num_input_tokens_seen": ("non_padding", "non_padding"),
    "log_level": ("info", "info"),
    "log_level_replica": ("error", "error"),
    "report_to": ("jsonl", ["jsonl"]),
    "eval_strategy": ("epoch", "epoch"),
    "save_strategy": ("epoch", "epoch"),
    "logging_strategy": ("epoch", "epoch"),
    "metric_for_best_model": ("accuracy", "accuracy"),
    "dataloader_multiprocessing_context": ("spawn", "spawn"),
    "dataloader_num_workers": ("2", 2),
    "dataloader_prefetch_factor": ("4", 4),
    "train_sampling_strategy": ("sequential", "sequential"),
    "include_for_metrics": ("loss", ["loss"]),
    "label_names": ("start_positions end_positions", ["start_positions", "end_positions"]),
    "ddp_backend": ("gloo", "gloo"),
    "fsdp": ("full_shard", ["full_shard"]),
    "fsdp_config": ('{"min_num_params": 10}', {"min_num_params": 10}),
    "accelerator_config": ('{"even_batches": false}', False),
    "torch_compile_mode": ("default", "default"),
    "activation_checkpointing_policy": ("every_2", "every_2"),
    "tf32": ("false", False),
    "max_steps": ("7", 7),
    "warmup_ratio": ("0.5", 0.5),
    "loss_type": ("chunked_nll", "chunked_nll"),
    "adam_beta1": ("0.8", 0.8),
    "adam_beta2": ("0.99", 0.99),
    "label_smoothing_factor": ("0.1", 0.1),
    "average_tokens_across_devices": ("true", True),
    "eval_steps": ("5", 5),
    "deepspeed": None,  # the DeepSpeed work owns this field
    "evaluation_strategy": ("epoch", None),  # transformers 4's name: sets eval_strategy, then reads None
    "use_legacy_prediction_loop": ("false", False),  # True is not built
    "save_safetensors": ("true", True),  # False is not built
    "tpu_metrics_debug": ("false", False),  # True is not built
    "activation_checkpointing_kwargs": ('{"use_reentrant": false}', {"use_reentrant": False}),
    "gradient_checkpointing_kwargs": ('{"use_reentrant": false}', {"use_reentrant": False}),
}


CLI_NEEDS = {
    "dataloader_prefetch_factor": ["--dataloader_num_workers", "1"],
    "dataloader_persistent_workers": ["--dataloader_num_workers", "1"],
    "lr_scheduler_kwargs": ["--lr_scheduler_type", "cosine"],
    "optim_args": ["--optim", "sgd"],
    "load_best_model_at_end": ["--eval_strategy", "steps"],
}


def _cli_sample(name: str, default):
    if name in CLI_SAMPLES:
        return CLI_SAMPLES[name]
    if isinstance(default, bool):
        return ("false", False) if default else ("true", True)
    hint = str(HINTS[name])
    if default is None and "bool" in hint:
        return ("true", True)
    if isinstance(default, (int, float)) or (default is None and ("int" in hint or "float" in hint)):
        return ("3", 3)
    if isinstance(default, str) or (default is None and "str" in hint):
        return ("x", "x")
    raise AssertionError(f"add a CLI sample for {name}")


def test_from_cli_accepts_every_field():
    for name, f in OURS.items():
        status = FIELD_STATUS.get(name, (IMPLEMENTED, ""))[0]
        sample = None if status == NOT_BUILT else _cli_sample(name, _default(f))
        if sample is None:
            continue
        text, expected = sample
        argv = [f"--{name}", *(text.split() if name == "label_names" else [text])]
        args = TrainingArguments.from_cli(argv + CLI_NEEDS.get(name, []))
        value = getattr(args, name)
        if name == "accelerator_config":
            value = value.even_batches
        assert value == expected, name


def test_from_cli_explains_a_field_that_is_not_built(capsys):
    with pytest.raises(SystemExit):
        TrainingArguments.from_cli(["--push_to_hub"])
    assert "push_to_hub=True) is not built in lockstep" in capsys.readouterr().err
    assert (
        TrainingArguments.from_cli(["--push_to_hub", "false", "--hub_strategy", "every_save"]).push_to_hub
        is False
    )
