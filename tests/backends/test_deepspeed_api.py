"""The Accelerator's API under DeepSpeed on one process (a process group of one, as DeepSpeed needs):
get_state_dict and save_model under ZeRO-3, free_memory, named plugins, zero3_init, the scheduler the
engine steps, and the errors before any work (DeepSpeed missing, wrong plugin types, and fp16 on a CPU
without fp16 support).

fp16 depends on the CPU: DeepSpeed trains fp16 on a CPU only where oneDNN has fp16 kernels (avx512_fp16,
as on Xeons with AMX). The fp16 test asks DeepSpeed's own accelerator query, as lockstep does, and checks
the path this machine has: the refusal, or fp16 training on 2 processes against 1 process on the global
batch. Measured with DeepSpeed told that fp16 is supported on a CPU without it (torch's reference fp16
kernels), ZeRO-2, 12 SGD steps, no step skipped: 2 processes against 1 process on the global batch 2.4e-4
(one fp16 rounding step), either against fp32 PyTorch 3.4e-3 (fp16 parameters keep about 3 digits)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fsdp_models import data_loader, loss_of, make_transformer, reference_run
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

pytestmark = [requires("deepspeed"), pytest.mark.distributed, pytest.mark.usefixtures("deepspeed_preloaded")]


def _zero3_model_io(folder: str) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model = make_transformer()
    model, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data_loader(16, 4))
    result = {"unwrapped": type(accelerator.unwrap_model(model)).__name__}
    try:
        accelerator.get_state_dict(model)
    except ValueError as error:
        result["error"] = str(error)
    accelerator.deepspeed_plugin.deepspeed_config["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"
    ] = True
    model._config.zero_config.gather_16bit_weights_on_model_save = True  # what the config now says
    accelerator.save_model(model, folder)
    result["norm"] = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    accelerator.free_memory()
    result["engines_after_free"] = len(accelerator.backend.engines)
    return result


def test_zero3_get_state_dict_needs_its_flag_save_model_writes_and_free_memory_destroys(tmp_path):
    from safetensors.torch import load_file

    result = run_distributed(_zero3_model_io, 1, str(tmp_path / "model"), timeout=120)[0]
    assert result["unwrapped"] == "TinyTransformer"
    assert "stage3_gather_16bit_weights_on_model_save is false. Set it to true" in result["error"]
    assert "zero3_save_16bit_model" in result["error"]
    weights = load_file(tmp_path / "model" / "model.safetensors")
    expected = make_transformer().state_dict()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    assert result["engines_after_free"] == 0


def _named_plugins() -> dict:
    from lockstep import Accelerator
    from lockstep.state import AcceleratorState
    from lockstep.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    student = DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.0)
    teacher = DeepSpeedPlugin(zero_stage=3)
    accelerator = Accelerator(deepspeed_plugin={"student": student, "teacher": teacher})
    first = accelerator.deepspeed_plugin is student
    config = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    accelerator.state.deepspeed_plugins["student"].deepspeed_config.update(config)
    model = make_transformer()
    optimizer = DummyOptim(model.parameters(), lr=0.5)
    schedule = DummyScheduler(
        optimizer, lr_scheduler_callable=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)
    )
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, schedule, data_loader(16, 4))
    rates = []
    for batch in loader:
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        scheduler.step()  # the engine stepped it already: this does nothing
        rates.append(scheduler.get_last_lr()[0])
    AcceleratorState().select_deepspeed_plugin("teacher")
    frozen = accelerator.prepare(make_transformer())
    wrapped = accelerator.deepspeed_engine_wrapped
    return {
        "accelerate_attributes": [
            wrapped.engine is model,
            accelerator.deepspeed_config is accelerator.deepspeed_plugin.deepspeed_config,
        ],
        "first_active": first,
        "active_after": accelerator.deepspeed_plugin is accelerator.state.get_deepspeed_plugin("teacher"),
        "stages": [model.zero_optimization_stage(), frozen.zero_optimization_stage()],
        "rates": rates,
        "wrappers": [type(optimizer).__name__, type(scheduler).__name__],
    }


def test_named_plugins_give_each_model_its_engine_and_the_engine_steps_the_scheduler():
    result = run_distributed(_named_plugins, 1, timeout=120)[0]
    assert result["first_active"] and result["active_after"]
    assert result["accelerate_attributes"] == [
        True,
        True,
    ]  # Accelerate's deepspeed_engine_wrapped, deepspeed_config
    assert result["stages"] == [2, 3]
    assert result["wrappers"] == ["DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"]
    assert result["rates"] == [0.25, 0.125, 0.0625, 0.03125]  # halved once per step by the engine alone


def _zero3_init() -> list[int]:
    from lockstep import Accelerator
    from lockstep.backends.deepspeed.zero3 import zero3_init
    from lockstep.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        zero_stage=3, hf_ds_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}
    )
    Accelerator(deepspeed_plugin=plugin)
    with zero3_init(plugin):
        model = make_transformer()
    return [p.numel() for p in model.parameters()]


def test_zero3_init_builds_the_model_already_partitioned():
    sizes = run_distributed(_zero3_init, 2, timeout=120)[0]
    assert all(size == 0 for size in sizes)  # each process holds its partition aside; the module holds none


def _refusals() -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    found = {}
    for name, build in {
        "type": lambda: Accelerator(deepspeed_plugin=object()),
        "both": lambda: Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(), fsdp_plugin=FullyShardedDataParallelPlugin()
        ),
    }.items():
        try:
            build()
        except (TypeError, ValueError) as error:
            found[name] = str(error)
    return found


def test_bad_set_ups_are_refused_before_any_work():
    found = run_distributed(_refusals, 1, timeout=120)[0]
    assert found["type"] == "DeepSpeed plugin 'default' must be a lockstep DeepSpeedPlugin, got object."
    assert "FSDP and DeepSpeed both shard the model" in found["both"]


def _fp16_support() -> bool:
    """DeepSpeed's own answer for this machine (its CPU accelerator asks oneDNN for fp16 kernels)."""
    from lockstep.backends.deepspeed.loading import import_deepspeed

    deepspeed = import_deepspeed(device_type="cpu", local_rank=0)
    return bool(deepspeed.accelerator.get_accelerator().is_fp16_supported())


def _fp16_refusal() -> str:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    try:
        Accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin())
    except ValueError as error:
        return str(error)
    return "no error"


FP16_LENGTH, FP16_GLOBAL_BATCH = 48, 8


def _fp16_training(per_process: int) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    accelerator = Accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model = make_transformer()
    loader = data_loader(FP16_LENGTH, per_process)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    skipped = 0
    for _ in range(2):
        for x, y in loader:
            # DeepSpeed casts the model to fp16, not the inputs (transformers models take integer ids)
            loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            skipped += int(accelerator.optimizer_step_was_skipped)
    params = [p.detach().float().reshape(-1).clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"params": torch.cat(params), "skipped": skipped, "dtype": str(next(model.parameters()).dtype)}


def test_fp16_on_this_cpu_trains_where_it_is_supported_and_is_refused_where_not():
    if not run_distributed(_fp16_support, 1, timeout=120)[0]:
        message = run_distributed(_fp16_refusal, 1, timeout=120)[0]
        assert message == (
            "DeepSpeed cannot train in fp16 on this device (cpu): on a CPU it needs the avx512_fp16 instructions. "
            "Use mixed_precision='bf16' (or no mixed precision)."
        )
        return
    one = run_distributed(_fp16_training, 1, FP16_GLOBAL_BATCH, timeout=300)[0]
    two = run_distributed(_fp16_training, 2, FP16_GLOBAL_BATCH // 2, timeout=300)
    expected, _ = reference_run(FP16_LENGTH, FP16_GLOBAL_BATCH)
    for result in (one, *two):
        assert result["dtype"] == "torch.float16" and result["skipped"] == 0
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=1e-2)  # fp16 against fp32
    for result in two:  # the same fp16 arithmetic on the global batch, cut in two
        torch.testing.assert_close(result["params"], one["params"], rtol=0, atol=1e-3)


def test_a_missing_deepspeed_names_the_pip_line(monkeypatch):
    from lockstep.backends.deepspeed import loading

    monkeypatch.setattr(loading, "is_deepspeed_installed", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lockstep\[deepspeed\]'"):
        loading.import_deepspeed(device_type="cpu", local_rank=0)


def _from_pretrained_under_zero3_init(folder: str) -> dict:
    import transformers

    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True, zero3_save_16bit_model=True)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = transformers.BertModel.from_pretrained(folder)
    local = [p.numel() for p in model.parameters()]
    with plugin.zero3_init_context_manager(enable=False):
        whole = transformers.BertModel.from_pretrained(folder)
    loader = torch.utils.data.DataLoader(torch.zeros(8, 4), batch_size=4)  # the micro batch comes from it
    model, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    gathered = accelerator.get_state_dict(model)
    return {
        "partitioned": all(n == 0 for n in local),
        "whole_outside_context": all(p.numel() > 0 for p in whole.parameters()),
        "weights": {k: v.clone() for k, v in gathered.items()},
    }


@requires("transformers")
def test_zero3_init_flag_makes_from_pretrained_build_the_model_partitioned(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    expected = transformers.BertModel.from_pretrained(tmp_path / "bert").state_dict()
    result = run_distributed(_from_pretrained_under_zero3_init, 2, str(tmp_path / "bert"), timeout=180)[0]
    assert result["partitioned"] and result["whole_outside_context"]
    for name, tensor in result["weights"].items():  # the pretrained weights, loaded into the partitions
        assert torch.equal(tensor, expected[name]), name
