"""Accelerate 1.15 semantics a user's code relies on (issue 18): deprecated constructor arguments, the
dataloader configuration, a settable distributed type, unwrapping a compiled DDP model."""

from __future__ import annotations

import pytest
import torch

from lockstep import Accelerator, AcceleratorState, DataLoaderConfiguration, DistributedType


def test_deprecated_dataloader_arguments_are_applied_with_a_future_warning():
    with pytest.warns(
        FutureWarning,
        match=r"Passing split_batches, even_batches to Accelerator\(\) is deprecated \(as in Accelerate\): pass "
        r"Accelerator\(dataloader_config=DataLoaderConfiguration\(split_batches=True, even_batches=False\)\) "
        r"instead\. The values are applied\.",
    ):
        accelerator = Accelerator(split_batches=True, even_batches=False)
    assert accelerator.split_batches is True and accelerator.even_batches is False
    assert accelerator.dataloader_config.split_batches is True


def test_the_second_positional_argument_is_split_batches_as_in_accelerate():
    with pytest.warns(FutureWarning, match="Passing split_batches to Accelerator"):
        accelerator = Accelerator(True, True)
    assert accelerator.split_batches is True and accelerator.mixed_precision == "no"


def test_deprecated_arguments_override_the_given_configuration_and_are_checked():
    config = DataLoaderConfiguration(use_seedable_sampler=False)
    with pytest.warns(FutureWarning, match="Passing dispatch_batches, use_seedable_sampler to Accelerator"):
        accelerator = Accelerator(dataloader_config=config, use_seedable_sampler=True, dispatch_batches=False)
    assert accelerator.dataloader_config is config and config.use_seedable_sampler is True
    assert accelerator.dispatch_batches is False
    with pytest.raises(TypeError, match=r"DataLoaderConfiguration\(split_batches='yes'\) is invalid"):
        Accelerator(split_batches="yes")


def test_no_warning_without_deprecated_arguments():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    assert accelerator.even_batches is False and accelerator.dataloader_config.even_batches is False
    accelerator.even_batches = True  # Accelerate's setter: loaders prepared from now on
    assert accelerator.dataloader_config.even_batches is True


def test_the_distributed_type_can_be_set_on_the_state():
    accelerator = Accelerator()
    assert accelerator.distributed_type == DistributedType.NO
    AcceleratorState().distributed_type = DistributedType.MULTI_CPU
    assert AcceleratorState().distributed_type == DistributedType.MULTI_CPU
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    AcceleratorState().distributed_type = "NO"
    assert accelerator.distributed_type is DistributedType.NO
    with pytest.raises(ValueError, match="distributed_type='SOMETIMES' is invalid"):
        AcceleratorState().distributed_type = "SOMETIMES"


def _unwrap_compiled(world: int, compiled_by: str) -> dict[str, bool]:
    accelerator = Accelerator(dynamo_backend="eager" if compiled_by == "accelerator" else None)
    model = torch.nn.Linear(3, 2)
    given = torch.compile(model, backend="eager") if compiled_by == "user before prepare" else model
    prepared = accelerator.prepare(given)
    if compiled_by == "user after prepare":  # compiled around the DDP wrapper
        prepared = torch.compile(prepared, backend="eager")
    inner = getattr(prepared, "_orig_mod", prepared)
    kept = accelerator.unwrap_model(prepared, keep_torch_compile=True)
    plain = accelerator.unwrap_model(prepared, keep_torch_compile=False)
    kept(torch.ones(2, 3)).sum().backward()  # the returned compiled module runs
    return {
        "kept_is_compiled": isinstance(getattr(kept, "_orig_mod", None), torch.nn.Module),
        "no_wrapper_inside": kept._orig_mod is model,
        "plain_is_the_model": plain is model,
        "training_model_untouched": getattr(prepared, "_orig_mod", prepared) is inner,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("compiled_by", ["user before prepare", "accelerator", "user after prepare"])
def test_unwrap_model_keeps_the_compiled_module_with_the_distributed_wrapper_removed(world, compiled_by):
    from tests.helpers.multiprocess import run_distributed

    results = run_distributed(_unwrap_compiled, world, world, compiled_by)
    assert results == [dict.fromkeys(results[0], True)] * world


def _state_text(world: int) -> tuple[str, str]:
    from lockstep import PartialState

    accelerator = Accelerator(mixed_precision="bf16")
    return repr(PartialState()), str(accelerator.state)


@pytest.mark.distributed
def test_printing_the_state_gives_accelerates_text():
    from tests.helpers.multiprocess import run_distributed

    partial, full = run_distributed(_state_text, 2, 2)[1]
    expected = (
        "Distributed environment: MULTI_CPU  Backend: gloo\nNum processes: 2\nProcess index: 1\n"
        "Local process index: 1\nDevice: cpu\n"
    )
    assert partial == expected and full == expected + "Mixed precision type: bf16\n"
    single = str(Accelerator().state)
    assert single.startswith("Distributed environment: NO\nNum processes: 1\n")  # no backend: no Backend part


def test_the_launchers_dynamo_settings_reach_the_accelerators_plugin(monkeypatch):
    import json

    launched = {"dynamo_backend": "eager", "dynamo_plugin": {"mode": "reduce-overhead", "fullgraph": True}}
    monkeypatch.setenv("LOCKSTEP_LAUNCH_CONFIG", json.dumps(launched))
    plugin = Accelerator().settings.dynamo_plugin
    assert (plugin.backend, plugin.mode, plugin.fullgraph) == ("eager", "reduce-overhead", True)
    explicit = Accelerator(
        dynamo_backend="aot_eager"
    ).settings.dynamo_plugin  # an explicit backend wins alone
    assert (explicit.backend, explicit.mode, explicit.fullgraph) == ("aot_eager", None, False)
