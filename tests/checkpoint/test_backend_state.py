"""A new backend plugs into checkpoints through the Backend interface alone.

The backend below keeps its model state in files of its own (as a sharding backend does): checkpoint/
writes none of its weights, covers its files with the manifest and the atomic commit, and hands them
back on load. Nothing in lockstep.checkpoint knows this backend exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.checkpoints import CheckpointManager
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.backends.base import Backend
from lockstep.backends.capabilities import ShardedCheckpointIO
from lockstep.checkpoint import layout
from lockstep.config.enums import PrecisionType
from lockstep.config.project import ProjectConfiguration
from lockstep.precision import Precision
from lockstep.state import GradientState, PartialState
from tests.helpers.multiprocess import run_distributed

OWN_FOLDER = "own_state"


class OwnFilesBackend(Backend, ShardedCheckpointIO):
    """Writes each model's weights into ``own_state/model_<i>.pt`` itself."""

    def __init__(self, state: PartialState) -> None:
        super().__init__(state, precision=Precision(PrecisionType.NO, state.device))
        self.applied: list[int] = []

    def wrap_model(self, model):
        return model

    def model_state_dicts(self, models):
        return [None for _ in models]  # nothing for checkpoint/ to write

    def save_shards(self, models, optimizers, folder: Path, *, frozen_left_out=()) -> None:
        (folder / OWN_FOLDER).mkdir()
        for index, model in models:
            torch.save(model.state_dict(), folder / OWN_FOLDER / f"model_{index}.pt")

    def read_model_states(self, models, optimizers, folder: Path):
        super().read_model_states([], optimizers, folder)  # optimizers stay ordinary files
        return {index: torch.load(folder / OWN_FOLDER / f"model_{index}.pt") for index, _ in models}

    def apply_model_states(self, models, optimizers, loaded) -> None:
        for index, model in models:
            model.load_state_dict(loaded[index])
            self.applied.append(index)


def _manager(
    tmp_path: Path, backend: OwnFilesBackend
) -> tuple[CheckpointManager, torch.nn.Module, torch.optim.Optimizer]:
    state = PartialState(cpu=True)
    prepared = PreparedObjects()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepared.models.append(model)
    prepared.optimizers.append(optimizer)
    manager = CheckpointManager(
        prepared=prepared,
        backend=backend,
        state=state,
        project=ProjectConfiguration(project_dir=str(tmp_path)),
        accumulation=GradientAccumulation(GradientState()),
    )
    return manager, model, optimizer


def test_a_backend_that_writes_its_own_state_is_saved_committed_and_loaded(tmp_path):
    backend = OwnFilesBackend(PartialState(cpu=True))
    manager, model, optimizer = _manager(tmp_path, backend)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    saved_weight = model.weight.detach().clone()
    folder = Path(manager.save_state(tmp_path / "ckpt", safe_serialization=True))

    files = set(json.loads((folder / layout.MANIFEST_NAME).read_text())["files"])
    assert f"{OWN_FOLDER}/model_0.pt" in files  # the backend's file is covered by the manifest
    assert "model.safetensors" not in files and "optimizer.bin" in files  # checkpoint/ wrote no weights
    layout.verify(folder)

    with torch.no_grad():
        model.weight.zero_()
    optimizer.state.clear()
    manager.load_state(folder)
    assert backend.applied == [0] and torch.equal(model.weight, saved_weight)
    assert optimizer.state[model.weight]["momentum_buffer"] is not None


def test_a_missing_file_of_the_backend_is_an_error_before_anything_is_applied(tmp_path):
    backend = OwnFilesBackend(PartialState(cpu=True))
    manager, _, _ = _manager(tmp_path, backend)
    folder = Path(manager.save_state(tmp_path / "ckpt", safe_serialization=True))
    (folder / OWN_FOLDER / "model_0.pt").unlink()
    with pytest.raises(layout.CheckpointError, match="model_0.pt"):
        manager.load_state(folder)  # the manifest names the missing file
    assert backend.applied == []


class _StateOnTheMainProcessOnly(torch.optim.SGD):
    """Like ZeroRedundancyOptimizer after consolidate_state_dict(to=0): only rank 0 has the whole state."""

    def state_dict(self):
        if torch.distributed.get_rank() != 0:
            raise RuntimeError("Optimizer state has not been consolidated on this rank.")
        return super().state_dict()


def _save_with_main_only_state(world: int, folder: str) -> bool:
    from lockstep import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, _StateOnTheMainProcessOnly(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(4, 3)).sum())
    optimizer.step()
    accelerator.save_state(folder)
    return (Path(folder) / "optimizer.bin").is_file()


@pytest.mark.distributed
def test_optimizer_state_is_taken_only_where_it_is_written(tmp_path):
    """The optimizer's state_dict() runs on the processes that write the shared files, as in Accelerate;
    calling it on every rank would raise on rank 1 here and leave rank 0 waiting."""
    assert run_distributed(_save_with_main_only_state, 2, 2, str(tmp_path / "ckpt"), timeout=60) == [
        True,
        True,
    ]
