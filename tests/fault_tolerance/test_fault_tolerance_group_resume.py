"""A replica group of two FSDP2 processes in a fault-tolerant job saves its state after step 3 and goes on to
step 5; a new launch of the group, from other initial weights, loads that checkpoint and trains to step 5
too: it reads the same samples at each step and ends with bitwise the same weights, and torchft's step
count continues from the checkpoint. Worker: tests/helpers/ft_group_resume_worker.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ft_group_resume_worker as worker
from tests.helpers.cli import cli_env
from tests.helpers.ft_lighthouse import lighthouse_process

pytest.importorskip("torchft")
ROOT = Path(__file__).resolve().parents[2]


def _launch(folder: Path, lighthouse: str, phase: str) -> None:
    command = [
        *("launch", "--cpu", "--num-processes", "2", "--use-fsdp", "--fault-tolerance"),
        *("--replica-group", "0", "--num-replica-groups", "1", "--lighthouse", lighthouse),
        *("--quorum-timeout", "20", str(ROOT / "tests/helpers/ft_group_resume_worker.py")),
        *(phase, str(folder / "checkpoint"), str(folder)),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "lockstep.cli.main", *command],
        cwd=folder,  # where a failing run's reports go
        env=cli_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{phase} exited {done.returncode}:\n{done.stderr[-4000:]}"


def test_a_group_of_fsdp2_processes_resumes_from_its_checkpoint_to_the_same_weights(tmp_path: Path) -> None:
    with lighthouse_process(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=2000) as (_, address):
        _launch(tmp_path, address, "save")
        _launch(tmp_path, address, "load")
    for rank in range(2):
        first = torch.load(tmp_path / f"save{rank}.pt")
        resumed = torch.load(tmp_path / f"load{rank}.pt")
        assert first["steps"] == resumed["steps"] == worker.STEPS
        after_save = [line for line in first["lines"] if line["step"] >= worker.SAVE_AT]
        assert [line["step"] for line in resumed["lines"]] == [worker.SAVE_AT, worker.SAVE_AT + 1]
        assert all(line["committed"] for line in first["lines"] + resumed["lines"])
        assert [line["ids"] for line in resumed["lines"]] == [line["ids"] for line in after_save], rank
        for key, value in first["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (rank, key)
