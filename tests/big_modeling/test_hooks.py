"""lockstep.hooks against hand-computed behaviour: what each hook does to a module's forward and where it
puts weights and inputs (meta <-> cpu moves are real on a CPU machine; the CPU-offload chain records the
moves a model is asked to make)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lockstep import cpu_offload_with_hook
from lockstep.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    remove_hook_from_module,
    remove_hook_from_submodules,
)


class AddOne(ModelHook):
    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (args[0] + 1, *args[1:]), kwargs


class TimesTwo(ModelHook):
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output * 2


class Recorder(nn.Module):
    """Records the devices of its own weight and of its inputs each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.seen: list[tuple[str, ...]] = []

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        devices = (self.weight.device.type, x.device.type, cache.device.type if cache is not None else "-")
        self.seen.append(devices)
        return x


def test_add_hook_runs_pre_and_post_forward_and_remove_restores_the_class_forward():
    layer = nn.Identity()
    add_hook_to_module(layer, AddOne())
    assert layer(torch.tensor([1.0])).tolist() == [2.0]
    add_hook_to_module(layer, TimesTwo())  # replaces AddOne, wrapping the original forward (not AddOne's)
    assert layer(torch.tensor([1.0])).tolist() == [2.0]
    add_hook_to_module(layer, AddOne(), append=True)  # TimesTwo then AddOne
    assert isinstance(layer._hf_hook, SequentialHook)
    assert [type(h).__name__ for h in layer._hf_hook.hooks] == ["TimesTwo", "AddOne"]
    assert layer(torch.tensor([1.0])).tolist() == [4.0]  # (1 + 1) * 2
    remove_hook_from_module(layer)
    assert (
        not hasattr(layer, "_hf_hook") and not hasattr(layer, "_old_forward") and "forward" not in vars(layer)
    )
    assert layer(torch.tensor([1.0])).tolist() == [1.0]


def test_no_grad_hook_and_detach_hook_is_called_on_removal():
    class Frozen(ModelHook):
        no_grad = True
        detached = False

        def detach_hook(self, module: nn.Module) -> nn.Module:
            Frozen.detached = True
            return module

    layer = add_hook_to_module(nn.Linear(2, 2), Frozen())
    assert not layer(torch.ones(1, 2)).requires_grad
    remove_hook_from_module(layer)
    assert Frozen.detached and layer(torch.ones(1, 2)).requires_grad


def test_remove_hook_from_submodules_keeps_the_root_hook_and_recurse_removes_all():
    model = nn.Sequential(nn.Sequential(nn.Identity()), nn.Identity())
    for module in model.modules():
        add_hook_to_module(module, AddOne())
    assert model(torch.zeros(1)).tolist() == [4.0]  # root, inner Sequential, its Identity, the last Identity
    remove_hook_from_submodules(model)
    assert hasattr(model, "_hf_hook") and not any(hasattr(m, "_hf_hook") for m in list(model.modules())[1:])
    assert model(torch.zeros(1)).tolist() == [1.0]
    remove_hook_from_module(model, recurse=True)
    assert model(torch.zeros(1)).tolist() == [0.0]


def test_align_devices_hook_offload_loads_weights_for_the_forward_only():
    module = Recorder()
    weights = {"weight": torch.full((2,), 3.0)}
    add_hook_to_module(module, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    assert module.weight.device.type == "meta"  # between calls
    module(torch.ones(2))
    assert module.seen == [("cpu", "cpu", "-")]  # inside the forward: on the execution device
    assert module.weight.device.type == "meta"
    remove_hook_from_module(module)  # detach: back where it was, with the weights_map's values
    assert module.weight.device.type == "cpu" and module.weight.tolist() == [3.0, 3.0]


def test_align_devices_hook_moves_inputs_except_skip_keys_and_io_same_device():
    module = Recorder()
    hook = AlignDevicesHook(execution_device="meta", skip_keys="cache")
    add_hook_to_module(module, hook)
    assert module.weight.device.type == "meta"  # not offloaded: moved to the execution device once
    module(torch.ones(2), cache=torch.ones(2))
    assert module.seen == [("meta", "meta", "cpu")]
    plain = add_hook_to_module(nn.Identity(), AlignDevicesHook(execution_device="meta", io_same_device=True))
    with pytest.raises(
        NotImplementedError, match="meta"
    ):  # meta -> cpu cannot copy: the output was sent back
        plain(torch.ones(1))


def test_cpu_offload_hook_and_user_hook_move_the_whole_model():
    moves: list[str] = []

    class Tracked(nn.Linear):
        def to(self, *args: Any, **kwargs: Any) -> nn.Module:
            moves.append(str(args[0]))
            return self

    model = Tracked(2, 2)
    hook = CpuOffload(execution_device="meta")  # stands for a GPU: inputs really move, the model records
    add_hook_to_module(model, hook)
    user_hook = UserCpuOffloadHook(model, hook)
    assert moves == ["cpu"]  # attached: the model goes to the CPU
    with pytest.raises(RuntimeError, match="meta"):  # the input went to the execution device, not the weight
        model(torch.ones(1, 2))
    assert moves == ["cpu", "meta"]
    user_hook.offload()
    assert moves == ["cpu", "meta", "cpu"]
    user_hook.remove()
    assert not hasattr(model, "_hf_hook")


def test_cpu_offload_with_hook_chain_keeps_only_the_running_model_on_the_execution_device():
    where: dict[str, str] = {}
    log: list[str] = []

    class Stage(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def to(self, device: Any) -> nn.Module:  # records the move instead of making it (no GPU here)
            where[self.name] = str(device)
            log.append(f"{self.name}->{device}")
            return self

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert [n for n, d in where.items() if d == "meta"] == [self.name]  # alone on the device
            assert x.device.type == "meta"
            return x

    hooks: list[UserCpuOffloadHook] = []
    stages = []
    for name in ("encoder", "unet", "decoder"):
        # "meta" stands for the GPU: inputs really move there, the stages record their moves
        stage, hook = cpu_offload_with_hook(
            Stage(name), "meta", prev_module_hook=hooks[-1] if hooks else None
        )
        stages.append(stage)
        hooks.append(hook)
    assert where == {"encoder": "cpu", "unet": "cpu", "decoder": "cpu"}
    log.clear()
    x = torch.ones(1)
    for stage in stages:
        x = stage(x)
    assert log == ["encoder->meta", "encoder->cpu", "unet->meta", "unet->cpu", "decoder->meta"]
    hooks[-1].offload()
    assert where == {"encoder": "cpu", "unet": "cpu", "decoder": "cpu"}


def test_attach_align_device_hook_gives_each_module_with_tensors_a_hook_and_preload_classes_one():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    expected = model(torch.ones(1, 2))
    attach_align_device_hook(model, "cpu", offload=True, weights_map=model.state_dict())
    hooked = sorted(name for name, m in model.named_modules() if hasattr(m, "_hf_hook"))
    assert hooked == ["0", "2.0", "2.1"]  # ReLU and the containers hold no tensors of their own
    assert (
        model[2][1]._hf_hook.weights_map["weight"] is model[2][1]._hf_hook.weights_map.dataset["2.1.weight"]
    )
    assert torch.equal(model(torch.ones(1, 2)), expected)
    remove_hook_from_module(model, recurse=True)
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=model.state_dict(), preload_module_classes=["Sequential"]
    )
    assert sorted(name for name, m in model.named_modules() if hasattr(m, "_hf_hook")) == [""]
    assert model._hf_hook.place_submodules and model[2][1].weight.device.type == "meta"


def test_attach_on_blocks_offloads_only_the_blocks_marked_offloaded():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    expected = model(torch.ones(1, 2))
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": "cpu", "0": "cpu", "1": "cpu", "2": "cpu"},
        offload={"0": False, "1": True, "2": False},
        weights_map=model.state_dict(),
    )
    assert [model[i].weight.device.type for i in range(3)] == ["cpu", "meta", "cpu"]
    assert model._hf_hook.io_same_device and model[0]._hf_hook.place_submodules
    assert model[1]._hf_hook.offload and not model[0]._hf_hook.offload
    assert torch.equal(model(torch.ones(1, 2)), expected)
