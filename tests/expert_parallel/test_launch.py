"""``lockstep launch --num-processes 2 --parallelism-config-ep-size 2``: the flag (derived from the layout's key
table) reaches the workers, which train as one process does on the global batch; a size that does not divide
the data-parallel processes fails before any process starts."""

from __future__ import annotations

import pytest
import torch

from tests.expert_parallel.test_accelerator import TOLERANCE, _differences, _one_process
from tests.helpers.cli import lockstep
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed
SCRIPT = "tests/scripts/ep_launch_train.py"


def test_the_launch_flag_trains_ep2_equal_to_one_process(tmp_path) -> None:
    out = tmp_path / "ep"
    result = lockstep(
        "launch", "--cpu", "--num-processes", "2", "--parallelism-config-ep-size", "2", SCRIPT, str(out),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(2)]
    assert [r["ep_size"] for r in ranks] == [2, 2]
    (reference,) = run_distributed(_one_process, 1, timeout=300.0)
    diff = _differences(reference, ranks)
    print(f"lockstep launch ep=2 vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_an_ep_size_that_does_not_divide_the_processes_fails_before_they_start(tmp_path) -> None:
    result = lockstep(
        "launch", "--cpu", "--num-processes", "3", "--parallelism-config-ep-size", "2", SCRIPT,
        str(tmp_path / "never"), timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "ParallelismConfig(ep_size=2) does not fit 3 data-parallel processes" in result.stderr
    assert not list(tmp_path.iterdir())
