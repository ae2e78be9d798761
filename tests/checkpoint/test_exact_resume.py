"""Exact resume: a run stopped at any step and restarted ends with bitwise the same losses and weights."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

TOTAL_MICRO_STEPS = 14  # 3 epochs of 5 batches per rank, stopped one short of the end


class Progress:
    """The loop's own counter, checkpointed with register_for_checkpointing."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]


def _train(
    folder: str, save_at: int | None, resume: bool, async_save: bool = False
) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 6, generator=generator), torch.randn(40, 1, generator=generator))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    train_dl = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, scheduler, train_dl = accelerator.prepare(model, optimizer, scheduler, train_dl)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if resume:
        accelerator.load_state(folder)
    losses = []
    while progress.done < TOTAL_MICRO_STEPS:
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            progress.done += 1
            if progress.done == save_at:
                accelerator.save_state(folder, async_save=async_save)
                if async_save:  # training goes on while the files are written
                    model(x).sum().backward()
                    accelerator.wait_for_checkpoint()
                return losses, torch.empty(0)
            if progress.done == TOTAL_MICRO_STEPS:
                break
    params = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return losses, params


@pytest.fixture(scope="module")
def straight() -> list[tuple[list[float], torch.Tensor]]:
    """The uninterrupted run every test compares with (it saves nothing: the folder is not used)."""
    return run_distributed(_train, 2, "unused", None, False)


@pytest.mark.parametrize(
    "save_at",
    [4, 7, 5],
    ids=["mid-epoch at a sync step", "mid-epoch in an accumulation cycle", "end of epoch mid-cycle"],
)
def test_resume_is_bitwise_exact(tmp_path, save_at, straight):
    folder = str(tmp_path / "checkpoint")
    before = run_distributed(_train, 2, folder, save_at, False)
    after = run_distributed(_train, 2, folder, None, True)
    for rank in range(2):
        straight_losses, straight_params = straight[rank]
        assert before[rank][0] == straight_losses[:save_at]
        assert after[rank][0] == straight_losses[save_at:], f"rank {rank}: losses after resume differ"
        assert torch.equal(after[rank][1], straight_params), f"rank {rank}: final parameters differ"


def test_resume_from_an_asynchronous_save_is_bitwise_exact(tmp_path, straight):
    folder = str(tmp_path / "checkpoint")
    before = run_distributed(_train, 2, folder, 7, False, True)
    after = run_distributed(_train, 2, folder, None, True)
    for rank in range(2):
        assert before[rank][0] == straight[rank][0][:7]
        assert after[rank][0] == straight[rank][0][7:]
        assert torch.equal(after[rank][1], straight[rank][1])
