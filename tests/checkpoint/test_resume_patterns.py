"""The resume pattern of transformers' ``*_no_trainer.py`` examples is exact (issue 15).

``load_state(path)`` restores the loader's position too; the script then calls
``skip_first_batches(train_dataloader, resume_step)`` for the first resumed epoch and the plain loader
afterwards. The skipping copy takes over the restored position (nothing is skipped twice), replays the
interrupted epoch's order and random numbers, and hands the next epoch back to the loader: the run ends
bitwise equal to the uninterrupted one, on one process and on two. That holds too when the collate
function draws random numbers from torch's global generator (``DataCollatorForLanguageModeling`` masks with
it): the loader reads one batch ahead, so the checkpoint also records the generator as it was before that
batch was collated, and the resumed epoch collates it from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, DataLoaderConfiguration
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

SAMPLES, BATCH, EPOCHS, STOP = 48, 4, 2, 9  # per process: 12 or 6 batches an epoch


def _masking_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero random features with torch's global generator, as DataCollatorForLanguageModeling masks."""
    x = torch.stack([item[0] for item in items])
    y = torch.stack([item[1] for item in items])
    return x * torch.bernoulli(torch.full(x.shape, 0.7)), y


def _setup(masking: bool = False, dispatch: bool = False):
    config = DataLoaderConfiguration(dispatch_batches=True) if dispatch else None
    accelerator = Accelerator(dataloader_config=config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 12), nn.Dropout(0.25), nn.ReLU(), nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 5, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )
    collate = _masking_collate if masking else None
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=collate)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def _script(
    world: int,
    folder: str,
    stop_at: int | None,
    resume: str | None,
    masking: bool = False,
    dispatch: bool = False,
) -> dict:
    """The loop of run_glue_no_trainer.py, reduced: checkpoint every step, optionally stop, optionally resume."""
    accelerator, model, optimizer, train_dataloader, scheduler = _setup(masking, dispatch)
    starting_epoch, resume_step, completed_steps = 0, None, 0
    if resume is not None:
        accelerator.load_state(resume)
        resume_step = int(Path(resume).name.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step
        resume_step -= starting_epoch * len(train_dataloader)
    losses = []
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        if resume is not None and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for x, y in active_dataloader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            completed_steps += 1
            if completed_steps == stop_at:
                accelerator.save_state(str(Path(folder) / f"step_{completed_steps}"))
                return {"losses": losses}
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return {"losses": losses, "weights": weights.tolist()}


@pytest.mark.parametrize("masking", [False, True], ids=["plain_collate", "random_masking_collate"])
@pytest.mark.parametrize("world", [1, 2])
def test_load_state_then_skip_first_batches_resumes_bitwise(tmp_path, world, masking):
    whole = run_distributed(_script, world, world, str(tmp_path), None, None, masking)
    first = run_distributed(_script, world, world, str(tmp_path), STOP, None, masking)
    rest = run_distributed(
        _script, world, world, str(tmp_path), None, str(tmp_path / f"step_{STOP}"), masking
    )
    for rank in range(world):
        assert first[rank]["losses"] + rest[rank]["losses"] == whole[rank]["losses"]
        assert rest[rank]["weights"] == whole[rank]["weights"]


def test_rank_0_reading_for_all_resumes_bitwise_with_a_random_collate(tmp_path):
    """dispatch_batches=True: rank 0 reads and collates every batch, one step ahead."""
    args = (str(tmp_path),)
    whole = run_distributed(_script, 2, 2, *args, None, None, True, True)
    first = run_distributed(_script, 2, 2, *args, STOP, None, True, True)
    rest = run_distributed(_script, 2, 2, *args, None, str(tmp_path / f"step_{STOP}"), True, True)
    for rank in range(2):
        assert first[rank]["losses"] + rest[rank]["losses"] == whole[rank]["losses"]
        assert rest[rank]["weights"] == whole[rank]["weights"]


def _skip_with_another_count(world: int, folder: str) -> list[int]:
    accelerator, _model, _optimizer, loader, _scheduler = _setup()
    accelerator.load_state(str(Path(folder) / f"step_{STOP}"))
    with pytest.warns(
        UserWarning, match=rf"restored the loader at batch {STOP} of epoch 0: the epoch starts at"
    ):
        return [len(x) for x, _ in accelerator.skip_first_batches(loader, STOP - 2)]


def test_a_different_skip_than_the_restored_position_is_used_and_warned_about(tmp_path):
    run_distributed(_script, 1, 1, str(tmp_path), STOP, None)
    batches = run_distributed(_skip_with_another_count, 1, 1, str(tmp_path))[0]
    assert len(batches) == SAMPLES // BATCH - (STOP - 2)
