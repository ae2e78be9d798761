"""A lockstep.Trainer run killed on 3 processes resumes on 2, and one killed on 2 resumes on 3
(`resume_from_checkpoint=True`): real `lockstep launch` jobs, the second standing for the elastic restart.

Rank 1 of the first job kills itself with SIGKILL at a seeded step; the second job resumes from the newest
checkpoint with the script's per-device batch and accumulation steps, so the global batch follows the
number of processes. 3 -> 2 uses `train_sampling_strategy="group_by_length"` (the Trainer's length-grouped
sampler, whose order depends only on the seed and the epoch, so it is exact across a resize), 2 -> 3 the
default shuffled sampler, whose epochs end in a padded micro-batch on 3 processes. Every sample id of each
epoch is trained on exactly once across both jobs, the run ends at the step the new size needs, and the
final weights equal a single-process replay of the logged global batches.

Tolerance: 1e-6 (float32; DDP averages the ranks' means where the replay takes one mean). Measured 2.4e-7
to 6.3e-7 over kill steps 3-5; printed by the test.
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


def _epochs(before: list[list[int]], after: list[list[int]], rest: int, micro: int) -> list[list[int]]:
    """The real sample ids of each epoch: the killed job's global micro-batches, then the resumed job's,
    ``micro`` samples each; the last micro-batch of an epoch holds its real samples first, ranks in order,
    then the even_batches padding (samples repeated from the epoch's start), which is left out."""
    first = -(-rest // micro)  # the resumed job's micro-batches in epoch 0
    whole = -(-N // micro)
    assert len(after) == first + whole, (len(after), first, whole)

    def real(batches: list[list[int]], count: int) -> list[int]:
        return [i for batch in batches for i in batch][:count]

    return [real(before + after[:first], N), real(after[first:], N)]


def _micro_per_step(micro_batches: int) -> list[int]:
    """Micro-batches of each optimizer step over an epoch's ``micro_batches`` (the last cycle may be short)."""
    return [ACCUMULATION] * (micro_batches // ACCUMULATION) + [1] * (micro_batches % ACCUMULATION)


@pytest.mark.parametrize(
    ("saved_on", "resumed_on", "strategy"),
    [(3, 2, "group_by_length"), (2, 3, "random")],
    ids=["3to2", "2to3"],
)
def test_a_killed_trainer_run_resumes_on_another_number_of_processes_with_every_sample_once(
    tmp_path, saved_on, resumed_on, strategy
):
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    die_at, drawn = draw_step(f"trainer resize {saved_on} to {resumed_on}", 3, 5)
    job = [SCRIPT, str(out), str(logs), "--strategy", strategy]
    kill = ["--attempt", "0", "--die-at", str(die_at)]
    first = lockstep("launch", "--num-processes", str(saved_on), *job, *kill)
    assert first.returncode != 0 and "killed by SIGKILL" in first.stderr, f"{drawn}: {first.stderr[-3000:]}"
    saved = last_checkpoint_before(die_at, SAVE_EVERY)
    second = lockstep("launch", "--num-processes", str(resumed_on), *job, "--attempt", "1")
    assert second.returncode == 0, f"{drawn}: {second.stderr[-3000:]}"

    # 2 samples per process and micro-batch, 2 micro-batches per step: the rest of epoch 0 in steps of the
    # new size (the last one short when the micro-batches are odd), then a whole epoch of the new size.
    old_micro, micro = 2 * saved_on, 2 * resumed_on
    consumed = saved * ACCUMULATION * old_micro
    rest_micro, whole_micro = -(-(N - consumed) // micro), -(-N // micro)
    per_step = [ACCUMULATION] * saved + _micro_per_step(rest_micro) + _micro_per_step(whole_micro)
    final = len(per_step)
    folder = out / f"checkpoint-{saved}"
    assert f"[train] resumed from {folder} at step {saved}/{final}" in second.stdout, (drawn, second.stdout)
    assert f"STEP {final}" in second.stdout
    assert (
        f"resumed on {resumed_on} processes from a checkpoint saved on {saved_on}: {folder} after {saved} "
        f"optimizer steps, epoch 0, {consumed} of {N} samples of the epoch consumed; global batch follows "
        f"the number of processes: {micro * ACCUMULATION} samples per optimizer step ({micro} per micro-step x "
        f"2 accumulation steps; it was {old_micro * ACCUMULATION})"
    ) in second.stderr, second.stderr[-3000:]
    # The rest of epoch 0 ends in a micro-batch completed from the epoch's start (even_batches): the line says
    # how many samples it repeats, which is what the run then trained (checked by _epochs below).
    repeated = -(N - consumed) % micro
    stated = f"the epoch's last micro-step repeats {repeated} samples from its start (even_batches)"
    assert (stated in second.stderr) == (repeated > 0), (drawn, second.stderr[-3000:])

    killed, resumed = _steps(logs, 0, saved_on, saved), _steps(logs, 1, resumed_on, None)
    steps = killed + resumed
    assert [len(step) for step in steps] == per_step, drawn
    before = [micro_batch for step in killed for micro_batch in step]
    after = [micro_batch for step in resumed for micro_batch in step]
    assert {len(m) for m in before} == {old_micro} and {len(m) for m in after} == {micro}
    for number, ids in enumerate(_epochs(before, after, N - consumed, micro)):
        assert sorted(ids) == list(range(N)), (drawn, number, ids)  # every sample once in each epoch

    replayed = _replay(steps)  # the padding included: it was trained on
    weights = torch.tensor(final_params(second.stdout))
    difference = (weights - replayed).abs().max().item()
    print(f"{drawn}; largest difference from the single-process replay: {difference:.3g}")
    assert difference <= TOLERANCE, drawn
    assert (replayed - _replay([])).abs().max() > 0.05  # the run did train


def _one_process_replay(steps: list[list[list[int]]]) -> torch.Tensor:
    """As :func:`_replay`, each micro-batch's mean loss divided by its step's micro-batches (the
    accumulation of the time: 1 before the resize, 2 after)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    data = Points()
    for step in steps:
        for ids in step:
            x = torch.stack([features(i) for i in ids])
            y = torch.stack([data[i]["labels"] for i in ids])
            (nn.functional.mse_loss(model(x), y) / len(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_trainer_keeps_the_global_batch_through_a_resize_when_asked(tmp_path):
    """``TrainingArguments(elastic_keep_global_batch=True)``: killed on 2 processes (2 samples each, no
    accumulation: 4 per optimizer step), refused on 3 (6 samples per micro-step cannot make 4; the
    checkpoint is left as it was), resumed on 1 with accumulation 2: 4 samples per optimizer step
    throughout, 16 steps per epoch as before the resize, every sample once per epoch, and the weights of a
    one-process replay of the logged steps (1e-6; measured below 1e-7)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    die_at, drawn = draw_step("trainer keep global batch", 3, 5)
    job = [SCRIPT, str(out), str(logs), "--strategy", "random", "--accumulation", "1", "--keep-global-batch"]
    first = lockstep("launch", "--num-processes", "2", *job, "--attempt", "0", "--die-at", str(die_at))
    assert first.returncode != 0 and "killed by SIGKILL" in first.stderr, f"{drawn}: {first.stderr[-3000:]}"
    saved = last_checkpoint_before(die_at, SAVE_EVERY)
    before = sorted(p.name for p in (out / f"checkpoint-{saved}").iterdir())
    refused = lockstep("launch", "--num-processes", "3", *job, "--attempt", "1")
    assert refused.returncode != 0, refused.stderr[-3000:]
    assert "keeps the global batch of 4 samples per optimizer step" in refused.stderr, refused.stderr[-3000:]
    assert "one micro-step on 3 processes reads 6 samples, which does not divide it" in refused.stderr
    assert sorted(p.name for p in (out / f"checkpoint-{saved}").iterdir()) == before
    second = lockstep("launch", "--num-processes", "1", *job, "--attempt", "2")
    assert second.returncode == 0, f"{drawn}: {second.stderr[-3000:]}"
    assert f"[train] resumed from {out / f'checkpoint-{saved}'} at step {saved}/32" in second.stdout
    assert "STEP 32" in second.stdout  # 2 epochs of 16 steps of 4 samples, as without the resize
    assert (
        "global batch kept at 4 samples per optimizer step (gradient_accumulation_steps 1 -> 2, "
        "Accelerator(elastic_keep_global_batch=True))"
    ) in second.stderr, second.stderr[-3000:]
    steps = _steps(logs, 0, 2, saved) + _steps(logs, 2, 1, None)
    assert len(steps) == 32 and [len(step) for step in steps] == [1] * saved + [2] * (32 - saved), drawn
    assert all(sum(len(ids) for ids in step) == 4 for step in steps), drawn
    for epoch in (steps[:16], steps[16:]):
        assert sorted(i for step in epoch for ids in step for i in ids) == list(range(N)), drawn
    difference = (torch.tensor(final_params(second.stdout)) - _one_process_replay(steps)).abs().max().item()
    print(f"{drawn}; largest difference from the single-process replay: {difference:.3g}")
    assert difference <= TOLERANCE, drawn
