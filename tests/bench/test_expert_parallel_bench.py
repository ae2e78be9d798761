"""bench/expert_parallel.py on 2 real gloo processes with a tiny Qwen3-MoE (about 15 s): every layout runs and is
timed, each rank holds exactly the expert bytes its layout promises (all 4 experts under DDP and ep=1, 2 of them
under ep=2), the dense part whole; and gpu_expert_parallel.sh, the device script, skips cleanly without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from _torchrun import run_worker  # noqa: E402

from expert_parallel import report  # noqa: E402

HIDDEN, WIDTH, EXPERTS, LAYERS = 32, 16, 4, 1
TINY = [
    "--hidden",
    str(HIDDEN),
    "--expert-width",
    str(WIDTH),
    "--experts",
    str(EXPERTS),
    "--layers",
    str(LAYERS),
]
TINY += ["--vocab", "64", "--batch", "2", "--sequence", "8", "--warmup", "1"]


def expert_bytes(experts_per_rank: int) -> int:
    """Parameters, gradients and AdamW's two moments (4 fp32 copies) of each block's gate_up_proj
    (E x 2W x H) and down_proj (E x H x W), plus AdamW's fp32 step counter of each of the two."""
    elements = experts_per_rank * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH)
    return LAYERS * (elements * 4 * 4 + 2 * 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_expert_parallel_benchmark_times_every_layout_and_counts_each_ranks_experts() -> None:
    result = run_worker("_expert_parallel_worker.py", "--blocks", "2", "--steps", "1", *TINY, processes=2)
    layouts = result["layouts"]
    assert list(layouts) == ["torch", "ep=1", "ep=2"]
    held = {name: figures["bytes"] for name, figures in layouts.items()}
    assert {name: h["experts"] for name, h in held.items()} == {
        "torch": expert_bytes(EXPERTS),
        "ep=1": expert_bytes(EXPERTS),
        "ep=2": expert_bytes(EXPERTS // 2),
    }
    assert {name: h["experts_per_block"] for name, h in held.items()} == {
        "torch": [EXPERTS],
        "ep=1": [EXPERTS],
        "ep=2": [EXPERTS // 2],
    }
    assert held["torch"]["dense"] == held["ep=1"]["dense"] == held["ep=2"]["dense"] > 0
    assert all(figures["ms"] > 0 and figures["peak_bytes"] is None for figures in layouts.values())
    assert all(
        layouts[name]["ratio"] > 0 and len(layouts[name]["ratio_quartiles"]) == 3 for name in ("ep=1", "ep=2")
    )
    lines = report(result)
    assert lines[-1].startswith("ep=2") and "0.05 MiB" in lines[-1]  # 49,160 bytes of experts


def test_the_device_script_skips_without_cuda() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_expert_parallel.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped, expert parallelism needs >= 2 CUDA devices and this machine has 0" in done.stdout
