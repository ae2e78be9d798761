"""DeepSpeedPlugin: Accelerate's fields and defaults, the JSON config they make or that is given, the
"auto" rules and errors of prepare, and the launcher's reading of the deepspeed_config section. No process
group and no DeepSpeed engine here (tests/backends/test_deepspeed*.py train)."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from lockstep.backends.deepspeed import auto
from lockstep.backends.deepspeed.placeholders import DummyOptim, DummyScheduler
from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin, load_deepspeed_config
from lockstep.backends.deepspeed.section import (
    check_deepspeed_section,
    deepspeed_launcher_notes,
    plugin_fields,
)


@pytest.fixture(autouse=True)
def _no_launcher_variables(monkeypatch):
    for name in (
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "ACCELERATE_GRADIENT_CLIPPING",
    ):
        monkeypatch.delenv(name, raising=False)


def test_the_fields_make_accelerates_config():
    plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == 2  # Accelerate's default stage
    assert config["train_micro_batch_size_per_gpu"] == config["train_batch_size"] == "auto"
    assert config["gradient_accumulation_steps"] == "auto" and config["gradient_clipping"] == "auto"
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert plugin.zero3_init_flag is False and plugin.is_train_batch_min
    nvme = DeepSpeedPlugin(zero_stage=3, offload_param_device="nvme", offload_param_nvme_path="/nvme")
    assert nvme.deepspeed_config["zero_optimization"]["offload_param"] == {
        "device": "nvme",
        "nvme_path": "/nvme",
    }
    assert nvme.is_zero3() and nvme.is_offload() and nvme.zero3_init_flag is True


def test_the_launchers_variables_are_the_defaults(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    plugin = DeepSpeedPlugin()
    assert plugin.stage == 1 and plugin.get_value("gradient_accumulation_steps") == 4


def test_a_json_config_loads_from_a_dict_a_file_text_or_base64(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    for source in (config, str(path), json.dumps(config), encoded):
        assert load_deepspeed_config(source)["zero_optimization"]["stage"] == 3
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    assert plugin.get_value("gradient_accumulation_steps") == 1  # added, as in Accelerate
    assert config == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}  # not modified


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 4}, r"ZeRO stage 4 is invalid"),
        ({"hf_ds_config": {"train_batch_size": 8}}, r"no zero_optimization section"),
        ({"hf_ds_config": "/no/such/file.json"}, r"is not a DeepSpeed config: pass a dict"),
        ({"offload_optimizer_device": "gpu"}, r"offload_optimizer_device='gpu'\) is invalid"),
        (
            {
                "hf_ds_config": {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0},
                "zero_stage": 3,
                "gradient_clipping": 0.5,
            },
            r"config \(hf_ds_config\) and the other DeepSpeed settings disagree: gradient_clipping=0.5 against "
            r"gradient_clipping=1.0; zero_stage=3 against zero_optimization.stage=2",
        ),
    ],
)
def test_bad_plugin_settings_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedPlugin(**kwargs)


def test_fields_fill_what_a_json_config_leaves_out():
    plugin = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": "auto"}}, zero_stage=3, gradient_clipping=0.5
    )
    assert plugin.stage == 3 and plugin.get_value("gradient_clipping") == 0.5


def test_mixed_precision_fills_the_config_and_a_contradiction_is_refused():
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"] == {"enabled": True} and plugin.deepspeed_config["fp16"] == {
        "enabled": False
    }
    assert plugin.mixed_precision_of_config() == "bf16"
    fp16 = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    with pytest.raises(
        ValueError, match="mixed_precision='bf16' contradicts the DeepSpeed config, which enables fp16"
    ):
        fp16.set_mixed_precision("bf16")


def test_zero3_init_flag_is_for_stage_3_only():
    with pytest.warns(UserWarning, match="applies to ZeRO stage 3 only"):
        plugin = DeepSpeedPlugin(zero_stage=2, zero3_init_flag=True)
    assert plugin.zero3_init_flag is False
    with pytest.raises(NotImplementedError, match="MS-AMP"):
        DeepSpeedPlugin(enable_msamp=True)


def _run(*sizes, split=False, accumulation=1, processes=2) -> auto.TrainingRun:
    return auto.TrainingRun(
        batch_sizes=list(sizes), accumulation_steps=accumulation, num_processes=processes, split_batches=split
    )


def test_auto_batch_sizes_follow_accelerate():
    plugin = DeepSpeedPlugin()
    assert auto.micro_batch_size(plugin, _run(8, 4), training=True) == 4  # is_train_batch_min
    assert auto.micro_batch_size(plugin, _run(8, split=True), training=True) == 4  # split over 2 processes
    largest = DeepSpeedPlugin(is_train_batch_min=False)
    assert auto.micro_batch_size(largest, _run(8, 4), training=True) == 8
    model = torch.nn.Linear(2, 2)
    values = auto.auto_values(
        plugin, _run(4, accumulation=3), model=model, optimizer=object(), scheduler=None
    )
    assert (values["train_micro_batch_size_per_gpu"], values["train_batch_size"]) == (4, 4 * 3 * 2)
    assert plugin.get_value("gradient_accumulation_steps") == 3 and values["gradient_clipping"] == 1.0


def test_auto_values_that_cannot_be_filled_are_errors():
    plugin = DeepSpeedPlugin()
    with pytest.raises(ValueError, match="prepare\\(\\) was given no dataloader"):
        auto.micro_batch_size(plugin, _run(), training=True)
    with pytest.raises(ValueError, match="has batch_size None"):
        auto.micro_batch_size(plugin, _run(None), training=True)
    bucket = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    with pytest.raises(
        ValueError, match="Linear has no config. Write numbers for zero_optimization.reduce_bucket_size"
    ):
        auto.auto_values(bucket, _run(4), model=torch.nn.Linear(2, 2), optimizer=None, scheduler=None)
    plain = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "scheduler": {"params": {"total_num_steps": "auto"}}}
    )
    with pytest.raises(
        ValueError, match='sets scheduler.params.total_num_steps to "auto", and lockstep has nothing'
    ):
        plain.deepspeed_config_process(must_match=False)


def test_hidden_size_fills_the_bucket_sizes():
    class Config:
        hidden_size = 16

    model = torch.nn.Linear(2, 2)
    model.config = Config()
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            }
        }
    )
    values = auto.auto_values(plugin, _run(4), model=model, optimizer=None, scheduler=None)
    assert values["zero_optimization.reduce_bucket_size"] == 256
    assert values["zero_optimization.stage3_param_persistence_threshold"] == 160


def test_optimizer_and_scheduler_combinations_accelerate_refuses():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with_optimizer = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    )
    with pytest.raises(ValueError, match="has an optimizer section and prepare\\(\\) was given a SGD"):
        auto.check_optimizer_and_scheduler(with_optimizer, torch.optim.SGD(params, lr=0.1), None)
    with pytest.raises(ValueError, match="was given a DummyOptim, and the DeepSpeed config has no optimizer"):
        auto.check_optimizer_and_scheduler(DeepSpeedPlugin(), DummyOptim(params), None)
    with pytest.raises(ValueError, match="A DummyScheduler goes with a DummyOptim"):
        auto.check_optimizer_and_scheduler(
            DeepSpeedPlugin(),
            torch.optim.SGD(params, lr=0.1),
            DummyScheduler(None, lr_scheduler_callable=print),
        )
    with pytest.raises(ValueError, match="DummyScheduler with no lr_scheduler_callable"):
        auto.check_optimizer_and_scheduler(with_optimizer, DummyOptim(params), DummyScheduler(None))


def test_the_launchers_section_becomes_plugin_fields_and_is_checked():
    assert plugin_fields({"zero_stage": 3, "deepspeed_moe_layer_cls_names": "Block"}) == {
        "zero_stage": 3,
        "transformer_moe_cls_names": "Block",
    }
    with pytest.raises(ValueError, match="deepspeed_config.zero_stages is not a setting of DeepSpeedPlugin"):
        plugin_fields({"zero_stages": 3})
    with pytest.raises(ValueError, match="--gradient-accumulation-steps 4 contradicts"):
        check_deepspeed_section({"gradient_accumulation_steps": 2}, mixed_precision="no", accumulation=4)
    notes = deepspeed_launcher_notes({"deepspeed_hostfile": "hosts", "zero_stage": 2})
    assert len(notes) == 1 and notes[0].startswith("deepspeed_hostfile: DeepSpeed's own launcher")
