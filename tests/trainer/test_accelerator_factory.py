"""create_accelerator_and_postprocess: TrainingArguments -> a real Accelerator, and the checks after it."""

import json
import logging
from datetime import timedelta

import pytest
from torch import nn

from lockstep import Accelerator, DistributedType, FullyShardedDataParallelPlugin, TrainingArguments
from lockstep.trainer.accelerator_factory import (
    backend_plugins,
    check_launcher_agreement,
    create_accelerator_and_postprocess,
    ddp_kwargs,
)


class CheckpointableModel(nn.Module):
    """Says it supports gradient checkpointing, as transformers models do."""

    supports_gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        pass


def _launch_config(monkeypatch, **settings):
    monkeypatch.setenv("LOCKSTEP_LAUNCH_CONFIG", json.dumps(settings))


def test_settings_reach_the_accelerator(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=3,
        accelerator_config={"split_batches": True, "even_batches": False, "use_seedable_sampler": False},
        data_seed=7,
        ddp_backend="gloo",
        ddp_timeout=90,
        ddp_bucket_cap_mb=5,
        ddp_broadcast_buffers=False,
        torch_compile_backend="eager",
        report_to="jsonl",
    )
    accelerator = create_accelerator_and_postprocess(args, nn.Linear(2, 2))
    assert accelerator.gradient_accumulation_steps == 3
    assert (accelerator.split_batches, accelerator.even_batches, accelerator.use_seedable_sampler) == (
        True,
        False,
        False,
    )
    assert accelerator.settings.dataloader_config.data_seed == 7
    assert accelerator.project_dir == str(tmp_path) and accelerator.logging_dir == str(tmp_path)
    handlers = accelerator.settings.handlers
    assert handlers.init.timeout == timedelta(seconds=90) and handlers.init.backend == "gloo"
    assert (handlers.ddp.bucket_cap_mb, handlers.ddp.broadcast_buffers) == (5, False)
    assert accelerator.settings.dynamo_plugin.backend == "eager"
    assert accelerator.step_scheduler_with_optimizer is False
    accelerator.init_trackers("run")
    assert accelerator.get_tracker("jsonl").name == "jsonl"
    assert accelerator.fsdp_plugin is None and accelerator.distributed_type == DistributedType.NO
    accelerator.end_training()


def test_accumulation_is_the_trainers_and_a_launcher_value_is_not_applied_on_top(
    monkeypatch, caplog, tmp_path
):
    _launch_config(monkeypatch, gradient_accumulation_steps=4)
    assert Accelerator().gradient_accumulation_steps == 4  # what a plain Accelerator would do
    with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
        accelerator = create_accelerator_and_postprocess(
            TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2), None
        )
    assert accelerator.gradient_accumulation_steps == 2
    assert "launcher asked for gradient_accumulation_steps=4, TrainingArguments for 2" in caplog.text


def test_find_unused_parameters_default():
    plain, checkpointable = nn.Linear(2, 2), CheckpointableModel()
    assert ddp_kwargs(TrainingArguments(), plain).find_unused_parameters is False
    assert ddp_kwargs(TrainingArguments(), checkpointable).find_unused_parameters is True
    with_gc = TrainingArguments(gradient_checkpointing=True)
    assert ddp_kwargs(with_gc, checkpointable).find_unused_parameters is False
    explicit = TrainingArguments(ddp_find_unused_parameters=True)
    assert ddp_kwargs(explicit, plain).find_unused_parameters is True


def test_find_unused_parameters_is_on_for_transformers_models_without_checkpointing_support():
    """transformers' rule for any PreTrainedModel (XLNet leaves its mask embedding unused: DDP failed without
    it in run_qa_beam_search.py), whether or not the model supports gradient checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.XLNetConfig(vocab_size=20, d_model=8, n_layer=1, n_head=2, d_inner=16)
    model = transformers.XLNetForQuestionAnswering(config)
    assert not model.supports_gradient_checkpointing
    assert ddp_kwargs(TrainingArguments(), model).find_unused_parameters is True
    assert (
        ddp_kwargs(TrainingArguments(ddp_find_unused_parameters=False), model).find_unused_parameters is False
    )


def _deepspeed_accelerator(folder: str) -> tuple[str, int, int]:
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=3, deepspeed={"zero_optimization": {"stage": 2}}
    )
    accelerator = create_accelerator_and_postprocess(args, None)
    config = accelerator.deepspeed_plugin.deepspeed_config
    return (
        accelerator.distributed_type.value,
        config["zero_optimization"]["stage"],
        config["gradient_accumulation_steps"],
    )


@pytest.mark.distributed
def test_deepspeed_arguments_build_the_deepspeed_plugin(tmp_path):
    pytest.importorskip("deepspeed")
    from tests.helpers.multiprocess import run_distributed

    # In a forked worker: DeepSpeed sets process-wide variables (LOCAL_RANK, DS_ACCELERATOR) when it loads.
    assert run_distributed(_deepspeed_accelerator, 1, str(tmp_path), timeout=120)[0] == ("DEEPSPEED", 2, 1)


def test_fsdp_arguments_build_the_plugin(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path), fsdp="shard_grad_op auto_wrap", fsdp_config={"min_num_params": 1000}
    )
    accelerator = create_accelerator_and_postprocess(args, nn.Linear(2, 2))
    plugin = accelerator.fsdp_plugin
    assert isinstance(plugin, FullyShardedDataParallelPlugin)
    assert plugin.reshard_after_forward is False and plugin.auto_wrap_policy == "SIZE_BASED_WRAP"
    assert plugin.min_num_params == 1000 and plugin.cpu_offload is False


def test_fsdp_activation_checkpointing_with_gradient_checkpointing_is_an_error(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fsdp="full_shard",
        fsdp_config={"activation_checkpointing": True},
        gradient_checkpointing=True,
    )
    with pytest.raises(
        ValueError, match=r"gradient_checkpointing=True\) and fsdp_config activation_checkpointing"
    ):
        create_accelerator_and_postprocess(args, CheckpointableModel())


def test_launcher_fsdp_makes_the_fields_unnecessary_and_is_checked_after_creation(monkeypatch, tmp_path):
    _launch_config(
        monkeypatch,
        distributed_type="FSDP",
        fsdp_config={"fsdp_activation_checkpointing": True, "fsdp_auto_wrap_policy": "NO_WRAP"},
    )
    accelerator = create_accelerator_and_postprocess(
        TrainingArguments(output_dir=str(tmp_path)), nn.Linear(2, 2)
    )
    assert accelerator.distributed_type == DistributedType.FSDP
    assert accelerator.fsdp_plugin.activation_checkpointing is True
    args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True)
    with pytest.raises(ValueError, match=r"both recompute activations"):
        create_accelerator_and_postprocess(args, None)


def test_arguments_that_contradict_the_launchers_fsdp_config_are_an_error():
    launch = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True, "fsdp_version": 2}}
    agreeing = backend_plugins(TrainingArguments(fsdp="full_shard offload"), None, launch)
    assert agreeing["fsdp_plugin"].cpu_offload is True
    assert agreeing["deepspeed_plugin"] is None
    assert backend_plugins(TrainingArguments(), None, launch) == {
        "deepspeed_plugin": None,
        "fsdp_plugin": None,
    }
    check_launcher_agreement(TrainingArguments(), launch)  # FSDP comes from the launcher alone
    with pytest.raises(
        ValueError, match=r"contradict the launcher's FSDP config \(cpu_offload: arguments False"
    ):
        backend_plugins(TrainingArguments(fsdp="full_shard"), None, launch)
    backend_plugins(TrainingArguments(fsdp="full_shard"), None, {"distributed_type": "FSDP"})  # no section
    with pytest.raises(ValueError, match=r"launcher's config selected DeepSpeed, but .*fsdp"):
        check_launcher_agreement(TrainingArguments(fsdp="full_shard"), {"distributed_type": "DEEPSPEED"})
    with pytest.raises(ValueError, match=r"launcher's config selected FSDP, but .*deepspeed"):
        check_launcher_agreement(TrainingArguments(deepspeed={"a": 1}), launch)


def test_launcher_agreement_compares_in_the_plugins_form():
    # The launcher writes the file's spellings (FSDP1 strategy names, comma-separated classes); the
    # arguments use transformers'. Both become plugin fields through the key table before comparing.
    launch = {
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
            "fsdp_transformer_layer_cls_to_wrap": "A,B",
            "fsdp_cpu_offload": False,
            "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        },
    }
    agreeing = TrainingArguments(
        fsdp="shard_grad_op auto_wrap", fsdp_config={"transformer_cls_names_to_wrap": ["A", "B"]}
    )
    assert backend_plugins(agreeing, None, launch)["fsdp_plugin"].transformer_cls_names_to_wrap == ["A", "B"]
    contradicting = TrainingArguments(
        fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": "A"}
    )
    with pytest.raises(ValueError) as caught:
        backend_plugins(contradicting, None, launch)
    assert str(caught.value) == (
        "TrainingArguments(fsdp/fsdp_config) contradict the launcher's FSDP config (reshard_after_forward: "
        "arguments True, launcher config False; transformer_cls_names_to_wrap: arguments ['A'], launcher config "
        "['A', 'B']). The launcher's config already enables FSDP: drop fsdp/fsdp_config from the arguments, or "
        "make them agree."
    )


def test_non_blocking_without_pinned_memory_logs_a_performance_warning(caplog, tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path), accelerator_config={"non_blocking": True}, dataloader_pin_memory=False
    )
    with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
        accelerator = create_accelerator_and_postprocess(args, None)
    assert accelerator.non_blocking is True
    assert "non_blocking=True has no effect without dataloader_pin_memory=True" in caplog.text


def test_accelerator_fsdp_plugin_property_reports_the_plugin_in_force():
    assert Accelerator().fsdp_plugin is None
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP")
    assert Accelerator(fsdp_plugin=plugin).fsdp_plugin is plugin
