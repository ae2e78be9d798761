"""Checkpoints both ways with the real Accelerate 1.15 (run in the reference environment, real files).

Accelerate's ``save_state`` writes a checkpoint after 3 steps that lockstep's ``load_state`` restores into
objects built from another seed; and the other way round. Checked bitwise: weights, the optimizer state
(AdamW moments and step), the scheduler, a registered custom object, the step, the next draws of Python's,
NumPy's and torch's generators, and the weights after 2 more steps on each side (so a missed optimizer or
scheduler load shows even where the state dicts would hide it). On 1 process, with the weights in
safetensors (the default) and in a pickle (``safe_serialization=False``), and on 2 (DDP over gloo: ``torchrun``
for Accelerate, lockstep's test workers for lockstep; each rank has its own random states). Accelerate runs
FSDP only on accelerators (its ``AcceleratorState`` never picks FSDP for ``MULTI_CPU``), so single process and
DDP are the CPU backends both support (DeepSpeed would need deepspeed and its JIT builds in the reference
environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tests.helpers.reference import run_reference
from tests.reference._training import assert_same, build, snapshot, train

pytestmark = [pytest.mark.distributed]

WRITTEN, LATER = 3, 2  # steps before the save, steps after it

_ACCELERATE_WRITES = """
import sys, torch
from accelerate import Accelerator
from tests.reference._training import build, snapshot, train
folder, out, safe = sys.argv[1:4]
accelerator = Accelerator(cpu=True)
model, optimizer, scheduler, counter = build(seed=1)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
accelerator.register_for_checkpointing(counter)
train(accelerator, model, optimizer, scheduler, counter, {written})
accelerator.save_state(folder, safe_serialization=safe == "safetensors")
saved = snapshot(accelerator, model, optimizer, scheduler, counter)
train(accelerator, model, optimizer, scheduler, counter, {later})
after = accelerator.unwrap_model(model).state_dict()
torch.save({{"saved": saved, "after": after}}, f"{{out}}.{{accelerator.process_index}}")
accelerator.wait_for_everyone()
"""

_ACCELERATE_READS = """
import sys, torch
from accelerate import Accelerator
from tests.reference._training import build, snapshot, train
folder, out = sys.argv[1:3]
accelerator = Accelerator(cpu=True)
model, optimizer, scheduler, counter = build(seed=2)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
accelerator.register_for_checkpointing(counter)
accelerator.load_state(folder)
saved = snapshot(accelerator, model, optimizer, scheduler, counter)
train(accelerator, model, optimizer, scheduler, counter, {later})
after = accelerator.unwrap_model(model).state_dict()
torch.save({{"saved": saved, "after": after}}, f"{{out}}.{{accelerator.process_index}}")
accelerator.wait_for_everyone()
"""


def _prepared(seed: int):
    from lockstep import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler, counter = build(seed=seed)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def _lockstep_reads(folder: str, theirs: str) -> int:
    accelerator, model, optimizer, scheduler, counter = _prepared(seed=2)
    accelerator.load_state(folder)
    expected = torch.load(f"{theirs}.{accelerator.process_index}", weights_only=True)
    assert_same(snapshot(accelerator, model, optimizer, scheduler, counter), expected["saved"], "loaded")
    train(accelerator, model, optimizer, scheduler, counter, LATER)
    assert_same(accelerator.unwrap_model(model).state_dict(), expected["after"], "after")
    return counter.count


def _lockstep_writes(folder: str, ours: str, safe: str) -> None:
    accelerator, model, optimizer, scheduler, counter = _prepared(seed=1)
    train(accelerator, model, optimizer, scheduler, counter, WRITTEN)
    accelerator.save_state(folder, safe_serialization=safe == "safetensors")
    saved = snapshot(accelerator, model, optimizer, scheduler, counter)
    train(accelerator, model, optimizer, scheduler, counter, LATER)
    after = accelerator.unwrap_model(model).state_dict()
    torch.save({"saved": saved, "after": after}, f"{ours}.{accelerator.process_index}")


# (processes, model weights format): safetensors is the default; pickle is safe_serialization=False
CASES = [(1, "safetensors"), (1, "pickle"), (2, "safetensors")]
WEIGHTS_FILE = {"safetensors": "model.safetensors", "pickle": "pytorch_model.bin"}


@pytest.mark.parametrize(("processes", "safe"), CASES)
def test_lockstep_loads_what_accelerate_saved(tmp_path: Path, processes: int, safe: str):
    folder, theirs = tmp_path / "accelerate_checkpoint", tmp_path / "accelerate.pt"
    snippet = _ACCELERATE_WRITES.format(written=WRITTEN, later=LATER)
    run_reference(snippet, str(folder), str(theirs), safe, folder=tmp_path, processes=processes)
    assert (folder / WEIGHTS_FILE[safe]).is_file() and not (folder / "manifest.json").exists()
    counts = run_distributed(_lockstep_reads, processes, str(folder), str(theirs))
    assert counts == [WRITTEN + LATER] * processes


@pytest.mark.parametrize(("processes", "safe"), CASES)
def test_accelerate_loads_what_lockstep_saved(tmp_path: Path, processes: int, safe: str):
    folder, ours, theirs = (
        tmp_path / "lockstep_checkpoint",
        tmp_path / "lockstep.pt",
        tmp_path / "accelerate.pt",
    )
    run_distributed(_lockstep_writes, processes, str(folder), str(ours), safe)
    assert (folder / "manifest.json").is_file() and (folder / WEIGHTS_FILE[safe]).is_file()
    snippet = _ACCELERATE_READS.format(later=LATER)
    run_reference(snippet, str(folder), str(theirs), folder=tmp_path, processes=processes)
    for rank in range(processes):
        expected = torch.load(f"{ours}.{rank}", weights_only=True)
        loaded = torch.load(f"{theirs}.{rank}", weights_only=True)
        assert loaded["saved"]["counter"] == WRITTEN
        assert_same(loaded["saved"], expected["saved"], f"rank {rank} loaded")
        assert_same(loaded["after"], expected["after"], f"rank {rank} after")
