"""TrainingArguments: defaults, validation messages, JSON dict/path fields, command-line parsing, FSDP mapping,
learning-rate schedules."""

import argparse
import json
import math

import pytest
import torch

from lockstep import TrainingArguments
from lockstep.backends.fsdp.trainer_options import (
    fsdp_plugin_kwargs,
    normalize_fsdp_config,
    parse_fsdp_options,
)
from lockstep.trainer import AcceleratorConfig
from lockstep.trainer.schedules import get_scheduler


def test_defaults_follow_transformers():
    args = TrainingArguments()
    assert args.output_dir == "trainer_output"
    assert (args.num_train_epochs, args.max_steps, args.learning_rate) == (3.0, -1, 5e-5)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert (args.lr_scheduler_type, args.warmup_steps, args.max_grad_norm) == ("linear", 0, 1.0)
    assert (args.logging_steps, args.save_steps, args.eval_strategy, args.save_strategy) == (
        500,
        500,
        "no",
        "steps",
    )
    assert (args.seed, args.ddp_timeout, args.dataloader_pin_memory) == (42, 1800, True)
    assert args.report_to == [] and args.disable_tqdm is False
    assert args.fsdp is None and args.fsdp_config is None  # as in transformers 5.24
    assert args.accelerator_config == AcceleratorConfig(
        split_batches=False,
        dispatch_batches=None,
        even_batches=True,
        use_seedable_sampler=True,
        non_blocking=False,
    )
    assert args.accelerator_config.even_batches is True


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bf16": True, "fp16": True}, ValueError, r"bf16=True, fp16=True\) is invalid: choose one"),
        (
            {"ddp_backend": "mpi"},
            ValueError,
            r"ddp_backend='mpi'\) is invalid: it must be one of 'nccl', 'gloo'",
        ),
        (
            {"lr_scheduler_type": "step"},
            ValueError,
            r"lr_scheduler_type='step'\) is invalid: it must be one of 'linear'",
        ),
        ({"eval_strategy": "sometimes"}, ValueError, r"eval_strategy='sometimes'\) is invalid"),
        ({"max_steps": 0}, ValueError, r"max_steps=0\) is invalid: give a number of steps >= 1, or -1"),
        ({"gradient_accumulation_steps": 0}, ValueError, r"gradient_accumulation_steps=0\) is invalid"),
        ({"per_device_train_batch_size": 2.5}, ValueError, r"per_device_train_batch_size=2.5\) is invalid"),
        ({"save_total_limit": 0}, ValueError, r"save_total_limit=0\) is invalid: it must be an integer >= 1"),
        ({"warmup_ratio": 1.5}, ValueError, r"warmup_ratio=1.5\) is invalid: it must be in \[0, 1\]"),
        ({"adam_beta2": 1.0}, ValueError, r"adam_beta2=1.0\) is invalid: it must be in \[0, 1\)"),
        ({"logging_steps": 0}, ValueError, r"logging_steps=0\) is invalid"),
        ({"save_steps": 2.5}, ValueError, r"save_steps=2.5\) is invalid: a value > 1 must be a whole number"),
        ({"ddp_timeout": 0}, ValueError, r"ddp_timeout=0\) is invalid"),
        ({"torch_compile_mode": "fast"}, ValueError, r"torch_compile_mode='fast'\) is invalid"),
        ({"report_to": "neptune"}, ValueError, r"report_to='neptune'\) is invalid"),
        ({"dataloader_prefetch_factor": 2}, ValueError, r"needs dataloader_num_workers > 0"),
        ({"output_dir": ""}, ValueError, r"output_dir=''\) is invalid"),
        ({"accelerator_config": {"split_batch": True}}, ValueError, r"unknown key\(s\) \['split_batch'\]"),
        ({"accelerator_config": {"even_batches": "yes"}}, ValueError, r"even_batches='yes' is invalid"),
        ({"fsdp": "full_shard shard_grad_op"}, ValueError, r"names 2 sharding strategies"),
        ({"fsdp": "zero3"}, ValueError, r"'zero3' is not an FSDP option"),
        ({"fsdp_config": {"fsdp_wrap_everything": True}}, ValueError, r"unknown key 'fsdp_wrap_everything'"),
        (
            {"fsdp": "full_shard", "deepspeed": {"zero_optimization": {}}},
            ValueError,
            r"both fsdp and deepspeed",
        ),
        ({"accelerator_config": 3}, TypeError, r"accelerator_config=3\) is invalid: pass a dict"),
    ],
)
def test_invalid_arguments_are_explained(kwargs, error, message):
    with pytest.raises(error, match=message):
        TrainingArguments(**kwargs)


def test_eval_steps_default_to_logging_steps_and_fractions_are_kept():
    args = TrainingArguments(eval_strategy="steps", logging_steps=25)
    assert args.eval_steps == 25
    assert TrainingArguments(save_steps=0.25).save_steps == 0.25
    assert TrainingArguments(torch_compile_backend="eager").torch_compile is True


def test_dict_fields_accept_a_dict_json_text_or_a_json_file(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"split_batches": True, "non_blocking": True}))
    from_file = TrainingArguments(accelerator_config=str(path)).accelerator_config
    from_text = TrainingArguments(
        accelerator_config='{"split_batches": true, "non_blocking": true}'
    ).accelerator_config
    from_dict = TrainingArguments(
        accelerator_config={"split_batches": True, "non_blocking": True}
    ).accelerator_config
    assert from_file == from_text == from_dict
    assert isinstance(from_file, AcceleratorConfig)
    assert from_file.split_batches is True and from_file.use_seedable_sampler is True
    given = AcceleratorConfig(even_batches=False)
    assert TrainingArguments(accelerator_config=given).accelerator_config is given
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    assert TrainingArguments(deepspeed=str(ds)).deepspeed == {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"fsdp_config='missing.json'\) is invalid: no such file"):
        TrainingArguments(fsdp_config="missing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad.json holds a JSON list; it must hold an object"):
        TrainingArguments(fsdp_config=str(tmp_path / "bad.json"))


def test_from_cli_parses_every_kind_of_field():
    args = TrainingArguments.from_cli(
        [
            "--learning_rate", "3e-5",
            "--bf16",
            "--dataloader_pin_memory", "false",
            "--max_steps", "7",
            "--report_to", "jsonl", "csv",
            "--label_names", "labels", "extra",
            "--save_total_limit", "none",
            "--accelerator_config", '{"even_batches": false}',
            "--fsdp", "full_shard auto_wrap",
            "--logging_steps", "0.1",
        ]
    )  # fmt: skip
    assert args.learning_rate == 3e-5 and args.bf16 is True and args.dataloader_pin_memory is False
    assert (
        args.max_steps == 7 and args.report_to == ["jsonl", "csv"] and args.label_names == ["labels", "extra"]
    )
    assert args.save_total_limit is None and args.accelerator_config.even_batches is False
    assert args.fsdp == ["full_shard", "auto_wrap"] and args.logging_steps == 0.1


def test_from_cli_rejects_unknown_and_invalid_options_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exited:
        TrainingArguments.from_cli(["--learnig_rate", "3e-5"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --learnig_rate 3e-5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        TrainingArguments.from_cli(["--bf16", "--fp16"])
    assert exited.value.code == 2
    assert "bf16=True, fp16=True) is invalid" in capsys.readouterr().err


def test_parse_known_cli_returns_the_rest_and_from_cli_with_parses_the_scripts_own_options():
    args, rest = TrainingArguments.parse_known_cli(["--seed", "3", "--data", "x.csv"])
    assert args.seed == 3 and rest == ["--data", "x.csv"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--limit", type=int, default=0)
    args, own = TrainingArguments.from_cli_with(
        parser, ["--data", "x.csv", "--num_train_epochs", "2"], defaults={"learning_rate": 1e-4}
    )
    assert vars(own) == {"data": "x.csv", "limit": 0}
    assert args.num_train_epochs == 2 and args.learning_rate == 1e-4 and args.data_seed is None


def test_fsdp_options_map_to_plugin_fields():
    assert parse_fsdp_options("full_shard, offload") == ["full_shard", "offload"]
    assert fsdp_plugin_kwargs([], {"min_num_params": 10}) == {}
    assert fsdp_plugin_kwargs(["shard_grad_op", "offload"], None) == {
        "fsdp_version": 2,
        "reshard_after_forward": False,
        "cpu_offload": True,
        "auto_wrap_policy": "NO_WRAP",
    }
    config = {"fsdp_transformer_layer_cls_to_wrap": "BertLayer", "fsdp_activation_checkpointing": "true"}
    assert fsdp_plugin_kwargs(["full_shard", "auto_wrap"], config) == {
        "fsdp_version": 2,
        "reshard_after_forward": True,
        "cpu_offload": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_cls_names_to_wrap": ["BertLayer"],
        "activation_checkpointing": True,
    }
    by_size = fsdp_plugin_kwargs(
        ["auto_wrap"], {"min_num_params": 1000, "state_dict_type": "FULL_STATE_DICT"}
    )
    assert by_size["auto_wrap_policy"] == "SIZE_BASED_WRAP" and by_size["min_num_params"] == 1000
    assert by_size["state_dict_type"] == "FULL_STATE_DICT" and by_size["reshard_after_forward"] is True
    from_model = fsdp_plugin_kwargs(["full_shard", "auto_wrap"], {}, no_split_modules=["BertLayer"])
    assert from_model["transformer_cls_names_to_wrap"] == ["BertLayer"]
    assert normalize_fsdp_config({"fsdp_version": 2, "cpu_ram_efficient_loading": True}) == {
        "version": 2,
        "cpu_ram_efficient_loading": True,
    }


@pytest.mark.parametrize(
    ("options", "config", "error", "message"),
    [
        (
            ["shard_grad_op"],
            {"reshard_after_forward": True},
            ValueError,
            r"means reshard_after_forward=False",
        ),
        (
            ["full_shard"],
            {"transformer_layer_cls_to_wrap": ["L"]},
            ValueError,
            r"fsdp has no 'auto_wrap' option",
        ),
        (["auto_wrap"], {}, ValueError, r"neither fsdp_config.transformer_layer_cls_to_wrap nor the model"),
        (["auto_wrap"], {"min_num_params": 5, "transformer_layer_cls_to_wrap": "L"}, ValueError, r"Keep one"),
        (["hybrid_shard"], {}, NotImplementedError, r"hybrid sharding needs a 2-D device mesh"),
        (["no_shard"], {}, ValueError, r"Leave fsdp empty to train with DDP"),
        (["full_shard"], {"xla": True}, NotImplementedError, r"XLA/TPU is not supported"),
        (["full_shard"], {"version": 2, "fsdp_version": 2}, ValueError, r"gives 'version' twice"),
    ],
)
def test_fsdp_contradictions_are_explained(options, config, error, message):
    with pytest.raises(error, match=message):
        fsdp_plugin_kwargs(options, config)


def _lrs(name: str, warmup: int, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    values = []
    for _ in range(total):
        values.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return values


def test_schedules_follow_the_transformers_formulas():
    assert _lrs("linear", 2, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    assert _lrs("constant", 2, 3) == [1.0, 1.0, 1.0]
    assert _lrs("constant_with_warmup", 2, 4) == pytest.approx([0.0, 0.5, 1.0, 1.0])
    expected = [0.0, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 1) / 5)) for s in range(2, 6)]
    assert _lrs("cosine", 1, 6) == pytest.approx(expected)


def test_scheduler_state_loads_with_weights_only(tmp_path):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=5)
    optimizer.step()
    scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    fresh = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=5)
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert fresh.last_epoch == 1 and fresh.get_last_lr() == scheduler.get_last_lr()


def test_accelerator_config_becomes_an_object_and_fsdp_defaults_to_none_as_in_transformers():
    args = TrainingArguments(accelerator_config={"even_batches": False})
    assert isinstance(args.accelerator_config, AcceleratorConfig)
    assert args.accelerator_config.even_batches is False and args.accelerator_config.split_batches is False
    assert (
        args.to_dict()["accelerator_config"]["even_batches"] is False
    )  # plain values for trainer_state.json
    json.dumps(args.to_dict()["accelerator_config"])
    assert (args.fsdp, args.fsdp_config) == (None, None)
    sharded = TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_min_num_params": 10})
    assert sharded.fsdp == ["full_shard"] and sharded.fsdp_config == {"min_num_params": 10}
    with pytest.raises(TypeError, match=r"accelerator_config=AcceleratorConfig\) is invalid: it is a class"):
        TrainingArguments(accelerator_config=AcceleratorConfig)
