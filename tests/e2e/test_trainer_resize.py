"""A lockstep.Trainer run killed on 3 processes resumes on 2 (`resume_from_checkpoint=True`): real `lockstep
launch` jobs, the second standing for the elastic restart on the machines that are left.

Rank 1 of the first job kills itself with SIGKILL at a seeded step; the second job resumes from the newest
checkpoint with 8 samples per optimizer step instead of 12 (the script's per-device batch and accumulation
steps stay). With `train_sampling_strategy="group_by_length"` (the Trainer's length-grouped sampler, whose
order depends only on the seed and the epoch, so it is exact across a resize): every sample id of each epoch is
trained on exactly once across both jobs, the run ends at the step the new size needs, and the final weights
equal a single-process replay of the logged global batches.

Tolerance: 1e-6 (float32; DDP averages the ranks' means where the replay takes one mean; measured in the
test's output).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.cli import lockstep
from tests.helpers.resume import draw_step, final_params, last_checkpoint_before
from tests.scripts.trainer_resize_train import N, Points, features

pytestmark = [pytest.mark.distributed]

SCRIPT = "tests/scripts/trainer_resize_train.py"
SAVE_EVERY, ACCUMULATION = 2, 2
TOLERANCE = 1e-6


def _steps(logs: Path, attempt: int, world: int, last: int | None) -> list[list[list[int]]]:
    """Each optimizer step of one job (up to step ``last``): its global micro-batches, ranks in order."""
    ranks = []
    for rank in range(world):
        lines = (logs / f"attempt{attempt}_rank{rank}.jsonl").read_text().splitlines()
        ranks.append([json.loads(line) for line in lines])
    steps = []
    for records in zip(*ranks, strict=False):  # a killed job's ranks may have logged one step more or less
        assert len({r["step"] for r in records}) == 1, records
        if last is not None and records[0]["step"] > last:
            break
        micro = [[i for r in records for i in r["micro"][m]] for m in range(len(records[0]["micro"]))]
        steps.append(micro)
    return steps


def _replay(steps: list[list[list[int]]]) -> torch.Tensor:
    """The logged global batches on one process: the mean loss of each global micro-batch divided by the
    accumulation steps, one SGD step (momentum 0.9) per optimizer step, from attempt 0's initial weights."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    data = Points()
    for step in steps:
        for ids in step:
            x = torch.stack([features(i) for i in ids])
            y = torch.stack([data[i]["labels"] for i in ids])
            (nn.functional.mse_loss(model(x), y) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_killed_trainer_run_resumes_on_fewer_processes_with_every_sample_once(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    die_at, drawn = draw_step("trainer resize", 3, 5)
    job = [SCRIPT, str(out), str(logs)]
    first = lockstep("launch", "--num-processes", "3", *job, "--attempt", "0", "--die-at", str(die_at))
    assert first.returncode != 0 and "killed by SIGKILL" in first.stderr, f"{drawn}: {first.stderr[-3000:]}"
    saved = last_checkpoint_before(die_at, SAVE_EVERY)
    second = lockstep("launch", "--num-processes", "2", *job, "--attempt", "1")
    assert second.returncode == 0, f"{drawn}: {second.stderr[-3000:]}"

    # 12 samples per step on 3 processes, 8 on 2: the rest of epoch 0, then a whole epoch of 8 steps.
    left = (N - 12 * saved) // 8
    final = saved + left + N // 8
    folder = out / f"checkpoint-{saved}"
    assert f"[train] resumed from {folder} at step {saved}/{final}" in second.stdout, (drawn, second.stdout)
    assert f"STEP {final}" in second.stdout
    assert (
        f"resumed on 2 processes from a checkpoint saved on 3: {folder} at step {saved * ACCUMULATION}, epoch 0, "
        f"{12 * saved} of {N} samples of the epoch consumed; global batch follows the number of processes: 8 "
        "samples per optimizer step (4 per micro-step x 2 accumulation steps; it was 12)"
    ) in second.stderr, second.stderr[-3000:]

    steps = _steps(logs, 0, 3, saved) + _steps(logs, 1, 2, None)
    assert [sum(map(len, step)) for step in steps] == [12] * saved + [8] * (left + N // 8), drawn
    ids = [i for step in steps for micro in step for i in micro]
    for epoch in range(2):  # every sample once in each epoch, across both jobs
        assert sorted(ids[epoch * N : (epoch + 1) * N]) == list(range(N)), (drawn, epoch, ids)

    replayed = _replay(steps)
    weights = torch.tensor(final_params(second.stdout))
    difference = (weights - replayed).abs().max().item()
    print(f"{drawn}; largest difference from the single-process replay: {difference:.3g}")
    assert difference <= TOLERANCE, drawn
    assert (replayed - _replay([])).abs().max() > 0.05  # the run did train
