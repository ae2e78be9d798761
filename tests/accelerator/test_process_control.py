"""Process-control helpers on a real 2-process group."""

import os
import tempfile

import pytest
import torch

from lockstep import Accelerator, PartialState
from lockstep.state import split_for_process
from tests.helpers.multiprocess import run_distributed


def _process_control(log_path: str) -> dict:
    accelerator = Accelerator()
    state = PartialState()
    with accelerator.main_process_first():
        with open(log_path, "a") as log:
            log.write(f"{accelerator.process_index}\n")
    accelerator.wait_for_everyone()

    @accelerator.on_main_process
    def main_only():
        return "main"

    @accelerator.on_last_process
    def last_only():
        return "last"

    @accelerator.on_process(process_index=1)
    def rank_one():
        return "one"

    with accelerator.split_between_processes(list("abcde")) as share:
        pass
    with accelerator.split_between_processes(torch.arange(5), apply_padding=True) as padded:
        pass
    no_trigger = accelerator.check_trigger()
    if accelerator.process_index == 1:
        accelerator.set_trigger()
    triggered = accelerator.check_trigger()
    reset = accelerator.check_trigger()
    return {
        "flags": (state.is_main_process, state.is_last_process, state.is_local_main_process),
        "calls": (main_only(), last_only(), rank_one()),
        "share": share,
        "padded": padded.tolist(),
        "triggers": (no_trigger, triggered, reset),
        "type": str(accelerator.distributed_type),
        "world": (state.num_processes, state.process_index, state.local_process_index),
    }


@pytest.mark.distributed
def test_process_control_helpers():
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "order.txt")
        rank0, rank1 = run_distributed(_process_control, 2, log_path)
        with open(log_path) as log:
            assert log.read() == "0\n1\n"  # the main process went first
    assert rank0["flags"] == (True, False, True) and rank1["flags"] == (False, True, False)
    assert rank0["calls"] == ("main", None, None) and rank1["calls"] == (None, "last", "one")
    assert rank0["share"] == ["a", "b", "c"] and rank1["share"] == ["d", "e"]
    assert rank0["padded"] == [0, 1, 2] and rank1["padded"] == [3, 4, 4]
    assert rank0["triggers"] == rank1["triggers"] == (False, True, False)
    assert rank0["type"] == "MULTI_CPU"  # CPU multi-process is a real group, no flag needed
    assert rank0["world"] == (2, 0, 0) and rank1["world"] == (2, 1, 1)


def test_single_process_defaults():
    state = PartialState()
    assert (state.num_processes, state.process_index, state.distributed_type) == (1, 0, "NO")
    assert state.device == torch.device("cpu")
    assert state.is_main_process and state.is_last_process


@pytest.mark.parametrize(
    ("length", "world", "expected"),
    [(5, 2, [[0, 1, 2], [3, 4]]), (2, 3, [[0], [1], []]), (6, 3, [[0, 1], [2, 3], [4, 5]])],
)
def test_split_for_process(length, world, expected):
    assert [split_for_process(list(range(length)), world, i) for i in range(world)] == expected


def test_split_for_process_dict_needs_equal_lengths():
    with pytest.raises(ValueError, match="every value of a dict to have the same length"):
        split_for_process({"a": [1, 2], "b": [1]}, 2, 0)


def test_on_process_needs_an_index():
    with pytest.raises(ValueError, match="needs process_index="):
        PartialState().on_process(lambda: None)
