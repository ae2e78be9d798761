from datetime import timedelta

import pytest

from lockstep import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)


def test_distributed_type_is_a_str_enum_that_serializes():
    assert DistributedType.MULTI_CPU == "MULTI_CPU"
    assert str(DistributedType.FSDP) == "FSDP"
    assert DistributedType("NO") is DistributedType.NO


def test_kwargs_handler_to_kwargs_lists_only_changes():
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {
        "find_unused_parameters": True
    }


def test_dynamo_plugin_to_kwargs_lists_only_changes_as_accelerate_does():
    assert TorchDynamoPlugin().to_kwargs() == {}
    plugin = TorchDynamoPlugin(
        backend="INDUCTOR", mode="max-autotune", dynamic=True, use_regional_compilation=True
    )
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "max-autotune", "dynamic": True}
    assert TorchDynamoPlugin(options={"a": 1}).to_kwargs() == {"options": {"a": 1}}
    assert TorchDynamoPlugin().to_dict()["backend"] == "no"


def test_ddp_kwargs_validate_hooks():
    with pytest.raises(ValueError, match="comm_hook='zip' is invalid: it must be one of 'no', 'fp16'"):
        DistributedDataParallelKwargs(comm_hook="zip")
    with pytest.raises(ValueError, match="a wrapper must be 'no', 'fp16' or 'bf16'"):
        DistributedDataParallelKwargs(comm_wrapper="power_sgd")


def test_init_process_group_kwargs_backend_and_timeout():
    assert InitProcessGroupKwargs(backend="GLOO").backend == "gloo"
    assert InitProcessGroupKwargs(timeout=5).timeout == timedelta(seconds=5)
    with pytest.raises(
        ValueError, match="got backend 'carrier-pigeon', which is not a torch.distributed backend"
    ):
        InitProcessGroupKwargs(backend="carrier-pigeon")
    with pytest.raises(TypeError, match="pass a datetime.timedelta or a number of seconds"):
        InitProcessGroupKwargs(timeout="soon")


def test_project_configuration_defaults_logging_dir():
    config = ProjectConfiguration(project_dir="runs/a")
    assert config.logging_dir == "runs/a"
    with pytest.raises(ValueError, match=r"total_limit=0\) is invalid"):
        ProjectConfiguration(total_limit=0)


def test_gradient_accumulation_plugin_validates():
    with pytest.raises(ValueError, match=r"num_steps=0\) is invalid"):
        GradientAccumulationPlugin(num_steps=0)


def test_dataloader_configuration_type_checks():
    with pytest.raises(TypeError, match=r"split_batches='yes'\) is invalid"):
        DataLoaderConfiguration(split_batches="yes")


def test_dynamo_plugin():
    assert not TorchDynamoPlugin().enabled
    plugin = TorchDynamoPlugin(backend="EAGER", mode="default")
    assert plugin.enabled and plugin.compile_kwargs() == {
        "backend": "eager",
        "fullgraph": False,
        "mode": "default",
    }
    with pytest.raises(ValueError, match="backend=...\\)='tpu-magic' is invalid"):
        TorchDynamoPlugin(backend="tpu-magic")


def test_public_names_resolve_lazily():
    import lockstep

    assert set(lockstep.__all__) == {"__version__", *lockstep._EXPORTS}
    for name in lockstep._EXPORTS:
        assert getattr(lockstep, name) is not None
    import pytest as _pytest

    with _pytest.raises(AttributeError, match="has no attribute 'Accelerate'"):
        lockstep.Accelerate  # noqa: B018
