"""Big-model inference against the real Accelerate (reference environment): offload folders written by either
library are read by the other's ``disk_offload`` with the same outputs, and ``infer_auto_device_map`` makes
the same plan for a model that does not fit its budget."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep import disk_offload, infer_auto_device_map
from lockstep.big_modeling import init_empty_weights
from tests.helpers.big_models import IDS, Net, Tower, make_net
from tests.helpers.reference import run_reference

# Accelerate reads lockstep's folder, writes its own from the same weights, and plans a Tower.
_ACCELERATE = """
import json, sys
import torch
from accelerate import disk_offload, infer_auto_device_map, init_empty_weights
from tests.helpers.big_models import IDS, Net, Tower, make_net

ours, theirs, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
with init_empty_weights():
    net = Net()
disk_offload(net, ours, execution_device="cpu", offload_buffers=True)
with torch.no_grad():
    torch.save(net(IDS), "accelerate_output.pt")
disk_offload(make_net(seed=4), theirs, execution_device="cpu", offload_buffers=True)
with init_empty_weights():
    tower = Tower(6, 16)
plans = [infer_auto_device_map(tower, max_memory={"cpu": budget}, no_split_module_classes=["Block"])]
import transformers
from tests.helpers.llama import tiny_llama_config
with init_empty_weights():
    llama = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=6))
plans += [infer_auto_device_map(llama, {"cpu": size}, llama._no_split_modules) for size in LLAMA_BUDGETS]
print(json.dumps(plans))
"""
LLAMA_BUDGETS = (77024, 119632, 160000, 10**6)
_ACCELERATE = f"LLAMA_BUDGETS = {LLAMA_BUDGETS}\n" + _ACCELERATE


def test_offload_folders_and_plans_match_accelerate(tmp_path):
    net = make_net(seed=4)
    with torch.no_grad():
        expected = net(IDS)
    disk_offload(net, tmp_path / "ours", execution_device="cpu", offload_buffers=True)
    budget = 3 * 2 * (16 * 16 + 16) * 4 + 100  # three blocks and a bit: one is kept free for offloaded ones
    done = run_reference(
        _ACCELERATE, str(tmp_path / "ours"), str(tmp_path / "theirs"), str(budget), folder=tmp_path
    )
    theirs_output = torch.load(tmp_path / "accelerate_output.pt")
    assert (theirs_output - expected).abs().max().item() <= 1e-6
    with init_empty_weights():
        empty = Net()
    disk_offload(empty, tmp_path / "theirs", execution_device="cpu", offload_buffers=True)
    with torch.no_grad():
        assert (empty(IDS) - expected).abs().max().item() <= 1e-6
    with init_empty_weights():
        tower = Tower(6, 16)
    ours = infer_auto_device_map(tower, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == theirs[0]
    assert ours == {
        "blocks.0": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "blocks.4": "disk",
        "blocks.5": "disk",
    }
    from tests.helpers.llama import tiny_llama_config

    transformers = pytest.importorskip("transformers")
    with init_empty_weights():
        llama = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=6))
    plans = [infer_auto_device_map(llama, {"cpu": size}, llama._no_split_modules) for size in LLAMA_BUDGETS]
    assert plans == theirs[1:]
    assert [list(plan.values()).count("cpu") for plan in plans] == [1, 3, 4, 1]  # {"": "cpu"} at 1 MB
