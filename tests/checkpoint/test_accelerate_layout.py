"""Checkpoints both ways with Hugging Face Accelerate (never imported here).

An Accelerate checkpoint is written with torch in Accelerate's documented layout and file names
(``model.safetensors``, ``model_1.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
``random_states_0.pkl``, ``custom_checkpoint_0.pkl``) and loaded by lockstep; a lockstep checkpoint is
read the way Accelerate's ``load_state`` reads one (``weights_only`` with NumPy arrays allowed).
"""

from __future__ import annotations

import codecs
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_model, save_file

from lockstep import Accelerator
from lockstep.checkpoint import layout
from lockstep.errors import UnsafeCheckpointError


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _objects(seed: int):
    torch.manual_seed(seed)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return models, optimizer, scheduler


def _write_accelerate_checkpoint(folder: Path) -> dict:
    """What Accelerate 1.15's save_state writes for two models, an optimizer, a scheduler and a counter."""
    models, optimizer, scheduler = _objects(seed=1)
    models[0](torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    folder.mkdir()
    save_file(models[0].state_dict(), folder / "model.safetensors", metadata={"format": "pt"})
    save_file(models[1].state_dict(), folder / "model_1.safetensors", metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save(scheduler.state_dict(), folder / "scheduler.bin")
    torch.save({"count": 7}, folder / "custom_checkpoint_0.pkl")
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    rng = {
        "step": 3,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(rng, folder / "random_states_0.pkl")
    expected = {"next": (random.random(), float(np.random.rand()), torch.rand(1).item())}
    expected["weights"] = [m.weight.detach().clone() for m in models]
    expected["lr"] = scheduler.get_last_lr()
    return expected


def test_lockstep_loads_a_checkpoint_written_by_accelerate(tmp_path, caplog):
    folder = tmp_path / "accelerate_ckpt"
    expected = _write_accelerate_checkpoint(folder)
    assert layout.written_by_accelerate(folder)

    accelerator = Accelerator()
    models, optimizer, scheduler = _objects(seed=2)
    prepared = accelerator.prepare(*models, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    with caplog.at_level(logging.WARNING, logger="lockstep.checkpoint"):
        accelerator.load_state(str(folder))
    assert any("was written by Hugging Face Accelerate" in r.getMessage() for r in caplog.records)
    for model, weight in zip(prepared[:2], expected["weights"]):
        assert torch.equal(model.weight, weight)
    assert prepared[3].get_last_lr() == expected["lr"] and counter.count == 7
    assert accelerator.step == 3  # Accelerate keeps the step with the RNG states
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected["next"]
    assert all(state["step"].item() == 1 for state in prepared[2].optimizer.state.values())
    accelerator.backward(prepared[1](prepared[0](torch.ones(2, 4))).sum())  # training continues
    prepared[2].step()


def test_a_lockstep_folder_without_its_manifest_is_still_refused(tmp_path):
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    (folder / layout.MANIFEST_NAME).unlink()
    assert not layout.written_by_accelerate(folder)  # accelerator_state.json marks it as lockstep's
    with pytest.raises(layout.CheckpointError, match="has no manifest.json"):
        accelerator.load_state(str(folder))
    del model


class _Payload:
    def __reduce__(self):
        return (print, ("the payload ran",))


def test_a_pickle_payload_in_accelerate_rng_file_is_refused(tmp_path):
    folder = tmp_path / "accelerate_ckpt"
    _write_accelerate_checkpoint(folder)
    torch.save({"step": 0, "random_state": _Payload()}, folder / "random_states_0.pkl")
    accelerator = Accelerator()
    models, optimizer, scheduler = _objects(seed=2)
    accelerator.prepare(*models, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(UnsafeCheckpointError, match="random_states_0.pkl holds Python objects"):
        accelerator.load_state(str(folder))


def _accelerate_load(path: Path):
    """Accelerate 1.15's ``load``: weights_only, with NumPy arrays and codecs.encode allowed."""
    core = np._core if hasattr(np, "_core") else np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype, np.dtypes.UInt32DType]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def test_a_lockstep_checkpoint_has_the_files_accelerate_reads(tmp_path):
    accelerator = Accelerator()
    models, optimizer, scheduler = _objects(seed=3)
    model, optimizer, scheduler = accelerator.prepare(models[0], optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    scheduler.step()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))

    fresh = torch.nn.Linear(4, 3)
    load_model(fresh, folder / "model.safetensors")  # Accelerate's model loading
    assert torch.equal(fresh.weight, model.weight)
    assert _accelerate_load(folder / "optimizer.bin")["state"][0]["step"].item() == 1
    assert _accelerate_load(folder / "scheduler.bin")["last_epoch"] == 1
    assert _accelerate_load(folder / "custom_checkpoint_0.pkl") == {"count": 0}
    states = _accelerate_load(folder / "random_states_0.pkl")
    assert {"step", "random_state", "numpy_random_seed", "torch_manual_seed"} <= set(states)
    random.setstate(states["random_state"])  # what Accelerate does with them
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
