"""Bad input to the Accelerator gets a clear error, never a silent no-op or a deep torch traceback."""

import pytest
import torch

from lockstep import Accelerator, DistributedDataParallelKwargs, GradientAccumulationPlugin
from tests.helpers.multiprocess import WorkerError, run_distributed
from tests.helpers.training import make_model


@pytest.mark.parametrize("value", ["fp32", "half", 16])
def test_wrong_mixed_precision(value):
    with pytest.raises(
        ValueError, match=rf"mixed_precision={value!r} is invalid: it must be one of 'no', 'fp16'"
    ):
        Accelerator(mixed_precision=value)


def test_fp8_is_not_supported_yet():
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not supported by lockstep yet"):
        Accelerator(mixed_precision="fp8")


@pytest.mark.parametrize("steps", [0, -2, 1.5, True])
def test_gradient_accumulation_steps_must_be_positive(steps):
    with pytest.raises(
        ValueError,
        match=rf"gradient_accumulation_steps={steps!r}\) is invalid: it must be an integer >= 1. Pass 1",
    ):
        Accelerator(gradient_accumulation_steps=steps)


def test_plugin_and_steps_conflict():
    with pytest.raises(ValueError, match="conflicts with gradient_accumulation_plugin"):
        Accelerator(
            gradient_accumulation_steps=4,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )


def test_parallelism_config_of_the_wrong_kind_is_refused():
    with pytest.raises(
        TypeError, match="parallelism_config must be a lockstep ParallelismConfig, got object"
    ):
        Accelerator(parallelism_config=object())


def test_kwargs_handlers_are_checked():
    with pytest.raises(TypeError, match=r"kwargs_handlers\[1\] is a dict"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), {"find_unused_parameters": True}])
    with pytest.raises(ValueError, match="more than one DistributedDataParallelKwargs"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])


def test_dynamo_backend_and_plugin_conflict():
    from lockstep import TorchDynamoPlugin

    with pytest.raises(ValueError, match="either dynamo_backend or dynamo_plugin"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))


def test_explicit_argument_beats_launcher_settings(monkeypatch):
    monkeypatch.setenv(
        "LOCKSTEP_LAUNCH_CONFIG", '{"mixed_precision": "bf16", "gradient_accumulation_steps": 4}'
    )
    assert Accelerator().mixed_precision == "bf16"
    assert Accelerator().gradient_accumulation_steps == 4


def test_explicit_argument_beats_launcher_settings_when_given(monkeypatch):
    monkeypatch.setenv(
        "LOCKSTEP_LAUNCH_CONFIG", '{"mixed_precision": "bf16", "gradient_accumulation_steps": 4}'
    )
    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=1)
    assert (accelerator.mixed_precision, accelerator.gradient_accumulation_steps) == ("no", 1)


def test_prepare_twice_is_a_no_op():
    accelerator = Accelerator()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    again_model, again_optimizer = accelerator.prepare(prepared_model, prepared_optimizer)
    assert again_model is prepared_model and again_optimizer is prepared_optimizer
    assert len(accelerator._prepared.models) == 1 and len(accelerator._prepared.optimizers) == 1


def test_unknown_objects_pass_through():
    accelerator = Accelerator()
    marker = object()
    assert accelerator.prepare(marker, 3) == (marker, 3)


def _prepare_frozen_with_ddp_kwargs() -> None:
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = make_model().requires_grad_(False)
    accelerator.prepare(model)


@pytest.mark.distributed
def test_frozen_model_with_ddp_kwargs_is_a_clear_error():
    with pytest.raises(
        WorkerError, match="none of its parameters requires grad, so there is nothing to synchronise"
    ):
        run_distributed(_prepare_frozen_with_ddp_kwargs, 2)


def _prepare_frozen_without_kwargs() -> str:
    accelerator = Accelerator()
    return type(accelerator.prepare(make_model().requires_grad_(False))).__name__


@pytest.mark.distributed
def test_frozen_model_without_kwargs_is_not_wrapped():
    assert run_distributed(_prepare_frozen_without_kwargs, 2) == ["Sequential", "Sequential"]
