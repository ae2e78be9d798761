"""TrainingArguments(deepspeed=...): a tiny BERT with a config of "auto" values everywhere (the config's
AdamW and warm-up scheduler, ZeRO-3) trains, evaluates like one process and resumes exactly on 2 CPU
processes; the "auto" values come from the arguments and a contradicting value is an error listing each."""

from __future__ import annotations

import shutil

import pytest
import torch

from lockstep import TrainingArguments
from lockstep.backends.deepspeed.trainer_options import deepspeed_plugin_for
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires
from tests.trainer.test_transformers_models import QUIET, _check_against_one_process, _train, check_resumed_at

pytestmark = [
    requires("deepspeed", "transformers"),
    pytest.mark.distributed,
    pytest.mark.usefixtures("deepspeed_preloaded"),
]

AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": "auto"},
}


@pytest.mark.slow
def test_tiny_bert_under_zero3_with_auto_everywhere_trains_evaluates_and_resumes_exactly(tmp_path):
    options = {"deepspeed": AUTO, "save_strategy": "steps", "save_steps": 16, "warmup_steps": 4}
    result, _ = run_distributed(_train, 2, str(tmp_path / "full"), options, timeout=300, env=QUIET)
    _check_against_one_process(result)
    shutil.copytree(
        tmp_path / "full" / "checkpoint-16", tmp_path / "resumed" / "checkpoint-16"
    )  # mid-epoch 3
    resumed, _ = run_distributed(
        _train, 2, str(tmp_path / "resumed"), options, True, 1, timeout=300, env=QUIET
    )  # other initial weights (model seed 1): only a real load reaches the uninterrupted run's weights
    check_resumed_at(resumed["printed"], tmp_path / "resumed" / "checkpoint-16", 16, 36)
    for name, value in result["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert resumed["metrics"]["eval_loss"] == result["metrics"]["eval_loss"]


@pytest.mark.slow
def test_bf16_through_the_deepspeed_config_trains_under_zero2(tmp_path):
    config = {**AUTO, "zero_optimization": {"stage": 2}}
    result, _ = run_distributed(
        _train,
        2,
        str(tmp_path / "bf16"),
        {"deepspeed": config, "bf16": True, "warmup_steps": 2},
        timeout=300,
        env=QUIET,
    )
    assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]
    assert result["metrics"]["eval_accuracy"] > 0.9
    assert all(
        tensor.dtype == torch.bfloat16 for tensor in result["weights"].values()
    )  # the engine's bf16 copy


def test_auto_values_come_from_the_arguments(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=2e-3,
        adam_beta1=0.8,
        weight_decay=0.1,
        deepspeed=AUTO,
        use_cpu=True,
    )
    config = deepspeed_plugin_for(args, num_processes=4).deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (3, 24)
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (2, 0.5)
    assert config["optimizer"]["params"] == {
        "lr": 2e-3,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
    }
    assert config["scheduler"]["params"]["warmup_max_lr"] == 2e-3
    assert config["scheduler"]["params"]["warmup_num_steps"] == "auto"  # filled once the steps are planned
    assert config["bf16"]["enabled"] is False


def test_config_values_that_contradict_the_arguments_are_listed(tmp_path):
    config = {**AUTO, "gradient_clipping": 2.0, "train_micro_batch_size_per_gpu": 16}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, deepspeed=config, use_cpu=True
    )
    with pytest.raises(ValueError) as caught:
        deepspeed_plugin_for(args, num_processes=1)
    message = str(caught.value)
    assert "train_micro_batch_size_per_gpu: DeepSpeed config 16, TrainingArguments 8" in message
    assert "gradient_clipping: DeepSpeed config 2.0, TrainingArguments 1.0" in message
    with pytest.raises(ValueError, match="both fsdp and deepspeed"):
        TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", deepspeed=AUTO)


def test_a_warmup_scheduler_without_warmup_steps_is_refused_with_what_to_set():
    from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
    from lockstep.backends.deepspeed.trainer_options import fill_schedule

    plugin = DeepSpeedPlugin(hf_ds_config=AUTO)
    with pytest.raises(ValueError, match="WarmupDecayLR needs at least one warm-up step.*Set warmup_steps"):
        fill_schedule(plugin, warmup_steps=0, max_steps=10)
    fill_schedule(plugin, warmup_steps=2, max_steps=10)
    assert plugin.deepspeed_config["scheduler"]["params"]["total_num_steps"] == 10
