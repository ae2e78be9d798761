"""A full disk loses nothing: a save that runs out of space on a real size-limited disk (tmpfs) fails with
one CheckpointError naming the checkpoint, the bytes needed and the space left; nothing of it remains; the
previous checkpoint stays the newest valid one and loads; rotation has deleted nothing.

Sizes: the model (Linear(128, 128), SGD with momentum) makes checkpoints of about 150 KB (66,224 bytes of
model.safetensors, 68,149 of optimizer.bin, 14,561 of RNG states per process); a 256 KiB disk holds one of
them and fills during the second one's optimizer.bin (``torch.save``, which reports a full disk without an
errno).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError
from lockstep.checkpoint.disk_space import human_bytes, out_of_space_error
from tests.helpers.multiprocess import run_distributed
from tests.helpers.small_disk import small_disk

DISK_BYTES = 256 * 1024
# weight + bias and their momentum buffers (float32), and the CPU generator's state (5,056 bytes)
TENSOR_BYTES = 2 * (128 * 128 + 128) * 4 + 5056


def _training(project_dir: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    project = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(accelerator, model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    accelerator.backward(model(torch.ones(3, 128)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _what_remains(disk: Path) -> list[str]:
    return sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))


COMMITTED = [
    "checkpoints",
    "checkpoints/checkpoint_0",
    *(
        f"checkpoints/checkpoint_0/{name}"
        for name in (
            "accelerator_state.json",
            "manifest.json",
            "model.safetensors",
            "optimizer.bin",
            "random_states_0.pkl",
        )
    ),
    "checkpoints/latest",
]


def _assert_resumes_from_the_first(disk: Path, saved: torch.Tensor) -> None:
    """A new run (other weights) resumes from checkpoint_0, the newest valid checkpoint."""
    accelerator, model, _ = _training(disk)
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state()
    assert torch.equal(model.weight.detach(), saved)
    assert accelerator.project_configuration.iteration == 1
    assert (disk / "checkpoints" / "latest").read_text() == "checkpoint_0\n"


def test_a_save_on_a_full_disk_fails_with_one_clear_error_and_the_previous_checkpoint_loads(tmp_path):
    with small_disk(tmp_path / "disk", DISK_BYTES) as disk:
        accelerator, model, optimizer = _training(disk)
        accelerator.save_state()
        saved = model.weight.detach().clone()
        _step(accelerator, model, optimizer)
        with pytest.raises(CheckpointError) as failure:
            accelerator.save_state()
        message = str(failure.value)
        assert message.startswith(
            f"Saving the checkpoint {disk}/checkpoints/checkpoint_1 ran out of disk space (RuntimeError: "
        )
        assert (
            f"The save needs about {TENSOR_BYTES:,} bytes (133.9 KiB) for this process's tensors" in message
        )
        assert f"free of 262,144 bytes (256.0 KiB) on the disk mounted at {disk}. The partial" in message
        assert "ProjectConfiguration(total_limit=...)" in message
        assert isinstance(failure.value.__cause__, RuntimeError)  # torch.save's own error, kept
        # nothing of the failed save; total_limit=1 deleted nothing before the new one was committed
        assert _what_remains(disk) == COMMITTED
        assert accelerator.project_configuration.iteration == 1
        _assert_resumes_from_the_first(disk, saved)


def test_a_background_save_on_a_full_disk_fails_at_the_next_save_state(tmp_path):
    with small_disk(tmp_path / "disk", DISK_BYTES) as disk:
        accelerator, model, optimizer = _training(disk)
        accelerator.save_state()
        saved = model.weight.detach().clone()
        _step(accelerator, model, optimizer)
        accelerator.save_state(async_save=True)  # returns once the snapshot is taken
        _step(accelerator, model, optimizer)
        with pytest.raises(CheckpointError) as failure:
            accelerator.save_state()  # the training loop's next save learns of it
        message = str(failure.value)
        assert message.startswith(
            "The previous asynchronous checkpoint save failed: Saving the checkpoint "
            f"{disk}/checkpoints/checkpoint_1 ran out of disk space"
        )
        assert f"The save needs about {TENSOR_BYTES:,} bytes" in message
        assert _what_remains(disk) == COMMITTED
        _assert_resumes_from_the_first(disk, saved)


def _two_processes_on_a_full_disk(disk: str) -> dict:
    accelerator, model, optimizer = _training(Path(disk))
    accelerator.save_state()
    weight = accelerator.unwrap_model(model).weight
    saved = weight.detach().clone()
    _step(accelerator, model, optimizer)
    errors = []
    for async_save in (False, True):
        try:
            accelerator.save_state(async_save=async_save)
            accelerator.save_state()  # raises the background save's error, on every rank
        except CheckpointError as error:
            errors.append(str(error))
        accelerator.wait_for_everyone()
    remains = _what_remains(Path(disk))
    with torch.no_grad():
        weight.zero_()
    accelerator.load_state()
    return {"errors": errors, "remains": remains, "resumed": torch.equal(weight.detach(), saved)}


def test_two_processes_on_a_full_disk_both_get_the_error_and_resume_from_the_previous_checkpoint(tmp_path):
    with small_disk(tmp_path / "disk", DISK_BYTES) as disk:
        results = run_distributed(_two_processes_on_a_full_disk, 2, str(disk), timeout=90)
    committed = sorted([*COMMITTED, "checkpoints/checkpoint_0/random_states_1.pkl"])
    folder = f"{disk}/checkpoints/checkpoint_1"
    for rank, result in enumerate(results):
        assert result["remains"] == committed and result["resumed"], (rank, result)
        synchronous, background = result["errors"]
        # the main process writes the shared files and always fills the disk; the other rank's small RNG
        # file may fit or not (the order of the two writers is not fixed): every rank raises the same kind
        assert f"Saving the checkpoint {folder} (process 0 of 2) ran out of disk space" in synchronous
        assert background.startswith("The previous asynchronous checkpoint save ")
        assert f"Saving the checkpoint {folder} (process 0 of 2) ran out of disk space" in background


def test_only_a_full_disk_is_called_one(tmp_path):
    """A write error on a disk with room left stays itself; ENOSPC is recognised from its errno or text."""
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "model.safetensors").write_bytes(bytes(100))
    other = RuntimeError("unexpected pos 576 vs 534")
    assert out_of_space_error(other, checkpoint="c", staging=tmp_path / "staging", needed=10) is None
    for error in (
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ):
        found = out_of_space_error(error, checkpoint="c", staging=tmp_path / "staging", needed=10)
        assert found is not None and found.__cause__ is error
        assert "The save needs more than the 100 bytes it had written when the write failed" in str(found)
    assert human_bytes(1023) == "1,023 bytes" and human_bytes(137152) == "137,152 bytes (133.9 KiB)"


@pytest.mark.parametrize("save_only_model", [False, True])
def test_the_trainer_on_a_full_disk_stops_with_the_error_and_keeps_its_last_checkpoint(
    tmp_path, save_only_model
):
    """The Trainer saves through save_state (or, with save_only_model, its own staging and commit) and
    rotates (save_total_limit=1) only after the save returns: its checkpoints take about 30 KB (nine files
    of one 4 KiB page or more), a 96 KiB disk holds one; with save_only_model three files (weights, trainer
    state, manifest) of one page each, a 16 KiB disk holds one."""
    from lockstep import Trainer, TrainingArguments
    from lockstep.checkpoint import verify
    from lockstep.trainer._checkpoint_folders import newest_valid_checkpoint
    from tests.helpers.training import make_dataset, make_model

    def mse(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.mse_loss(outputs, labels)

    with small_disk(tmp_path / "disk", (16 if save_only_model else 96) * 1024) as disk:
        settings = {"max_steps": 4, "save_steps": 2, "save_total_limit": 1, "per_device_train_batch_size": 4}
        settings |= {"save_only_model": save_only_model}
        arguments = TrainingArguments(
            output_dir=str(disk),
            optim="sgd",
            logging_steps=100,
            disable_tqdm=True,
            report_to="none",
            **settings,
        )
        trainer = Trainer(make_model(), arguments, train_dataset=make_dataset(64), compute_loss_func=mse)
        with pytest.raises(
            CheckpointError, match=rf"^Saving the checkpoint {disk}/checkpoint-4 ran out of disk"
        ):
            trainer.train()
        assert [p.name for p in disk.iterdir()] == ["checkpoint-2"]
        assert newest_valid_checkpoint(str(disk)) == disk / "checkpoint-2"
        verify(disk / "checkpoint-2")
        assert json.loads((disk / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
