"""bench/_gpu_memory_io.py, the checkpoint and activation measures of gpu_check.sh, run on the CPU with tiny
sizes: the figures a GPU machine records come from code that ran here."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _gpu_memory_io import POLICIES, activation_figures, checkpoint_figures, print_memory_io


def test_the_gpu_checkpoint_and_activation_measures_run_on_the_cpu(tmp_path, capsys):
    cpu = torch.device("cpu")
    checkpoint = checkpoint_figures(cpu, tmp_path / "checkpoints", width=64, layers=2, repeats=1)
    assert checkpoint["parameters"] == 2 * (64 * 64 + 64)
    for name in ("save", "load"):
        assert {tool: len(times) for tool, times in checkpoint["seconds"][name].items()} == {
            "torch": 2,
            "lockstep": 2,
        }
        assert checkpoint["ratio_to_hand_written"][name] > 0
    assert len(checkpoint["async_stall_seconds"]) == 2
    assert list((tmp_path / "checkpoints").iterdir()) == []  # every folder removed after its load
    rows = activation_figures(cpu, dim=32, depth=4, vocab=50, batch=2, seq=16, steps=1)
    kept = {row["policy"]: row["kept_bytes_meter"] for row in rows}
    assert list(kept) == list(POLICIES)
    assert kept["full"] < kept["every_2"] < kept["none"]  # the policies really wrapped the blocks
    assert all(row["peak_over_step_bytes"] is None for row in rows)  # the allocator's peaks: CUDA only
    print_memory_io(checkpoint, rows)
    assert "activations     full" in capsys.readouterr().out
