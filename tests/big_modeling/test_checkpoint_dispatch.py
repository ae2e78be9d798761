"""load_checkpoint_and_dispatch: a sharded checkpoint loaded tensor by tensor into a CPU + disk map gives the
full model's outputs; bad input is refused before any weight is read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lockstep import load_checkpoint_and_dispatch
from lockstep.big_modeling import init_empty_weights
from lockstep.checkpoint.model_files import save_model_files
from tests.helpers.big_models import IDS, Net, make_net


@pytest.fixture
def saved(tmp_path):
    net = make_net(seed=3)
    with torch.no_grad():
        expected = net(IDS)
    save_model_files(net.state_dict(), tmp_path / "ckpt", max_shard_size="1KB")  # 3 shards and an index
    return tmp_path / "ckpt", expected


def empty_net() -> Net:
    with init_empty_weights():
        return Net()


def test_a_dict_map_on_cpu_and_disk_equals_the_full_model(saved, tmp_path):
    checkpoint, expected = saved
    assert len(list(checkpoint.glob("*.safetensors"))) == 3
    device_map = {
        "embed": "disk",
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "cpu",
        "blocks.3": "disk",
        "norm": "disk",
        "head": "disk",
    }
    model = load_checkpoint_and_dispatch(empty_net(), checkpoint, device_map, offload_folder=tmp_path / "off")
    assert model.hf_device_map == device_map
    assert model.blocks[0][0].weight.device.type == "cpu" and model.blocks[1][0].weight.device.type == "meta"
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert sorted(index) == sorted(
        ["embed.weight", "head.weight", "norm.weight", "norm.bias"]
        + [f"blocks.{i}.{j}.{p}" for i in (1, 3) for j in (0, 2) for p in ("weight", "bias")]
    )  # the head's tied weight is not in the checkpoint: it shares the embedding's file
    assert os.path.samefile(tmp_path / "off" / "head.weight.dat", tmp_path / "off" / "embed.weight.dat")
    assert model.norm.running_mean.device.type == "cpu"  # buffers of disk blocks stay in memory
    with torch.no_grad():
        assert (model(IDS) - expected).abs().max().item() <= 1e-6


def test_auto_plan_under_a_budget_puts_the_rest_on_disk(saved, tmp_path):
    checkpoint, expected = saved
    model = load_checkpoint_and_dispatch(
        empty_net(),
        checkpoint,
        "auto",
        max_memory={"cpu": 1200},
        offload_folder=tmp_path / "off",
    )
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    assert model.hf_device_map["embed"] == model.hf_device_map["head"]
    with torch.no_grad():
        assert (model(IDS) - expected).abs().max().item() <= 1e-6


def test_sequential_plan_and_dtype(saved, tmp_path):
    checkpoint, expected = saved
    model = load_checkpoint_and_dispatch(empty_net(), checkpoint, "sequential", dtype=torch.float64)
    assert model.hf_device_map == {"": "cpu"} and model.blocks[0][0].weight.dtype == torch.float64
    with torch.no_grad():
        output = model(IDS)
    assert output.dtype == torch.float64 and (output - expected).abs().max().item() <= 1e-5


def test_missing_keys_are_named_before_any_weight_is_read(saved, tmp_path):
    checkpoint, _ = saved
    index_path = next(checkpoint.glob("*.index.json"))
    index = json.loads(index_path.read_text())
    del index["weight_map"]["blocks.2.0.bias"]
    index_path.write_text(json.dumps(index))
    model = empty_net()
    with pytest.raises(ValueError, match=r"Missing from the checkpoint \(1\): \['blocks\.2\.0\.bias'\]"):
        load_checkpoint_and_dispatch(model, checkpoint, {"": "cpu"}, strict=True)
    assert model.blocks[0][0].weight.device.type == "meta"  # nothing was read


@pytest.mark.parametrize(
    ("device_map", "kwargs", "message"),
    [
        (
            "fastest",
            {},
            r"device_map='fastest'\): a device_map given as a string must be one of auto, balanced",
        ),
        ({"": "disk"}, {}, r"sends \[''\] to 'disk', and no offload_folder was given"),
        ({"embed": "cpu", "blocks": "cpu"}, {}, r"no device to these tensors: norm\.weight"),
        ({"": "cpu"}, {"max_memory": {"cpu": 10}}, None),
    ],
)
def test_bad_input_is_refused_before_reading(saved, device_map, kwargs, message):
    checkpoint, _ = saved
    model = empty_net()
    if message is None:  # a budget is ignored with an explicit map: loads fine
        load_checkpoint_and_dispatch(model, checkpoint, device_map, **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(model, checkpoint, device_map, **kwargs)
    assert model.blocks[0][0].weight.device.type == "meta"


def test_a_budget_below_the_largest_block_names_it(saved):
    checkpoint, _ = saved
    with pytest.raises(ValueError, match=r"'embed' \(512 B\), does not fit in max_memory\['cpu'\] = 300 B"):
        load_checkpoint_and_dispatch(empty_net(), checkpoint, "auto", max_memory={"cpu": 300})
