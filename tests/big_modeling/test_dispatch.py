"""cpu_offload, disk_offload and dispatch_model give the plain model's outputs; dispatch_model's errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lockstep import cpu_offload, cpu_offload_with_hook, disk_offload, dispatch_model
from lockstep.hooks import remove_hook_from_module
from lockstep.utils import has_offloaded_params
from tests.helpers.big_models import IDS, Net, make_net


@pytest.fixture
def net_and_expected() -> tuple[Net, torch.Tensor]:
    net = make_net()
    with torch.no_grad():
        expected = net(IDS).detach()
    return net, expected


def run(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def test_cpu_offload_equals_the_plain_model(net_and_expected):
    net, expected = net_and_expected
    cpu_offload(net, execution_device="cpu")
    assert net.blocks[0][0].weight.device.type == "meta" and has_offloaded_params(net.blocks[0][0])
    assert net.norm.running_mean.device.type == "cpu"  # buffers are not offloaded by default
    assert (run(net) - expected).abs().max().item() <= 1e-6
    assert net.blocks[0][0].weight.device.type == "meta"


def test_disk_offload_equals_the_plain_model_and_reads_memory_maps(net_and_expected, tmp_path):
    net, expected = net_and_expected
    disk_offload(net, tmp_path / "offload", execution_device="cpu", offload_buffers=True)
    index = json.loads((tmp_path / "offload" / "index.json").read_text())
    assert index["blocks.0.0.weight"] == {"dtype": "float32", "shape": [8, 8]}
    assert (tmp_path / "offload" / "norm.running_mean.dat").stat().st_size == 8 * 4
    assert net.norm.running_mean.device.type == "meta" and net.scale.device.type == "cpu"
    assert (run(net) - expected).abs().max().item() <= 1e-6
    # the weights come from the files: changing one changes the output
    weight = torch.from_numpy(
        __import__("numpy").memmap(tmp_path / "offload" / "norm.bias.dat", "float32", "r+")
    )
    weight += 1.0
    assert (run(net) - expected).abs().max().item() > 0.1


def test_dispatch_model_cpu_and_disk_keeps_ties_and_sets_hf_device_map(net_and_expected, tmp_path):
    net, expected = net_and_expected
    device_map = {
        "embed": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "disk",
        "blocks.3": "cpu",
        "norm": "disk",
        "head": "cpu",
    }
    dispatch_model(net, device_map, offload_dir=tmp_path)
    assert net.hf_device_map == device_map
    assert net.head.weight is net.embed.weight  # tied, on the CPU
    assert [net.blocks[i][0].weight.device.type for i in range(4)] == ["cpu", "meta", "meta", "cpu"]
    assert sorted(path.name for path in tmp_path.glob("blocks.1*")) == [
        "blocks.1.0.bias.dat",
        "blocks.1.0.weight.dat",
        "blocks.1.2.bias.dat",
        "blocks.1.2.weight.dat",
    ]
    assert (run(net) - expected).abs().max().item() <= 1e-6
    with pytest.raises(
        RuntimeError, match=r"Net\.to\(\) was called on a model dispatched with offloaded blocks"
    ):
        net.to(torch.float64)
    remove_hook_from_module(net, recurse=True)  # the weights come back from disk
    assert net.blocks[1][0].weight.device.type == "cpu"
    assert (run(net) - expected).abs().max().item() <= 1e-6
    assert net.to(torch.float64).blocks[1][0].weight.dtype == torch.float64  # no hooks: it moves again


def test_dispatch_model_offloads_tied_weights_together(net_and_expected, tmp_path):
    net, expected = net_and_expected
    device_map = {"embed": "disk", "blocks": "cpu", "norm": "cpu", "head": "disk"}
    dispatch_model(net, device_map, offload_dir=tmp_path)
    assert net.embed.weight.device.type == "meta"
    assert (run(net) - expected).abs().max().item() <= 1e-6


def test_dispatch_model_on_one_device_moves_the_model_without_hooks(net_and_expected):
    net, expected = net_and_expected
    dispatch_model(net, {"": "cpu"})
    assert not hasattr(net, "_hf_hook") and net.hf_device_map == {"": "cpu"}
    dispatch_model(net, {"": "cpu"}, force_hooks=True)
    assert net._hf_hook.io_same_device
    assert (run(net) - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("device_map", "kwargs", "message"),
    [
        ({"embed": "cpu", "blocks": "cpu", "head": "cpu"}, {}, r"no device to these tensors: norm\.weight"),
        ({"": 3}, {}, r"device_map\[''\] = 3 names GPU 3, but this machine has 0 GPU"),
        (
            {"embed": "cpu", "blocks": "tpu", "norm": "cpu", "head": "cpu"},
            {},
            r"device_map\['blocks'\] = 'tpu' is not a device",
        ),
        (
            {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"},
            {},
            r"sends \['blocks'\] to 'disk', and no offload_dir",
        ),
        ({"": "disk"}, {}, r"whole model to 'disk'\. Use disk_offload"),
    ],
)
def test_dispatch_model_refuses_bad_maps_before_moving_anything(
    net_and_expected, device_map, kwargs, message
):
    net, _ = net_and_expected
    if torch.cuda.is_available() and device_map == {"": 3}:
        pytest.skip("the GPU count differs on this machine")
    with pytest.raises(ValueError, match=message):
        dispatch_model(net, device_map, **kwargs)
    assert not hasattr(net, "_hf_hook") and net.blocks[0][0].weight.device.type == "cpu"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_dispatch_model_gpu_cpu_and_disk(net_and_expected, tmp_path):
    net, expected = net_and_expected
    device_map = {
        "embed": 0,
        "blocks.0": 0,
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "cpu",
        "norm": "disk",
        "head": 0,
    }
    dispatch_model(net, device_map, offload_dir=tmp_path)
    assert net.blocks[0][0].weight.device.type == "cuda" and net.blocks[1][0].weight.device.type == "meta"
    seen = []
    net.blocks[1][0].register_forward_pre_hook(lambda module, args: seen.append(module.weight.device.type))
    output = run(net)
    assert output.device.type == "cpu" and seen == ["cuda"]  # a CPU block runs on the main device
    assert (output - expected).abs().max().item() <= 1e-5  # TF32/cuBLAS against the CPU


@needs_gpu
def test_cpu_offload_with_hook_chain_on_a_gpu():
    models = [nn.Linear(4, 4) for _ in range(3)]
    hooks = []
    for index, model in enumerate(models):
        _, hook = cpu_offload_with_hook(model, 0, prev_module_hook=hooks[index - 1] if index else None)
        hooks.append(hook)
    x = torch.ones(1, 4)
    for index, model in enumerate(models):
        x = model(x)
        assert [m.weight.device.type for m in models] == ["cuda" if i == index else "cpu" for i in range(3)]
    hooks[-1].offload()
    assert {m.weight.device.type for m in models} == {"cpu"}


def test_align_module_device_onloads_an_offloaded_module_through_its_hook(net_and_expected, tmp_path):
    from lockstep.utils import align_module_device

    net, _ = net_and_expected
    disk_offload(net, tmp_path, execution_device="cpu")
    layer = net.blocks[2][0]
    with align_module_device(layer):
        assert layer.weight.device.type == "cpu"
        assert torch.equal(layer.weight, make_net().blocks[2][0].weight)
    assert layer.weight.device.type == "meta"
