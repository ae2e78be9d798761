"""infer_auto_device_map and get_balanced_memory against plans computed by hand from the blocks' sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockstep.big_modeling import init_empty_weights
from lockstep.utils import compute_module_sizes, get_balanced_memory, get_max_memory, infer_auto_device_map

BLOCK = 16 * 16 * 4 + 16 * 4  # one Linear(16, 16) in fp32: 1088 bytes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)


def blocks(count: int) -> nn.Module:
    with init_empty_weights():
        model = nn.Sequential()
        model.embed = nn.Embedding(8, 16)  # 512 bytes
        model.layers = nn.Sequential(*[Block() for _ in range(count)])  # 2176 bytes each
        model.head = nn.Linear(16, 8, bias=False)  # 512 bytes
    return model


def test_sizes_come_from_shapes_and_dtypes_on_the_meta_device():
    sizes = compute_module_sizes(blocks(2), dtype=torch.float16)
    assert sizes["layers.0"] == BLOCK and sizes[""] == (512 + 2 * 2 * BLOCK + 512) // 2


def test_the_whole_model_fits_on_the_cpu():
    assert infer_auto_device_map(blocks(3), max_memory={"cpu": 10**6}) == {"": "cpu"}


def test_cpu_then_disk_with_room_kept_for_the_largest_block():
    # 512 + 4 * 2176 + 512 = 9728 bytes; budget 6000 - largest unsplittable (a Block, 2176) = 3824 for
    # the CPU: embed (512) + layers.0 (2176) = 2688; layers.1 would make 4864 > 3824 -> disk from there.
    plan = infer_auto_device_map(blocks(4), max_memory={"cpu": 6000}, no_split_module_classes=["Block"])
    assert plan == {
        "embed": "cpu",
        "layers.0": "cpu",
        "layers.1": "disk",
        "layers.2": "disk",
        "layers.3": "disk",
        "head": "disk",
    }


def test_splittable_blocks_are_opened_up_to_fill_the_device():
    # without no_split, the largest layer is one Linear (1088): 5500 - 1088 = 4412 for the CPU:
    # embed 512 + layers.0 2176 = 2688; layers.1 (2176) would make 4864 -> opened up: layers.1.a fits
    # (3776), layers.1.b (a leaf) does not -> disk from there.
    plan = infer_auto_device_map(blocks(4), max_memory={"cpu": 5500})
    assert plan == {
        "embed": "cpu",
        "layers.0": "cpu",
        "layers.1.a": "cpu",
        "layers.1.b": "disk",
        "layers.2": "disk",
        "layers.3": "disk",
        "head": "disk",
    }


def test_gpus_first_then_cpu_then_disk_with_clean_result():
    plan = infer_auto_device_map(
        blocks(4), max_memory={0: 3000, 1: 5000, "cpu": 3000}, no_split_module_classes=["Block"]
    )
    # GPU 0 keeps 2176 free (it runs the offloaded blocks): 824 left -> embed (512)
    assert plan == {
        "embed": 0,
        "layers.0": 1,
        "layers.1": 1,
        "layers.2": "cpu",
        "layers.3": "disk",
        "head": "disk",
    }
    unclean = infer_auto_device_map(
        blocks(4),
        max_memory={0: 3000, 1: 5000, "cpu": 3000},
        no_split_module_classes=["Block"],
        clean_result=False,
    )
    assert unclean["layers.0"] == 1 and "layers.3" in unclean


def test_a_head_tied_to_the_embedding_goes_with_it():
    model = blocks(4)
    model.head.weight = model.embed.weight
    plan = infer_auto_device_map(model, max_memory={"cpu": 6000}, no_split_module_classes=["Block"])
    assert plan["embed"] == plan["head"] == "cpu"


def test_verbose_prints_the_plan_as_a_table(capsys):
    infer_auto_device_map(
        blocks(2), max_memory={"cpu": 5000}, no_split_module_classes=["Block"], verbose=True
    )
    assert capsys.readouterr().out.splitlines() == [
        "module   | size     | device",
        "---------+----------+-------",
        "embed    | 512 B    | cpu",
        "layers.0 | 2.12 KiB | cpu",
        "layers.1 | 2.12 KiB | disk",
        "head     | 512 B    | disk",
        "total on cpu: 2.62 KiB; on disk: 2.62 KiB",
    ]


def test_a_budget_below_the_largest_unsplittable_block_names_it():
    with pytest.raises(
        ValueError, match=r"'layers\.0' \(2\.12 KiB\), does not fit in max_memory\['cpu'\] = 2\.00 KiB"
    ):
        infer_auto_device_map(blocks(2), max_memory={"cpu": 2048}, no_split_module_classes=["Block"])


def test_balanced_memory_spreads_the_model_over_gpus():
    model = blocks(4)  # 9728 bytes; largest block 2176; leaves: 512, 8 x 1088, 512 -> mean 1002
    budget = {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**6}
    assert get_balanced_memory(model, budget, no_split_module_classes=["Block"]) == {
        0: 9728 // 3 + 2176,
        1: 9728 // 3 + 2176,
        2: 10**6,
        "cpu": 10**6,
    }
    low = get_balanced_memory(model, budget, no_split_module_classes=["Block"], low_zero=True)
    assert low == {0: 2176, 1: 9728 // 2 + 2176, 2: 10**6, "cpu": 10**6}
    assert get_balanced_memory(model, {"cpu": 5000}) == {"cpu": 5000}  # one device: nothing to balance


def test_get_max_memory_reads_the_free_memory():
    import psutil

    found = get_max_memory()
    assert abs(found["cpu"] - psutil.virtual_memory().available) < 256 * 2**20
    if torch.cuda.is_available():
        assert found[0] == pytest.approx(torch.cuda.mem_get_info(0)[0], rel=0.05)
    assert get_max_memory({"cpu": "1GiB", 0: 5}) == {"cpu": 2**30, 0: 5}
