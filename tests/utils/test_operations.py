"""``lockstep.utils.operations``: Accelerate's operations on nested tensors, pinned value by value, and the
ones that communicate run in a real 2-process gloo group."""

from __future__ import annotations

import pickle
from collections import namedtuple
from typing import Any

import pytest
import torch

from lockstep.utils import operations as ops
from lockstep.utils.dataclasses import TensorInformation
from tests.helpers.multiprocess import run_distributed

Pair = namedtuple("Pair", ["a", "b"])


def test_send_to_device_skips_the_named_keys_at_every_depth():
    batch = {"x": torch.ones(1), "ids": torch.ones(1), "inner": [{"ids": torch.ones(1), "y": torch.ones(1)}]}
    moved = ops.send_to_device(batch, "meta", skip_keys=["ids"])
    assert moved["x"].is_meta and moved["inner"][0]["y"].is_meta
    assert moved["ids"].device.type == "cpu" and moved["inner"][0]["ids"].device.type == "cpu"
    assert moved["ids"] is batch["ids"]  # left as it was, not copied
    every = ops.send_to_device(Pair(torch.ones(1), [torch.ones(1)]), "meta")
    assert isinstance(every, Pair) and every.a.is_meta and every.b[0].is_meta


def test_listify_turns_tensors_into_numbers_and_bf16_through_fp32():
    data = {"a": torch.tensor([[1, 2], [3, 4]]), "b": (torch.tensor(0.25, dtype=torch.bfloat16), "text")}
    assert ops.listify(data) == {"a": [[1, 2], [3, 4]], "b": (0.25, "text")}


def test_slice_tensors_slices_tensors_only():
    data = {"x": torch.arange(5), "names": ["a", "b", "c", "d", "e"], "pair": Pair(torch.arange(5), 7)}
    sliced = ops.slice_tensors(data, slice(1, 3))
    assert sliced["x"].tolist() == [1, 2]
    assert sliced["names"] == ["a", "b", "c", "d", "e"]  # as Accelerate: lists of samples are not tensors
    assert isinstance(sliced["pair"], Pair) and sliced["pair"].a.tolist() == [1, 2] and sliced["pair"].b == 7


def test_convert_to_fp32_casts_half_types_only():
    data = [
        torch.ones(2, dtype=torch.float16),
        torch.ones(2, dtype=torch.bfloat16),
        torch.ones(2, dtype=torch.int8),
    ]
    converted = ops.convert_to_fp32(data)
    assert [t.dtype for t in converted] == [torch.float32, torch.float32, torch.int8]
    double = torch.ones(1, dtype=torch.float64)
    assert ops.convert_to_fp32({"d": double})["d"] is double


def test_convert_outputs_to_fp32_wraps_a_forward_and_refuses_pickling():
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    original = model.forward
    model.forward = ops.convert_outputs_to_fp32(model.forward)
    assert model(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.float32
    assert isinstance(model.forward.__wrapped__, ops.ConvertOutputsToFp32)
    assert model.forward.__wrapped__.model_forward == original
    with pytest.raises(pickle.PicklingError, match="unwrap the model first"):
        pickle.dumps(model.forward.__wrapped__)
    with pytest.raises(TypeError, match=r"wraps a function, got a Tensor\. .*convert_to_fp32\(outputs\)"):
        ops.convert_outputs_to_fp32(torch.ones(1))


def test_data_structure_round_trip_through_tensor_information():
    data = {"x": torch.zeros(2, 3, dtype=torch.float16), "rest": [torch.zeros(4, dtype=torch.long), "keep"]}
    structure = ops.get_data_structure(data)
    assert structure == {
        "x": TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float16),
        "rest": [TensorInformation(shape=torch.Size([4]), dtype=torch.long), "keep"],
    }
    assert ops.is_tensor_information(structure["x"]) and not ops.is_tensor_information(data["x"])
    rebuilt = ops.initialize_tensors(structure)
    assert rebuilt["x"].shape == (2, 3) and rebuilt["x"].dtype == torch.float16
    assert rebuilt["rest"][0].dtype == torch.long and rebuilt["rest"][1] == "keep"
    assert ops.get_shape(data) == {"x": [2, 3], "rest": [[4], "keep"]}


def test_find_batch_size_and_device():
    assert ops.find_batch_size([{"text": ["a"], "ids": torch.zeros(5, 2)}]) == 5
    assert ops.ignorant_find_batch_size({"text": ["a", "b"]}) is None
    assert ops.find_device({"a": "x", "b": [torch.zeros(1, device="meta")]}) == torch.device("meta")
    assert ops.find_device(["no tensors"]) is None
    assert ops.is_torch_tensor(torch.zeros(1)) and not ops.is_torch_tensor([1])


@pytest.mark.parametrize(
    ("rows", "processes", "padded"), [(3, 4, 4), (5, 4, 8), (6, 4, 8), (8, 4, 8), (1, 1, 1)]
)
def test_pad_input_tensors_pads_with_zeros_to_the_next_multiple(rows, processes, padded):
    tensor = torch.ones(rows, 2)
    result = ops.pad_input_tensors({"x": tensor}, batch_size=rows, num_processes=processes)["x"]
    assert result.shape == (padded, 2)
    assert result[:rows].eq(1).all() and result[rows:].eq(0).all()


def test_pad_input_tensors_rejects_a_wrong_batch_size():
    with pytest.raises(ValueError, match=r"batch_size=4\) got a tensor of shape \(3, 2\)"):
        ops.pad_input_tensors(torch.ones(3, 2), batch_size=4, num_processes=2)
    with pytest.raises(ValueError, match=r"num_processes=0\) is invalid"):
        ops.pad_input_tensors(torch.ones(3, 2), batch_size=3, num_processes=0)


def test_copy_tensor_to_devices_on_one_process():
    source = torch.tensor([1.0, 2.0])
    copy = ops.copy_tensor_to_devices(source)
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    with pytest.raises(ValueError, match=r"copy_tensor_to_devices\(None\) on rank 0 of world size 1"):
        ops.copy_tensor_to_devices(None)
    with pytest.raises(TypeError, match="takes a tensor or None, got a list"):
        ops.copy_tensor_to_devices([1])


def test_gathered_parameters_is_a_context_that_changes_nothing():
    layer = torch.nn.Linear(2, 2)
    before = layer.weight.detach().clone()
    with ops.GatheredParameters(layer.parameters(), modifier_rank=0):
        assert torch.equal(layer.weight, before)


def _copy_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from lockstep.state import PartialState
    from lockstep.utils import operations

    rank = PartialState().process_index
    mine = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 7 if rank == 1 else None
    copied = operations.copy_tensor_to_devices(mine)
    try:
        operations.copy_tensor_to_devices(torch.ones(1))  # every rank passes one: refused on every rank
        error = ""
    except ValueError as caught:
        error = str(caught)
    dist.barrier()
    return {"copied": copied, "error": error}


@pytest.mark.distributed
def test_copy_tensor_to_devices_in_a_real_group():
    results = run_distributed(_copy_worker, 2)
    expected = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 7
    for rank, result in enumerate(results):
        assert result["copied"].dtype == torch.float64 and torch.equal(result["copied"], expected)
        assert f"rank {rank} of world size 2" in result["error"]
        assert "2 passed one (ranks [0, 1])" in result["error"]
