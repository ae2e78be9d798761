"""Save and load hooks that keep models in their own format inside the checkpoint (the diffusers pattern:
``models[0].save_pretrained(os.path.join(output_dir, "unet"))`` in the save hook, read back in the load
hook). Their files must be part of the committed checkpoint: covered by the manifest, kept by rotation,
there for the load hook in a fresh process group, with synchronous and asynchronous saves alike."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import layout
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

OWN_FOLDER = "unet"


def _accelerator(project_dir: str) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2
        )
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _save_in_own_format(accelerator: Accelerator):
    def hook(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            folder = Path(output_dir) / OWN_FOLDER
            folder.mkdir(parents=True, exist_ok=True)  # as save_pretrained does
            torch.save(accelerator.unwrap_model(models[0]).state_dict(), folder / "weights.pt")
        weights.pop()  # saved here: lockstep writes no model file for it

    return hook


def _train_and_save(world: int, project_dir: str) -> list[float]:
    accelerator, model, optimizer = _accelerator(project_dir)
    accelerator.register_save_state_pre_hook(_save_in_own_format(accelerator))
    for save in range(3):
        for _ in range(2):
            accelerator.backward(model(torch.full((2, 4), float(accelerator.process_index + save))).sum())
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(async_save=save == 2)  # the newest one is written in the background
    accelerator.wait_for_checkpoint()
    return accelerator.unwrap_model(model).weight.detach().flatten().tolist()


def _load_in_own_format(world: int, project_dir: str) -> tuple[list[float], list[str]]:
    accelerator, model, _ = _accelerator(project_dir)
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    seen: list[str] = []

    def hook(models: list, input_dir: str) -> None:
        state = torch.load(Path(input_dir) / OWN_FOLDER / "weights.pt")
        accelerator.unwrap_model(models[0]).load_state_dict(state)
        seen.append(Path(input_dir).name)
        models.pop()  # loaded here: lockstep does not look for a model file

    accelerator.register_load_state_pre_hook(hook)
    accelerator.load_state()
    return accelerator.unwrap_model(model).weight.detach().flatten().tolist(), seen


def test_files_a_save_hook_writes_are_committed_rotated_and_read_back_by_the_load_hook(tmp_path):
    project_dir = str(tmp_path / "run")
    trained = run_distributed(_train_and_save, 2, 2, project_dir)[0]

    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1",
        "checkpoint_2",
        "latest",
    ]  # total_limit=2 rotated checkpoint_0 away, with the hook's files in it
    for name in ("checkpoint_1", "checkpoint_2"):
        manifest = json.loads((checkpoints / name / layout.MANIFEST_NAME).read_text())
        assert f"{OWN_FOLDER}/weights.pt" in manifest["files"]
        assert "model.safetensors" not in manifest["files"]  # the hook took the model out of `weights`
        layout.verify(checkpoints / name)

    loaded, seen = run_distributed(_load_in_own_format, 2, 2, project_dir)[0]
    assert seen == ["checkpoint_2"] and loaded == trained


def test_a_corrupted_file_of_a_save_hook_is_refused_like_lockstep_own(tmp_path):
    project_dir = str(tmp_path / "run")
    run_distributed(_train_and_save, 2, 2, project_dir)
    newest = tmp_path / "run" / "checkpoints" / "checkpoint_2"
    with open(newest / OWN_FOLDER / "weights.pt", "r+b") as handle:
        handle.seek(os.path.getsize(newest / OWN_FOLDER / "weights.pt") // 2)
        handle.write(b"\x00\x01\x02")
    with pytest.raises(layout.CheckpointError, match=r"unet/weights.pt is corrupt"):
        layout.verify(newest)
